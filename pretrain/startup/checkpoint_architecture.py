"""The architecture and tokenizer that a checkpoint records, applied to the run that loads it.

Megatron's ``--use-checkpoint-args``, always on: the model settings the flags (or YAML) left unset are
taken from the checkpoint to be loaded (``--load``, else ``--pretrained-checkpoint``); one they set
differently stops the run before any process group exists, naming the flag and both values. The
sequence length and dropout are taken when not given, and may be changed. A Hugging Face import also
brings its tokenizer, used when no tokenizer flag is given; a run on the built-in corpus again takes its
--default-corpus-vocab-size (the tokenizer it trains). A run that resumes a checkpoint whole keeps
its global batch (and batch schedule) unless a batch flag is given: Megatron's default batch, micro-batch
x data-parallel size, would otherwise change with the process count, and with it the run.
"""

from __future__ import annotations

import os

from models.config import GPTConfig
from pretrain.checkpoint.catalog import CheckpointError, exists, not_a_checkpoint_directory, read_manifest
from pretrain.checkpoint.directory_contents import foreign_contents
from pretrain.checkpoint.foreign.megatron_checkpoint import MISSING_DISTRIBUTED, READ_OPTIMIZER_STATES
from pretrain.checkpoint.foreign.megatron_optimizer import DISTRIBUTED_OPTIMIZER_FILE
from pretrain.checkpoint.foreign.megatron_pieces import megatron_pieces
from pretrain.checkpoint.selection import checkpoint_to_load, step_to_load
from pretrain.config.schema import Config

# what the run may set freely whatever it loads: init, padding
NOT_ARCHITECTURE = {"init_method_std", "make_vocab_size_divisible_by",
                    "mtp_loss_scaling_factor"}  # (the depths' loss weight: DeepSeek-V3 lowered it mid-run)
# taken from the checkpoint when not given (an imported Llama trains without dropout), never refused
INHERITED = {"seq_length", "hidden_dropout", "attention_dropout",
             # how MoE layers compute and balance, not what they are
             "moe_token_dispatcher_type", "moe_grouped_gemm", "moe_router_dtype", "moe_aux_loss_coeff",
             "moe_z_loss_coeff", "moe_router_load_balancing_type", "moe_router_bias_update_rate",
             "moe_expert_capacity_factor", "moe_token_drop_policy", "moe_pad_expert_input_to_capacity",
             "mamba_chunk_size"}  # the scan's chunks: its speed and memory, not its result
# settings whose default depends on others: compared by the value they take
EFFECTIVE = {"ffn_hidden_size": "ffn_size", "kv_channels": "head_dim", "num_query_groups": "query_groups",
             "position_embedding_type": "position_embedding", "max_position_embeddings": "max_positions",
             "hybrid_layer_pattern": "uncut_pattern", "mamba_num_heads": "mamba_heads"}
# taken from the checkpoint as the value they take there (a pattern without the saved run's pipeline cuts)
TAKEN_EFFECTIVE = ("max_position_embeddings", "hybrid_layer_pattern")
TOKENIZER = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")
DATA_SOURCES = ("data_path", "mock_data", "train_data_path")  # none of them: the built-in corpus
BATCH = ("global_batch_size", "rampup_batch_size", "step_batch_size_schedule")



def apply_checkpoint_args(config: Config) -> None:
    """Take the loaded checkpoint's architecture (and an import's tokenizer) into ``config``; ValueError
    naming the flag that contradicts it."""
    directory = checkpoint_to_load(config)
    step, load = config.checkpoint.ckpt_step, config.checkpoint.load
    if step is not None and (not load or directory != load):  # read_manifest names the saved ones
        if not load:
            raise ValueError(f"--ckpt-step {step} picks a checkpoint under --load: add --load DIR")
        try:
            read_manifest(load, step)
        except CheckpointError as error:
            raise ValueError(str(error)) from None
    if directory is None:
        wrong = load and os.path.isdir(load) and (not_a_checkpoint_directory(load) or foreign_contents(load))
        if wrong:
            raise ValueError(wrong)
        if config.checkpoint.pretrained_checkpoint and not exists(config.checkpoint.pretrained_checkpoint):
            raise ValueError(f"--pretrained-checkpoint {config.checkpoint.pretrained_checkpoint}: no "
                             "checkpoint "
                             "there (no 'latest' pointer); import one with python -m pretrain.convert "
                             "--from-hf")
        return
    try:
        path, manifest = read_manifest(directory, step_to_load(config, directory))
    except CheckpointError as error:
        raise ValueError(str(error)) from None
    _check_megatron(config, directory, manifest)
    fields = GPTConfig.__dataclass_fields__
    recorded = {name: value for name, value in manifest["config"].items() if name in fields}
    saved = GPTConfig(**recorded)
    model = config.model
    for name in fields:
        if name in NOT_ARCHITECTURE or name not in recorded:
            continue
        if name in config.given and name in INHERITED:
            continue
        if name in config.given:
            theirs, ours = ((getattr(saved, EFFECTIVE[name]), getattr(model, EFFECTIVE[name]))
                            if name in EFFECTIVE else (recorded[name], getattr(model, name)))
            if name == "vocab_size" and config.data.tokenizer_type == "NullTokenizer":
                ours += 1  # a NullTokenizer's --vocab-size V makes a model of V + 1 (its end of document)
            if theirs != ours:
                raise ValueError(f"--{name.replace('_', '-')} {ours} contradicts the checkpoint {path}, "
                                 "whose model "
                                 f"has {theirs}: drop the flag (the model's shape comes from the checkpoint)")
        else:
            taken = getattr(saved, EFFECTIVE[name]) if name in TAKEN_EFFECTIVE else recorded[name]
            setattr(model, name, taken)
    if directory == load and not config.checkpoint.finetune and manifest.get("kind") != "weights":
        _keep_global_batch(config, manifest)
        if config.training.cooldown_iters and not {"train_iters", "train_samples"} & set(config.given):
            for name in ("train_iters", "train_samples"):  # a cooldown branch reads the stable run's data
                setattr(config.training, name, manifest["config"].get(name))
    tokenizer = manifest.get("tokenizer")
    if tokenizer and not any(name in config.given for name in TOKENIZER):
        for name, value in tokenizer.items():
            setattr(config.data, name, value if name == "tokenizer_type" else os.path.join(path, value))
    saved_data = manifest["config"]
    if (not any(saved_data.get(name) for name in DATA_SOURCES)
            and not any(getattr(config.data, name) for name in DATA_SOURCES)
            and "default_corpus_vocab_size" not in config.given
            and "default_corpus_vocab_size" in saved_data):
        # the built-in corpus again: its tokenizer is the one this vocabulary size trains
        config.data.default_corpus_vocab_size = saved_data["default_corpus_vocab_size"]


