#!/usr/bin/env bash
# One node of a multi-node run: torchrun with a c10d rendezvous at MASTER_ADDR:MASTER_PORT (the first
# node), then `python -m pretrain "$@"` on NPROC_PER_NODE processes. Run it on every node (by hand, by
# pdsh, or from launch/slurm.sbatch) with the same arguments:
#
#   NNODES=4 MASTER_ADDR=node001 NPROC_PER_NODE=8 bash launch/multinode.sh --config my.yaml
#
# Every variable below can be overridden from the environment. The NCCL settings are defaults for
# InfiniBand clusters; set NCCL_SOCKET_IFNAME / NCCL_IB_HCA to your interfaces. Each node logs to
# $LOG_DIR/node-<NODE_NAME>.log as well as to its standard output.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${NNODES:?set NNODES, the number of nodes}"
: "${MASTER_ADDR:?set MASTER_ADDR, the first node (the rendezvous host)}"
MASTER_PORT=${MASTER_PORT:-29500}
NPROC_PER_NODE=${NPROC_PER_NODE:-$({ nvidia-smi -L 2>/dev/null || true; } | wc -l | awk '{print ($1 > 0) ? $1 : 1}')}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-gpt3d}}
MAX_RESTARTS=${MAX_RESTARTS:-0}           # > 0: torchrun restarts every node's workers after a failure
NODE_NAME=${NODE_NAME:-${SLURM_NODEID:-$(hostname)}}
# which node hosts the rendezvous store: node 0 (SLURM's first node, MASTER_ADDR's), said to torch, not
# guessed from addresses: where two agents both take MASTER_ADDR for their own (one host, containers,
# aliases) both would try to host it, and the loser's failed store server could abort its agent (SIGABRT)
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-}}
RDZV_CONF=()
if [[ -n "$NODE_RANK" ]]; then
  RDZV_CONF=(--rdzv-conf "is_host=$([[ "$NODE_RANK" == 0 ]] && echo true || echo false)")
fi
LOG_DIR=${LOG_DIR:-logs}
PYTHON=${PYTHON:-python}
ENTRY=${ENTRY:-pretrain}                  # the module each worker runs (tests: launch.tools.faults.fault_injection)

# NCCL / InfiniBand: fail loudly instead of hanging, use the IB adapters and GPUDirect RDMA when present
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-PHB}
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# a restarted world must not read the previous attempt's addresses (pytorch/pytorch#135712)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC_PER_NODE > 0 ? $(nproc) / NPROC_PER_NODE : 1 ))}

mkdir -p "$LOG_DIR"
# torchrun, run by launch/torchrun.py: each failed attempt is told in one line per lost worker
"$PYTHON" -c 'import sys; from launch.torchrun import run_torchrun; sys.exit(run_torchrun(sys.argv[1:]))' \
  --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID" ${RDZV_CONF[@]+"${RDZV_CONF[@]}"} \
  --max-restarts "$MAX_RESTARTS" -m "$ENTRY" "$@" 2>&1 | tee "$LOG_DIR/node-$NODE_NAME.log"
exit "${PIPESTATUS[0]}"
