"""The mixture-of-experts flags (Megatron's names and meanings), a part of ``models.config.GPTConfig``."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from models.flags import flag
from models.moe.router import RouterOptions

LONGEST_PATTERN = 100_000  # layers a --moe-layer-freq list may describe


@dataclass
class MoEConfig:
    """Which layers are mixtures of experts and how they route, balance, drop and dispatch tokens. Owns
    values only; ``GPTConfig.validate`` calls ``validate_moe``."""

    num_experts: int | None = field(default=None, metadata=flag(
        "experts per MoE layer (none: every layer has a dense MLP)"))
    moe_ffn_hidden_size: int | None = field(default=None, metadata=flag(
        "each expert's MLP width (default --ffn-hidden-size); the expert tp size divides it"))
    moe_layer_freq: str = field(default="1", metadata=flag(
        "which layers are MoE: N (every Nth, from the first) or one 0/1 per layer in Megatron's list "
        "syntax, e.g. \"([0]+[1]*3)\" or \"[0,1,1,1]\" (only lists, +, * and integers: nothing is "
        "evaluated)"))
    moe_router_topk: int = field(default=2, metadata=flag("experts each token is routed to (k)"))
    moe_router_score_function: str = field(default="softmax", metadata=flag(
        "routing scores: softmax, or sigmoid (DeepSeek-V3; normalised over the chosen k)",
        choices=["softmax", "sigmoid"]))
    moe_router_pre_softmax: bool = field(default=False, metadata=flag(
        "softmax over all experts before the top-k (default: over the chosen k's logits)"))
    moe_router_topk_scaling_factor: float | None = field(default=None, metadata=flag(
        "routing weights scaled by this (DeepSeek-V3: 2.5)"))
    moe_router_num_groups: int | None = field(default=None, metadata=flag(
        "group-limited routing: experts cut into this many groups (DeepSeek-V3: 8)"))
    moe_router_group_topk: int | None = field(default=None, metadata=flag(
        "group-limited routing: the groups a token may choose from (DeepSeek-V3: 4)"))
    moe_router_enable_expert_bias: bool = field(default=False, metadata=flag(
        "auxiliary-loss-free balancing (DeepSeek-V3): a bias per expert decides the choice only, moved after "
        "each step towards the mean load (sigmoid scores)"))
    moe_router_bias_update_rate: float = field(default=1e-3, metadata=flag(
        "how far each expert bias moves per step with --moe-router-enable-expert-bias"))
    moe_router_dtype: str | None = field(default=None, metadata=flag(
        "the router's logits and scores in fp32 or fp64 (default: the activations' dtype)",
        choices=["fp32", "fp64"]))
    moe_router_load_balancing_type: str = field(default="aux_loss", metadata=flag(
        "balancing loss: aux_loss (Switch, over the micro-batch), seq_aux_loss (per sequence) or none",
        choices=["aux_loss", "seq_aux_loss", "none"]))
    moe_aux_loss_coeff: float = field(default=0.0, metadata=flag("the balancing loss's coefficient"))
    moe_z_loss_coeff: float | None = field(default=None, metadata=flag(
        "the router z-loss's coefficient (ST-MoE: 1e-3; none: no z-loss)"))
    moe_expert_capacity_factor: float | None = field(default=None, metadata=flag(
        "an expert takes at most ceil(tokens x k / experts x this) of a micro-batch's tokens, the rest are "
        "dropped (default: dropless)"))
    moe_token_drop_policy: str = field(default="probs", metadata=flag(
        "which tokens an expert over capacity drops: the lowest weights (probs) or the latest (position)",
        choices=["probs", "position"]))
    moe_pad_expert_input_to_capacity: bool = field(default=False, metadata=flag(
        "every expert computes exactly its capacity of rows (zero-weight padding)"))
    moe_shared_expert_intermediate_size: int | None = field(default=None, metadata=flag(
        "width of the shared expert every token goes through besides its routed ones (DeepSeek, Qwen2-MoE)"))
    moe_shared_expert_gate: bool = field(default=False, metadata=flag(
        "the shared expert's output scaled by sigmoid(x w) per token (Qwen2-MoE)"))
    moe_grouped_gemm: bool = field(default=False, metadata=flag(
        "a layer's experts as one grouped product (torch._grouped_mm where torch has it, else a loop)"))
    moe_token_dispatcher_type: str = field(default="allgather", metadata=flag(
        "how tokens reach their experts: alltoall (only routed rows travel) or allgather (all tokens)",
        choices=["alltoall", "allgather"]))

    def moe_layers(self, num_layers: int) -> list[bool]:
        """Which of ``num_layers`` layers are MoE (all False without --num-experts)."""
        if not self.num_experts:
            return [False] * num_layers
        pattern = parse_layer_freq(self.moe_layer_freq)
        if isinstance(pattern, int):
            return [layer % pattern == 0 for layer in range(num_layers)]
        return [bool(value) for value in pattern]

    @property
    def router_options(self) -> RouterOptions:
        return RouterOptions(self.num_experts, self.moe_router_topk, self.moe_router_score_function,
                             self.moe_router_pre_softmax, self.moe_router_num_groups,
                             self.moe_router_group_topk,
                             self.moe_router_topk_scaling_factor)

    def validate_moe(self, num_layers: int, ffn_size: int, etp: int = 1, ep: int = 1) -> None:
        """Raise ValueError naming the flag for MoE settings the model (at this etp and ep) cannot take."""
        if self.num_experts is None:
            return
        if self.num_experts < 1:
            raise ValueError(f"--num-experts must be >= 1, got {self.num_experts}")
        if self.num_experts % ep:
            raise ValueError(f"--expert-model-parallel-size {ep} does not divide --num-experts "
                             f"{self.num_experts}: each ep rank holds an equal share of the experts")
        pattern = parse_layer_freq(self.moe_layer_freq)
        if isinstance(pattern, int) and pattern < 1 or isinstance(pattern, list) and (
                len(pattern) != num_layers or set(pattern) - {0, 1}):
            raise ValueError(f"--moe-layer-freq {self.moe_layer_freq}: give N >= 1 or one 0/1 per layer "
                             f"({num_layers})")
        if not any(self.moe_layers(num_layers)):
            raise ValueError(f"--moe-layer-freq {self.moe_layer_freq} makes none of the {num_layers} layers "
                             "a mixture of experts: put a 1 where one should be, or drop --num-experts to "
                             "train a dense model")
        width = self.moe_ffn_hidden_size or ffn_size
        if width < 1 or width % etp:
            raise ValueError(f"--expert-tensor-parallel-size {etp} does not divide --moe-ffn-hidden-size "
                             f"{width}: choose a width it divides")
        shared = self.moe_shared_expert_intermediate_size
        if shared is not None and shared < 1:
            raise ValueError(f"--moe-shared-expert-intermediate-size must be >= 1, got {shared}")
        if self.moe_shared_expert_gate and shared is None:
            raise ValueError("--moe-shared-expert-gate gates the shared expert: add "
                             "--moe-shared-expert-intermediate-size")
        if self.moe_expert_capacity_factor is not None and not self.moe_expert_capacity_factor > 0:
            raise ValueError("--moe-expert-capacity-factor must be > 0, got "
                             f"{self.moe_expert_capacity_factor}")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ValueError("--moe-pad-expert-input-to-capacity pads to the capacity: add "
                             "--moe-expert-capacity-factor")
        if self.moe_router_enable_expert_bias and (self.moe_router_score_function != "sigmoid"
                                                   or not self.moe_router_bias_update_rate > 0):
            raise ValueError("--moe-router-enable-expert-bias moves sigmoid scores' choice: add "
                             "--moe-router-score-function sigmoid and a --moe-router-bias-update-rate > 0")
        self.router_options  # noqa: B018  (RouterOptions checks top-k and the groups, naming the flags)


def parse_layer_freq(text: str, flag: str = "--moe-layer-freq") -> int | list[int]:
    """``flag`` (--moe-layer-freq, --linear-attention-freq): an integer, or Megatron's list expression
    (lists of integers joined by + and repeated by * an integer, in parentheses) read as a syntax tree:
    nothing in it is executed."""
    try:
        tree = ast.parse(str(text).strip(), mode="eval").body
        value = _evaluate(tree)
    except (SyntaxError, ValueError, TypeError) as error:
        raise ValueError(f"{flag} {text!r}: give an integer or a list such as ([0]+[1]*3)*2 "
                         f"({error})") from None
    if not isinstance(value, (int, list)) or isinstance(value, bool):
        raise ValueError(f"{flag} {text!r}: give an integer or a list")
    return value


def _evaluate(node: ast.AST) -> int | list[int]:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        values = [_evaluate(item) for item in node.elts]
        if any(not isinstance(value, int) for value in values):
            raise ValueError("a list holds integers only")
        return values
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(left, int) and isinstance(right, list):
            left, right = right, left
        if isinstance(node.op, ast.Mult) and isinstance(left, list) and isinstance(right, int) \
                and not 0 <= len(left) * right <= LONGEST_PATTERN:
            raise ValueError(f"a list of more than {LONGEST_PATTERN} layers")
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and isinstance(left, list) and isinstance(right, int):
            return left * right
    raise ValueError(f"{ast.dump(node)[:40]} is not a list, an integer, + or *")
