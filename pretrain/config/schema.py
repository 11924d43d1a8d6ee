"""The run's configuration: dataclasses grouped by concern, one field per flag.

Each field's metadata holds its help text (and choices): the flags of ``python -m pretrain`` and the
keys of a YAML file are generated from these fields (``--hidden-size`` <-> ``hidden_size``), so the
meaning of a setting is written once, here or in ``models.config.GPTConfig``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from data.tokenizers.spec import TOKENIZER_TYPES, TokenizerSpec
from models.config import GPTConfig, flag
from parallel.recompute import RECOMPUTE_MODULES
from parallel.zero.options import ZeroOptions
from pretrain.config.optimizer import OptimizerConfig
from pretrain.config.reporting import LoggingConfig, ProfilingConfig


@dataclass
class ParallelConfig:
    """How the world is split: tp x pp model parallelism, cp ranks splitting each sequence, the rest data
    parallelism."""

    tensor_model_parallel_size: int = field(default=1, metadata=flag("ranks splitting each layer (tp)"))
    pipeline_model_parallel_size: int = field(default=1, metadata=flag("pipeline stages (pp)"))
    context_parallel_size: int = field(default=1, metadata=flag(
        "ranks splitting each sequence (cp): each holds 2 of its 2 x cp chunks (chunks i and 2cp-1-i)"))
    cp_comm_type: list[str] = field(default_factory=lambda: ["p2p"], metadata=flag(
        "how attention sees the other cp ranks' keys and values: p2p (ring attention), a2a (Ulysses "
        "all-to-all to head sharding) or allgather; one value, or one per layer",
        choices=["p2p", "a2a", "allgather", "a2a+p2p"]))
    hierarchical_context_parallel_sizes: list[int] | None = field(default=None, metadata=flag(
        "a2a+p2p's inner (all-to-all) and outer (ring) cp sizes: refused, a2a+p2p is not implemented"))
    virtual_pipeline_size: int | None = field(default=None, metadata=flag(
        "model chunks per stage for the interleaved schedule",
        aliases=["--num-virtual-stages-per-pipeline-rank"]))
    num_layers_per_virtual_pipeline_stage: int | None = field(default=None, metadata=flag(
        "layers per model chunk (Megatron's way to ask for virtual stages: layers / pp / this)"))
    sequence_parallel: bool = field(
        default=False, metadata=flag("split norms and dropout along the sequence across tp ranks"))
    expert_model_parallel_size: int = field(default=1, metadata=flag(
        "ranks holding different experts of each MoE layer (ep): tokens reach their experts over them"))
    expert_tensor_parallel_size: int | None = field(default=None, metadata=flag(
        "ranks splitting each expert by width (etp; default: tp); the expert grid is etp x ep x expert dp x "
        "pp"))
    pipeline_schedule: str | None = field(default=None, metadata=flag(
        "gpipe, 1f1b, interleaved, zb-h1 (1F1B, each backward split: the weights' gradients fill the bubble) "
        "or zbv (the same over two chunks per stage in a V) (default: interleaved with virtual stages, else "
        "1f1b)", choices=["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"]))
    pipeline_layers_per_stage: list[int] | None = field(default=None, metadata=flag(
        "explicit layers per pipeline stage, e.g. 3 5 (each cut evenly over its virtual chunks), or per "
        "virtual stage in the order a micro-batch visits them (default: an even split)"))
    decoder_first_pipeline_num_layers: int | None = field(default=None, metadata=flag(
        "layers of the first pipeline stage (the others split the rest evenly)"))
    decoder_last_pipeline_num_layers: int | None = field(default=None, metadata=flag(
        "layers of the last pipeline stage (the others split the rest evenly)"))
    account_for_embedding_in_pipeline_split: bool = field(default=False, metadata=flag(
        "count the embedding as a layer of the first virtual stage, which holds one layer fewer"))
    account_for_loss_in_pipeline_split: bool = field(default=False, metadata=flag(
        "count the loss as a layer of the last virtual stage, which holds one layer fewer"))
    pipeline_model_parallel_layout: str | None = field(default=None, metadata=flag(
        "Megatron's layout string: per virtual stage in path order, separated by |, E (embedding), t "
        "(layer), L (loss), x*n and (...)*n repeat; e.g. 'Et|(tt|)*2tL' (sets the virtual stages)"))
    gpus_per_node: int | None = field(default=None, metadata=flag(
        "ranks per node (default: the launcher's LOCAL_WORLD_SIZE): which bytes cross nodes "
        "(comm_bytes_inter_node), and a warning when tp spans nodes"))
    distributed_timeout_s: float = field(default=600.0, metadata=flag(
        "seconds a collective may wait before the run fails (never a silent hang)",
        aliases={"--distributed-timeout-minutes": 60.0}))


@dataclass
class ZeroConfig:
    """The ZeRO optimizer along the data-parallel axis."""

    zero_stage: int | None = field(default=None, metadata=flag(
        "0 = data parallel (all-reduce), 1 = shard optimizer states, 2 = + gradients, 3 = + parameters "
        "(default 0; 1 with --use-distributed-optimizer, 3 with --use-megatron-fsdp / --use-torch-fsdp2)",
        choices=[0, 1, 2, 3]))
    use_distributed_optimizer: bool = field(default=False, metadata=flag(
        "Megatron's distributed optimizer: ZeRO stage 1 unless --zero-stage says otherwise"))
    overlap_grad_reduce: bool = field(default=False, metadata=flag(
        "overlap the gradient reduction with backward (always done here: accepted for Megatron's scripts)"))
    overlap_param_gather: bool = field(default=False, metadata=flag(
        "stages 1-2: the all-gather of the updated parameters after a step runs bucket by bucket behind the "
        "next forward (each module waits only for its own buckets) instead of before it"))
    zero_quantized_weights: bool = field(default=False, metadata=flag(
        "ZeRO++'s qwZ, stages 1-3: the parameter all-gathers send block-wise int8 values with an fp32 scale "
        "per 256 elements (about half of bf16's bytes, a quarter of fp32's); the fp32 masters stay exact"))
    zero_quantized_gradients: bool = field(default=False, metadata=flag(
        "ZeRO++'s qgZ, stages 2-3: the gradient reduce-scatter becomes an all-to-all of block-wise int8 "
        "gradients within each node, then one of the node's partial sums across nodes, summed in fp32 "
        "(a byte an element, and 1/(dp ranks per node) of the gradients leave a node)"))
    zero_shard_size: int | None = field(default=None, metadata=flag(
        "MiCS / HSDP, stages 1-3: shard the model states within groups of this many data-parallel ranks (a "
        "node's) and replicate them across the groups; gradients are reduce-scattered within a group, then "
        "all-reduced across its replicas (default: the data-parallel size, one group)"))
    zero_hpz_partition_size: int = field(default=1, metadata=flag(
        "ZeRO++'s hpZ, stage 3: keep a secondary copy of the parameters sharded over groups of this many "
        "data-parallel ranks (a node's), so that backward's gathers (and later micro-batches') stay "
        "within the "
        "group; costs 1/K of the parameters per rank; 1 = off"))
    grad_reduce_in_bf16: bool = field(default=False, metadata=flag(
        "under --bf16, accumulate and reduce gradients in bf16 (half the gradient memory and traffic) "
        "instead of in fp32 main gradients (the default, as Megatron's)"))
    zero_bucket_size: int = field(default=ZeroOptions.bucket_size, metadata=flag(
        "elements per fused communication bucket at most (a flat buffer is cut into at least 4, so that its "
        "reductions overlap backward at any model size)"))
    zero_persistence_threshold: int = field(default=ZeroOptions.persistence_threshold, metadata=flag(
        "stage 3: parameters with at most this many elements stay whole (norms, biases)"))
    zero_prefetch_budget: int | None = field(default=ZeroOptions.prefetch_budget, metadata=flag(
        "stage 3: elements of gathered parameters allowed alive at once when prefetching the next modules "
        "(default: the modules enclosing others, such as the embedding and head, and two blocks, so the next "
        "block is always gathered while one computes)"))
    offload_optimizer: str = field(default="none", metadata=flag(
        "where the fp32 masters, optimizer states and the step live: with the parameters (none), in CPU "
        "memory (cpu), or in swap files under --nvme-path (nvme); stages 1-3",
        choices=["none", "cpu", "nvme"]))
    zero_sub_group_size: int | None = field(default=None, metadata=flag(
        "the largest fp32 master, and with --offload-optimizer nvme the elements stepped at a time (at most "
        "three sub-groups in memory at once); default: a twentieth of the rank's shard, within 64K..1e8"))
    offload_param: str = field(default="none", metadata=flag(
        "stage 3: where the parameter shards live between gathers: in memory (none) or in swap files under "
        "--nvme-path (nvme), read ahead of their gathers", choices=["none", "cpu", "nvme"]))
    nvme_path: str | None = field(default=None, metadata=flag(
        "directory on a local disk for the swap files (each process makes a private one inside, removed "
        "at exit)"))


@dataclass
class RecomputeConfig:
    """Activation checkpointing (ZeRO-R)."""

    recompute_granularity: str | None = field(default=None, metadata=flag(
        "recompute whole layers (full) or the --recompute-modules (selective); none turns a YAML choice off",
        choices=["full", "selective"]))
    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn"], metadata=flag(
        "selective: what is recomputed (Megatron's names): core_attn the attention core, mlp the MLP, "
        "layernorm the pre-norms' outputs, moe a MoE layer, moe_act its experts' activation, shared_experts "
        "its shared expert, mla_up_proj latent attention from its latents, mamba a Mamba-2 mixer",
        choices=list(RECOMPUTE_MODULES)))
    recompute_num_layers: int | None = field(default=None, metadata=flag(
        "full: layers per checkpoint (uniform) or checkpointed layers per model chunk (block); default all"))
    recompute_method: str = field(default="uniform", metadata=flag(
        "full: checkpoint groups of --recompute-num-layers layers (uniform) or only the first ones (block)",
        choices=["uniform", "block"]))
    partition_activations: bool = field(
        default=False, metadata=flag("keep 1/tp of each checkpointed layer input per tensor-parallel rank"))
    activations_on_cpu: bool = field(
        default=False, metadata=flag("keep the checkpointed inputs (or their partitions) in CPU memory"))


@dataclass
class TrainingConfig:
    """Batch sizes, length of the run, precision and seed."""

    micro_batch_size: int = field(default=4, metadata=flag("samples per forward/backward on one rank"))
    global_batch_size: int | None = field(default=None, metadata=flag(
        "samples per optimizer step over all data-parallel ranks; a multiple of micro-batch x dp (default: "
        "micro-batch x dp)"))
    rampup_batch_size: list[int] | None = field(default=None, metadata=flag(
        "START INCREMENT SAMPLES: the global batch grows from START by INCREMENT in equal shares of SAMPLES "
        "samples up to --global-batch-size"))
    step_batch_size_schedule: str | None = field(default=None, metadata=flag(
        "'THRESHOLD:BATCH ...' (spaces or commas; K/M/B/T suffixes): the global batch from THRESHOLD "
        "tokens on"))
    train_iters: int | None = field(default=None, metadata=flag(
        "optimizer steps (default 100 without --train-samples)"))
    train_samples: int | None = field(default=None,
                                      metadata=flag("train until this many samples are consumed"))
    exit_interval: int | None = field(default=None,
                                      metadata=flag("save (with --save) and exit at iterations that "
                                                                   "this divides"))
    cooldown_iters: int | None = field(default=None, metadata=flag(
        "a cooldown branch: resume a warmup-stable-decay run's stable checkpoint (--load, --ckpt-step) and "
        "decay over this many iterations from it (--lr-wsd-decay-style, to --min-lr), reading on in the "
        "stable run's data; the run ends there (saving with --save), a point of a scaling study"))
    exit_duration_in_mins: float | None = field(default=None, metadata=flag(
        "save (with --save) and exit once the run has taken this many minutes"))
    eval_interval: int | None = field(default=None,
                                      metadata=flag("evaluate every N iterations (default: never)"))
    eval_iters: int = field(default=100, metadata=flag("validation global batches per evaluation"))
    eval_global_batch_size: int | None = field(default=None, metadata=flag(
        "samples per validation batch (default: the training batch at the end of its schedule)"))
    calculate_per_token_loss: bool = field(default=False, metadata=flag(
        "the loss and gradients are the mean over every loss token of the global batch (default: the mean of "
        "the micro-batches' means)"))
    seed: int = field(default=1234, metadata=flag("seed of weights, data order and dropout"))
    bf16: bool = field(default=False, metadata=flag("compute in bfloat16, fp32 master weights"))
    fp16: bool = field(default=False, metadata=flag("compute in float16 with dynamic loss scaling"))
    compile: bool = field(default=False, metadata=flag(
        "torch.compile each transformer layer and the loss head on its own (torchtitan's per-block compile): "
        "pointwise work fused into few kernels; communication stays eager between compiled regions; the "
        "first step compiles"))
    compile_backend: str = field(default="inductor", metadata=flag(
        "torch.compile's backend for --compile (inductor: Triton kernels on GPUs, C++ on the CPU; aot_eager: "
        "graphs captured, torch's own kernels)"))
    fp8_format: str | None = field(default=None, metadata=flag(
        "compute the transformer layers' linear products in fp8 through torchao's float8 training, inside a "
        "--bf16 run (e4m3: every operand e4m3; hybrid: e4m3 forward, e5m2 gradients); needs an NVIDIA GPU of "
        "compute capability 8.9 or newer, or --fp8-emulate", choices=["e4m3", "hybrid"]))
    fp8_recipe: str = field(default="tensorwise", metadata=flag(
        "fp8 scales, computed from each tensor as it is cast: one per tensor (tensorwise) or one per row "
        "(rowwise); Megatron's delayed (amax history) scaling is not offered",
        choices=["tensorwise", "rowwise", "delayed", "mxfp8", "blockwise"]))
    fp8_emulate: bool = field(default=False, metadata=flag(
        "with --fp8-format: emulate the fp8 products (torchao's emulation: fp8 rounding, high-precision "
        "products), for CPUs and GPUs without fp8; slow, for tests"))
    initial_loss_scale: float = field(default=2.0 ** 32, metadata=flag("fp16: loss scale at the start"))
    min_loss_scale: float = field(default=1.0, metadata=flag("fp16: the scale never backs off below this"))
    loss_scale_window: int = field(default=1000, metadata=flag("fp16: clean steps before the scale doubles"))
    hysteresis: int = field(default=2, metadata=flag("fp16: overflowing steps tolerated before backing off"))
    check_for_nan_in_loss_and_grad: bool = field(default=True, metadata=flag(
        "stop at the first step whose loss or gradient norm is NaN or Inf, naming the iteration and the "
        "ranks whose loss was (Megatron's flag, on by default); --no-check-for-nan-in-loss-and-grad skips "
        "such steps instead, up to --bad-step-limit in a row"))
    bad_step_limit: int = field(default=3, metadata=flag(
        "with --no-check-for-nan-in-loss-and-grad: stop after this many consecutive steps with a "
        "non-finite loss or gradient norm (each is skipped: the parameters do not change; fp16 overflows "
        "are the loss scaler's business and do not count)"))


@dataclass
class DataConfig:
    """Where tokens come from."""

    data_path: list[str] | None = field(default=None, metadata=flag(
        "indexed dataset prefix(es), optionally weighted: W1 P1 W2 P2 (default: the built-in stdlib corpus)"))
    train_data_path: list[str] | None = field(default=None, metadata=flag(
        "the training split's own prefix(es), optionally weighted (with --valid-data-path, "
        "--test-data-path)"))
    valid_data_path: list[str] | None = field(default=None,
                                              metadata=flag("the validation split's prefix(es)"))
    test_data_path: list[str] | None = field(default=None, metadata=flag("the test split's prefix(es)"))
    sft: bool = field(default=False, metadata=flag(
        "supervised fine-tuning: --data-path names .jsonl files of conversations or prompt/response "
        "pairs; the "
        "loss counts the answers only (data.sft_dataset)"))
    mock_data: bool = field(default=False, metadata=flag(
        "synthetic tokens (megatron-core's mock GPT dataset) instead of files; with --tokenizer-type "
        "NullTokenizer"))
    tokenizer_type: str | None = field(default=None, metadata=flag(
        "how the data was tokenized, by Megatron's names (default: GPT2BPETokenizer with --vocab-file, else "
        "SentencePieceTokenizer)", choices=list(TOKENIZER_TYPES)))
    tokenizer_model: str | None = field(default=None, metadata=flag(
        "SentencePieceTokenizer: the .model; HuggingFaceTokenizer: a tokenizer.json or the directory "
        "holding it"))
    vocab_file: str | None = field(default=None, metadata=flag("GPT2BPETokenizer: GPT-2's vocab.json"))
    merge_file: str | None = field(default=None, metadata=flag("GPT2BPETokenizer: GPT-2's merges.txt"))
    split: str = field(default="969,30,1", metadata=flag("train,valid,test weights"))
    data_cache_dir: str = field(default=os.path.join(".cache", "data"), metadata=flag(
        "where the built-in corpus and dataset indices are cached", aliases=["--data-cache-path"]))
    default_corpus_vocab_size: int = field(default=4096, metadata=flag(
        "vocabulary of the tokenizer trained on the built-in corpus"))
    default_corpus_max_bytes: int | None = field(default=None, metadata=flag(
        "cap on the built-in corpus size in bytes (default: all of the stdlib)"))
    reset_attention_mask: bool = field(default=False, metadata=flag(
        "documents packed into one sequence never attend across an end-of-document token"))
    reset_position_ids: bool = field(default=False, metadata=flag(
        "positions restart at 0 after each end-of-document token"))
    eod_mask_loss: bool = field(default=False, metadata=flag(
        "no loss on end-of-document tokens (as labels)"))

    def tokenizer_spec(self, model_vocab_size: int | None) -> TokenizerSpec:
        """The tokenizer of a validated run. A NullTokenizer's --vocab-size V becomes the model's
        vocabulary V + 1 in validation (its end-of-document id is V), so V is read back from it."""
        null = self.tokenizer_type == "NullTokenizer" and model_vocab_size is not None
        return TokenizerSpec(self.tokenizer_type, self.tokenizer_model, self.vocab_file, self.merge_file,
                             model_vocab_size - 1 if null else None)


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    save: str | None = field(default=None, metadata=flag("directory to save checkpoints in"))
    load: str | None = field(default=None, metadata=flag("directory to resume from"))
    ckpt_step: int | None = field(default=None, metadata=flag(
        "resume from the checkpoint of this iteration under --load instead of the newest"))
    save_interval: int | None = field(default=None, metadata=flag("save every N iterations (default: only at "
                                                                   "the end)"))
    save_keep_last: int = field(default=0, metadata=flag(
        "keep only the newest K checkpoints (0 = keep all; never the one this run resumed from)",
        aliases=["--ckpt-keep"]))
    async_save: bool = field(default=False, metadata=flag(
        "save in the background: the step copies its states to host memory and goes on while a thread "
        "writes, hashes and publishes them; the log says when a checkpoint is published"))
    ckpt_format: str = field(default="native", metadata=flag(
        "how checkpoints are stored: native (one verified file per rank and a manifest; Megatron's torch "
        "and torch_dist, whose own formats pretrain.convert --to megatron writes, mean it too) or "
        "torch_dcp (a PyTorch Distributed Checkpoint of whole tensors by our names, which torch's "
        "dcp.load and torchtitan's tools read; the same manifest beside it); both resume in any layout",
        choices=["native", "torch_dcp", "torch", "torch_dist"]))
    save_retain_interval: int | None = field(default=None, metadata=flag(
        "keep only the checkpoints at multiples of this iteration, and the newest"))
    finetune: bool = field(default=False, metadata=flag(
        "--load the model weights only: iteration 0, a fresh optimizer, schedule and data position"))
    pretrained_checkpoint: str | None = field(default=None, metadata=flag(
        "weights to start from when --load holds no checkpoint yet (fine-tuning that resumes itself)"))
    no_load_optim: bool = field(default=False, metadata=flag("resume without the optimizer's states"))
    no_load_rng: bool = field(default=False, metadata=flag("resume without the random states"))
    use_checkpoint_args: bool = field(default=False, metadata=flag(
        "the model's shape from the checkpoint (always done here: a shape flag that contradicts it is "
        "refused)"))
    use_checkpoint_opt_param_scheduler: bool = field(default=False, metadata=flag(
        "a resumed run takes the checkpoint's learning-rate schedule and weight decay, whatever the flags "
        "say (without it, or --override-opt_param-scheduler, a schedule unlike the checkpoint's is refused)",
        aliases=["--use-checkpoint-opt_param-scheduler"]))
    override_opt_param_scheduler: bool = field(default=False, metadata=flag(
        "a resumed run takes the flags' learning-rate schedule and weight decay, not the checkpoint's",
        aliases=["--override-opt_param-scheduler"]))


SECTIONS = {
    "model": GPTConfig, "parallel": ParallelConfig, "zero": ZeroConfig, "recompute": RecomputeConfig,
    "optimizer": OptimizerConfig, "training": TrainingConfig, "data": DataConfig,
    "checkpoint": CheckpointConfig, "logging": LoggingConfig, "profiling": ProfilingConfig,
}


@dataclass
class Config:
    """The whole run: one dataclass per concern. Owns values only; ``pretrain.config.arguments`` fills it and
    ``pretrain.startup.validation`` checks it."""

    model: GPTConfig = field(default_factory=GPTConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    ignored_flags: list[str] = field(default_factory=list)  # Megatron flags given that mean nothing here
    given: set[str] = field(default_factory=set)  # the settings the flags or YAML set (the rest are defaults)
    notes: list[str] = field(default_factory=list)  # what resolving the settings says (printed at start)

    def to_dict(self) -> dict:
        """Flat {name: value} of every setting (the YAML form)."""
        return {f.name: getattr(getattr(self, section), f.name)
                for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def all_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """Every setting name -> (section, field)."""
    return {f.name: (section, f) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
