"""The training loop of one rank: global batch -> micro-batches -> backward -> ZeRO step -> metrics."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from dataclasses import dataclass, field

import torch

from data.gpt_dataset import build_gpt_datasets
from data.sampler import DataParallelSampler, micro_batches
from data.tokenizer import TokenizerSpec, build_tokenizer
from models.generate import context_window, generate
from models.counting import flops_per_token, num_parameters
from models.stages import build_stage
from parallel import comm, zero
from parallel.buffers import BufferPool
from parallel.checkpointing import RecomputePolicy, apply_recompute
from parallel.process_groups import ParallelGroups, create_process_groups
from parallel.saved_activations import SavedActivationMeter
from parallel.topology import Topology
from parallel.zero import DynamicLossScaler, ModelParallelGroups, expected_parameter_state_bytes
from pretrain import checkpoint
from pretrain.config import Config
from pretrain.lr_schedule import learning_rate
from pretrain.metrics import MetricsWriter, gather_per_rank, peak_memory_bytes, print_rank0, reset_peak_memory
from pretrain.stage_runner import StageRunner
from pretrain.wandb_run import start_wandb


@dataclass
class TrainResult:
    """What a run did, per iteration, as seen by this rank (losses are data-parallel means)."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    valid_losses: dict[int, float] = field(default_factory=dict)
    sample: str | None = None
    wandb_dir: str | None = None


def resolve_data(config: Config) -> tuple[list[str], object]:
    """The --data-path and its tokenizer to train on; builds the built-in corpus on first use."""
    data = config.data
    if data.data_path is not None:
        return data.data_path, build_tokenizer(data.tokenizer_spec(config.model.vocab_size))
    from data.default_corpus import ensure_default_corpus

    prefix, tokenizer_model = ensure_default_corpus(data.data_cache_dir, data.default_corpus_vocab_size,
                                                    data.default_corpus_max_bytes)
    return [prefix], build_tokenizer(TokenizerSpec("SentencePieceTokenizer", tokenizer_model))


