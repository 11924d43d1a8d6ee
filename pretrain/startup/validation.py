"""Check a Config against the world before any process group exists.

Every rank runs ``validate`` on the same inputs and so raises the same ``ConfigError`` (naming the
flag and the fix) before anything could hang.
"""

from __future__ import annotations

import torch

from models.counting import num_parameters
from models.layers.registry import check_buildable, recomputable_modules
from pretrain.training.batch_schedule import build_batch_schedule
from pretrain.checkpoint.selection import resume_point, resumed_state
from pretrain.startup.checkpoint_architecture import BATCH, apply_checkpoint_args, made_with
from pretrain.startup.context_validation import validate_context
from pretrain.startup.expert_validation import validate_experts
from pretrain.startup.mtp_validation import validate_mtp
from pretrain.startup.optimizer_validation import validate_optimizer
from pretrain.config.megatron_flags import resolve_settings
from parallel.pipeline.partition import validate_partition
from parallel.tensor.fp8 import RECIPES as FP8_RECIPES, torchao_float8
from parallel.pipeline.schedules import V_SCHEDULES, validate_schedule, validate_schedule_flags
from parallel.topology import Topology
from parallel.zero.swap import check_swap_directory
from pretrain.config.arguments import ConfigError
from pretrain.config.schema import Config
from pretrain.training.build import zero_options
from pretrain.training.cooldown import BRANCH_KEYS, branch_refusal
from pretrain.training.lr_schedule import build_lr_schedule
from pretrain.training.param_scheduler import FIX, build_param_scheduler, schedule_mismatch


