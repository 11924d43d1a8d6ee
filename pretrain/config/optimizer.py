"""The optimizer's settings: which one steps (AdamW, SGD, Muon), its hyper-parameters as Megatron-LM
spells them, and the learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.config import flag
from parallel.muon.matrices import TP_MODES
from parallel.muon.newton_schulz import COEFFICIENT_SETS, PRECISIONS, SCALE_MODES

OPTIMIZERS = ("adam", "sgd", "muon")


@dataclass
class OptimizerConfig:
    """The optimizer (AdamW, SGD or Muon with AdamW beside it) and the learning-rate schedule."""

    optimizer: str = field(default="adam", metadata=flag(
        "adam (AdamW: decoupled weight decay, as Megatron's adam), sgd (with --sgd-momentum), or muon "
        "(Muon on the transformer layers' matrices, AdamW with the --adam-* flags on the rest)"))
    lr: float = field(default=6e-4, metadata=flag("peak learning rate"))
    min_lr: float = field(default=0.0, metadata=flag("learning rate at the end of decay"))
    lr_warmup_init: float = field(default=0.0, metadata=flag("learning rate warm-up starts from"))
    lr_warmup_iters: int = field(default=0,
                                 metadata=flag("iterations of linear warm-up (x the global batch, in "
                                                           "samples)"))
    lr_warmup_samples: int = field(default=0, metadata=flag("samples of linear warm-up"))
    lr_warmup_fraction: float | None = field(default=None,
                                             metadata=flag("warm-up as a fraction of the decay length"))
    lr_decay_iters: int | None = field(default=None, metadata=flag(
        "iteration where decay ends (default: --train-iters)"))
    lr_decay_samples: int | None = field(default=None, metadata=flag(
        "sample where decay ends (default: --train-samples)"))
    lr_decay_style: str = field(default="linear", metadata=flag(
        "decay after warm-up: cosine, linear, constant, inverse-square-root (lr x sqrt(warm-up / samples), "
        "never below --min-lr), or WSD (warmup-stable-decay: --lr until the last --lr-wsd-decay-iters "
        "(-samples) before the decay's end, then --lr-wsd-decay-style down to --min-lr)",
        choices=["cosine", "linear", "constant", "inverse-square-root", "WSD"]))
    lr_wsd_decay_style: str = field(default="exponential", metadata=flag(
        "WSD's decay: linear, cosine, exponential (2 x 0.5^t - 1) or minus_sqrt (1 - sqrt(t)) of the "
        "fraction t of the decay done", choices=["linear", "cosine", "exponential", "minus_sqrt"]))
    lr_wsd_decay_iters: int | None = field(default=None, metadata=flag(
        "WSD: iterations of decay, ending where --lr-decay-iters does (x the global batch, in samples)"))
    lr_wsd_decay_samples: int | None = field(default=None, metadata=flag(
        "WSD: samples of decay, ending where --lr-decay-samples does"))
    decoupled_lr: float | None = field(default=None, metadata=flag(
        "a learning rate of their own for the input embedding and the output layer"))
    decoupled_min_lr: float | None = field(default=None, metadata=flag("the --min-lr of --decoupled-lr"))
    weight_decay: float = field(default=0.01, metadata=flag("AdamW weight decay (never on norms and biases)"))
    start_weight_decay: float | None = field(default=None, metadata=flag(
        "weight decay at the start of an increasing one (--weight-decay-incr-style linear or cosine)"))
    end_weight_decay: float | None = field(default=None, metadata=flag(
        "weight decay at the end of the run (--train-iters / --train-samples) of an increasing one"))
    weight_decay_incr_style: str = field(default="constant", metadata=flag(
        "how weight decay goes from --start-weight-decay to --end-weight-decay over the run (constant: "
        "--weight-decay throughout)", choices=["constant", "linear", "cosine"]))
    apply_wd_to_qk_layernorm: bool = field(default=False,
                                           metadata=flag("weight decay on the query/key norms too"))
    adam_beta1: float = field(default=0.9, metadata=flag("AdamW beta1"))
    adam_beta2: float = field(default=0.999, metadata=flag("AdamW beta2"))
    adam_eps: float = field(default=1e-8, metadata=flag("AdamW epsilon"))
    clip_grad: float = field(default=1.0, metadata=flag("clip the global gradient norm to this (0 = off)"))
    sgd_momentum: float = field(default=0.9, metadata=flag("--optimizer sgd's momentum"))
    muon_momentum: float = field(default=0.95, metadata=flag("Muon's momentum (an EMA of the gradients)"))
    muon_use_nesterov: bool = field(default=False, metadata=flag("Nesterov momentum in Muon"))
    muon_no_split_qkv: bool = field(default=False, metadata=flag(
        "orthogonalize a fused QKV weight as one matrix (default: q, k and v each on their own)"))
    muon_num_ns_steps: int = field(default=5, metadata=flag("Newton-Schulz iterations per step"))
    muon_coefficient_type: str = field(default="quintic", metadata=flag(
        "the iterations' coefficients", choices=list(COEFFICIENT_SETS)))
    muon_fp32_matmul_prec: str = field(default="medium", metadata=flag(
        "Newton-Schulz in bf16 after an fp32 normalisation (medium), TF32 (high) or fp32 (highest)",
        choices=[p for p in PRECISIONS if p != "torch"]))
    muon_scale_mode: str = field(default="spectral", metadata=flag(
        "the orthogonalized update's scale: spectral sqrt(max(A, B)), shape_scaling sqrt(max(1, A/B)), "
        "unit_rms_norm sqrt(A/B); spectral with --muon-extra-scale-factor 0.2 is Moonlight's AdamW-matching "
        "RMS (AdamW's learning rate and weight decay carry over)", choices=list(SCALE_MODES)))
    muon_extra_scale_factor: float = field(default=1.0, metadata=flag("a factor on every Muon update"))
    muon_tp_mode: str = field(default="duplicated", metadata=flag(
        "tensor-parallel weights orthogonalized whole (duplicated, distributed: one owner joins the shards; "
        "the same result in every layout) or each shard on its own (blockwise, Megatron's default)",
        choices=list(TP_MODES)))
    qk_clip: bool = field(default=False, metadata=flag(
        "Kimi K2's QK-clip after every step: the query and key projections of heads whose largest attention "
        "logit passed --qk-clip-threshold scaled back to it"))
    qk_clip_threshold: float = field(default=100.0, metadata=flag("QK-clip's largest logit allowed"))
    qk_clip_alpha: float = field(default=0.5, metadata=flag(
        "QK-clip's balance: queries x eta^alpha, keys x eta^(1 - alpha)"))
    log_max_attention_logit: bool = field(default=False, metadata=flag(
        "log each layer's largest attention logit of every step (on with --qk-clip)"))