def adamw_factory(config: Config):
    opt = config.optimizer

    def make(param_groups: list[dict]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(param_groups, lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps,
                                 weight_decay=opt.weight_decay, foreach=True)
    return make


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay on matrices, none on norms and biases (1-D parameters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


class Trainer:
    """One rank's run: owns its model part, ZeRO optimizer, data iterators and metrics writer.

    Never decides layout (``Topology``) or talks to torch.distributed directly (``parallel.comm``).
    """

    def __init__(self, config: Config, topology: Topology, device: torch.device):
        self.config, self.device = config, device
        self.groups: ParallelGroups = create_process_groups(topology, config.parallel.distributed_timeout_s)
        self.is_logger = self.groups.rank == 0
        train = config.training
        self.dtype = torch.bfloat16 if train.bf16 else torch.float16 if train.fp16 else torch.float32
        torch.manual_seed(train.seed + 100 * self.groups.pp_rank)  # dropout: equal over tp and dp, not over stages
        data_path, self.tokenizer = resolve_data(config)
        self.num_micro_batches = train.global_batch_size // (train.micro_batch_size * topology.dp)
        eval_samples = train.eval_iters * train.global_batch_size if train.eval_interval else 0
        self.train_data, self.valid_data, _ = build_gpt_datasets(
            data_path, config.data.split, config.model.seq_length, train.seed,
            (train.train_iters * train.global_batch_size, eval_samples, 0), self.tokenizer,
            os.path.join(config.data.data_cache_dir, "indices"))
        # ZeRO-3 builds the model on the meta device: no rank ever holds it whole; each unit is
        # materialised from its initialisation recipe and sharded in zero.initialize
        sharded = config.zero.zero_stage == 3
        with torch.device("meta") if sharded else contextlib.nullcontext():
            self.model = build_stage(config.model, self.groups, seed=train.seed,
                                     vp=config.parallel.virtual_pipeline_size or 1,
                                     sequence_parallel=config.parallel.sequence_parallel,
                                     layers_per_stage=config.parallel.pipeline_layers_per_stage)
        self.model.to(self.dtype) if sharded else self.model.to(device, self.dtype)
        self.buffer_pool = BufferPool(device)  # ZeRO-R: checkpoints, gradient staging and stage-3 gathers
        recompute = config.recompute
        apply_recompute(self.model, RecomputePolicy(recompute.recompute_granularity, recompute.recompute_num_layers,
                                                    recompute.recompute_method, recompute.partition_activations,
                                                    recompute.activations_on_cpu), self.groups.tp,
                        self.buffer_pool)
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        self.flops_per_token = flops_per_token(config.model)
        # what the optimizer will hold for these parameters, by the rule it shards them with
        self.expected_state_bytes = expected_parameter_state_bytes(
            self.model.parameters(), config.zero.zero_stage, topology.dp, torch.finfo(self.dtype).bits // 8,
            config.zero.zero_persistence_threshold)
        _, self.optimizer = zero.initialize(
            self.model, adamw_factory(config), stage=config.zero.zero_stage, group=self.groups.dp,
            param_groups=weight_decay_groups(self.model, config.optimizer.weight_decay),
            bucket_size=config.zero.zero_bucket_size, clip_grad=config.optimizer.clip_grad,
            model_parallel=ModelParallelGroups(tp=self.groups.tp, model_parallel=self.groups.mp,
                                               embedding=self.groups.embedding),
            loss_scaler=DynamicLossScaler(train.initial_loss_scale, growth_interval=train.loss_scale_window,
                                          hysteresis=train.hysteresis, min_scale=train.min_loss_scale)
            if train.fp16 else None,
            unit_modules=[*self.model, *(block for chunk in self.model for block in chunk.layers)],
            persistence_threshold=config.zero.zero_persistence_threshold,
            prefetch_budget=config.zero.zero_prefetch_budget, buffer_pool=self.buffer_pool,
            offload_optimizer=config.zero.offload_optimizer, nvme_path=config.zero.nvme_path,
            sub_group_size=config.zero.zero_sub_group_size, offload_param=config.zero.offload_param)
        self.parameter_names = {param: name for chunk in self.model for param, name in
                                chunk.global_parameter_names().items()}  # the same in every layout
        self.activation_meter = SavedActivationMeter()
        self.runner = StageRunner(config, self.groups, self.model, device, self.activation_meter,
                                  self.optimizer.no_sync)
        self.consumed_samples, self.start_iteration = 0, 0
        self.preempted, self._signal_received = False, False
        self.bad_steps: list[int] = []  # the current run of consecutive non-finite steps
        if config.checkpoint.save:  # cluster preemption: save, then stop (without --save: default exit)
            for signum in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(signum, self._on_signal)
        if config.checkpoint.load and not checkpoint.exists(config.checkpoint.load):
            # a job that restarts itself passes --load from its first start, before any save
            print_rank0(self.is_logger, f"no checkpoint under --load {config.checkpoint.load} yet: training from "
                        "iteration 0")
        elif config.checkpoint.load:
            manifest, rng = checkpoint.load(config.checkpoint.load, self.groups, self.optimizer, self.parameter_names)
            self.start_iteration, self.consumed_samples = manifest["iteration"], manifest["consumed_samples"]
            if rng is not None:  # the same layout: the stage's dropout streams and the default one
                self.model[0].rng.set_states(rng)
            print_rank0(self.is_logger, f"resumed from {config.checkpoint.load} at iteration {self.start_iteration}")

    def _batches(self, dataset, total_samples: int, consumed: int):
        """This rank's micro-batches, or None on a pipeline stage that reads no data."""
        if not self.runner.reads_data:
            return None
        sampler = DataParallelSampler(total_samples, consumed, self.config.training.micro_batch_size,
                                      self.groups.dp_rank, self.groups.topology.dp)
        return micro_batches(dataset, sampler)

    def _dp_mean(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64)
        comm.all_reduce(tensor, self.groups.dp)
        return tensor.item() / self.groups.dp.size

    def train_step(self, batches) -> tuple[float, zero.StepResult]:
        """One optimizer step over a global batch; returns this data-parallel rank's loss and the step."""
        self.optimizer.zero_grad()
        self.activation_meter.reset()
        loss, self.last_step_stats = self.runner.run(batches, loss_scale=self.optimizer.loss_scale)
        return loss, self.optimizer.step()

    @torch.no_grad()
    def evaluate(self) -> float:
        train = self.config.training
        self.model.eval()
        batches = self._batches(self.valid_data, train.eval_iters * train.global_batch_size, 0)
        losses = [self.runner.run(batches, train=False)[0] for _ in range(train.eval_iters)]
        self.model.train()
        return self._dp_mean(sum(losses) / len(losses))

    def _record(self, iteration: int, loss: float, lr: float, result: zero.StepResult, step_time: float,
                comm_bytes: dict[str, int], peak_mem: int) -> dict:
        """The metrics line of ``iteration`` (a collective over the world: every rank calls it)."""
        train = self.config.training
        tokens = train.global_batch_size * self.config.model.seq_length
        mine = {"rank": self.groups.rank, "parameters": self.num_parameters,
                "expected_model_state_bytes": self.expected_state_bytes,
                "model_state_bytes": self.optimizer.model_state_bytes(),
                "offloaded_bytes": self.optimizer.offloaded_bytes(),
                "saved_activation_bytes": self.activation_meter.peak_bytes,
                "buffer_pool_bytes": self.buffer_pool.bytes(), "peak_mem_bytes": peak_mem}
        return {
            "iteration": iteration, "consumed_samples": self.consumed_samples, "loss": loss, "lr": lr,
            "grad_norm": result.grad_norm, "loss_scale": result.loss_scale, "skipped": result.skipped,
            "step_time_s": step_time, "tokens_per_s": tokens / step_time,
            "tflops_per_rank": self.flops_per_token * tokens / step_time
            / self.groups.topology.world_size / 1e12,
            "per_rank": gather_per_rank(self.groups, mine, comm_bytes),
        }

    def train(self) -> TrainResult:
        config, train = self.config, self.config.training
        wandb_run = start_wandb(config) if self.is_logger else None
        writer = MetricsWriter(config.logging.metrics_file, wandb_run, enabled=self.is_logger)
        result = TrainResult(wandb_dir=wandb_run.dir if wandb_run else None)
        print_rank0(self.is_logger, f"training {self.num_parameters:,} parameters per rank "
                    f"(model {num_parameters(config.model):,}) on {self.groups.topology.describe().splitlines()[0]}, "
                    f"{self.num_micro_batches} micro-batches of {train.micro_batch_size} per step")
        try:
            batches = self._batches(self.train_data, train.train_iters * train.global_batch_size, self.consumed_samples)
            started = time.perf_counter()
            for iteration in range(self.start_iteration + 1, train.train_iters + 1):
                self.groups.stats.reset()
                reset_peak_memory(self.device)
                lr = learning_rate(iteration - 1, config.optimizer, train.train_iters)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                step_start = time.perf_counter()
                local_loss, step = self.train_step(batches)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the step's kernels belong to its time
                step_time = time.perf_counter() - step_start
                self.consumed_samples += train.global_batch_size
                comm_bytes = self.groups.stats.bytes_by_operation()  # the step's traffic only
                peak_mem = peak_memory_bytes(self.device)
                loss = self._dp_mean(local_loss)
                self._check_bad_step(iteration, loss, step)
                result.losses.append(loss)
                result.grad_norms.append(step.grad_norm)
                last = iteration == train.train_iters
                evaluated = train.eval_interval and (iteration % train.eval_interval == 0 or last)
                valid = self.evaluate() if evaluated else None
                if iteration % config.logging.log_interval == 0 or evaluated or iteration in (1, train.train_iters):
                    record = self._record(iteration, loss, lr, step, step_time, comm_bytes, peak_mem)
                    if iteration == 1:
                        self._print_model_state_table(record["per_rank"])
                    if valid is not None:
                        result.valid_losses[iteration] = valid
                        record.update(valid_loss=valid, valid_ppl=math.exp(min(valid, 50.0)))
                        print_rank0(self.is_logger, f"validation at iter {iteration}: loss {valid:.4f}, "
                                    f"perplexity {record['valid_ppl']:.2f}")
                    done = iteration - self.start_iteration
                    elapsed = time.perf_counter() - started
                    writer.log(record, train.train_iters, elapsed / done * (train.train_iters - iteration))
                if self._should_save(iteration):
                    self.save(iteration)
                if self.preempted:
                    print_rank0(self.is_logger, f"stopping after iteration {iteration} on a preemption signal")
                    break
            result.sample = None if self.preempted else self.sample()
        finally:  # also on an error: swap files are scratch
            self.optimizer.close()
        writer.close()
        if wandb_run is not None:
            wandb_run.finish()
            print_rank0(self.is_logger, f"wandb run files: {os.path.dirname(wandb_run.dir)}")
        return result

    def _check_bad_step(self, iteration: int, loss: float, step: zero.StepResult) -> None:
        """Count consecutive steps whose loss or gradient norm is not finite and stop at the limit.

        Every rank sees the same loss (the pipeline broadcasts it, data parallelism averages it) and the
        same norm (reduced over the world), so every rank decides alike: no extra collective. A non-finite
        loss makes non-finite gradients, and the optimizer then skips the update on every rank."""
        fp16 = self.config.training.fp16
        if math.isfinite(loss) and (math.isfinite(step.grad_norm) or fp16):
            self.bad_steps = []
            return
        self.bad_steps.append(iteration)
        limit = self.config.training.bad_step_limit
        print_rank0(self.is_logger, f"iteration {iteration}: loss {loss}, grad norm {step.grad_norm}: step skipped "
                    f"({len(self.bad_steps)} in a row, the run stops at {limit})")
        if len(self.bad_steps) >= limit:
            raise FloatingPointError(
                f"{limit} consecutive steps with a non-finite loss or gradient norm (iterations "
                f"{self.bad_steps[0]}-{iteration}; the last: loss {loss}, grad norm {step.grad_norm}). The run stops "
                f"here without saving; resume from the last checkpoint with a lower --lr or more warm-up")

    def _on_signal(self, signum, frame) -> None:
        self._signal_received = True

    def _should_save(self, iteration: int) -> bool:
        """Save at --save-interval, at the end, and (agreed by every rank) on a preemption signal."""
        if not self.config.checkpoint.save:
            return False  # no signal is caught, nothing to agree on: no collective on the hot path
        flag = torch.tensor([1.0 if self._signal_received else 0.0])
        comm.all_reduce(flag, self.groups.world, op=torch.distributed.ReduceOp.MAX)
        self.preempted = bool(flag.item())
        ckpt, last = self.config.checkpoint, iteration == self.config.training.train_iters
        interval = ckpt.save_interval and iteration % ckpt.save_interval == 0
        return bool(interval or last or self.preempted)

    def save(self, iteration: int) -> None:
        path = checkpoint.save(self.config.checkpoint.save, iteration, self.consumed_samples, self.groups,
                               self.optimizer, self.parameter_names, self.model[0].rng.get_states(),
                               self.config.to_dict(), self.config.checkpoint.save_keep_last)
        print_rank0(self.is_logger, f"saved checkpoint {path}")

    def _print_model_state_table(self, per_rank: list[dict]) -> None:
        """Per rank: model-state bytes as ``parallel.zero.memory`` predicts them for its parameters beside
        what the tensors hold (after the first step, when the optimizer states exist)."""
        if not self.is_logger:
            return
        stage, dp = self.config.zero.zero_stage, self.groups.topology.dp
        lines = [f"model-state bytes per rank (ZeRO stage {stage}, dp {dp}, {self.dtype}): expected vs measured "
                 "(in memory + in swap files)"]
        for entry in per_rank:
            expected = entry["expected_model_state_bytes"]
            held = entry["model_state_bytes"] + entry["offloaded_bytes"]
            lines.append(f"  rank {entry['rank']:>3}: {entry['parameters']:>12,} params  expected "
                         f"{expected / 2**20:10.2f} MiB  measured {entry['model_state_bytes'] / 2**20:10.2f} + "
                         f"{entry['offloaded_bytes'] / 2**20:.2f} MiB  ({held / expected:.3f}x)")
        print("\n".join(lines), flush=True)

    def sample(self) -> str | None:
        """Continue --sample-prompt with the trained model (every rank runs it; rank 0 prints)."""
        logging, model = self.config.logging, self.config.model
        if not logging.sample_prompt or logging.sample_tokens < 1:
            return None
        prompt = self.tokenizer.encode(logging.sample_prompt)
        window = context_window(model.max_positions, self.groups.tp.size, self.runner.sequence_parallel)
        self.model.eval()
        greedy = self.tokenizer.decode(generate(self.runner.next_token_logits, prompt, logging.sample_tokens,
                                                window=window))
        sampled = self.tokenizer.decode(generate(self.runner.next_token_logits, prompt, logging.sample_tokens,
                                                 window=window, temperature=0.8, top_k=40,
                                                 seed=self.config.training.seed))
        self.model.train()
        print_rank0(self.is_logger, f"--- greedy sample ---\n{logging.sample_prompt}{greedy}\n"
                    f"--- top-k 40, temperature 0.8 ---\n{logging.sample_prompt}{sampled}\n---")
        return logging.sample_prompt + greedy
