"""One way to run a GPT on a cluster, as the planner prices it (``launch.tools.planning``): a value that
says which layers each stage and chunk holds, and nothing about what it costs."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from launch.tools.planning.link_model import ZeroCommOptions
from launch.tools.planning.schedule_price import chunks_of
from parallel.pipeline.partition import chunk_layers, virtual_stage
from parallel.pipeline.schedules import V_SCHEDULES
from parallel.topology import Topology


@dataclass(frozen=True)
class Layout:
    """One way to run the model: parallel sizes, ZeRO stage, recompute, micro-batch size, the optimizer and
    its offload (none or cpu), sequence parallelism, context parallelism (ring attention). A value, never
    checked against a model by itself."""

    tp: int
    pp: int
    dp: int
    zero_stage: int
    recompute: str | None = None
    micro_batch_size: int = 1
    offload_optimizer: str = "none"
    sequence_parallel: bool = False
    split: tuple[int, ...] | None = None  # layers per virtual stage (``partition``; None: even)
    zero: ZeroCommOptions = ZeroCommOptions()  # ZeRO++ / MiCS
    cp: int = 1  # --context-parallel-size: each rank holds S / cp tokens of every sequence
    recompute_modules: tuple[str, ...] = ("core_attn",)  # what selective recompute redoes
    ep: int = 1  # --expert-model-parallel-size: the ranks a MoE layer's experts are spread over
    etp: int | None = None  # --expert-tensor-parallel-size (None: tp)
    dispatcher: str = "alltoall"  # --moe-token-dispatcher-type
    schedule: str = "1f1b"  # --pipeline-schedule (``schedule_price.SCHEDULES``)
    vp: int = 1  # --virtual-pipeline-size (interleaved)
    optimizer: str = "adam"  # --optimizer: adam, sgd or muon (``muon_price``)

    @property
    def recompute_label(self) -> str:
        """none, full, or selective's modules (Megatron's names)."""
        return ("+".join(self.recompute_modules) if self.recompute == "selective"
                else str(self.recompute or "none"))

    @property
    def data_ranks(self) -> int:
        """The ranks gradients are reduced and ZeRO shards over: dp x cp."""
        return self.dp * self.cp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_data_ranks(self) -> int:
        """The ranks an expert's gradients are reduced and its ZeRO states sharded over (expert dp)."""
        return self.tp * self.dp * self.cp // (self.expert_tp * self.ep)

    @property
    def v(self) -> bool:
        """Whether each stage holds two chunks in a V (zbv)."""
        return self.schedule in V_SCHEDULES

    def topology(self, gpus_per_node: int | None = None) -> Topology:
        return Topology(self.tp * self.pp * self.dp * self.cp, self.tp, self.pp, self.cp,
                        gpus_per_node=gpus_per_node, ep=self.ep, etp=self.etp, pipeline_v=self.v)

    @property
    def chunks(self) -> int:
        """Model chunks per stage: two in a V, ``vp`` interleaved."""
        return chunks_of(self.schedule, self.vp)

    def layers_on(self, stage: int, num_layers: int) -> int:
        return len(self.stage_layers(stage, num_layers))

    def chunk_layers(self, stage: int, num_layers: int) -> list[list[int]]:
        """The global indices of the layers each chunk of ``stage`` holds."""
        return _chunk_layers(self.pp, self.chunks, self.split, self.v, stage, num_layers)

    def stage_layers(self, stage: int, num_layers: int) -> list[int]:
        """The global indices of the layers ``stage`` holds (all its chunks')."""
        return [index for chunk in self.chunk_layers(stage, num_layers) for index in chunk]

    def holds(self, stage: int, chunk: int) -> tuple[bool, bool]:
        """Whether chunk ``chunk`` of ``stage`` holds (the embedding, the loss)."""
        virtual = virtual_stage(stage, chunk, self.pp, self.v)
        return virtual == 0, virtual == self.pp * self.chunks - 1


@functools.lru_cache(maxsize=65536)
def _chunk_layers(pp: int, chunks: int, split: tuple[int, ...] | None, v: bool, stage: int,
                  num_layers: int) -> list[list[int]]:
    return [chunk_layers(num_layers, pp, stage, chunk, chunks, split, v) for chunk in range(chunks)]
