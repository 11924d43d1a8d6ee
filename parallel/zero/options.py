"""What a ZeRO optimizer does, as typed values, and which of them each stage can take."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ZeroOptions:
    """The settings of one ZeRO optimizer: stage, buckets, clipping, stage-3 sharding, offload,
    precision and the ZeRO++ / MiCS switches, with the trainer's flag for each; the defaults are the
    trainer's (its flags take them from here), clipping aside.

    Owns the rules of which settings a stage can take (``check``); it never holds a process group
    or a tensor (``ZeroGroups`` holds the groups).
    """

    stage: int = 0  # --zero-stage
    bucket_size: int = 20_000_000  # --zero-bucket-size: elements per fused collective (at most)
    clip_grad: float = 0.0  # --clip-grad: max global norm, 0 for none (as a torch optimizer; the flag: 1.0)
    persistence_threshold: int = 100_000  # --zero-persistence-threshold: stage 3 keeps smaller ones whole
    prefetch_budget: int | None = None  # --zero-prefetch-budget: gathered elements alive (None: see
    # parameter_unit.default_prefetch_budget)
    offload_optimizer: str = "none"  # --offload-optimizer: none, cpu or nvme
    offload_param: str = "none"  # --offload-param: none or nvme (stage 3)
    nvme_path: str | None = None  # --nvme-path: the swap files' directory
    sub_group_size: int | None = None  # --zero-sub-group-size: the largest master; None: a 20th of the shard
    main_grads_in_fp32: bool = True  # not --grad-reduce-in-bf16: 16-bit gradients reduced in fp32
    overlap_param_gather: bool = False  # --overlap-param-gather (stages 1-2)
    quantized_weights: bool = False  # --zero-quantized-weights: int8 parameter gathers (qwZ)
    quantized_gradients: bool = False  # --zero-quantized-gradients: int8 gradient all-to-all (qgZ)
    hpz_partition_size: int = 1  # --zero-hpz-partition-size: a secondary partition of K ranks (hpZ)
    shard_size: int | None = None  # --zero-shard-size: MiCS / HSDP shard groups; None: all of dp

    def check(self, dp_size: int) -> None:
        """Raise ValueError naming the flag and the fix when these settings cannot run over ``dp_size``
        data-parallel ranks."""
        stage = self.stage
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero-stage {stage} is unknown: choose 0, 1, 2 or 3")
        for flag, value in (("--zero-bucket-size", self.bucket_size),
                            ("--zero-sub-group-size", self.sub_group_size)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1 element, got {value}")
        if self.persistence_threshold < 0 or (self.prefetch_budget or 0) < 0:
            raise ValueError("--zero-persistence-threshold and --zero-prefetch-budget must be >= 0")
        self._check_offload()
        if self.quantized_weights and stage == 0:
            raise ValueError("--zero-quantized-weights needs --zero-stage 1, 2 or 3: stage 0 all-reduces "
                             "gradients "
                             "and gathers no parameters; add --zero-stage 3 (or 1, 2) or drop the flag")
        if self.quantized_gradients and stage < 2:
            raise ValueError(f"--zero-quantized-gradients needs --zero-stage 2 or 3: stage {stage} "
                             f"{'all-reduces' if stage == 0 else 'reduce-scatters'} the gradients in place "
                             "in their "
                             "flat buffer; add --zero-stage 3 (or 2) or drop the flag")
        self._check_partitions(dp_size)

    def _check_offload(self) -> None:
        if self.offload_optimizer not in ("none", "cpu", "nvme"):
            raise ValueError(f"--offload-optimizer {self.offload_optimizer} is unknown: choose none, "
                             "cpu or nvme")
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ValueError(f"--offload-optimizer {self.offload_optimizer} needs --zero-stage 1, 2 or 3: "
                             "stage 0 "
                             "keeps no optimizer shard to offload")
        if self.offload_param not in ("none", "nvme"):
            raise ValueError(f"--offload-param {self.offload_param} is not available in this build: use "
                             "--offload-param nvme "
                             "(stage 3) or none")
        if self.offload_param == "nvme" and self.stage != 3:
            raise ValueError("--offload-param nvme needs --zero-stage 3: only stage 3 shards the parameters")
        if self.nvme_path is not None and "nvme" not in (self.offload_optimizer, self.offload_param):
            raise ValueError("--nvme-path is only used with --offload-optimizer nvme or "
                             "--offload-param nvme: "
                             "add one or drop --nvme-path")

    def _check_partitions(self, dp_size: int) -> None:
        shard, hpz = self.shard_size, self.hpz_partition_size
        for flag, size in (("--zero-shard-size", shard), ("--zero-hpz-partition-size", hpz)):
            if size is not None and (size < 1 or dp_size % size):
                raise ValueError(f"{flag} {size} must divide the data-parallel size {dp_size} (world / (tp "
                                 "x pp)): "
                                 "choose a divisor, usually the data-parallel ranks of one node")
        if shard is not None and shard < dp_size:
            if self.stage == 0:
                raise ValueError(f"--zero-shard-size {shard} needs --zero-stage 1, 2 or 3: stage 0 "
                                 "shards nothing")
            if hpz > 1 or self.quantized_gradients:
                raise ValueError(f"--zero-shard-size {shard} is not combined with "
                                 "--zero-hpz-partition-size or "
                                 "--zero-quantized-gradients here: a shard group of one node already "
                                 "keeps the "
                                 "gathers and reduce-scatters in the node; choose one of the two ways")
        if hpz > 1 and self.stage != 3:
            raise ValueError(f"--zero-hpz-partition-size {hpz} needs --zero-stage 3: only stage 3 "
                             "gathers the "
                             "parameters in forward and backward; add --zero-stage 3 or drop the flag")
