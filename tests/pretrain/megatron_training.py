"""megatron-core's own training step on the CPU, for the tests that resume a Megatron-LM run here and ours
there: its DDP (the distributed optimizer, buckets on request, or the plain optimizer), Adam, clipping and
scheduler on given micro-batches, saved as Megatron-LM saves them (legacy files with ``distrib_optim.pt``,
torch_dist with the ``fully_reshardable`` and the ``dp_reshardable`` optimizer states), and resumed as
Megatron-LM's ``load_checkpoint`` resumes them. The models are ``megatron_oracle``'s.
"""

from __future__ import annotations

import os

import torch

from tests.pretrain.megatron_oracle import (VOCAB, causal_mask, megatron_args, megatron_model,
                                           stop_writer_manager)

# a short run of megatron-core's own training step (DDP with the distributed optimizer, Adam, clipping,
# its scheduler), the hyper-parameters our flags in the trajectory test name
TRAINING = {"lr": 3e-3, "min_lr": 3e-4, "weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.95,
            "adam_eps": 1e-8, "clip_grad": 0.5, "warmup_iters": 2, "decay_iters": 12, "global_batch": 8}


def train_megatron(rank: int, world_size: int, architecture: str, tp: int, batches: list, stop: int,
                   out: str, final: str | None, bucket_size: int | None = None,
                   distributed: bool = True) -> list[float]:
    """megatron-core trains its model (tp x dp, pp1) on ``batches`` (one list of micro-batches per
    iteration, the whole global batch: each dp rank takes its share in order) with its DistributedOptimizer;
    after iteration ``stop`` it saves as Megatron-LM does under ``out`` (``_save_trained``), after the last
    one the weights alone under ``final``. Returns the loss of each iteration. ``bucket_size``: its DDP
    overlaps the gradients' reduce-scatter with the backward pass in buckets of that many elements
    (``--overlap-grad-reduce --ddp-bucket-size``); ``distributed``: its distributed optimizer, else the
    plain one (Adam's states whole on every dp rank)."""
    chunk, model, optimizer, scheduler = _megatron_trainer(architecture, tp, bucket_size, distributed)
    losses = []
    for iteration, micro_batches in enumerate(batches, start=1):
        losses.append(_megatron_step(model, optimizer, scheduler, micro_batches))
        if iteration == stop:
            _save_trained(rank, world_size, architecture, tp, out, iteration, chunk, optimizer, scheduler,
                          bucket_size, distributed)
    if final:
        _save_trained(rank, world_size, architecture, tp, final, len(batches), chunk, None, scheduler,
                      bucket_size, distributed)
    return losses


def resume_megatron(rank: int, world_size: int, architecture: str, tp: int, batches: list,
                    directory: str) -> list[float]:
    """megatron-core resumes the legacy checkpoint under ``directory`` as Megatron-LM's ``load_checkpoint``
    does with ``--use-distributed-optimizer`` (the model, the optimizer's ``state_dict``, its parameter
    states from ``distrib_optim.pt``, the scheduler) at tp x dp, and trains on with the ``batches`` after
    its iteration. Returns their losses."""
    from megatron.core import parallel_state

    with open(os.path.join(directory, "latest_checkpointed_iteration.txt")) as handle:
        iteration = int(handle.read())
    first = torch.load(os.path.join(directory, f"iter_{iteration:07d}", "mp_rank_00", "model_optim_rng.pt"),
                       weights_only=False)
    chunk, model, optimizer, scheduler = _megatron_trainer(architecture, tp, None, True,
                                                           first["args"].padded_vocab_size)
    folder = os.path.join(directory, f"iter_{iteration:07d}",
                          f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}")
    state = torch.load(os.path.join(folder, "model_optim_rng.pt"), weights_only=False)
    chunk.load_state_dict(state["model"], strict=True)
    optimizer.load_state_dict(state["optimizer"])
    # megatron-core 0.16.1 with torch's Adam (no Apex / TE) sets every parameter's step to one shared
    # tensor in load_state_dict (torch's Adam then adds 1 to it once per parameter per step) and asks the
    # gathered file for it, which no file holds: set aside while the states load, then one each; and its
    # fp32 masters are views of the weights, which an in-place copy may only touch without autograd
    inner = optimizer.chained_optimizers[0].optimizer
    steps = {param: state.pop("step") for param, state in inner.state.items() if "step" in state}
    with torch.no_grad():
        optimizer.load_parameter_state(os.path.join(folder, "distrib_optim.pt"))
    for param, step in steps.items():
        inner.state[param]["step"] = step.clone()
    scheduler.load_state_dict(state["opt_param_scheduler"])
    return [_megatron_step(model, optimizer, scheduler, micro) for micro in batches[iteration:]]


