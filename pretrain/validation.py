"""Check a Config against the world before any process group exists.

Every rank runs ``validate`` on the same inputs and so raises the same ``ConfigError`` (naming the
flag and the fix) before anything could hang.
"""

from __future__ import annotations

import os

from models.counting import num_parameters
from parallel.pipeline.partition import validate_partition
from parallel.pipeline.schedules import validate_schedule
from parallel.topology import Topology
from parallel.zero.swap import check_swap_directory
from pretrain.arguments import ConfigError
from pretrain.config import Config


def validate(config: Config, world_size: int) -> Topology:
    """Raise ConfigError for any setting that cannot work with ``world_size`` processes; return the layout."""
    par, train, opt, model = config.parallel, config.training, config.optimizer, config.model
    try:
        topology = Topology(world_size, par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                            par.gpus_per_node)
        model.validate(topology.tp)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if par.sequence_parallel and model.seq_length % topology.tp:
        raise ConfigError(f"--sequence-parallel needs --seq-length {model.seq_length} divisible by "
                          f"--tensor-model-parallel-size {topology.tp}")
    _validate_pipeline(config, topology)
    if config.zero.zero_bucket_size < 1:
        raise ConfigError(f"--zero-bucket-size must be >= 1 element, got {config.zero.zero_bucket_size}")
    if config.zero.zero_persistence_threshold < 0 or config.zero.zero_prefetch_budget < 0:
        raise ConfigError("--zero-persistence-threshold and --zero-prefetch-budget must be >= 0")
    recompute = config.recompute
    if (recompute.partition_activations or recompute.activations_on_cpu) and recompute.recompute_granularity is None:
        raise ConfigError("--partition-activations / --activations-on-cpu act on checkpointed activations: "
                          "add --recompute-granularity full or selective")
    if recompute.recompute_num_layers is not None and recompute.recompute_num_layers < 1:
        raise ConfigError(f"--recompute-num-layers must be >= 1, got {recompute.recompute_num_layers}")
    if train.bf16 and train.fp16:
        raise ConfigError("--bf16 and --fp16 exclude each other: choose one")
    if config.checkpoint.save_interval < 0 or config.checkpoint.save_keep_last < 0:
        raise ConfigError("--save-interval and --save-keep-last must be >= 0")

    for name in ("micro_batch_size", "global_batch_size", "train_iters", "bad_step_limit"):
        if getattr(train, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(train, name)}")
    per_step = train.micro_batch_size * topology.dp
    if train.global_batch_size % per_step:
        raise ConfigError(f"--global-batch-size {train.global_batch_size} is not divisible by --micro-batch-size "
                          f"{train.micro_batch_size} x data-parallel size {topology.dp} = {per_step}: use a "
                          f"multiple of {per_step}")
    if train.eval_interval < 0 or (train.eval_interval and train.eval_iters < 1):
        raise ConfigError("--eval-interval needs --eval-iters >= 1 (or --eval-interval 0 to never evaluate)")
    if config.logging.log_interval < 1:
        raise ConfigError(f"--log-interval must be >= 1, got {config.logging.log_interval}")
    if opt.lr <= 0 or opt.min_lr < 0 or opt.min_lr > opt.lr:
        raise ConfigError(f"--lr {opt.lr} / --min-lr {opt.min_lr}: need 0 <= min-lr <= lr and lr > 0")
    if opt.lr_warmup_iters < 0 or opt.clip_grad < 0 or opt.weight_decay < 0:
        raise ConfigError("--lr-warmup-iters, --clip-grad and --weight-decay must be >= 0")
    _validate_data(config)
    _validate_offload(config, topology)  # after the data: the vocabulary sizes the swap files
    return topology


