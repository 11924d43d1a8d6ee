"""The text a run prints at its end: --sample-prompt continued by the trained model, greedily and by top-k
sampling, through the pipeline runner on every rank (rank 0 prints)."""

from __future__ import annotations

from torch import nn

from models.generate import context_window, generate
from pretrain.config.schema import Config
from pretrain.observability.metrics import print_rank0


def sample_text(config: Config, tokenizer, runner, model: nn.ModuleList, tp_size: int,
                is_logger: bool) -> str | None:
    """Continue --sample-prompt with the trained ``model`` (every rank runs it; rank 0 prints); the
    greedy text, or None where there is no prompt or the tokenizer cannot encode it (a run's end never
    fails for its sample)."""
    logging, shape = config.logging, config.model
    if not logging.sample_prompt or logging.sample_tokens < 1:
        return None
    try:  # the same on every rank: all sample, or none
        prompt = tokenizer.encode(logging.sample_prompt)
    except ValueError as error:
        prompt, problem = [], str(error)
    else:
        problem = "it encodes to no tokens"
    if not prompt:
        print_rank0(is_logger, f"no sample: --sample-prompt {logging.sample_prompt!r} cannot be encoded by "
                    f"{type(tokenizer).__name__} ({problem}); give a prompt it encodes, or '' for none")
        return None
    window = context_window(shape.max_positions, tp_size, runner.sequence_parallel)
    model.eval()
    greedy = tokenizer.decode(generate(runner.next_token_logits, prompt, logging.sample_tokens,
                                       window=window))
    sampled = tokenizer.decode(generate(runner.next_token_logits, prompt, logging.sample_tokens,
                                        window=window, temperature=0.8, top_k=40, seed=config.training.seed))
    model.train()
    print_rank0(is_logger, f"--- greedy sample ---\n{logging.sample_prompt}{greedy}\n"
                f"--- top-k 40, temperature 0.8 ---\n{logging.sample_prompt}{sampled}\n---")
    return logging.sample_prompt + greedy