def _megatron_trainer(architecture: str, tp: int, bucket_size: int | None, distributed: bool,
                      vocab: int = VOCAB) -> tuple:
    """megatron-core's model (pp1, ``vocab`` rows), its DDP, optimizer and scheduler, with ``TRAINING``'s
    settings."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    chunk, = megatron_model(architecture, tp, 1, seed=1234, vocab=vocab)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=distributed,
                                        overlap_grad_reduce=bucket_size is not None, bucket_size=bucket_size)
    model = DistributedDataParallel(chunk.config, ddp, chunk)
    t = TRAINING
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=t["lr"], min_lr=t["min_lr"], weight_decay=t["weight_decay"],
        adam_beta1=t["adam_beta1"], adam_beta2=t["adam_beta2"], adam_eps=t["adam_eps"],
        clip_grad=t["clip_grad"], use_distributed_optimizer=distributed), [model])
    batch = t["global_batch"]
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=t["lr"], min_lr=t["min_lr"], lr_warmup_steps=t["warmup_iters"] * batch,
        lr_decay_steps=t["decay_iters"] * batch, lr_decay_style="cosine", start_wd=t["weight_decay"],
        end_wd=t["weight_decay"], wd_incr_steps=t["decay_iters"] * batch, wd_incr_style="constant")
    return chunk, model, optimizer, scheduler


def _megatron_step(model, optimizer, scheduler, micro_batches: list) -> float:
    """One iteration of megatron-core's training step on a global batch (this dp rank's share of
    ``micro_batches``); the loss, averaged over the data-parallel ranks."""
    from megatron.core import parallel_state

    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    model.zero_grad_buffer()
    optimizer.zero_grad()
    mine = micro_batches[dp_rank * len(micro_batches) // dp:(dp_rank + 1) * len(micro_batches) // dp]
    total = torch.zeros(1)
    for micro in mine:
        per_token = model(micro["tokens"], micro["position_ids"], attention_mask=causal_mask(micro["tokens"]),
                          labels=micro["labels"])
        loss = (per_token.float() * micro["loss_mask"]).sum() / micro["loss_mask"].sum()
        (loss / len(mine)).backward()
        total += loss.detach() / len(micro_batches)
    model.finish_grad_sync()
    optimizer.step()
    scheduler.step(increment=TRAINING["global_batch"])
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return total.item()


def _save_trained(rank, world_size, architecture, tp, out, iteration, chunk, optimizer, scheduler,
                  bucket_size, distributed) -> None:
    """Megatron-LM's saves: legacy under ``out/torch`` (the model, optimizer's ``state_dict`` and
    scheduler per tp rank from dp rank 0; with ``--use-distributed-optimizer`` its parameter state
    gathered on dp rank 0 into ``distrib_optim.pt`` beside it, else Adam's states in the ``state_dict``)
    and, with the distributed optimizer, torch_dist under ``out/torch_dist`` (its
    ``fully_reshardable`` sharding, model-space states: megatron-core 0.16.1 writes them at the wrong
    places when --overlap-grad-reduce cuts buckets, as its own warning of "data corruption" says) and
    under ``out/torch_dist_dp`` (its default ``dp_reshardable`` sharding: each bucket's flat states)."""
    from megatron.core import dist_checkpointing, parallel_state

    args = megatron_args(architecture, tp, 1, world_size)
    args.use_distributed_optimizer, args.iteration = distributed, iteration
    args.overlap_grad_reduce, args.ddp_bucket_size = bucket_size is not None, bucket_size
    args.consumed_train_samples = iteration * TRAINING["global_batch"]
    common = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
              "opt_param_scheduler": scheduler.state_dict(), "num_floating_point_operations_so_far": 0}
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    legacy = os.path.join(out, "torch")
    folder = os.path.join(legacy, f"iter_{iteration:07d}", f"mp_rank_{tp_rank:02d}")
    os.makedirs(folder, exist_ok=True)
    state = {**common, "model": chunk.state_dict_for_save_checkpoint()}
    kinds = [legacy]
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if optimizer is not None and distributed:
        optimizer.save_parameter_state(os.path.join(folder, "distrib_optim.pt"))
    for sharding, name in (("fully_reshardable", "torch_dist"), ("dp_reshardable", "torch_dist_dp")):
        if optimizer is None or not distributed:
            break
        sharded = os.path.join(out, name)
        os.makedirs(os.path.join(sharded, f"iter_{iteration:07d}"), exist_ok=True)
        torch.distributed.barrier()
        model = chunk.sharded_state_dict()
        dist_checkpointing.save({**common, "model": model, "optimizer": optimizer.sharded_state_dict(
            model, metadata={"distrib_optim_sharding_type": sharding})},
            os.path.join(sharded, f"iter_{iteration:07d}"))
        stop_writer_manager()
        kinds.append(sharded)
    if parallel_state.get_data_parallel_rank() == 0:
        torch.save(state, os.path.join(folder, "model_optim_rng.pt"))
    torch.distributed.barrier()
    if rank == 0:
        for directory in kinds:
            with open(os.path.join(directory, "latest_checkpointed_iteration.txt"), "w") as handle:
                handle.write(str(iteration))
    torch.distributed.barrier()
