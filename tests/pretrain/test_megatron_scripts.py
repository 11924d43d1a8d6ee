"""Megatron-LM's own example scripts run here with only the model and batch sizes (and torchrun's
arguments) scaled down: examples/gpt3/train_gpt3_175b_distributed.sh (GPT-2 BPE data made by
data.preprocess, fp16, tp2 x pp2, its batch ramp-up, a TensorBoard event file) and
examples/llama/train_llama3_8b_h100_fp8.sh (its bf16 branch on mock data; its fp8 branch, delayed scaling's
flags ignored, is refused on a machine without fp8 products, naming --fp8-emulate) and
examples/mixtral/train_mixtral_8x7b_distributed.sh (top-2 of 8 experts, grouped product, the all-to-all
dispatcher, pp x ep, Llama-2 sentencepiece data; its split scaled to the small corpus).
The scripts are shell: their flag arrays are expanded unquoted, as the originals do."""

import os
import subprocess
import sys

import pytest

from pretrain.config.arguments import ConfigError, parse_config
from pretrain.startup.validation import validate
from tests.data.bpe_files import write_gpt2_files
from tests.data.synthetic import make_documents, write_jsonl

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the two scripts' arrays, sizes scaled down (layers, widths, batches, lengths, intervals)
GPT3 = """
GPT_MODEL_ARGS=(--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32
    --max-position-embeddings 32 --attention-backend auto)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 8 --rampup-batch-size 4 4 16 --train-iters 6
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16
    --lr 6.0e-4 --lr-decay-style cosine --min-lr 6.0e-5 --lr-warmup-fraction .1 --lr-decay-iters 5)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2)
DATA_ARGS=(--data-path $DATA_PATH --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --split 949,50,1)
EVAL_AND_LOGGING_ARGS=(--log-interval 1 --save-interval 3 --eval-interval 3 --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH --eval-iters 1 --tensorboard-dir $TENSORBOARD_LOGS_PATH)
ALL=(${GPT_MODEL_ARGS[@]} ${TRAINING_ARGS[@]} ${MODEL_PARALLEL_ARGS[@]} ${DATA_ARGS[@]}
     ${EVAL_AND_LOGGING_ARGS[@]})
"""

LLAMA3 = """
MODEL_ARGS=(--use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 160 --num-attention-heads 4
    --group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 32 --max-position-embeddings 32
    --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0
    --hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
    --untie-embeddings-and-output-weights --disable-bias-linear)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 4 --train-samples 24 --lr-decay-samples 20
    --lr-warmup-samples 4 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
    --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
    --grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
    --empty-unused-memory-level 1 --exit-duration-in-mins 235)
DTYPE_ARGS=()
if [[ "$DTYPE" == "fp8" ]]; then
    DTYPE_ARGS+=("--fp8-format hybrid" "--fp8-amax-history-len 1024" "--fp8-amax-compute-algo max"
                 "--fp8-param-gather")
fi
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel)
DDP_ARGS=(--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)
TRAINING_ARGS+=("${DDP_ARGS[@]}")
DATA_ARGS_LIST=("--mock-data" "--tokenizer-type NullTokenizer" "--vocab-size 500"
    "--data-cache-path ${DATA_CACHE_PATH}" "--tiktoken-pattern v2" "--split '99,1,0'"
    "--no-create-attention-mask-in-dataloader" "--no-mmap-bin-files" "--num-workers 1")
EVAL_AND_LOGGING_ARGS=(--log-interval 1 --eval-iters 2 --eval-interval 100 --save-interval 1000
    --log-throughput --profile --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist
    --distributed-timeout-minutes 60 --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH")
ALL=(${MODEL_ARGS[@]} ${TRAINING_ARGS[@]} ${DTYPE_ARGS[@]} ${MODEL_PARALLEL_ARGS[@]} ${DATA_ARGS_LIST[@]}
     ${EVAL_AND_LOGGING_ARGS[@]})
"""


MIXTRAL = """
MODEL_ARGS=(--use-mcore-models --disable-bias-linear --seq-length 64 --max-position-embeddings 256
    --num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --init-method-std 0.01
    --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope
    --swiglu --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2
    --no-masked-softmax-fusion --no-position-embedding --rotary-base 1000000)
MOE_ARGS=(--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather
    --overlap-grad-reduce)
DATA_ARGS=(--tokenizer-type Llama2Tokenizer --tokenizer-model ${TOKENIZER_MODEL} --data-path $DATA_PATH
    --split 90,8,2)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 8 --lr 1e-4 --train-iters 4 --lr-decay-iters 4
    --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 1 --clip-grad 1.0 --bf16)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2
    --expert-model-parallel-size 2 --use-distributed-optimizer --sequence-parallel)
LOGGING_ARGS=(--log-interval 1 --save-interval 2 --eval-interval 2 --eval-iters 1 --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard" --no-load-optim --no-load-rng)
ALL=(${MODEL_ARGS[@]} ${MOE_ARGS[@]} ${DATA_ARGS[@]} ${TRAINING_ARGS[@]} ${MODEL_PARALLEL_ARGS[@]}
     ${LOGGING_ARGS[@]})
"""


def _argv(script: str, **environment: str) -> list[str]:
    """The words the script's `${ALL[@]}` expands to, as bash splits them."""
    shell = script + '\nprintf "%s\\0" "${ALL[@]}"'
    words = subprocess.run(["bash", "-c", shell], env=dict(os.environ, **environment), capture_output=True,
                           check=True).stdout.split(b"\0")[:-1]
    return [word.decode() for word in words]


