"""The optimizer flags checked before any process group exists: the --optimizer name and Muon's settings."""

from __future__ import annotations

from parallel.muon import MuonSettings
from pretrain.config.arguments import ConfigError
from pretrain.config.optimizer import OPTIMIZERS
from pretrain.config.schema import Config
from pretrain.checkpoint.selection import resume_point, resumed_state
from pretrain.training.param_groups import muon_options, switch_refusal

# --optimizer names Megatron-LM takes that this build has no optimizer for
MEGATRON_ONLY = ("dist_muon", "soap", "adaptive_muon", "lion", "shampoo", "adafactor")


def validate_optimizer(config: Config) -> None:
    opt = config.optimizer
    if opt.optimizer not in OPTIMIZERS:
        hint = ("Megatron-LM's layer-wise distributed Muon: --optimizer muon is sharded by ZeRO here"
                if opt.optimizer == "dist_muon" else
                "a Megatron-LM optimizer this build does not have" if opt.optimizer in MEGATRON_ONLY else
                "not an optimizer this build knows")
        raise ConfigError(f"--optimizer {opt.optimizer}: {hint}; choose {', '.join(OPTIMIZERS)}")
    for name, value in (("--sgd-momentum", opt.sgd_momentum), ("--muon-momentum", opt.muon_momentum)):
        if not 0 <= value < 1:
            raise ConfigError(f"{name} {value}: a momentum is in [0, 1)")
    if not config.checkpoint.no_load_optim and resume_point(config) is not None:
        saved = (resumed_state(config, "optimizer") or {"name": "adam"})["name"]  # adam's before it was saved
        if saved != opt.optimizer:
            raise ConfigError(switch_refusal(saved, opt.optimizer))
    if opt.qk_clip or opt.log_max_attention_logit:
        if config.parallel.context_parallel_size > 1:
            raise ConfigError("--qk-clip / --log-max-attention-logit read every score of a head, which "
                              "--context-parallel-size > 1 splits over ranks: drop one")
        if opt.qk_clip and config.model.qk_layernorm:
            raise ConfigError("--qk-clip scales the query and key projections, which --qk-layernorm "
                              "normalises away: drop one")
        if opt.qk_clip_threshold <= 0 or not 0 <= opt.qk_clip_alpha <= 1:
            raise ConfigError(f"--qk-clip-threshold {opt.qk_clip_threshold} must be > 0 and --qk-clip-alpha "
                              f"{opt.qk_clip_alpha} in [0, 1]")
    if opt.optimizer == "muon":
        settings = {k: v for k, v in muon_options(opt).items() if k in MuonSettings.__dataclass_fields__}
        try:
            MuonSettings(**settings).check()
        except ValueError as error:
            raise ConfigError(str(error)) from None
