"""One global batch through this rank's pipeline stage: micro-batches, schedule, loss."""

from __future__ import annotations

import contextlib
from typing import Iterator, Protocol

import torch
from torch import nn

from models.generate import gather_vocab_logits
from models.mtp.depth import depth_batch
from parallel import comm
from parallel.context import shard_sequence
from parallel.pipeline.executor import PipelineExecutor, StepStats
from parallel.pipeline.p2p import StageExchange
from parallel.pipeline.schedules import SPLIT_SCHEDULES, V_SCHEDULES, Action, schedule_actions
from parallel.pipeline.timeline import Exchange, simulate
from parallel.process_groups import ParallelGroups
from parallel.saved_activations import SavedActivationMeter
from parallel.tensor.layers import defer_weight_gradients
from parallel.tensor.weight_grad import WeightGradStore
from pretrain.config.schema import Config


class GradientOwner(Protocol):
    """What backward needs from the optimizer (``ZeroOptimizer`` is one): the loss to call backward on,
    and a context in which backward accumulates without syncing."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor: ...

    def no_sync(self) -> contextlib.AbstractContextManager: ...


class _NoSync:
    """Plain backward (no optimizer wraps the chunks: a benchmark of the schedule alone)."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor on ``device`` without making the host wait: on an accelerator it is staged in pinned
    host memory and copied asynchronously (ordered before the compute that reads it, on the same stream)."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class _GradientJoined(torch.autograd.Function):
    """``main``'s value; backward gives ``extra`` the gradient ``main`` gets (megatron-core's
    MTPLossAutoScaler: the depths' losses train without entering the reported loss)."""

    @staticmethod
    def forward(ctx, main: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return main.detach().clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad


def masked_mean(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    return (per_token_loss.float() * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)


class PipelineRunner:
    """Runs global batches through this rank's model chunks with the configured pipeline schedule.

    Owns the chunks' execution (forward and backward steps), the exchange with neighbouring stages, and
    which micro-batches this stage reads (tokens on the first stage, labels on the last, nothing in
    between unless attention needs the documents or positions restart per document), and this cp rank's
    cut of each sequence (its two zig-zag chunks of tokens, labels, loss mask and positions; documents
    stay whole). Backward starts from ``gradients.scale_loss(loss)`` and runs inside ``gradients.no_sync()``
    until a chunk's last micro-batch: the optimizer owns the loss scale and when gradients sync, this
    runner is their one caller. With a zero-bubble schedule it owns the store of the weight-gradient work
    each split backward leaves for its weight pass (``parallel.tensor.weight_grad``), given to the chunks'
    linear layers, and the weight pass syncs instead. Never steps the optimizer; the loss it returns is the
    unscaled global-batch mean over every token of each sequence (sums and token counts reduced over cp),
    the same on every rank of the pipeline.
    """

    def __init__(self, config: Config, groups: ParallelGroups, chunks: nn.ModuleList, device: torch.device,
                 meter: SavedActivationMeter, gradients: GradientOwner | None = None):
        self.config, self.groups, self.chunks, self.device, self.meter = config, groups, chunks, device, meter
        self.gradients = gradients or _NoSync()
        par, model, train = config.parallel, config.model, config.training
        self.pp, self.vp, self.stage = groups.topology.pp, par.virtual_pipeline_size or 1, groups.pp_rank
        self.kind = par.pipeline_schedule or ("interleaved" if self.vp > 1 else "1f1b")
        self.per_token_loss = train.calculate_per_token_loss
        self.sequence_parallel = par.sequence_parallel and groups.tp.size > 1
        self.cp, self.cp_rank = groups.cp.size, groups.cp_rank
        data = config.data
        self.every_stage_reads = data.reset_attention_mask or data.reset_position_ids
        self.dtype = next(chunks.parameters()).dtype
        self.v = self.kind in V_SCHEDULES
        self.executor = PipelineExecutor(self._exchange(model.seq_length // self.cp, train.micro_batch_size),
                                         self.stage, self.pp, self.vp, self.v)
        self.weight_grads = WeightGradStore() if self.kind in SPLIT_SCHEDULES else None
        if self.weight_grads is not None:
            for chunk in chunks:
                self.weight_grads.deferring |= defer_weight_gradients(chunk, self.weight_grads)
        # each chunk's parameters in reverse, the order a whole backward hands their gradients on
        self._backward_order = [list(chunk.parameters())[::-1] for chunk in chunks]
        self._programs: dict[tuple[int, bool], list[Action | Exchange]] = {}
        # each prediction depth's loss in the last step, summed over its micro-batches' means / their count
        # (under context parallelism this rank's share of them)
        self.mtp_losses = torch.zeros(model.mtp_depths, dtype=torch.float64, device=device)
        self._training = True  # whether the step running trains (its depths' losses are then kept)

    def program(self, num_micro_batches: int, train: bool = True) -> list[Action | Exchange]:
        """This stage's actions and exchanges for a step (forwards only when not ``train``)."""
        key = (num_micro_batches, train)
        if key not in self._programs:
            orders = [[a for a in schedule_actions(self.kind, num_micro_batches, self.pp, stage, self.vp)
                       if train or a.kind == "F"] for stage in range(self.pp)]
            self._programs[key] = simulate(orders, self.pp, self.vp, v=self.v).program(self.stage)
        return self._programs[key]

    def _exchange(self, length: int, batch: int) -> StageExchange | None:
        """The pipeline exchange of [length, batch, hidden] activations (length: this rank's tokens)."""
        if self.pp == 1:
            return None
        local = length // self.groups.tp.size if self.sequence_parallel else length
        return StageExchange(self.groups.pp, (local, batch, self.config.model.hidden_size),
                             self.dtype, self.device)

    @property
    def _loss_rank(self) -> int:
        """The global rank of this pipeline's stage that holds the loss (the last virtual stage)."""
        return self.groups.pp.ranks[self.groups.topology.last_stage]

    @property
    def reads_data(self) -> bool:
        return self.groups.is_first_stage or self.groups.is_last_stage or self.every_stage_reads

    def _cut(self, batch: dict) -> dict:
        """This cp rank's share of a micro-batch: every [b, S] tensor (and the prediction depths' [D, b, S],
        taken from the whole sequences first: ``depth_batch``) but the documents, which attention reads
        whole (they are the only tokens' metadata a rank needs for keys it does not hold)."""
        depths = self.config.model.mtp_depths
        if depths and self.groups.is_last_stage:
            batch = {**batch, **depth_batch(batch, depths)}
        return {key: value if key == "documents" else shard_sequence(value, self.cp, self.cp_rank,
                                                                       dim=value.dim() - 1)
                for key, value in batch.items()}

    def run(self, batches: Iterator[dict] | None, num_micro_batches: int,
            train: bool = True, measure: bool = True) -> tuple[float, StepStats]:
        """Forward (and backward when ``train``) of one global batch of ``num_micro_batches`` micro-batches
        per data-parallel rank; returns (mean loss, stats). With ``measure`` (and ``train``) the meter counts
        the activations saved for backward (a Python hook per saved tensor: only on steps that report it). The
        loss is the mean of the micro-batches' means, or with --calculate-per-token-loss the mean over every
        loss token of the global batch."""
        loaded: dict[int, dict] = {}

        def micro_batch(index: int) -> dict:
            while index not in loaded:
                batch = next(batches)
                loaded[len(loaded)] = self._cut({k: to_device(v, self.device) for k, v in batch.items()})
            return loaded[index]

        weight = self._per_token_weight(micro_batch, num_micro_batches) if self.per_token_loss else None
        counts = self._token_counts(micro_batch, num_micro_batches)
        shares = (self.cp / counts.clamp(min=1.0) / num_micro_batches).float() \
            if counts is not None and self.cp > 1 and weight is None else None
        balancing = self.chunks[0].balancing  # the rank's MoE layers', shared by its chunks
        if balancing is not None and train:  # the balancing losses train as a micro-batch's loss, cp-averaged
            balancing.reset()  # what the step's layers record, for its metrics
            balancing.gradient_scale = self.gradients.scale_loss(torch.ones(())).item() * self.cp \
                / num_micro_batches

        def forward_step(chunk: int, index: int, received: torch.Tensor | None) -> torch.Tensor:
            model = self.chunks[chunk]
            reads = model.pre_process or model.post_process or self.every_stage_reads
            batch = micro_batch(index) if reads else None
            positions = batch["position_ids"] if batch is not None else self._positions()
            with self.meter.recording((chunk, index)) if train and measure else contextlib.nullcontext():
                ahead = (batch["mtp_tokens"], batch["mtp_position_ids"], batch["mtp_labels"]) \
                    if model.post_process and model.config.mtp_depths else None
                out = model(batch["tokens"] if model.pre_process else None, positions,
                            labels=batch["labels"] if model.post_process else None, hidden=received,
                            documents=batch.get("documents") if batch is not None else None, ahead=ahead)
            if not model.post_process:
                return out
            if out.dim() == 3:  # the language model's per-token loss, then the prediction depths'
                return self._with_depths(out, batch, weight, counts, shares, index, num_micro_batches)
            return self._micro_batch_loss(out, batch["loss_mask"], weight, None if shares is None else
                                          shares[:, 0], index, num_micro_batches)

        def backward_step(chunk: int, index: int, output: torch.Tensor, grad: torch.Tensor | None,
                          hidden: torch.Tensor | None, last: bool) -> torch.Tensor | None:
            root = self.gradients.scale_loss(output) if grad is None else output
            if self.weight_grads is not None:  # B of a split backward: the parameters' gradients wait for W
                input_grad = self.weight_grads.input_pass((chunk, index), root, grad, hidden,
                                                          self._backward_order[chunk])
                self.meter.release((chunk, index))
                if measure:  # what the weight pass keeps until it runs
                    self.meter.hold(("W", chunk, index), self.weight_grads.held_storages((chunk, index)))
                return input_grad
            with contextlib.nullcontext() if last else self.gradients.no_sync():
                torch.autograd.backward(root, grad)
            self.meter.release((chunk, index))
            return None if hidden is None else hidden.grad

        def weight_step(chunk: int, index: int, last: bool) -> None:
            with contextlib.nullcontext() if last else self.gradients.no_sync():
                self.weight_grads.weight_pass((chunk, index))
            self.meter.release(("W", chunk, index))

        if train:  # (an evaluation leaves the last step's for its metrics)
            self.mtp_losses.zero_()
        self._training = train
        stats = self.executor.run(self.program(num_micro_batches, train), forward_step, backward_step,
                                  weight_step, train=train)
        return self._loss_from_last_stage(stats.losses), stats

    @staticmethod
    def _micro_batch_loss(out: torch.Tensor, loss_mask: torch.Tensor, weight: torch.Tensor | None,
                          shares: torch.Tensor | None, index: int, num_micro_batches: int) -> torch.Tensor:
        """A micro-batch's term of the step's loss from per-token losses ``out`` [b, s]."""
        if weight is not None:  # this micro-batch's share of the global token mean
            return (out.float() * loss_mask).sum() * weight[0]
        if shares is not None:  # this cp rank's share of the micro-batch's mean
            return (out.float() * loss_mask).sum() * shares[index]
        return masked_mean(out, loss_mask) / num_micro_batches

    def _with_depths(self, out: torch.Tensor, batch: dict, weight: torch.Tensor | None, counts: torch.Tensor,
                     shares: torch.Tensor | None, index: int, num_micro_batches: int) -> torch.Tensor:
        """The language model's term from ``out[0]``, the prediction depths' (``out[k]`` against
        ``batch["mtp_loss_mask"][k - 1]``: the loss mask shifted by k, the next document's targets masked)
        joined to it as Megatron's MTPLossAutoScaler joins them: each depth's masked mean (under context
        parallelism this cp rank's share of the whole sequences', as the language model's) times
        --mtp-loss-scaling-factor / D adds its gradient, not its value (the reported loss is the language
        model's, bit for bit, whatever the depths' losses are). Under --calculate-per-token-loss each depth's
        sum is scaled by the micro-batch's loss tokens over its own (``counts``: whole sequences), as
        Megatron's. Each depth's mean is kept for the metrics (a training step's only; a cp rank keeps its
        share)."""
        main = self._micro_batch_loss(out[0], batch["loss_mask"], weight, None if shares is None else
                                      shares[:, 0], index, num_micro_batches)
        model = self.config.model
        scale = model.mtp_loss_scaling_factor / model.mtp_depths
        extra = torch.zeros((), device=out.device)
        for depth in range(1, out.shape[0]):
            mask, tokens = batch["mtp_loss_mask"][depth - 1], counts[index, depth].clamp(min=1.0)
            summed = (out[depth].float() * mask).sum()
            if self._training:
                self.mtp_losses[depth - 1] += summed.detach().double() / tokens / num_micro_batches
            if weight is not None:
                extra = extra + scale * summed * (counts[index, 0] / tokens).float() * weight[0]
            else:
                share = None if shares is None else shares[:, depth]
                extra = extra + scale * self._micro_batch_loss(out[depth], mask, None, share, index,
                                                               num_micro_batches)
        return _GradientJoined.apply(main, extra)

    def _per_token_weight(self, micro_batch, num_micro_batches: int) -> torch.Tensor | None:
        """dp / (loss tokens of the whole global batch), on the last stage: after the data-parallel mean
        each token weighs 1 / total, as Megatron's per-token loss. The loss masks of this rank's
        micro-batches are read first (they are small) and their count summed over data parallelism, on
        the device: the weight is a device scalar, and the host waits for none of it."""
        if not self.groups.is_last_stage:
            return None
        tokens = torch.stack([micro_batch(i)["loss_mask"].sum(dtype=torch.float64)
                              for i in range(num_micro_batches)]).sum().reshape(1)
        comm.all_reduce(tokens, self.groups.dp_cp)  # gradients are averaged over dp x cp
        return (self.groups.dp_cp.size / tokens.clamp(min=1.0)).float()

    def _token_counts(self, micro_batch, num_micro_batches: int) -> torch.Tensor | None:
        """On the last stage, under context parallelism (but with the per-token loss alone) or with
        prediction depths: [micro-batches, 1 + D],
        each micro-batch's loss tokens over its whole sequences (summed over cp: one all-reduce of the
        counts per step), the language model's, then each depth's."""
        depths = self.config.model.mtp_depths
        if not self.groups.is_last_stage or not depths and (self.cp == 1 or self.per_token_loss):
            return None  # (the per-token loss's weight counts its tokens itself)
        counts = []
        for i in range(num_micro_batches):
            batch = micro_batch(i)
            depth_counts = [batch["mtp_loss_mask"].sum(dim=(1, 2), dtype=torch.float64)] if depths else []
            counts.append(torch.cat([batch["loss_mask"].sum(dtype=torch.float64).reshape(1), *depth_counts]))
        counts = torch.stack(counts)
        if self.cp > 1:
            comm.all_reduce(counts, self.groups.cp)
        return counts

    def _positions(self) -> torch.Tensor:
        """A middle stage's positions (it reads no data): 0..S-1, this cp rank's cut of them."""
        train, model = self.config.training, self.config.model
        whole = torch.arange(model.seq_length, device=self.device).expand(train.micro_batch_size,
                                                                          model.seq_length)
        return shard_sequence(whole, self.cp, self.cp_rank)

    def _loss_from_last_stage(self, losses: list[torch.Tensor]) -> float:
        """The step's loss on every pipeline rank: the last stage's micro-batch losses summed on the
        device (and averaged over cp, each rank's being its share times cp), broadcast, and read by the
        host once (the only wait of the step for it)."""
        value = torch.zeros(1, dtype=torch.float64, device=self.device)
        if losses:
            value += torch.stack([loss.double() for loss in losses]).sum()
        if self.cp > 1 and self.groups.is_last_stage:
            comm.all_reduce(value, self.groups.cp)
            value /= self.cp
        comm.broadcast(value, src=self._loss_rank, group=self.groups.pp)
        return value.item()

    @torch.no_grad()
    def next_token_logits(self, tokens: list[int]) -> torch.Tensor:
        """Full-vocabulary logits after ``tokens`` (one sequence), identical on every rank of the pipeline."""
        length = len(tokens)
        padded = length + (-length % self.groups.tp.size if self.sequence_parallel else 0)
        ids = torch.tensor([tokens + [0] * (padded - length)], dtype=torch.long, device=self.device)
        positions = torch.arange(padded, device=self.device).unsqueeze(0)

        def forward_step(chunk: int, index: int, hidden: torch.Tensor | None) -> torch.Tensor:
            model = self.chunks[chunk]
            return model(ids if model.pre_process else None, positions, hidden=hidden, whole_sequence=True)

        executor = PipelineExecutor(self._exchange(padded, 1), self.stage, self.pp, self.vp, self.v)
        out = executor.run(self.program(1, train=False), forward_step, train=False).losses
        vocab = self.config.model.vocab_size
        logits = torch.empty(vocab, dtype=torch.float32, device=self.device)
        if self.groups.is_last_stage:
            logits.copy_(gather_vocab_logits(out[0][length - 1, 0], self.chunks[-1]))
        comm.broadcast(logits, src=self._loss_rank, group=self.groups.pp)
        return logits
