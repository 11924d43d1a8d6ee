"""The settings of what a run reports: the console, the metrics file, wandb, TensorBoard, the text
sampled at its end, and Megatron's profiling flags (sections of ``pretrain.config.schema.Config``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.config import flag


@dataclass
class LoggingConfig:
    """Console, metrics file, wandb and the text sample at the end."""

    log_interval: int = field(default=100, metadata=flag("iterations between console/metrics lines"))
    log_throughput: bool = field(default=False, metadata=flag(
        "tokens/s and TFLOP/s per rank on the console (they are always in the metrics file)"))
    log_params_norm: bool = field(default=False,
                                  metadata=flag("the parameters' global L2 norm in every metrics "
                                                                "line (a collective per logged step)"))
    tensorboard_dir: str | None = field(default=None,
                                        metadata=flag("write a TensorBoard event file here (rank 0)"))
    tensorboard_log_interval: int = field(default=1, metadata=flag("TensorBoard every N logged iterations"))
    metrics_file: str | None = field(default=None, metadata=flag("JSON-lines metrics written by rank 0"))
    wandb_project: str | None = field(default=None, metadata=flag("wandb project (offline unless wandb is "
                                                                   "configured online); none = no wandb"))
    wandb_exp_name: str | None = field(default=None, metadata=flag("wandb run name"))
    wandb_group: str | None = field(default=None,
                                    metadata=flag("wandb group (e.g. the sweep the run belongs to)"))
    wandb_entity: str | None = field(default=None, metadata=flag("wandb entity (team)"))
    wandb_dir: str = field(default="runs",
                           metadata=flag("directory for wandb files", aliases=["--wandb-save-dir"]))
    sample_prompt: str | None = field(default="def ", metadata=flag("text to continue with the trained model "
                                                                     "at the end (empty = no sample)"))
    sample_tokens: int = field(default=64, metadata=flag("tokens to sample at the end"))


@dataclass
class ProfilingConfig:
    """Megatron's profiling flags: which steps of which ranks are traced, and how."""

    profile: bool = field(default=False, metadata=flag(
        "trace the steps after --profile-step-start up to --profile-step-end on --profile-ranks: with "
        "--use-pytorch-profiler a torch.profiler trace per rank under --tensorboard-dir (TensorBoard and "
        "Perfetto read it), else (GPUs) nsys's capture range and NVTX ranges"))
    profile_step_start: int = field(default=10, metadata=flag(
        "steps done before the traced ones (the torch profiler warms up on the last of them)"))
    profile_step_end: int = field(default=12, metadata=flag("the last traced step (1-based, as logged)"))
    profile_ranks: list[int] = field(default_factory=lambda: [0], metadata=flag("global ranks to trace"))
    use_pytorch_profiler: bool = field(default=False, metadata=flag("trace with torch.profiler"))
    record_memory_history: bool = field(default=False, metadata=flag(
        "record the CUDA allocator's history and write torch's memory snapshot to --memory-snapshot-path "
        "(GPUs; pytorch.org/memory_viz reads it)"))
    memory_snapshot_path: str = field(default="snapshot.pickle", metadata=flag(
        "where --record-memory-history writes (rank R > 0 adds .rankR)"))