def validate(config: Config, world_size: int) -> Topology:
    """Raise ConfigError for any setting that cannot work with ``world_size`` processes; return the layout."""
    par, train, model = config.parallel, config.training, config.model
    try:
        topology = Topology(world_size, par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                            par.context_parallel_size, gpus_per_node=par.gpus_per_node,
                            ep=par.expert_model_parallel_size, etp=par.expert_tensor_parallel_size,
                            pipeline_v=par.pipeline_schedule in V_SCHEDULES)
        resolve_settings(config, topology.pp)
        apply_checkpoint_args(config)
        check_buildable(model)
        model.validate(topology.tp)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if par.sequence_parallel and model.seq_length % topology.tp:
        raise ConfigError(f"--sequence-parallel needs --seq-length {model.seq_length} divisible by "
                          f"--tensor-model-parallel-size {topology.tp}")
    validate_context(config, topology)
    _validate_pipeline(config, topology)
    validate_mtp(config, topology)
    validate_experts(config, topology)
    validate_optimizer(config)
    recompute = config.recompute
    if ((recompute.partition_activations or recompute.activations_on_cpu)
            and recompute.recompute_granularity is None):
        raise ConfigError("--partition-activations / --activations-on-cpu act on checkpointed activations: "
                          "add --recompute-granularity full or selective")
    have = recomputable_modules(model)
    unknown = [name for name in recompute.recompute_modules if name not in have]
    if unknown:
        raise ConfigError(f"--recompute-modules {' '.join(unknown)}: this model has no such part; its "
                          f"modules are {', '.join(have)}")
    if "recompute_modules" in config.given and recompute.recompute_granularity != "selective":
        raise ConfigError("--recompute-modules chooses what --recompute-granularity selective recomputes: "
                          "add it (full recomputes whole layers)")
    if recompute.recompute_num_layers is not None and recompute.recompute_num_layers < 1:
        raise ConfigError(f"--recompute-num-layers must be >= 1, got {recompute.recompute_num_layers}")
    if train.bf16 and train.fp16:
        raise ConfigError("--bf16 and --fp16 exclude each other: choose one")
    if config.checkpoint.async_save and config.checkpoint.ckpt_format == "torch_dcp":
        raise ConfigError("--async-save writes native checkpoints; a --ckpt-format torch_dcp save is a "
                          "collective of every rank and runs in the step: drop one of them")
    for name in ("save_interval", "save_keep_last", "save_retain_interval"):
        value = getattr(config.checkpoint, name)
        if value is not None and value < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    for name in ("micro_batch_size", "bad_step_limit"):
        if getattr(train, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(train, name)}")
    _validate_length_and_schedule(config, topology)
    for name in ("eval_interval", "exit_interval", "exit_duration_in_mins", "eval_global_batch_size"):
        if getattr(train, name) is not None and getattr(train, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {getattr(train, name)}")
    if train.eval_interval and train.eval_iters < 1:
        raise ConfigError("--eval-interval needs --eval-iters >= 1 (or no --eval-interval to never evaluate)")
    eval_batch = train.eval_global_batch_size
    if eval_batch and eval_batch % (train.micro_batch_size * topology.dp):
        raise ConfigError(f"--eval-global-batch-size {eval_batch} is not divisible by --micro-batch-size "
                          f"{train.micro_batch_size} x data-parallel size {topology.dp}")
    if config.logging.log_interval < 1 or config.logging.tensorboard_log_interval < 1:
        raise ConfigError("--log-interval and --tensorboard-log-interval must be >= 1")
    _validate_profiling(config)
    _validate_fp8(config)
    if train.compile:
        from torch import _dynamo

        backends = _dynamo.list_backends(exclude_tags=())
        if train.compile_backend not in backends:
            raise ConfigError(f"--compile-backend {train.compile_backend}: not one of torch.compile's "
                              f"backends here ({', '.join(backends)})")
    _validate_data(config)
    _validate_zero(config, topology)  # after the data: the vocabulary sizes the swap files
    return topology


def _validate_profiling(config: Config) -> None:
    """Megatron's profiling flags (``pretrain.observability.profiling``) where the device can honour them."""
    profiling = config.profiling
    if profiling.profile and profiling.profile_step_end <= profiling.profile_step_start:
        raise ConfigError(f"--profile-step-end {profiling.profile_step_end} must be after "
                          f"--profile-step-start {profiling.profile_step_start}")
    if profiling.profile and profiling.use_pytorch_profiler and not config.logging.tensorboard_dir:
        raise ConfigError("--use-pytorch-profiler writes its traces under --tensorboard-dir: give one")
    if profiling.record_memory_history and not torch.cuda.is_available():
        raise ConfigError("--record-memory-history records the CUDA allocator: there is no GPU here (on the "
                          "CPU, the metrics file has each rank's peak memory)")


def _validate_fp8(config: Config) -> None:
    """--fp8-*: torchao's float8 training inside a bf16 run, on a device whose matrix products take fp8
    (or emulated)."""
    train = config.training
    if train.fp8_format is None:
        for name in ("fp8_recipe", "fp8_emulate"):
            if name in config.given:
                raise ConfigError(f"--{name.replace('_', '-')} sets up fp8 training: give --fp8-format "
                                  "e4m3 or hybrid too")
        return
    if train.fp8_recipe not in FP8_RECIPES:
        raise ConfigError(f"--fp8-recipe {train.fp8_recipe}: the scales here are computed from each tensor "
                          f"as it is cast ({' or '.join(FP8_RECIPES)}, through torchao): use --fp8-recipe "
                          "tensorwise")
    if not train.bf16:
        raise ConfigError(f"--fp8-format {train.fp8_format} computes the linear products in fp8 inside a "
                          "bf16 run (the other operations, the gradients' reduction and the masters as "
                          "--bf16 has them): add --bf16")
    try:
        torchao_float8()
    except ImportError:
        raise ConfigError(f"--fp8-format {train.fp8_format} runs through torchao's float8 training, which "
                          "is not installed: pip install torchao") from None
    if train.fp8_emulate:
        return
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    if capability is None or capability < (8, 9):
        where = ("there is no GPU here" if capability is None
                 else f"this GPU's compute capability is {capability[0]}.{capability[1]}")
        raise ConfigError(f"--fp8-format {train.fp8_format}: fp8 matrix products need an NVIDIA GPU of "
                          f"compute capability 8.9 or newer (Ada, Hopper, Blackwell) and {where}; "
                          "--fp8-emulate emulates them (slow: for tests)")


def _validate_length_and_schedule(config: Config, topology: Topology) -> None:
    """Batch schedule, run length and learning-rate schedule, as Megatron checks them: iteration-based
    (--train-iters with --lr-*-iters) or sample-based (--train-samples with --lr-*-samples), not both."""
    train, opt = config.training, config.optimizer
    point = resume_point(config)
    try:
        schedule = build_batch_schedule(train.global_batch_size, train.micro_batch_size, topology.dp,
                                        train.rampup_batch_size, train.step_batch_size_schedule,
                                        config.model.seq_length)
    except ValueError as error:
        kept = point is not None and not any(name in config.given for name in BATCH)
        kept_batch = (f" (the batch of the checkpoint under --load {config.checkpoint.load}, kept when "
                      "resuming: give --global-batch-size to change it)")
        raise ConfigError(str(error) + (kept_batch if kept else "")) from None
    if point is not None:
        schedule = schedule.resumed_at(*point)
    if train.train_iters is not None and train.train_samples is not None:
        raise ConfigError("--train-iters and --train-samples both set the run's length: give one")
    if train.train_samples is not None:
        sample_based = [f for f, v in (("--lr-decay-iters", opt.lr_decay_iters), ("--lr-warmup-iters",
                        opt.lr_warmup_iters), ("--lr-wsd-decay-iters", opt.lr_wsd_decay_iters)) if v]
        if sample_based:
            raise ConfigError("--train-samples counts in samples: use --lr-decay-samples / "
                              "--lr-warmup-samples "
                              f"instead of {' and '.join(sample_based)}")
        train.train_iters = schedule.iterations_for(train.train_samples)
    else:
        iteration_based = [f for f, v in (("--lr-decay-samples", opt.lr_decay_samples),
                                          ("--lr-warmup-samples", opt.lr_warmup_samples),
                                          ("--lr-wsd-decay-samples", opt.lr_wsd_decay_samples)) if v]
        if iteration_based:
            raise ConfigError(f"--train-iters counts in iterations: use --lr-decay-iters / --lr-warmup-iters "
                              f"instead of {' and '.join(iteration_based)} (or --train-samples)")
    if train.train_iters < 1:
        raise ConfigError(f"the run has no iteration: --train-iters {train.train_iters} / --train-samples "
                          f"{train.train_samples} (a partial last batch is dropped)")
    if opt.lr_warmup_fraction is not None and (opt.lr_warmup_iters or opt.lr_warmup_samples):
        raise ConfigError("--lr-warmup-fraction and --lr-warmup-iters / --lr-warmup-samples are two "
                          "warm-ups: give one")
    if opt.lr <= 0 or opt.min_lr < 0 or opt.min_lr > opt.lr:
        raise ConfigError(f"--lr {opt.lr} / --min-lr {opt.min_lr}: need 0 <= min-lr <= lr and lr > 0")
    if opt.decoupled_min_lr is not None and opt.decoupled_lr is None:
        raise ConfigError("--decoupled-min-lr needs --decoupled-lr")
    if min(opt.lr_warmup_iters, opt.lr_warmup_samples, opt.lr_warmup_fraction or 0, opt.clip_grad,
           opt.weight_decay) < 0:
        raise ConfigError("--lr-warmup-iters/-samples/-fraction, --clip-grad and --weight-decay must be >= 0")
    rates = build_lr_schedule(opt, train.train_iters, train.train_samples, schedule)
    decay_given = opt.lr_decay_iters is not None or opt.lr_decay_samples is not None
    if decay_given and 0 < rates.warmup_samples >= rates.decay_samples:  # Megatron asserts warm-up < decay
        # (a decay of the run's default length is not refused: a run shortened for a smoke test keeps
        # its warm-up, as this stack's tests and presets do)
        raise ConfigError(f"the warm-up ({rates.warmup_samples:g} samples: --lr-warmup-iters / -samples / "
                          f"-fraction) is not shorter than the decay ({rates.decay_samples:g} samples: "
                          "--lr-decay-iters / -samples): shorten the warm-up or lengthen the decay")
    for size in schedule.sizes():  # every batch the run can take must fit the pipeline schedule
        try:
            validate_schedule(config.parallel.pipeline_schedule, size // schedule.per_step, topology.pp,
                              config.parallel.virtual_pipeline_size or 1)
        except ValueError as error:
            raise ConfigError(f"a global batch of {size}: {error}") from None
    _validate_resumed_schedule(config, schedule)


def _validate_resumed_schedule(config: Config, batches) -> None:
    """Megatron's check of a resumed run's learning-rate schedule and weight decay against the
    checkpoint's (``pretrain.training.param_scheduler``): a difference names the flags and both values."""
    ckpt = config.checkpoint
    if ckpt.use_checkpoint_opt_param_scheduler and ckpt.override_opt_param_scheduler:
        raise ConfigError("--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler choose "
                          "opposite schedules: give one")
    refusal = branch_refusal(config) if config.training.cooldown_iters else None
    if refusal:
        raise ConfigError(refusal)
    saved = None if ckpt.no_load_optim else resumed_state(config, "opt_param_scheduler")
    if saved is None or ckpt.use_checkpoint_opt_param_scheduler or ckpt.override_opt_param_scheduler:
        return
    fresh_branch = config.training.cooldown_iters and saved.get("cooldown_from") is None
    differences = schedule_mismatch(saved, build_param_scheduler(config, batches).state_dict(),
                                    BRANCH_KEYS if fresh_branch else ())
    if differences:
        raise ConfigError(f"the learning-rate schedule differs from the checkpoint's under --load "
                          f"{ckpt.load}: {differences}; {FIX}")


def _validate_zero(config: Config, topology: Topology) -> None:
    """ZeRO's own rules (``ZeroOptions.check``), then room for its swap files on this node."""
    zero, train = config.zero, config.training
    try:
        zero_options(config).check(topology.dp_cp)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    optimizer_files, param_files = zero.offload_optimizer == "nvme", zero.offload_param == "nvme"
    if not (optimizer_files or param_files):
        return
    # the processes of this node write Adam's two fp32 moments (and fp32 masters under bf16/fp16, or
    # when the parameters are in files too), and the parameter shards
    mixed = train.bf16 or train.fp16
    bytes_per_param = ((8 + (4 if mixed or param_files else 0)) * optimizer_files
                       + (2 if mixed else 4) * param_files)
    local = min(topology.gpus_per_node or topology.world_size, topology.world_size) / topology.world_size
    try:
        check_swap_directory(zero.nvme_path, int(bytes_per_param * num_parameters(config.model) * local))
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _validate_pipeline(config: Config, topology: Topology) -> None:
    par = config.parallel
    vp = par.virtual_pipeline_size or 1
    if vp < 1:
        raise ConfigError(f"--virtual-pipeline-size must be >= 1, got {vp}")
    if vp > 1 and topology.pp == 1 and not topology.pipeline_v:
        raise ConfigError("--virtual-pipeline-size needs --pipeline-model-parallel-size > 1")
    try:
        validate_schedule_flags(par.pipeline_schedule, vp)
        validate_partition(config.model.num_layers, topology.pp, vp, par.pipeline_layers_per_stage)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _validate_data(config: Config) -> None:
    """One source of data (files, per-split files, mock tokens, or the built-in corpus), its files present,
    and the tokenizer that reads it; sets the model's vocabulary from the tokenizer when not given."""
    data, model = config.data, config.model
    sources = [flag for flag,
               given in (("--data-path", data.data_path is not None), ("--mock-data", data.mock_data),
                                        ("--train-data-path", data.train_data_path is not None)) if given]
    if len(sources) > 1:
        raise ConfigError(f"{' and '.join(sources)} are two sources of data: give one")
    document_flags = [flag for flag, on in (("--reset-attention-mask", data.reset_attention_mask),
                                            ("--reset-position-ids", data.reset_position_ids),
                                            ("--eod-mask-loss", data.eod_mask_loss)) if on]
    if data.sft and document_flags:
        raise ConfigError(f"{' / '.join(document_flags)} act on packed pretraining documents; --sft puts one "
                          "conversation in each sequence and masks its loss itself: drop them")
    if (data.valid_data_path or data.test_data_path) and data.train_data_path is None:
        raise ConfigError("--valid-data-path / --test-data-path go with --train-data-path (or use "
                          "--data-path "
                          "with --split)")
    chosen = [flag for flag,
              value in (("--tokenizer-model", data.tokenizer_model), ("--vocab-file", data.vocab_file),
                                       ("--merge-file", data.merge_file)) if value is not None]
    if data.tokenizer_type != "SentencePieceTokenizer":
        chosen.append(f"--tokenizer-type {data.tokenizer_type}")
    if not sources:
        if chosen:
            raise ConfigError(f"{chosen[0]} without --data-path: give the dataset it tokenized, or no "
                              "tokenizer "
                              "(to use the built-in corpus)")
        vocab = data.default_corpus_vocab_size
    else:
        from data.tokenizers.spec import TokenizerSpec, build_tokenizer

        if data.sft:
            if data.data_path is None:
                raise ConfigError("--sft reads --data-path FILE.jsonl ... (conversations or "
                                  "prompt/response pairs)")
            from data.sft_dataset import SFTDataError, read_sft_file

            for path in data.data_path:
                try:
                    read_sft_file(path)  # every line: a bad one is named before anything starts
                except SFTDataError as error:
                    raise ConfigError(str(error)) from None
        data_flags = [] if data.sft else [
            (flag, paths) for flag, paths in (("--data-path", data.data_path), ("--train-data-path",
                                              data.train_data_path), ("--valid-data-path",
                                                                      data.valid_data_path),
                                              ("--test-data-path", data.test_data_path)) if paths is not None]
        # every file whole before the tokenizer is asked about them; their ids once it is known
        opened = [found for flag, paths in data_flags for found in _opened_prefixes(flag, paths)]
        if data.data_path is not None and not data.sft:
            from data.gpt_dataset import check_split_weights

            try:
                check_split_weights(data.split, [True, bool(config.training.eval_interval), False])
            except ValueError as error:
                raise ConfigError(str(error)) from None
        spec = TokenizerSpec(data.tokenizer_type, data.tokenizer_model, data.vocab_file, data.merge_file,
                             model.vocab_size if data.tokenizer_type == "NullTokenizer" else None)
        try:
            vocab = build_tokenizer(spec).vocab_size
        except (OSError, ValueError, RuntimeError) as error:
            raise ConfigError(str(error)) from None
        for flag, prefix, dataset in opened:
            from data.gpt_dataset import check_token_ids

            try:
                check_token_ids(prefix, dataset, vocab, flag)
            except ValueError as error:
                raise ConfigError(str(error)) from None
        if data.tokenizer_type == "NullTokenizer":  # ids 0..V-1 and the end of document V: V + 1 rows
            model.vocab_size = vocab
    if model.vocab_size is None:
        model.vocab_size = vocab
    elif vocab > model.vocab_size and "vocab_size" in config.given:
        raise ConfigError(f"--vocab-size {model.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"{vocab}: "
                          f"use --vocab-size {vocab} or more (or leave it out)")
    elif vocab > model.vocab_size:  # the size came from the checkpoint loaded
        tokenizer = ("the built-in corpus's tokenizer, as no --data-path is given" if not sources
                     else "the tokenizer given")
        made = made_with(config)
        fix = (f"it was made with {made}: give that again" if made else
               "give the tokenizer it was made with (e.g. --tokenizer-type HuggingFaceTokenizer "
               "--tokenizer-model DIR) and --data-path of data tokenized by it, or --mock-data")
        raise ConfigError(f"the checkpoint's model has a vocabulary of {model.vocab_size}, smaller than "
                          f"{tokenizer} ({vocab}) and it brought no tokenizer of its own: {fix}")


def _opened_prefixes(flag: str, paths: list[str]) -> list[tuple]:
    """(flag, prefix, the opened pair) for every prefix of ``paths``, each checked whole."""
    from data.gpt_dataset import check_indexed_files, parse_data_path

    try:
        prefixes, _ = parse_data_path(paths)
        return [(flag, prefix, check_indexed_files(prefix, flag)) for prefix in prefixes]
    except ValueError as error:
        raise ConfigError(str(error).replace("--data-path", flag)) from None