def _validate_offload(config: Config, topology: Topology) -> None:
    zero, train = config.zero, config.training
    if zero.offload_param == "cpu":
        raise ConfigError("--offload-param cpu is not available in this build: use --offload-param nvme (stage 3) "
                          "or none")
    if zero.offload_param == "nvme" and zero.zero_stage != 3:
        raise ConfigError("--offload-param nvme needs --zero-stage 3: only stage 3 shards the parameters")
    if zero.offload_optimizer != "none" and zero.zero_stage == 0:
        raise ConfigError(f"--offload-optimizer {zero.offload_optimizer} needs --zero-stage 1, 2 or 3: stage 0 "
                          "keeps no optimizer shard to offload")
    optimizer_files, param_files = zero.offload_optimizer == "nvme", zero.offload_param == "nvme"
    if not (optimizer_files or param_files):
        if zero.nvme_path is not None:
            raise ConfigError("--nvme-path is only used with --offload-optimizer nvme or --offload-param nvme: "
                              "add one or drop --nvme-path")
        return
    if zero.zero_sub_group_size < 1:
        raise ConfigError(f"--zero-sub-group-size must be >= 1 element, got {zero.zero_sub_group_size}")
    # the processes of this node write Adam's two fp32 moments (and fp32 masters under bf16/fp16, or
    # when the parameters are in files too), and the parameter shards
    mixed = train.bf16 or train.fp16
    bytes_per_param = (8 + (4 if mixed or param_files else 0)) * optimizer_files + (2 if mixed else 4) * param_files
    local = min(topology.gpus_per_node or topology.world_size, topology.world_size) / topology.world_size
    try:
        check_swap_directory(zero.nvme_path, int(bytes_per_param * num_parameters(config.model) * local))
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _validate_pipeline(config: Config, topology: Topology) -> None:
    par, train = config.parallel, config.training
    vp = par.virtual_pipeline_size or 1
    if vp < 1:
        raise ConfigError(f"--virtual-pipeline-size must be >= 1, got {vp}")
    if vp > 1 and topology.pp == 1:
        raise ConfigError("--virtual-pipeline-size needs --pipeline-model-parallel-size > 1")
    try:
        validate_partition(config.model.num_layers, topology.pp, vp, par.pipeline_layers_per_stage)
        if train.micro_batch_size >= 1 and train.global_batch_size % (train.micro_batch_size * topology.dp) == 0:
            micro_batches = train.global_batch_size // (train.micro_batch_size * topology.dp)
            validate_schedule(par.pipeline_schedule, micro_batches, topology.pp, vp)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _validate_data(config: Config) -> None:
    data, model = config.data, config.model
    chosen = [flag for flag, value in (("--tokenizer-model", data.tokenizer_model), ("--vocab-file", data.vocab_file),
                                       ("--merge-file", data.merge_file)) if value is not None]
    if data.tokenizer_type != "SentencePieceTokenizer":
        chosen.append(f"--tokenizer-type {data.tokenizer_type}")
    if data.data_path is None:
        if chosen:
            raise ConfigError(f"{chosen[0]} without --data-path: give the dataset it tokenized, or no tokenizer "
                              "(to use the built-in corpus)")
        vocab = data.default_corpus_vocab_size
    else:
        from data.gpt_dataset import parse_data_path
        from data.tokenizer import TokenizerSpec, build_tokenizer

        try:
            prefixes, _ = parse_data_path(data.data_path)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        for prefix in prefixes:
            for suffix in (".bin", ".idx"):
                if not os.access(prefix + suffix, os.R_OK):
                    raise ConfigError(f"--data-path {prefix}: {prefix + suffix} is missing or unreadable; build it "
                                      f"with python -m data.preprocess --output-prefix ... (it writes "
                                      f"<prefix>_text_document.bin/.idx)")
        spec = TokenizerSpec(data.tokenizer_type, data.tokenizer_model, data.vocab_file, data.merge_file,
                             model.vocab_size if data.tokenizer_type == "NullTokenizer" else None)
        try:
            vocab = build_tokenizer(spec).vocab_size
        except (OSError, ValueError, RuntimeError) as error:
            raise ConfigError(str(error)) from None
        if data.tokenizer_type == "NullTokenizer":  # ids 0..V-1 and the end of document V: V + 1 rows
            model.vocab_size = vocab
    if model.vocab_size is None:
        model.vocab_size = vocab
    elif vocab > model.vocab_size:
        raise ConfigError(f"--vocab-size {model.vocab_size} is smaller than the tokenizer's vocabulary {vocab}: "
                          f"use --vocab-size {vocab} or more (or leave it out)")
