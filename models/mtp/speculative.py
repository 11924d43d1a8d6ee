"""Greedy speculative decoding with the multi-token prediction depths' drafts (DeepSeek-V3's use of them
at inference): the main model's next token and each depth's draft after it come from one forward pass;
a second pass of the main model over them accepts the drafts its own greedy choices agree with, and adds
its own choice where they part. The text is greedy decoding's (``models.generate``), token for token."""

from __future__ import annotations

import torch

from models.generate import gather_vocab_logits, padded_ids
from models.gpt import GPTModel


def _positions(length: int, device: torch.device, shift: int = 0) -> torch.Tensor:
    return (torch.arange(length, device=device) + shift).unsqueeze(0)


def _greedy(logits: torch.Tensor, position: int, model: GPTModel) -> int:
    return int(gather_vocab_logits(logits[position, 0], model).argmax())


@torch.no_grad()
def propose(model: GPTModel, tokens: list[int]) -> list[int]:
    """The main model's greedy next token after ``tokens``, then each depth's draft of the one after:
    depth k runs over the sequence with the tokens k ahead (the known ones, then the choices before it)."""
    ids = padded_ids(tokens, model)
    length, last = ids.shape[1], len(tokens) - 1
    x, inputs = model.hidden_states(ids, _positions(length, ids.device), whole_sequence=True)
    hidden = model.final_norm(x)
    chosen = [_greedy(model.output_logits(hidden), last, model)]
    for shift in range(1, model.config.mtp_depths + 1):
        ahead = padded_ids((tokens + chosen)[shift:shift + len(tokens)], model)
        hidden = model.depth_state(shift, hidden, ahead, _positions(length, ids.device, shift), inputs)
        chosen.append(_greedy(model.output_logits(hidden), last, model))
    return chosen


@torch.no_grad()
def speculative_greedy(model: GPTModel, prompt: list[int], max_new_tokens: int) -> tuple[list[int], int, int]:
    """Continue ``prompt`` by ``max_new_tokens`` greedy tokens of ``model`` (one that holds every layer and
    its prediction depths); returns (the new ids, drafts accepted, drafts proposed). ValueError where the
    sequence and its drafts would outgrow the model's learned positions (greedy decoding's window is not
    slid)."""
    longest = len(prompt) + max_new_tokens + model.config.mtp_depths + 1
    if model.config.position_embedding == "learned_absolute" and longest > model.config.max_positions:
        raise ValueError(f"a prompt of {len(prompt)} tokens, {max_new_tokens} new and "
                         f"{model.config.mtp_depths} drafts need {longest} positions; the model has "
                         f"{model.config.max_positions}")
    ids, accepted, proposed = list(prompt), 0, 0
    while len(ids) - len(prompt) < max_new_tokens:
        first, *drafts = propose(model, ids)
        candidate = padded_ids(ids + [first] + drafts, model)
        logits = model(candidate, _positions(candidate.shape[1], candidate.device), whole_sequence=True)
        ids.append(first)
        proposed += len(drafts)
        for draft in drafts:  # the main model's own choice after each token it accepted
            ids.append(_greedy(logits, len(ids) - 1, model))
            if ids[-1] != draft:
                break
            accepted += 1
        else:  # every draft accepted: the choice after the last is the main model's too
            ids.append(_greedy(logits, len(ids) - 1, model))
    return ids[len(prompt):len(prompt) + max_new_tokens], accepted, proposed