def _torchrun(nproc: int, argv: list[str], tmp_path, sample: bool = False) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "pretrain", *argv, *([] if sample else ["--sample-prompt", ""]), "--metrics-file",
               str(tmp_path / "metrics.jsonl")]
    environment = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    return subprocess.run(command, capture_output=True, text=True, env=environment,
                          cwd=REPOSITORY, timeout=600)


def test_the_gpt3_example_trains_on_gpt2_bpe_data_with_its_batch_ramp_up(tmp_path):
    documents = make_documents(120)
    vocab, merges = write_gpt2_files(str(tmp_path / "gpt2"), documents)
    corpus = write_jsonl(tmp_path / "corpus.jsonl", documents)
    subprocess.run([sys.executable, "-m", "data.preprocess", "--input", corpus, "--output-prefix",
                    str(tmp_path / "my-gpt3"), "--vocab-file", vocab, "--merge-file",
                    merges, "--tokenizer-type",
                    "GPT2BPETokenizer", "--append-eod", "--workers", "2"], check=True, capture_output=True)
    argv = _argv(GPT3, DATA_PATH=str(tmp_path / "my-gpt3_text_document"), VOCAB_FILE=vocab, MERGE_FILE=merges,
                 CHECKPOINT_PATH=str(tmp_path / "checkpoints"), TENSORBOARD_LOGS_PATH=str(tmp_path / "tb"))
    job = _torchrun(4, argv + ["--data-cache-path", str(tmp_path / "cache")], tmp_path)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "Megatron flags accepted and ignored: --attention-backend" in job.stdout
    lines = [__import__("json").loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # the ramp-up: 4 samples per step until 16 are consumed, then the global batch of 8
    assert [line["batch_size"] for line in lines] == [4, 4, 4, 4, 8, 8]
    assert any("valid_loss" in line for line in lines)
    assert os.listdir(tmp_path / "tb") and os.listdir(tmp_path / "tb")[0].startswith("events.out.tfevents")
    assert open(tmp_path / "checkpoints" / "latest").read() == "iter_0000006"


def test_the_llama3_example_trains_on_mock_data_in_bf16_and_refuses_its_fp8_branch_on_the_cpu(tmp_path):
    environment = dict(CHECKPOINT_PATH=str(tmp_path / "checkpoints"),
                       TENSORBOARD_LOGS_PATH=str(tmp_path / "tb"),
                       DATA_CACHE_PATH=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="--fp8-format hybrid: fp8 matrix products need an NVIDIA GPU .* "
                                          "--fp8-emulate"):
        validate(parse_config(_argv(LLAMA3, DTYPE="fp8", **environment)), 2)
    job = _torchrun(2, _argv(LLAMA3, DTYPE="bf16", **environment), tmp_path, sample=True)
    assert job.returncode == 0, job.stderr[-3000:]
    # the default closing sample's prompt is text, which a NullTokenizer cannot encode: said, and skipped
    assert "no sample: --sample-prompt " in job.stdout and "by NullTokenizer" in job.stdout
    lines = [__import__("json").loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["iteration"] for line in lines] == [1, 2, 3, 4, 5, 6]  # 24 samples in batches of 4
    assert lines[0]["lr"] == 0.0 and lines[1]["lr"] == pytest.approx(0.00015)  # 4 warm-up samples, from 0
    assert all(line["loss"] == line["loss"] for line in lines)
    ignored = job.stdout.split("Megatron flags accepted and ignored: ")[1].splitlines()[0]
    for flag in ("--use-mcore-models", "--cross-entropy-loss-fusion", "--num-workers",
                 "--tiktoken-pattern", "--no-mmap-bin-files"):
        assert flag in ignored, flag
    # --profile works here (issue 49): nsys's capture range is for GPUs, said once on the CPU
    assert "--profile" not in ignored and "--profile drives nsys's capture range on a GPU" in job.stdout
    assert "--overlap-param-gather" not in ignored  # it means what it means in Megatron
    assert "--ckpt-format" not in ignored  # torch_dist: our native checkpoints (torch_dcp: DCP's)


def test_the_mixtral_example_trains_its_experts_over_pp_and_ep(stdlib_corpus, tmp_path):
    _, tokenizer = stdlib_corpus
    corpus = write_jsonl(tmp_path / "corpus.jsonl", make_documents(200))
    subprocess.run([sys.executable, "-m", "data.preprocess", "--input", corpus, "--output-prefix",
                    str(tmp_path / "mixtral"), "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
                    tokenizer, "--append-eod", "--workers", "1"], check=True, capture_output=True)
    argv = _argv(MIXTRAL, TOKENIZER_MODEL=tokenizer, DATA_PATH=str(tmp_path / "mixtral_text_document"),
                 CHECKPOINT_PATH=str(tmp_path / "checkpoints"))
    job = _torchrun(4, argv + ["--data-cache-path", str(tmp_path / "cache")], tmp_path)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "experts: pp 2 x edp 1 x ep 2 x etp 1" in job.stdout
    lines = [__import__("json").loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lines = [line for line in lines if "loss" in line]  # the training lines
    assert [line["iteration"] for line in lines] == [1, 2, 3, 4], lines
    for line in lines:  # the balancing loss near its balanced value (coefficient x 1), the loads reported
        assert 0.005 < line["moe_aux_loss"] < 0.05 and len(line["moe_load_max_over_mean"]) == 4
        assert sum(rank["comm_bytes"]["all_to_all"] for rank in line["per_rank"]) > 0
    assert open(tmp_path / "checkpoints" / "latest").read() == "iter_0000004"
