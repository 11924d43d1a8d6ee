"""The training loop of one rank: global batch -> micro-batches -> backward -> ZeRO step -> metrics."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch

from models.compile import CompileReport
from models.counting import flops_per_token, num_parameters
from parallel import comm, zero
from parallel.buffer_pool import BufferPool
from parallel.param_meta import meta
from parallel.process_groups import ParallelGroups
from parallel.saved_activations import SavedActivationMeter
from parallel.topology import Topology
from parallel.watchdog import HangWatchdog
from parallel.zero import expected_parameter_state_bytes, gradient_bytes
from pretrain.checkpoint import checkpointer
from pretrain.checkpoint.async_save import AsyncSaver
from pretrain.checkpoint.catalog import DCP_STORAGE, MODEL, iteration_name
from pretrain.checkpoint.stateful import RunState, Stateful, ZeroModelState
from pretrain.training.batch_schedule import build_batch_schedule
from pretrain.checkpoint.selection import checkpoint_to_load, loads_weights_only, resume_point, step_to_load
from pretrain.config.schema import Config
from pretrain.training.param_groups import OptimizerChoice, state_moments
from pretrain.training.qk_clip import QKClip
from pretrain.training.param_scheduler import build_param_scheduler
from pretrain.config.megatron_flags import describe_ignored
from pretrain.observability.moe_metrics import moe_metrics
from pretrain.observability.mtp_metrics import mtp_metrics
from pretrain.observability.profiling import StepProfiler
from pretrain.observability.metrics import (MetricsWriter, comm_table, gather_per_rank, model_state_table,
                                            peak_flops, peak_memory_bytes, print_rank0, reset_peak_memory)
from pretrain.training.build import (build_compile, build_fp8, build_groups, build_model, build_optimizer,
                                     build_recompute, compute_dtype, zero_options)
from pretrain.training.non_finite_steps import NonFiniteSteps
from pretrain.training.end_sample import sample_text
from pretrain.training.progress import TrainingProgress
from pretrain.training.run_control import RunControl
from pretrain.training.pipeline_runner import PipelineRunner
from pretrain.training.training_data import TrainingData
from pretrain.observability.wandb_run import start_wandb


@dataclass
class TrainResult:
    """What a run did, per iteration, as seen by this rank (losses are data-parallel means)."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    valid_losses: dict[int, float] = field(default_factory=dict)
    sample: str | None = None
    wandb_dir: str | None = None


PROGRESS_INTERVAL_S = 10.0  # the longest the console stays silent between --log-interval lines


