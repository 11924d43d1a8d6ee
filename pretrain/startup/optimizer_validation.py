"""The optimizer flags checked before any process group exists: the --optimizer name, Muon's settings and
the shape of the learning-rate and weight-decay schedules (Megatron's asserts, as errors naming flags)."""

from __future__ import annotations

from parallel.muon import MuonSettings
from pretrain.config.arguments import ConfigError
from pretrain.config.optimizer import OPTIMIZERS
from pretrain.config.schema import Config
from pretrain.checkpoint.selection import resume_point, resumed_state
from pretrain.training.param_groups import muon_options, switch_refusal

# --optimizer names Megatron-LM takes that this build has no optimizer for
MEGATRON_ONLY = ("dist_muon", "soap", "adaptive_muon", "lion", "shampoo", "adafactor")


def validate_schedules(opt) -> None:
    """WSD's decay length, and a weight-decay increment's ends."""
    wsd = [value for value in (opt.lr_wsd_decay_iters, opt.lr_wsd_decay_samples) if value is not None]
    if opt.lr_decay_style == "WSD" and (len(wsd) != 1 or wsd[0] <= 0):
        raise ConfigError("--lr-decay-style WSD decays over the last --lr-wsd-decay-iters (or "
                          "--lr-wsd-decay-samples) before the decay's end: give one, > 0")
    if wsd and opt.lr_decay_style != "WSD":
        raise ConfigError(f"--lr-wsd-decay-iters / -samples belong to --lr-decay-style WSD, not "
                          f"{opt.lr_decay_style}: add it or drop them")
    ends = (opt.start_weight_decay, opt.end_weight_decay)
    if opt.weight_decay_incr_style == "constant" and ends != (None, None):
        raise ConfigError("--start-weight-decay / --end-weight-decay set an increasing weight decay: add "
                          "--weight-decay-incr-style linear or cosine (constant keeps --weight-decay)")
    if opt.weight_decay_incr_style != "constant" and not (None not in ends and 0 <= ends[0] <= ends[1]):
        raise ConfigError(f"--weight-decay-incr-style {opt.weight_decay_incr_style} needs "
                          "--start-weight-decay and --end-weight-decay with 0 <= start <= end")


def validate_optimizer(config: Config) -> None:
    opt = config.optimizer
    validate_schedules(opt)
    if opt.optimizer not in OPTIMIZERS:
        hint = ("Megatron-LM's layer-wise distributed Muon: --optimizer muon is sharded by ZeRO here"
                if opt.optimizer == "dist_muon" else
                "a Megatron-LM optimizer this build does not have" if opt.optimizer in MEGATRON_ONLY else
                "not an optimizer this build knows")
        raise ConfigError(f"--optimizer {opt.optimizer}: {hint}; choose {', '.join(OPTIMIZERS)}")
    muon = sorted(name for name in config.given if name.startswith("muon_"))
    if muon and opt.optimizer != "muon":
        raise ConfigError(f"--{muon[0].replace('_', '-')} sets Muon up, and --optimizer is {opt.optimizer}: "
                          "add --optimizer muon or drop the flag")
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
