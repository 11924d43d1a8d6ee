"""What an import and an export move, tensor by tensor: the rules of ``hf_names`` (GPT-2 and the decoder
families) and ``hf_hybrid_names`` (the hybrid families) for the model's Hugging Face family, as our name ->
their tensors and back."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from models.config import GPTConfig
from pretrain.interop.hf_config import hf_kind
from pretrain.interop.hf_hybrid_names import (granite_rules, kimi_linear_rules, kimi_stored_name,
                                             nemotron_rules, olmo_hybrid_rules, qwen3_next_rules)
from pretrain.interop.hf_names import Rule, StackedRule, decoder_rules, gpt2_rules


def rules(config: GPTConfig, kind: str | None = None) -> list[Rule | StackedRule]:
    """Every parameter of ours as the Hugging Face ``kind`` (default: the one that expresses ``config``)
    names and lays it out."""
    kind = kind or hf_kind(config)
    if kind in ("nemotron_h", "mamba2"):
        return list(nemotron_rules(config, kind))
    if kind == "granitemoehybrid":
        return list(granite_rules(config))
    if kind == "qwen3_next":
        return list(qwen3_next_rules(config))
    if kind == "kimi_linear":
        return list(kimi_linear_rules(config))
    if kind == "olmo_hybrid":
        return list(olmo_hybrid_rules(config))
    return list(gpt2_rules(config) if kind == "gpt2" else decoder_rules(config, kind))


def import_plan(config: GPTConfig) -> Iterator[tuple[str, list[str], Callable[..., torch.Tensor]]]:
    """(our name, the Hugging Face tensors it is made of, how) for every parameter of ours."""
    for rule in rules(config, config.hf_model_type):
        if isinstance(rule, StackedRule):
            for expert, ours in enumerate(rule.ours):
                yield ours, [rule.theirs], lambda t, rule=rule, expert=expert: rule.take(t, expert)
        elif not rule.copy:  # (a family's copies of a tensor are written, never read)
            yield rule.ours, list(rule.theirs), rule.join


def copies_of(config: GPTConfig) -> set[str]:
    """The Hugging Face tensors that are copies of others (DeepSeek-V3's MTP layers' embedding and head):
    an import reads the original; an export writes both."""
    return {name for rule in rules(config, config.hf_model_type) if isinstance(rule, Rule) and rule.copy
            for name in rule.theirs}


def export_plan(config: GPTConfig) -> Iterator[tuple[str, tuple[str, ...], Callable[..., torch.Tensor]]]:
    """(Hugging Face name, our parameters it comes from, how) for every tensor of the Hugging Face model."""
    for rule in rules(config):
        if isinstance(rule, StackedRule):
            yield rule.theirs, rule.ours, rule.stack
            continue
        for index, theirs in enumerate(rule.theirs):
            yield theirs, (rule.ours,), lambda x, rule=rule, index=index: rule.split(x)[index]


def stored_name(kind: str | None) -> Callable[[str], str]:
    """Where a family's files may name a tensor otherwise than its rules do: the rules' name for each name
    in the files (Kimi Linear's dense MLPs as transformers saves them; every other family as it is)."""
    return kimi_stored_name if kind == "kimi_linear" else (lambda name: name)
