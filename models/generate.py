"""Sample text from a GPT: greedy or temperature + top-k, on one model or a whole pipeline.

``generate`` only needs a function from a token list to the next token's full-vocabulary logits that returns
the same values on every rank; ``single_stage_logits(model)`` makes one for a model that is not pipelined
(tensor-parallel or not), ``pretrain.training.pipeline_runner.PipelineRunner.next_token_logits`` for a
pipeline. """

from __future__ import annotations

from typing import Callable

import torch

from models.gpt import GPTModel
from parallel import comm

NextTokenLogits = Callable[[list[int]], torch.Tensor]


def gather_vocab_logits(shard: torch.Tensor, model: GPTModel) -> torch.Tensor:
    """[vocab/tp] logits of one position -> [vocab] over the whole (unpadded) vocabulary, on every tp rank."""
    shard = shard.float().contiguous()
    gathered = torch.empty(model.tp.size * shard.numel(), dtype=shard.dtype, device=shard.device)
    comm.all_gather_into_tensor(gathered, shard, model.tp)
    return gathered[:model.config.vocab_size]


def padded_ids(tokens: list[int], model: GPTModel) -> torch.Tensor:
    """[1, s] ids on the model's device, padded with zeros to a multiple of tp under sequence parallelism
    (causal: the padding changes nothing before it)."""
    pad = -len(tokens) % model.tp.size if model.sequence_parallel else 0
    return torch.tensor([tokens + [0] * pad], dtype=torch.long, device=next(model.parameters()).device)


def single_stage_logits(model: GPTModel) -> NextTokenLogits:
    """Next-token logits of a model holding every layer (pre- and post-process on this rank)."""
    def logits(tokens: list[int]) -> torch.Tensor:
        ids = padded_ids(tokens, model)
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        with torch.no_grad():
            return gather_vocab_logits(model(ids, positions, whole_sequence=True)[len(tokens) - 1, 0], model)
    return logits


def context_window(max_positions: int, tp: int, sequence_parallel: bool) -> int:
    """Longest context to feed: the model's positions, leaving room for sequence-parallel padding."""
    return max_positions - (max_positions % tp if sequence_parallel else 0)


@torch.no_grad()
def generate(next_token_logits: NextTokenLogits, prompt: list[int], max_new_tokens: int, *, window: int,
             temperature: float = 0.0, top_k: int = 0, seed: int = 0) -> list[int]:
    """Continue ``prompt`` by ``max_new_tokens`` tokens; every rank returns the same ids.

    temperature 0 is greedy; otherwise sample from softmax(logits / temperature) over the top_k
    tokens (all when 0) with a CPU generator seeded identically on every rank. The context is the
    last ``window`` tokens.
    """
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = next_token_logits(ids[-window:]).float().cpu()
        if temperature <= 0:
            next_id = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k > 0:
                cutoff = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < cutoff, float("-inf"))
            next_id = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
        ids.append(next_id)
    return ids[len(prompt):]
