"""The GPT architecture as a dataclass: one field per Megatron-style flag."""

from __future__ import annotations

from dataclasses import dataclass, field


def flag(help_text: str, **extra) -> dict:
    """Field metadata: the flag's help text (and argparse extras such as choices)."""
    return {"help": help_text, **extra}


@dataclass
class GPTConfig:
    """Shape and options of the GPT. Owns no weights; ``validate(tp)`` checks what tp must divide."""

    num_layers: int = field(default=4, metadata=flag("transformer blocks"))
    hidden_size: int = field(default=256, metadata=flag("model width h"))
    num_attention_heads: int = field(default=4, metadata=flag("attention heads a; tp must divide it"))
    ffn_hidden_size: int | None = field(default=None, metadata=flag("MLP width (default 4h); tp must divide it"))
    seq_length: int = field(default=256, metadata=flag("tokens per sample s"))
    max_position_embeddings: int | None = field(
        default=None, metadata=flag("positions the model can take (default seq-length); >= --seq-length"))
    vocab_size: int | None = field(
        default=None, metadata=flag("tokenizer vocabulary (default: read from --tokenizer-model)"))
    make_vocab_size_divisible_by: int = field(
        default=128, metadata=flag("the embedding table is padded to a multiple of this x tp"))
    position_embedding_type: str = field(
        default="learned", metadata=flag("learned absolute positions or rotary (rope)", choices=["learned", "rope"]))
    rotary_base: float = field(default=10000.0, metadata=flag("rotary embedding base"))
    normalization: str = field(default="LayerNorm", metadata=flag("norm layer", choices=["LayerNorm", "RMSNorm"]))
    layernorm_epsilon: float = field(default=1e-5, metadata=flag("norm epsilon"))
    hidden_dropout: float = field(default=0.0, metadata=flag("dropout on residual branches and embeddings"))
    attention_dropout: float = field(default=0.0, metadata=flag("dropout on attention probabilities"))
    init_method_std: float = field(
        default=0.02, metadata=flag("std of weight init; residual projections use std/sqrt(2 layers)"))

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary rounded up to a multiple of make_vocab_size_divisible_by x tp (Megatron's rule)."""
        if self.vocab_size is None:
            raise ValueError("--vocab-size is unknown: give it or a --tokenizer-model to read it from")
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def validate(self, tp: int = 1) -> None:
        """Raise ValueError naming the flag for any shape the model (at this tp) cannot take."""
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "make_vocab_size_divisible_by"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"--num-attention-heads {self.num_attention_heads} does not divide --hidden-size "
                             f"{self.hidden_size}: choose a head count that divides it")
        if self.position_embedding_type == "rope" and (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError("--position-embedding-type rope needs an even head size (--hidden-size / "
                             "--num-attention-heads)")
        if self.num_attention_heads % tp:
            raise ValueError(f"--tensor-model-parallel-size {tp} does not divide --num-attention-heads "
                             f"{self.num_attention_heads}: choose a tp that divides it")
        if self.ffn_size % tp:
            raise ValueError(f"--tensor-model-parallel-size {tp} does not divide --ffn-hidden-size {self.ffn_size}")
        if self.max_positions < self.seq_length:
            raise ValueError(f"--seq-length {self.seq_length} is beyond --max-position-embeddings "
                             f"{self.max_positions}: raise --max-position-embeddings or shorten --seq-length")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1)")

    def num_parameters(self) -> int:
        """Parameters of the whole model (tied embedding counted once, padded vocabulary at tp = 1)."""
        h, f, layers = self.hidden_size, self.ffn_size, self.num_layers
        norm = 2 * h if self.normalization == "LayerNorm" else h
        per_layer = 2 * norm + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
        positions = self.max_positions * h if self.position_embedding_type == "learned" else 0
        return layers * per_layer + self.padded_vocab_size(1) * h + positions + norm

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), matmuls and attention scores."""
        h, f, s = self.hidden_size, self.ffn_size, self.seq_length
        per_layer = 2 * (4 * h * h + 2 * h * f) + 2 * 2 * s * h
        return 3 * (self.num_layers * per_layer + 2 * h * self.padded_vocab_size(1))