def _check_megatron(config: Config, directory: str, manifest: dict) -> None:
    """A Megatron-LM checkpoint's files, before any process group: every rank file or shard there, each
    tensor of the shape its args' model has (``MegatronPieces`` lists them, reading no weight). Resumed
    whole, it needs optimizer states this stack reads (``READ_OPTIMIZER_STATES``); without them the run
    continues its iteration and schedule with a fresh optimizer only when --no-load-optim says so, as
    Megatron's own loader asks of a checkpoint without them."""
    if manifest.get("kind") != "megatron":
        return
    try:
        pieces = megatron_pieces(manifest)
    except CheckpointError as error:
        raise ValueError(str(error)) from None
    ckpt = config.checkpoint
    if directory != ckpt.load or ckpt.finetune or ckpt.no_load_optim:
        return
    held = manifest["megatron"]["optimizer"]
    if held in READ_OPTIMIZER_STATES and pieces.unread_optimizer:
        raise ValueError(f"{pieces.unread_optimizer}: add --no-load-optim to continue with a fresh "
                         "optimizer, or --finetune to start from its weights")
    if held in READ_OPTIMIZER_STATES:
        return
    if held == MISSING_DISTRIBUTED:
        raise ValueError(f"--load {directory}: its args say --use-distributed-optimizer, but the "
                         f"{DISTRIBUTED_OPTIMIZER_FILE} that holds its optimizer states is missing beside "
                         f"its rank files (in {manifest['megatron']['folder']}): copy it there, or add "
                         "--no-load-optim to continue with a fresh optimizer")
    what = (f"its {held} optimizer's states are not read by this stack yet (the distributed optimizer's "
            "legacy distrib_optim.pt and torch_dist's fully_reshardable and dp_reshardable ones are: "
            "Megatron-LM's "
            "--ckpt-convert-format torch --ckpt-convert-save DIR writes the first)" if held
            else "it holds no optimizer states")
    raise ValueError(f"--load {directory}: a {manifest['source']} checkpoint of iteration "
                     f"{manifest['iteration']}; {what}: add --no-load-optim to continue its iteration, data "
                     "position and schedule with a fresh optimizer, or --finetune to start from its weights")


def made_with(config: Config) -> str | None:
    """The data and tokenizer flags the checkpoint to be loaded was made with (None: no checkpoint, or it
    recorded none): what a run that cannot read its vocabulary should give again."""
    directory = checkpoint_to_load(config)
    if directory is None:
        return None
    saved = read_manifest(directory, step_to_load(config, directory))[1]["config"]
    if not any(saved.get(name) for name in DATA_SOURCES):
        size = saved.get("default_corpus_vocab_size")
        return None if size is None else f"the built-in corpus with --default-corpus-vocab-size {size}"
    flags = [f"--{name.replace('_', '-')} {' '.join(map(str, value)) if isinstance(value, list) else value}"
             for name, value in saved.items() if name in (*TOKENIZER, *DATA_SOURCES) and value]
    return " ".join(flags) or None


def _keep_global_batch(config: Config, manifest: dict) -> None:
    """The resumed checkpoint's batch settings into ``config`` when no batch flag is given (its default
    batch resolved by the layout it was saved in)."""
    if any(name in config.given for name in BATCH):
        return
    saved = manifest["config"]
    for name in BATCH:
        if name in saved:
            setattr(config.training, name, saved[name])
    if saved.get("global_batch_size") is None and saved.get("step_batch_size_schedule") is None:
        config.training.global_batch_size = saved["micro_batch_size"] * manifest["layout"]["dp"]