class Trainer:
    """One rank's run: owns its model part, ZeRO optimizer, data, run control and metrics writer.

    Never decides layout (``Topology``) or talks to torch.distributed directly (``parallel.comm``).
    Tells the ``watchdog`` (one that only listens unless given) what it is doing.
    """

    def __init__(self, config: Config, topology: Topology, device: torch.device,
                 watchdog: HangWatchdog | None = None):
        self.config, self.device = config, device
        self.groups: ParallelGroups = build_groups(config, topology)
        self.watchdog = watchdog or HangWatchdog(config.parallel.distributed_timeout_s)
        self.watchdog.follow(self.groups.stats)
        self.is_logger = self.groups.rank == 0
        self.control = RunControl(config, self.groups.world, device)
        self._build_schedules(topology)
        train = config.training
        eval_samples = train.eval_iters * self.eval_batch_size if train.eval_interval else 0
        self.data = TrainingData(config, self.schedule.samples_after(train.train_iters), eval_samples,
                                 self.groups.dp_rank, topology.dp)
        self.tokenizer = self.data.tokenizer
        self.dtype = compute_dtype(config)
        self.model = build_model(config, self.groups, device)
        in_fp8, left = build_fp8(self.model, config)
        if train.fp8_format and self.is_logger:
            print(f"--fp8-format {train.fp8_format} ({train.fp8_recipe} scales"
                  f"{', emulated' if train.fp8_emulate else ''}): {in_fp8} linear layers of this stage in fp8"
                  + (f", {left} left in bf16 (a dimension not a multiple of 16)" if left else ""), flush=True)
        self.buffer_pool = BufferPool(device)  # ZeRO-R: checkpoints, gradient staging and stage-3 gathers
        build_recompute(self.model, config, self.groups, self.buffer_pool)
        build_compile(self.model, config)
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        self.flops_per_token = flops_per_token(config.model)
        self.expected_state_bytes = self._expected_state_bytes()  # before ZeRO: by the rule it shards with
        self.optimizer = build_optimizer(self.model, config, self.groups, self.buffer_pool)
        self.parameter_names = {param: name for chunk in self.model for param, name in
                                chunk.global_parameter_names().items()}  # the same in every layout
        self.activation_meter = SavedActivationMeter()
        self.runner = PipelineRunner(config, self.groups, self.model, device,
                                     self.activation_meter, self.optimizer)
        opt = config.optimizer
        self.qk_clip = (QKClip(self.model, self.groups, config.model.num_layers, opt.qk_clip,
                               opt.qk_clip_threshold, opt.qk_clip_alpha)
                        if opt.qk_clip or opt.log_max_attention_logit else None)
        self.max_attention_logits: list[float] = []  # each layer's, of the last step (with ``qk_clip``)
        self.progress = TrainingProgress()  # the data position; the LR schedule follows it
        self.start_iteration = 0
        self.resumed_from: str | None = None  # the checkpoint under --save this run resumed from (kept)
        self.published: int | None = None  # the newest checkpoint this run saved synchronously
        self.save_stall_s = 0.0
        self._checkpoint_states: dict[str, Stateful] | None = None
        self.saver = (AsyncSaver(self.groups, config.parallel.distributed_timeout_s,
                                 lambda line: print_rank0(self.is_logger, line))
                      if config.checkpoint.async_save else None)
        self.stopped_early: str | None = None
        self.step_check = NonFiniteSteps(config, self.groups, device)
        # the default stream (dropout outside tensor-parallel regions: equal over tp and dp, not over stages
        # or cp ranks, which hold other tokens) is seeded after the model is built: building on the meta
        # device (ZeRO-3) draws nothing, building in place (stages 0-2) does; masks never follow the stage
        torch.manual_seed(train.seed + 100 * self.groups.pp_rank + 7919 * self.groups.cp_rank)
        self._load_checkpoint()

    def _build_schedules(self, topology: Topology) -> None:
        """The batch-size schedule and the learning-rate schedules it sizes."""
        train = self.config.training
        self.schedule = build_batch_schedule(train.global_batch_size, train.micro_batch_size, topology.dp,
                                             train.rampup_batch_size, train.step_batch_size_schedule,
                                             self.config.model.seq_length)
        point = resume_point(self.config)  # a batch unlike the checkpoint's continues from its sample
        if point is not None:
            self.schedule = self.schedule.resumed_at(*point)
        self.param_scheduler = build_param_scheduler(self.config, self.schedule)
        self.eval_batch_size = train.eval_global_batch_size or self.schedule.final_batch_size

    def _expected_state_bytes(self) -> int:
        """What the optimizer will hold for this rank's parameters, by the rule it shards them with (expert
        parameters over the expert data-parallel group)."""
        options, compute_bytes = zero_options(self.config), torch.finfo(self.dtype).bits // 8
        shards = ((False, options.shard_size or self.groups.dp_cp.size), (True, self.groups.edp.size))
        moments = state_moments(self.model, self.config.optimizer)
        return sum(expected_parameter_state_bytes(
            [p for p in self.model.parameters() if meta(p).expert == expert], options.stage, dp,
            compute_bytes, options.persistence_threshold,
            gradient_bytes(compute_bytes, options.main_grads_in_fp32), options.hpz_partition_size, moments)
            for expert, dp in shards)

    def _load_checkpoint(self) -> None:
        """Resume --load, or start from --pretrained-checkpoint's weights (Megatron's fine-tuning flags:
        --finetune and a weights-only checkpoint load the model alone and start at iteration 0,
        --no-load-optim keeps the position with a fresh optimizer, --no-load-rng fresh random states)."""
        ckpt = self.config.checkpoint
        directory = checkpoint_to_load(self.config)
        if directory is None:
            if ckpt.load:  # a job that restarts itself passes --load from its first start, before any save
                print_rank0(self.is_logger,
                            f"no checkpoint under --load {ckpt.load} yet: training from iteration 0")
            return
        starts_over = directory != ckpt.load or ckpt.finetune
        states = dict(self.checkpoint_states())  # a copy: every save writes them all
        if starts_over:  # the weights alone, and the expert biases that route with them (Megatron's buffers)
            states = {name: states[name] for name in (MODEL, "load_balancing") if name in states}
        else:
            if ckpt.no_load_rng:
                del states["rng"]
            if ckpt.no_load_optim:  # Megatron's: the flags' schedule, with the fresh optimizer
                del states["opt_param_scheduler"], states["optimizer"]
        self.watchdog.at(0, "checkpoint load", watched=False)  # a slow disk is no hang
        manifest = checkpointer.load(directory, states, self.groups,
                                     weights_only=loads_weights_only(self.config, directory),
                                     step=step_to_load(self.config, directory))
        if starts_over or manifest.get("kind") == "weights":
            print_rank0(self.is_logger,
                        f"fine-tuning from the weights of {directory} ({manifest.get('source', 'ours')}"
                        f", iteration {manifest['iteration']}): a fresh optimizer, from iteration 0")
            return
        self.start_iteration = self.progress.iteration
        self.resumed_from = iteration_name(manifest["iteration"]) if directory == ckpt.save else None
        print_rank0(self.is_logger, f"resumed from {directory} at iteration {self.start_iteration}, sample "
                    f"{self.progress.consumed_samples} (global batch "
                    f"{self.schedule.batch_size(self.progress.consumed_samples)}"
                    + (", not the checkpoint's: its schedules continue from this sample to iteration "
                       f"{self.config.training.train_iters}" if self.schedule.resumed else "") + ")"
                    + (", with a fresh optimizer" if ckpt.no_load_optim else ""))

    def _batches(self, dataset, total_samples: int, consumed: int):
        """This rank's micro-batches, or None on a pipeline stage that reads no data."""
        return self.data.batches(dataset, total_samples, consumed) if self.runner.reads_data else None

    def _dp_mean(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64,
                              device=self.device)  # NCCL reduces device tensors only
        comm.all_reduce(tensor, self.groups.dp)
        return tensor.item() / self.groups.dp.size

    def train_step(self, batches, measure: bool = True) -> tuple[float, zero.StepResult]:
        """One optimizer step over the global batch that starts at the consumed samples; returns this
        data-parallel rank's loss and the step. ``measure``: count the saved activations anew (else the
        meter keeps the last measured step's peak)."""
        self.optimizer.zero_grad(set_to_none=False)  # the gradient views stay attached
        self.watchdog.at(self.progress.iteration + 1, "forward-backward")
        if measure:
            self.activation_meter.reset()
        loss, self.last_step_stats = self.runner.run(
            batches, self.schedule.micro_batches(self.progress.consumed_samples), measure=measure)
        if self.model[0].balancing is not None:  # the expert biases move with the step's loads
            self.model[0].balancing.update_biases(self.groups.world, self.device)
        self.watchdog.at(self.progress.iteration + 1, "optimizer step")
        result = self.optimizer.step()
        if self.qk_clip is not None:
            self.max_attention_logits = self.qk_clip.after_step(self.optimizer, result.skipped, self.device)
        return loss, result

    @torch.no_grad()
    def evaluate(self) -> float:
        train = self.config.training
        self.watchdog.at(self.progress.iteration, "evaluation")
        self.model.eval()
        batches = self._batches(self.data.valid, train.eval_iters * self.eval_batch_size, 0)
        micro = self.eval_batch_size // self.schedule.per_step
        losses = [self.runner.run(batches, micro, train=False)[0] for _ in range(train.eval_iters)]
        self.model.train()
        return self._dp_mean(sum(losses) / len(losses))

    def _record(self, iteration: int, loss: float, lr: float, batch_size: int, result: zero.StepResult,
                step_time: float, comm_bytes: tuple[dict[str, int], dict[str, int]], peak_mem: int) -> dict:
        """The metrics line of ``iteration`` (a collective over the world: every rank calls it)."""
        tokens = batch_size * self.config.model.seq_length
        mine = {"rank": self.groups.rank, "parameters": self.num_parameters,
                "expected_model_state_bytes": self.expected_state_bytes,
                "model_state_bytes": self.optimizer.model_state_bytes(),
                "offloaded_bytes": self.optimizer.offloaded_bytes(),
                "saved_activation_bytes": self.activation_meter.peak_bytes,
                "buffer_pool_bytes": self.buffer_pool.bytes(), "peak_mem_bytes": peak_mem}
        record = {
            "iteration": iteration, "consumed_samples": self.progress.consumed_samples,
            "batch_size": batch_size,
            "loss": loss, "lr": lr, "grad_norm": result.grad_norm, "loss_scale": result.loss_scale,
            "skipped": result.skipped, "step_time_s": step_time, "tokens_per_s": tokens / step_time,
            "tflops_per_rank": (self.flops_per_token * tokens / step_time / self.groups.topology.world_size
                                / 1e12),
            "per_rank": gather_per_rank(self.groups, mine, *comm_bytes),
        }
        peak = peak_flops(self.device, self.dtype)
        if peak is not None:  # model FLOPs utilisation against the device's data-sheet peak
            record["mfu"] = record["tflops_per_rank"] * 1e12 / peak
        if self.config.checkpoint.save:  # published: on disk and named by latest; the last save's stall
            record.update(checkpoint_published=self.saver.published if self.saver else self.published,
                          save_stall_s=self.save_stall_s)
        record.update({f"max_attention_logit/layer_{layer}": value
                       for layer, value in enumerate(self.max_attention_logits)})
        if self.config.logging.log_params_norm:
            record["params_norm"] = self.optimizer.parameter_norm()
        model = self.config.model
        record.update(mtp_metrics(self.runner.mtp_losses, self.groups))  # (none without the depths)
        if model.num_experts:
            record.update(moe_metrics(self.model, self.groups, model.moe_layers_with_depths(),
                                      model.num_experts, batch_size // self.schedule.per_step, self.device))
        return record

    def train(self) -> TrainResult:
        config, train = self.config, self.config.training
        wandb_run = start_wandb(config) if self.is_logger else None
        tensorboard = None
        if self.is_logger and config.logging.tensorboard_dir:
            from pretrain.observability.tensorboard_log import TensorboardLog

            tensorboard = TensorboardLog(config.logging.tensorboard_dir)
        writer = MetricsWriter(config.logging.metrics_file, wandb_run, enabled=self.is_logger,
                               tensorboard=tensorboard)
        result = TrainResult(wandb_dir=wandb_run.dir if wandb_run else None)
        if config.ignored_flags:
            print_rank0(self.is_logger, describe_ignored(config.ignored_flags))
        for note in config.notes:
            print_rank0(self.is_logger, note)
        micro = self.schedule.micro_batches(self.progress.consumed_samples)
        print_rank0(self.is_logger, f"training {self.num_parameters:,} parameters per rank "
                    f"(model {num_parameters(config.model):,}) on "
                    f"{self.groups.topology.describe().splitlines()[0]}, "
                    f"{micro} micro-batches of {train.micro_batch_size} per step"
                    + (f" (global batch {self.schedule.sizes()[0]} -> {self.schedule.final_batch_size})"
                       if len(self.schedule.sizes()) > 1 else ""))
        profiler = None
        try:
            batches = self._batches(self.data.train, self.schedule.samples_after(train.train_iters),
                                    self.progress.consumed_samples)
            if self.saver is not None:
                self.saver.reserve(self.checkpoint_states())  # the saves' host memory, before the clock
            started, last_console, first_sample = time.perf_counter(), 0.0, self.progress.consumed_samples
            profiler = StepProfiler(config, self.groups.rank, self.device)
            end = self.control.end  # --train-iters, or a cooldown branch's end
            for iteration in range(self.start_iteration + 1, end + 1):
                self.groups.stats.reset()
                reset_peak_memory(self.device)
                lr = self.param_scheduler.step(self.optimizer.param_groups)
                batch_size = self.schedule.batch_size(self.progress.consumed_samples)
                step_start = time.perf_counter()
                profiler.step_begin(iteration)
                local_loss, step = self.train_step(batches, self.control.records(
                    iteration, first=iteration == self.start_iteration + 1))
                profiler.step_end(iteration)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the step's kernels belong to its time
                step_time = time.perf_counter() - step_start
                self.progress.advance(batch_size)
                if not step.skipped:  # (Megatron's: a skipped fp16 step leaves the rates where they are)
                    self.param_scheduler.advance(batch_size)
                comm_bytes = (self.groups.stats.bytes_by_operation(),  # the step's traffic only
                              self.groups.stats.inter_node_bytes_by_operation())
                peak_mem = peak_memory_bytes(self.device)
                loss = self._dp_mean(local_loss)
                self.step_check.after(iteration, loss, local_loss, step)
                result.losses.append(loss)
                result.grad_norms.append(step.grad_norm)
                if self.saver is not None:
                    self.saver.poll()
                decision = self.control.after(iteration, first=iteration == self.start_iteration + 1,
                                              save_failed=self.saver is not None and self.saver.failed_here())
                if decision.stop == "a failed checkpoint save":
                    self.saver.wait()  # raises the failure, alike on every rank
                valid = self.evaluate() if decision.evaluate else None
                done, elapsed = iteration - self.start_iteration, time.perf_counter() - started
                if decision.console:
                    last_console = elapsed
                elif elapsed - last_console >= PROGRESS_INTERVAL_S:
                    last_console = elapsed
                    tokens = (self.progress.consumed_samples - first_sample) * config.model.seq_length
                    writer.progress(iteration, end, loss, lr, tokens / elapsed,
                                    elapsed / done * (end - iteration))
                if decision.record:
                    record = self._record(iteration, loss, lr, batch_size, step, step_time,
                                          comm_bytes, peak_mem)
                    if iteration == self.start_iteration + 1 and self.is_logger:
                        print(model_state_table(record["per_rank"], config.zero.zero_stage,
                                                self.groups.topology.dp,
                                                self.dtype), flush=True)
                        print(comm_table(record["per_rank"], self.groups.stats.node_size), flush=True)
                        if train.compile:  # a graph break elsewhere than at communication is a slow layer
                            print(f"--compile: the first step took {step_time:.1f} s with compilation; "
                                  f"{CompileReport.now().describe()}", flush=True)
                    if valid is not None:
                        result.valid_losses[iteration] = valid
                        record.update(valid_loss=valid, valid_ppl=math.exp(min(valid, 50.0)))
                        print_rank0(self.is_logger, f"validation at iter {iteration}: loss {valid:.4f}, "
                                    f"perplexity {record['valid_ppl']:.2f}")
                    record["elapsed_s"] = elapsed  # wall time since the first iteration began: the loop's own
                    writer.log(record, end, elapsed / done * (end - iteration), decision.console)
                if decision.save:
                    self.save()
                if decision.stop is not None:
                    self.stopped_early = decision.stop
                    print_rank0(self.is_logger, f"stopping after iteration {iteration} on {decision.stop}")
                    break
            self.watchdog.at(self.progress.iteration, "finishing")
            if self.saver is not None:
                self.saver.wait()  # the end of training waits for the last write
            result.sample = None if self.stopped_early else sample_text(
                self.config, self.tokenizer, self.runner, self.model, self.groups.tp.size, self.is_logger)
        finally:  # also on an error: swap files are scratch, a trace and a snapshot are written
            self.optimizer.close()
            if profiler is not None:
                profiler.close()
        writer.close()
        if wandb_run is not None:
            wandb_run.finish()
            print_rank0(self.is_logger, f"wandb run files: {os.path.dirname(wandb_run.dir)}")
        return result

    def checkpoint_states(self) -> dict[str, Stateful]:
        """What a checkpoint of this run holds, by owner: the one place a new checkpointed state is added.
        Made once: the model state keeps which pieces this rank writes, agreed with the world."""
        if self._checkpoint_states is None:
            self._checkpoint_states = {
                MODEL: ZeroModelState(self.optimizer, self.parameter_names, self.groups),
                "progress": RunState(self.progress),  # the data position; the LR schedule follows it
                "opt_param_scheduler": RunState(self.param_scheduler),
                "optimizer": RunState(OptimizerChoice(self.config.optimizer.optimizer)),
                "rng": self.model[0].rng}  # the stage's dropout streams and the default generator
            if self.config.model.moe_router_enable_expert_bias:  # every MoE layer's, on every rank
                self._checkpoint_states["load_balancing"] = RunState(self.model[0].balancing)
        return self._checkpoint_states

    def save(self) -> None:
        """Save this iteration's checkpoint: at once, or (--async-save) handed to the background writer,
        which says when it is published. Never prunes the checkpoint this run resumed from."""
        comm.barrier(self.groups.world)  # the stall starts when every rank is here (not the ranks' skew)
        ckpt, iteration, started = self.config.checkpoint, self.progress.iteration, time.perf_counter()
        self.watchdog.at(iteration, "checkpoint save", watched=False)  # a slow disk is no hang
        states, settings = self.checkpoint_states(), self.config.to_dict()
        if self.saver is not None:
            self.saver.start(ckpt.save, iteration, states, settings, ckpt.save_keep_last,
                             ckpt.save_retain_interval, self.resumed_from)
        else:
            path = checkpointer.save(ckpt.save, iteration, states, self.groups, settings, ckpt.save_keep_last,
                                     ckpt.save_retain_interval, self.resumed_from,
                                     DCP_STORAGE if ckpt.ckpt_format == DCP_STORAGE else None)
            self.published = iteration
            print_rank0(self.is_logger, f"saved checkpoint {path}")
        self.save_stall_s = time.perf_counter() - started  # the step's wait for the save
