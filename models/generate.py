"""Sample text from a (tensor-parallel) GPT: greedy or temperature + top-k."""

from __future__ import annotations

import torch

from models.gpt import GPTModel
from parallel import comm


def full_logits(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the last position over the whole vocabulary, [b, vocab]; gathered over tp ranks.

    Under sequence parallelism the context is padded on the right to a multiple of tp: causal
    attention keeps the padding from changing any earlier position."""
    length = tokens.shape[1]
    if model.sequence_parallel:
        tokens = torch.nn.functional.pad(tokens, (0, -length % model.tp.size))
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    shard = model(tokens, positions)[length - 1].contiguous()  # [b, v/tp]
    gathered = torch.empty((model.tp.size, *shard.shape), dtype=shard.dtype, device=shard.device)
    comm.all_gather_into_tensor(gathered, shard, model.tp)
    return torch.cat(gathered.unbind(0), dim=-1)[:, :model.config.vocab_size]


@torch.no_grad()
def generate(model: GPTModel, prompt: list[int], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0) -> list[int]:
    """Continue ``prompt`` by ``max_new_tokens`` tokens; every tensor-parallel rank returns the same ids.

    temperature 0 is greedy; otherwise sample from softmax(logits / temperature) over the top_k
    tokens (all when 0) with a generator seeded identically on every rank. The context is cut to the
    model's maximum positions.
    """
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    window = model.config.max_positions
    if model.sequence_parallel:  # leave room for the padding full_logits adds
        window -= window % model.tp.size
    ids = list(prompt)
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-window:]], dtype=torch.long, device=device)
        logits = full_logits(model, context)[0].float()
        if temperature <= 0:
            next_id = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k > 0:
                cutoff = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < cutoff, float("-inf"))
            next_id = int(torch.multinomial(logits.softmax(-1).cpu(), 1, generator=generator))
        ids.append(next_id)
    model.train(was_training)
    return ids[len(prompt):]
