"""Megatron-LM's command line beyond this project's own flags: what is accepted and ignored, what is refused.

A flag whose meaning exists here is an ordinary setting (``pretrain.config.schema``; some under Megatron's
other spellings, as aliases). The other flags of Megatron's GPT and Llama example scripts and GPT
functional tests fall in three groups, each entry with its reason:

- ``IGNORED``: it chooses an implementation (kernels, fusions, checkpoint formats, loader workers,
  profilers, timers) that has no meaning here; accepted with its value, and named in one start-up line.
- ``IMPLIED``: another spelling of a setting of ours (``--use-megatron-fsdp`` is ZeRO stage 3).
- ``REFUSED``: a feature this build does not have (expert parallelism, MoE, ...), or an option
  of Megatron's inference and RL scripts: a run that sets it stops before any process group exists,
  naming the flag. A value that means "off" (``--num-experts 1``) is fine.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from parallel.pipeline.layer_split import SplitRequest


@dataclass(frozen=True)
class MegatronFlag:
    """One Megatron flag and what this build does with it. ``nargs``: None for one value, "0" for a
    switch, "+" / "*" for lists; ``off``: the values that leave a refused feature off."""

    name: str
    nargs: str | None
    reason: str
    off: tuple = ()


def _flags(reason: str, *specs: str, off: tuple = ()) -> list[MegatronFlag]:
    """``specs``: "--name" (one value), "--name:0" (a switch), "--name:+" (a list)."""
    flags = []
    for spec in specs:
        name, _, nargs = spec.partition(":")
        flags.append(MegatronFlag(name, nargs or None, reason, off))
    return flags


IGNORED = [
    *_flags("selects Megatron's kernels or fusions; the computation is the same here",
            "--attention-backend", "--attention-softmax-in-fp32:0", "--apply-query-key-layer-scaling:0",
            "--cross-entropy-loss-fusion:0", "--cross-entropy-fusion-impl",
            "--no-gradient-accumulation-fusion:0",
            "--no-masked-softmax-fusion:0", "--no-persist-layer-norm:0", "--no-rope-fusion:0",
            "--use-flashinfer-fused-rope:0", "--transformer-impl", "--use-mcore-models:0",
            "--te-rng-tracker:0",
            "--cuda-graph-impl", "--enable-cuda-graph:0", "--deterministic-mode:0",
            "--first-last-layers-bf16:0"),
    *_flags("overlap and scheduling knobs of Megatron's kernels; they change timing, not results",
            "--tp-comm-overlap:0", "--tp-comm-overlap-cfg", "--defer-embedding-wgrad-compute:0",
            "--wgrad-deferral-limit", "--overlap-p2p-communication-warmup-flush:0",
            "--microbatch-group-size-per-virtual-pipeline-stage",
            "--overlap-param-gather-with-optimizer-step:0", "--ddp-average-in-collective:0",
            "--disable-gloo-process-groups:0", "--data-parallel-sharding-strategy",
            "--megatron-fsdp-grad-comm-dtype",
            "--megatron-fsdp-main-grads-dtype", "--megatron-fsdp-main-params-dtype"),
    *_flags("checkpoint formats and writers: checkpoints here are one verified file per rank plus a "
            "manifest, "
            "re-cut to any layout on load", "--async-strategy",
            "--async-ckpt-use-cpu-shm:0", "--use-persistent-ckpt-worker:0", "--auto-detect-ckpt-format:0",
            "--ckpt-assume-constant-structure:0", "--ckpt-fully-parallel-load:0",
            "--ckpt-fully-parallel-save:0",
            "--no-ckpt-fully-parallel-save:0", "--dist-ckpt-optim-fully-reshardable:0",
            "--dist-ckpt-strictness",
            "--verify-integrity:0",
            "--no-use-tokenizer-model-from-checkpoint-args:0"),
    *_flags("data-loader and memory-manager knobs: the data path here has no worker processes or masks",
            "--num-workers", "--no-mmap-bin-files:0", "--no-create-attention-mask-in-dataloader:0",
            "--empty-unused-memory-level", "--manual-gc:0", "--tiktoken-pattern"),
    *_flags("recomputed from --hidden-size / --mup-base-hidden-size, as Megatron does under --use-mup",
            "--mup-width-mult"),
    *_flags("profilers, timers and checks of Megatron's own; the metrics file, wandb and TensorBoard "
            "report here",
            "--timing-log-level",
            "--timing-log-option",
            "--log-timers-to-tensorboard:0", "--log-memory-to-tensorboard:0",
            "--log-validation-ppl-to-tensorboard:0",
            "--log-num-zeros-in-grad:0", "--log-progress:0", "--straggler-minmax-count", "--rerun-mode",
            "--error-injection-rate", "--error-injection-type",
            "--check-weight-hash-across-dp-replicas-interval",
            "--test-mode:0"),
    *_flags("the backend follows the device here (gloo on CPUs, NCCL on GPUs)", "--distributed-backend"),
    *_flags("selects Megatron's module spec or its Mamba kernels' memory path; the layers here are built "
            "from the flags (a hybrid model from --hybrid-layer-pattern)", "--spec:+", "--is-hybrid-model:0",
            "--disable-mamba-mem-eff-path:0"),
    *_flags("fusions of the MoE permutation and router kernels; the unfused code runs here",
            "--moe-permute-fusion:0", "--moe-router-fusion:0", "--moe-shared-expert-overlap:0",
            "--moe-use-legacy-grouped-gemm:0"),
    *_flags("Megatron's older spelling: no learned positions (rope and none have none; learned_absolute "
            "becomes none)", "--no-position-embedding:0"),
    *_flags("the amax history of delayed fp8 scaling; the scales here are computed from each tensor as it "
            "is cast (--fp8-recipe tensorwise or rowwise)", "--fp8-amax-compute-algo",
            "--fp8-amax-history-len", "--fp8-margin", "--fp8-interval"),
    *_flags("parameters are gathered in the compute dtype here and cast to fp8 at each product (the "
            "fp8 values are the same; the gather moves twice the bytes)", "--fp8-param-gather:0"),
]

IMPLIED = {"--use-megatron-fsdp": ("zero_stage", 3), "--use-torch-fsdp2": ("zero_stage", 3)}

REFUSED = [
    *_flags("the flex dispatcher (DeepEP, HybridEP) is not built: use --moe-token-dispatcher-type alltoall",
            "--moe-enable-deepep:0", "--moe-flex-dispatcher-backend", off=(None,)),
    *_flags("this attention variant (DeepSeek's sparse indexer) is not supported", "--dsa-indexer-head-dim",
            "--dsa-indexer-n-heads",
            "--dsa-indexer-topk", "--dsa-indexer-loss-coeff", off=(None,)),
    *_flags("one layer per multi-token prediction depth is built (--mtp-num-layers); a layer repeated over "
            "the depths is not", "--mtp-use-repeated-layer:0", off=(None,)),
    *_flags("ranks are laid out in Megatron's default order (tp, dp, pp) only", "--use-tp-pp-dp-mapping:0"),
    *_flags("Megatron's older placement of hybrid layers by ratios: give the layers as "
            "--hybrid-layer-pattern (e.g. 'M-M*-')", "--hybrid-attention-ratio", "--hybrid-mlp-ratio",
            off=(None, "0", "0.0")),
    *_flags("several distributed-optimizer instances (sharding within groups) are not supported",
            "--num-distributed-optimizer-instances", off=("1",)),
    *_flags("fill-in-the-middle data, distillation and Transformer Engine exports are not supported",
            "--fim-data:0", "--fim-rate", "--fim-spm-rate", "--export-kd-cfg",
            "--export-kd-teacher-load", "--export-te-mcore-model:0", off=(None,)),
    *_flags("an option of Megatron's RL training, which this build does not have", "--perform-rl-step:0",
            "--grpo-clamp-eps-lower", "--grpo-clamp-eps-upper", "--grpo-entropy-term-weight",
            "--grpo-group-size",
            "--grpo-iterations", "--grpo-kl-beta", "--grpo-prompts-per-step", "--langrl-env-config",
            "--refit-method", "--rl-consumption-granularity", "--rl-generation-lag",
            "--rl-inference-pipeline-model-parallel-size", "--rl-inference-tensor-model-parallel-size",
            "--rl-offload-optimizer-during-inference:0", "--rl-partial-rollouts:0",
            "--rl-sequence-packing-algo",
            "--rl-submission-granularity", "--rl-training-cuda-graphs:0",
            "--rl-use-sequence-packing:0", off=(None,)),
    *_flags("an option of Megatron's inference scripts, not of training (sample here with "
            "--sample-prompt, or "
            "export with python -m pretrain.convert --to hf)", "--prompts:+", "--prompt-file",
            "--prompt-file-num-truncate", "--temperature", "--top_k", "--top_p", "--top-n-logprobs",
            "--num-tokens-to-generate", "--return-log-probs:0", "--termination-id",
            "--stop-words:+", "--output-path",
            "--output-every-n-results", "--max-tokens-to-oom", "--flash-decode:0",
            "--enable-chunked-prefill:0",
            "--decode-only-cuda-graphs:0", "--use-legacy-static-engine:0",
            "--use-coordinator:0", "--async-mode:0",
            "--incoming-requests-per-sec", "--incoming-requests-per-step", "--inference-ckpt-non-strict:0",
            "--inference-rng-tracker:0", "--inference-fuse-tp-communication:0",
            "--inference-logging-step-interval",
            "--inference-max-requests", "--inference-max-seq-length", "--inference-repeat-n",
            "--inference-dynamic-batching-async-sched-mode", "--inference-dynamic-batching-buffer-size-gb",
            "--inference-dynamic-batching-cuda-graph-sizing-distribution",
            "--inference-dynamic-batching-max-requests", "--inference-dynamic-batching-max-tokens",
            "--inference-dynamic-batching-num-cuda-graphs", "--inference-dynamic-batching-prefix-caching:0",
            "--inference-dynamic-batching-prefix-caching-coordinator-policy",
            "--inference-dynamic-batching-prefix-caching-eviction-policy",
            "--inference-dynamic-batching-sampling-backend",
            "--inference-dynamic-batching-unified-memory-level",
            off=(None,)),
]

_DEST_PREFIX = "megatron__"


def _dest(name: str) -> str:
    return _DEST_PREFIX + name.lstrip("-").replace("-", "_")


def add_megatron_flags(parser: argparse.ArgumentParser) -> None:
    """Add every IGNORED, IMPLIED and REFUSED flag to ``parser`` (their values land under a prefix)."""
    group = parser.add_argument_group("Megatron-LM flags accepted for its scripts (ignored, implied or "
                                      "refused)")
    for flag in [*IGNORED, *REFUSED]:
        if flag.nargs == "0":
            group.add_argument(flag.name, dest=_dest(flag.name), action="store_true", help=flag.reason)
        else:
            group.add_argument(flag.name, dest=_dest(flag.name), nargs=flag.nargs, help=flag.reason)
    for name, (setting, value) in IMPLIED.items():
        group.add_argument(name, dest=_dest(name), action="store_true",
                           help=f"means --{setting.replace('_', '-')} "
                                                                            f"{value}")


def resolve_megatron_flags(args: dict) -> tuple[dict, list[str]]:
    """Take the Megatron-only flags out of parsed ``args``: raise ValueError for a refused feature that is on,
    turn implied flags into our settings, and return (the settings they imply, the ignored flags given)."""
    implied: dict = {}
    ignored: list[str] = []
    for flag in REFUSED:
        value = args.pop(_dest(flag.name), None)
        if value is None or value is False or (flag.off and str(value) in {str(v) for v in flag.off}):
            continue
        shown = " ".join(map(str, value)) if isinstance(value, list) else value
        given = flag.name if value is True else f"{flag.name} {shown}"
        raise ValueError(f"{given}: {flag.reason}")
    for flag in IGNORED:
        value = args.pop(_dest(flag.name), None)
        if value is not None and value is not False:
            ignored.append(flag.name)
    for name, (setting, value) in IMPLIED.items():
        if args.pop(_dest(name), False):
            implied[setting] = value
    return implied, ignored


def describe_ignored(ignored: list[str]) -> str:
    """The start-up line naming the ignored flags, grouped by reason."""
    by_reason: dict[str, list[str]] = {}
    for flag in IGNORED:
        if flag.name in ignored:
            by_reason.setdefault(flag.reason, []).append(flag.name)
    return "Megatron flags accepted and ignored: " + "; ".join(f"{' '.join(names)} ({reason})"
                                                               for reason, names in by_reason.items())


def resolve_settings(config, pipeline_stages: int) -> None:
    """Turn Megatron's spellings of our settings into ours, in place, before the checks that read them
    (ValueError naming the flags when two of them disagree)."""
    par, zero, data, train = config.parallel, config.zero, config.data, config.training
    model = config.model
    gpt_path = gated_delta_path(config, pipeline_stages)
    config.notes.extend(model.resolve_pattern("num_layers" in config.given and not gpt_path))
    if "hybrid_override_pattern" in config.given:  # forwarded: a pattern given, as a checkpoint's load sees
        config.given.add("hybrid_layer_pattern")
    pattern = model.parsed_pattern()
    if pattern is not None:
        hybrid_layout(config, pattern, pipeline_stages)
    if "--no-position-embedding" in config.ignored_flags and model.position_embedding == "learned_absolute":
        model.position_embedding_type = "none"
    if zero.zero_stage is None:
        zero.zero_stage = 1 if zero.use_distributed_optimizer else 0
    if par.num_layers_per_virtual_pipeline_stage is not None:
        per_chunk = par.num_layers_per_virtual_pipeline_stage
        layers = config.model.num_layers
        if per_chunk < 1 or layers % (pipeline_stages * per_chunk):
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per_chunk}: --num-layers "
                             f"{layers} is not "
                             f"pipeline stages {pipeline_stages} x chunks of {per_chunk} layers")
        chunks = layers // (pipeline_stages * per_chunk)
        if par.virtual_pipeline_size not in (None, chunks):
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per_chunk} makes {chunks} virtual "
                             "stages, "
                             f"--virtual-pipeline-size says {par.virtual_pipeline_size}: give one of them")
        if par.pipeline_schedule == "zbv" and chunks != 2:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per_chunk} makes {chunks} chunk(s) "
                             "per stage; --pipeline-schedule zbv runs two in a V: give "
                             f"{layers // (2 * pipeline_stages)} (--num-layers {layers} / 2 / "
                             f"--pipeline-model-parallel-size {pipeline_stages}) or leave it out")
        par.virtual_pipeline_size = chunks
    if par.virtual_pipeline_size is None and par.pipeline_schedule != "zbv":  # a layout string's chunks
        par.virtual_pipeline_size = split_request(par).chunks(pipeline_stages, config.model.num_layers)
    if par.pipeline_schedule is None:
        par.pipeline_schedule = "interleaved" if (par.virtual_pipeline_size or 1) > 1 else "1f1b"
    if par.pipeline_schedule == "zbv" and par.virtual_pipeline_size is None:
        par.virtual_pipeline_size = 2  # its V is two chunks per stage
    par.pipeline_layers_per_stage = resolve_split(config, pipeline_stages)
    if data.tokenizer_type is None:  # as Megatron's pretrain_gpt: GPT-2 BPE when its files are given
        data.tokenizer_type = ("GPT2BPETokenizer" if data.vocab_file or data.merge_file
                               else "SentencePieceTokenizer")
    if train.train_iters is None and train.train_samples is None:
        train.train_iters = 100


_GPT_PATH_SPLITS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                    "num_layers_per_virtual_pipeline_stage", "virtual_pipeline_size",
                    "pipeline_model_parallel_layout", "pipeline_layers_per_stage")


def gated_delta_path(config, pipeline_stages: int) -> bool:
    """Megatron's GPT path to gated delta nets (--experimental-attention-variant, --linear-attention-freq)
    made the --hybrid-layer-pattern it builds, said in a note (its --moe-layer-freq placed the experts);
    whether it was given. Its layers (two pattern layers each) split evenly over the pipeline stages; the
    flags that cut them otherwise are refused."""
    model = config.model
    if not model.experimental_attention_variant:
        return False
    shown = f"--experimental-attention-variant {model.experimental_attention_variant}"
    for name in _GPT_PATH_SPLITS:
        if name in config.given:
            raise ValueError(f"--{name.replace('_', '-')} with {shown}: its layers split evenly over the "
                             "pipeline stages here; drop the flag, or give the layers as "
                             "--hybrid-layer-pattern with | where the stages are cut")
    if model.num_layers % pipeline_stages:
        raise ValueError(f"--pipeline-model-parallel-size {pipeline_stages} does not divide --num-layers "
                         f"{model.num_layers} with {shown}: each stage holds whole layers")
    attention = "+" if model.multi_latent_attention else "*"
    pattern = model.gated_delta_pattern(model.moe_layers(model.num_layers), attention)
    if model.hybrid_override_pattern or model.hybrid_layer_pattern not in (None, pattern):
        raise ValueError(f"--experimental-attention-variant {model.experimental_attention_variant} beside "
                         "--hybrid-layer-pattern: the variant builds the pattern "
                         f"{pattern!r}; give one of them")
    config.notes.append(f"--experimental-attention-variant {model.experimental_attention_variant}: the "
                        f"layers are --hybrid-layer-pattern {pattern!r}")
    # the model is the pattern from here on (a checkpoint records it alone; its E placed the experts)
    model.hybrid_layer_pattern, model.experimental_attention_variant, model.linear_attention_freq = (
        pattern, None, None)
    model.moe_layer_freq = "1"
    config.given.discard("moe_layer_freq")
    return True


_NOT_WITH_A_PATTERN = (("num_layers_per_virtual_pipeline_stage", "--num-layers-per-virtual-pipeline-stage"),
                       ("virtual_pipeline_size", "--virtual-pipeline-size"),
                       ("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout"),
                       ("pipeline_layers_per_stage", "--pipeline-layers-per-stage"),
                       ("account_for_embedding_in_pipeline_split",
                        "--account-for-embedding-in-pipeline-split"),
                       ("account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split"))


def hybrid_layout(config, pattern, pipeline_stages: int) -> None:
    """A hybrid pattern's pipeline cut, as Megatron takes it: its ``|`` segments are the virtual stages in a
    micro-batch's path (their count a multiple of the stages; more make virtual stages); without ``|`` the
    layers split evenly (or by the first / last stage counts). The other ways to cut are refused beside it,
    as is --moe-layer-freq (its E symbols place the experts)."""
    par, shown = config.parallel, f"--hybrid-layer-pattern {pattern.text!r}"
    for name, flag in _NOT_WITH_A_PATTERN + (("moe_layer_freq", "--moe-layer-freq"),):
        if name in config.given:
            place = ("its E symbols place the experts" if name == "moe_layer_freq"
                     else "its | cut the pipeline")
            raise ValueError(f"{flag} beside {shown}: {place}; drop {flag}")
    if not pattern.cut:
        return
    for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        if getattr(par, name) is not None:
            raise ValueError(f"--{name.replace('_', '-')} beside {shown}: its | cut the pipeline; drop the "
                             "flag, or the |")
    segments = len(pattern.segments)
    if segments % pipeline_stages:
        raise ValueError(f"{shown} has {segments} pipeline segments, not a multiple of "
                         f"--pipeline-model-parallel-size {pipeline_stages}: cut it into a multiple of the "
                         "stages")
    empty = [index for index, segment in enumerate(pattern.segments) if not segment]
    if empty:
        raise ValueError(f"{shown}: segment {empty[0]} (between its |) holds no layer: give every segment "
                         "one")
    chunks = segments // pipeline_stages
    if chunks > 1 and par.pipeline_schedule == "zbv" and chunks != 2:
        raise ValueError(f"{shown} makes {chunks} virtual stages per pipeline stage; --pipeline-schedule zbv "
                         "runs two in a V")
    par.virtual_pipeline_size = chunks if chunks > 1 else None
    par.pipeline_layers_per_stage = [len(segment) for segment in pattern.segments]


def split_request(par) -> SplitRequest:
    """The uneven-cut flags of ``par`` (a ParallelConfig) as given."""
    return SplitRequest(par.pipeline_model_parallel_layout,
                        tuple(par.pipeline_layers_per_stage) if par.pipeline_layers_per_stage is not None
                        else None,
                        par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers,
                        par.account_for_embedding_in_pipeline_split, par.account_for_loss_in_pipeline_split)


def resolve_split(config, pipeline_stages: int) -> list[int] | None:
    """The layers of each virtual stage (``parallel.pipeline.partition``) from whichever of Megatron's ways
    to cut them unevenly was given (None: even)."""
    par = config.parallel
    split = split_request(par).split(config.model.num_layers, pipeline_stages, par.virtual_pipeline_size or 1,
                                     par.pipeline_schedule == "zbv")
    return list(split) if split is not None else None
