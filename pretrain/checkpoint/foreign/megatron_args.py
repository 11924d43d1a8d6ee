"""Megatron-LM's saved ``args`` read as this stack's model config, the layout that saved the checkpoint and
the run's position and schedule.

Megatron's flags and ours share their names (``pretrain.config``), so a field of the model config is taken
from the arg of its name; the few that differ are translated here (``--add-bias-linear``, the vocabulary,
``--norm-epsilon``). A model Megatron can express and this stack cannot (a hybrid's multi-token
prediction depths, a heterogeneous layer config) is refused by the flag that made it. Holds no tensor.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from models.config import GPTConfig
from models.hybrid.pattern import ParsedPattern, parse_pattern
from models.moe.config import parse_layer_freq
from pretrain.checkpoint.errors import CheckpointError

_PLAIN = (bool, int, float, str, type(None))
# flags of a Megatron model this stack does not build: refused by name
UNSUPPORTED = {"mtp_use_repeated_layer": "one multi-token prediction layer repeated over the depths",
               "mtp_detach_heads": "multi-token prediction depths detached from each other's gradients",
               "heterogeneous_layers_config_path": "a heterogeneous layer config",
               "heterogeneous_layers_config_encoded_json": "a heterogeneous layer config",
               "num_layers_in_first_pipeline_stage": "an uneven pipeline split",
               "num_layers_in_last_pipeline_stage": "an uneven pipeline split",
               "decoder_first_pipeline_num_layers": "an uneven pipeline split",
               "decoder_last_pipeline_num_layers": "an uneven pipeline split",
               "pipeline_model_parallel_layout": "a custom pipeline layout",
               "account_for_embedding_in_pipeline_split": "an uneven pipeline split",
               "account_for_loss_in_pipeline_split": "an uneven pipeline split"}


@dataclass(frozen=True)
class MegatronLayout:
    """The parallel sizes a Megatron checkpoint was saved at, and which model layers each pipeline rank's
    virtual stage held (``layer_offset``)."""

    tp: int
    pp: int
    vp: int
    ep: int
    etp: int
    num_layers: int
    # a hybrid pattern's pipeline segments (its ``|``): each model chunk's layers, chunk v x pp + p the
    # one of virtual stage v of pipeline rank p; empty for an even split
    chunk_layers: tuple[int, ...] = ()

    def layer_offset(self, pp_rank: int, vp_stage: int) -> int:
        """The first model layer of virtual stage ``vp_stage`` of pipeline rank ``pp_rank`` (Megatron's
        ``get_transformer_layer_offset`` for an even split, the pattern's segments for a cut one)."""
        if self.chunk_layers:
            return sum(self.chunk_layers[:vp_stage * self.pp + pp_rank])
        per_chunk = self.num_layers // (self.pp * self.vp)
        return vp_stage * (self.num_layers // self.vp) + pp_rank * per_chunk

    def describe(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"] + ([f"vp{self.vp}"] if self.vp > 1 else []) + (
            [f"ep{self.ep}"] if self.ep > 1 else []) + ([f"etp{self.etp}"] if self.etp != self.tp else [])
        return " x ".join(parts)


def _arg(args: argparse.Namespace, name: str, default=None):
    value = getattr(args, name, default)
    return default if value is None else value


def layout_of(args: argparse.Namespace, where: str) -> MegatronLayout:
    """The layout ``args`` were saved with; CheckpointError naming an uneven split this reader lacks."""
    for name, what in UNSUPPORTED.items():
        if getattr(args, name, None) not in (None, False, 0, "") and "pipeline" in what:
            raise CheckpointError(f"{where}: saved with --{name.replace('_', '-')} ({what}): not read yet; "
                                  "re-save it with an even split (Megatron's tools/checkpoint) first")
    tp = int(_arg(args, "tensor_model_parallel_size", 1))
    pp = int(_arg(args, "pipeline_model_parallel_size", 1))
    pattern = _pattern(args, where)
    layers = len(pattern.layers) if pattern is not None else int(args.num_layers)
    vp = _arg(args, "virtual_pipeline_model_parallel_size")
    if vp is None and _arg(args, "num_layers_per_virtual_pipeline_stage"):
        vp = layers // pp // int(args.num_layers_per_virtual_pipeline_stage)
    if pattern is not None and pattern.cut:  # (Megatron-LM main: the pattern's segments are the stages)
        segments = len(pattern.segments)
        if segments % pp or vp is not None and segments != pp * int(vp):
            raise CheckpointError(f"{where}: its --hybrid-layer-pattern's {segments} segments are not "
                                  f"{pp} pipeline stages x {vp or 'some'} virtual stages; the checkpoint's "
                                  "args are inconsistent")
        ep = int(_arg(args, "expert_model_parallel_size", 1))
        return MegatronLayout(tp, pp, segments // pp, ep, int(_arg(args, "expert_tensor_parallel_size", tp)),
                              layers, tuple(len(segment) for segment in pattern.segments))
    vp = int(vp or 1)
    if layers % (pp * vp):
        raise CheckpointError(f"{where}: --num-layers {layers} does not divide into {pp} pipeline stages x "
                              f"{vp} virtual stages; the checkpoint's args are inconsistent")
    ep = int(_arg(args, "expert_model_parallel_size", 1))
    return MegatronLayout(tp, pp, vp, ep, int(_arg(args, "expert_tensor_parallel_size", tp)), layers)


def config_of(args: argparse.Namespace, where: str) -> dict:
    """Our model config (GPTConfig's fields) of the model ``args`` describe; CheckpointError naming the
    flag of a model this stack does not build."""
    for name, what in UNSUPPORTED.items():
        if getattr(args, name, None) not in (None, False, 0, "") and "pipeline" not in what:
            raise CheckpointError(f"{where}: saved with --{name.replace('_', '-')} ({what}), which this "
                                  "stack does not build; refused")
    variant = _arg(args, "experimental_attention_variant")
    if variant:
        raise CheckpointError(f"{where}: saved by Megatron's GPT path with --experimental-attention-variant "
                              f"{variant} (a mixer and its MLP in each layer): not read yet; a HybridModel's "
                              "(--hybrid-layer-pattern) checkpoint of the same layers is")
    pattern = _pattern(args, where)
    if pattern is not None and (pattern.depths or _arg(args, "mtp_num_layers")):
        raise CheckpointError(f"{where}: its --hybrid-layer-pattern {pattern.text!r} has multi-token "
                              "prediction depths (after /): a hybrid's are not read yet (no megatron-core "
                              "release builds them to check against); refused")
    config = {name: value for name in GPTConfig.__dataclass_fields__
              if isinstance(value := getattr(args, name, None), _PLAIN) and value is not None
              or isinstance(value, list) and all(isinstance(item, _PLAIN) for item in value)}
    config.pop("hf_model_type", None)
    config.pop("hybrid_override_pattern", None)
    if pattern is not None:  # (the model whatever the layout: the saved run's cuts are its layout's)
        config.update(hybrid_layer_pattern=pattern.uncut, num_layers=len(pattern.layers))
    config["disable_bias_linear"] = not _arg(args, "add_bias_linear", True)
    vocabulary = _arg(args, "vocab_size") or _arg(args, "padded_vocab_size")
    if vocabulary is None:
        raise CheckpointError(f"{where}: its args record no --vocab-size nor padded vocabulary; not a "
                              "Megatron-LM training checkpoint")
    # the real vocabulary where the args name it (--vocab-size); else the embedding's rows as saved
    # (Megatron pads to --make-vocab-size-divisible-by x tp from its tokenizer, which it does not save)
    config["vocab_size"] = int(vocabulary)
    if _arg(args, "norm_epsilon") is not None:
        config["layernorm_epsilon"] = float(args.norm_epsilon)
    if not _arg(args, "group_query_attention", False):
        config.pop("num_query_groups", None)
    if "moe_layer_freq" in config:  # Megatron keeps N or the list; ours is the flag's text
        config["moe_layer_freq"] = str(config["moe_layer_freq"])
    if config.get("multi_latent_attention"):
        _latent(args, config, where)
    if _arg(args, "position_embedding_type") is None:
        config["position_embedding_type"] = ("rope" if _arg(args, "use_rotary_position_embeddings", False)
                                             else "learned_absolute")
    return config


def _pattern(args: argparse.Namespace, where: str) -> ParsedPattern | None:
    """A HybridModel's layer pattern (Megatron-LM main's --hybrid-layer-pattern, or 0.16's
    --hybrid-override-pattern; a MambaModel saved with neither, 0.16's default, is all Mamba layers), None
    for a GPT; CheckpointError for layers allotted by ratios alone."""
    text = _arg(args, "hybrid_layer_pattern") or _arg(args, "hybrid_override_pattern")
    if text is None:
        for name in ("hybrid_attention_ratio", "hybrid_mlp_ratio"):
            if _arg(args, name, 0.0):
                raise CheckpointError(f"{where}: saved with --{name.replace('_', '-')} and no layer pattern "
                                      "(Megatron's ratio allocation): not read; re-save it with "
                                      "--hybrid-layer-pattern")
        if not (_arg(args, "is_hybrid_model", False) or "mamba" in str(_arg(args, "spec", "")).lower()):
            return None
        text = "M" * int(args.num_layers)
    try:
        return parse_pattern(str(text))
    except ValueError as error:
        raise CheckpointError(f"{where}: {error}") from None


# Megatron's yarn flags (MLATransformerConfig's defaults where its args hold none) -> ours
YARN = {"rotary_scaling_factor": ("rope_scaling_factor", 40.0),
        "original_max_position_embeddings": ("rope_original_max_position_embeddings", 4096),
        "beta_fast": ("rope_beta_fast", 32.0), "beta_slow": ("rope_beta_slow", 1.0),
        "mscale": ("rope_mscale", 1.0), "mscale_all_dim": ("rope_mscale_all_dim", 0.0)}


def _latent(args: argparse.Namespace, config: dict, where: str) -> None:
    """Latent attention's fields: Megatron takes its rotary dims apart (evens, then odds) before rotating
    them, as our --rotary-interleaved does; its --qk-layernorm are the latent norms, which ours always has;
    its rotary is yarn unless --rope-type rope says otherwise, and it always rotates (the model is rope
    whatever --position-embedding-type says)."""
    if _arg(args, "rotary_interleaved", False):
        raise CheckpointError(f"{where}: latent attention saved with --rotary-interleaved, which Megatron "
                              "applies after taking the dims apart; this stack does not build that")
    config["rope_type"] = _arg(args, "rope_type", "yarn")
    if config["rope_type"] == "yarn":
        config.update({ours: type(default)(_arg(args, theirs, default))
                       for theirs, (ours, default) in YARN.items()})
    if not _arg(args, "qk_layernorm", False):
        raise CheckpointError(f"{where}: latent attention without --qk-layernorm (no latent norms): not "
                              "built here")
    # (megatron-core's latent attention rotates by --rope-type whatever --position-embedding-type says)
    config.update(rotary_interleaved=True, qk_layernorm=False, group_query_attention=False,
                  position_embedding_type="rope")
    for name in ("kv_channels", "num_query_groups"):  # (Megatron's args keep them; latent heads have none)
        config.pop(name, None)


def position_of(args: argparse.Namespace, iteration: int) -> dict:
    """Our "progress" run state of a Megatron run stopped at ``iteration``."""
    return {"iteration": int(iteration), "consumed_samples": int(_arg(args, "consumed_train_samples", 0))}


def scheduler_of(args: argparse.Namespace, saved: dict | None) -> dict | None:
    """Our "opt_param_scheduler" run state of Megatron's ``OptimizerParamScheduler.state_dict()`` (both
    count in samples; Megatron keeps the first rate in its args)."""
    if not saved:
        return None
    state = {key: value for key, value in saved.items() if isinstance(value, _PLAIN)}
    state.setdefault("init_lr", float(_arg(args, "lr_warmup_init", 0.0)))
    if state.get("lr_decay_style") == "WSD":  # its decay's length and style are in the args alone
        samples = _arg(args, "lr_wsd_decay_samples")
        state.setdefault("wsd_decay_steps", samples if samples is not None else
                         int(_arg(args, "lr_wsd_decay_iters", 0)) * int(_arg(args, "global_batch_size", 1)))
        state.setdefault("lr_wsd_decay_style", _arg(args, "lr_wsd_decay_style", "exponential"))
    return state


def args_of(config: GPTConfig, layout: MegatronLayout, padded_vocab: int, run: dict) -> argparse.Namespace:
    """The args Megatron-LM would have saved for ``config`` at ``layout`` (the inverse of ``config_of``),
    with ``run``'s batch settings and data position (``consumed_train_samples``)."""
    fields = {name: getattr(config, name) for name in GPTConfig.__dataclass_fields__
              if isinstance(getattr(config, name), _PLAIN) and name != "hf_model_type"}
    fields.update(ffn_hidden_size=config.ffn_size, kv_channels=config.head_dim,
                  num_query_groups=config.query_groups, position_embedding_type=config.position_embedding,
                  max_position_embeddings=config.max_positions, vocab_size=config.vocab_size,
                  padded_vocab_size=padded_vocab, norm_epsilon=config.layernorm_epsilon,
                  add_bias_linear=not config.disable_bias_linear,
                  tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                  virtual_pipeline_model_parallel_size=None if layout.vp == 1 else layout.vp,
                  expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
                  transformer_impl="local", **run)
    fields.pop("disable_bias_linear")
    if config.num_experts:
        fields["moe_layer_freq"] = parse_layer_freq(config.moe_layer_freq)
    if config.hybrid_layer_pattern:  # as Megatron-LM main saves a HybridModel's (it converts 0.16's)
        fields.update(hybrid_layer_pattern=config.uncut_pattern, hybrid_override_pattern=None,
                      is_hybrid_model=True, mamba_num_heads=config.mamba_heads)
    if config.multi_latent_attention:  # (the latent norms are its --qk-layernorm; see _latent)
        fields.update(rotary_interleaved=False, qk_layernorm=True, rope_type=config.rope_type or "rope")
        if config.rope_scaling == "yarn":
            fields.update({theirs: getattr(config, ours) for theirs, (ours, _) in YARN.items()})
    return argparse.Namespace(**fields)
