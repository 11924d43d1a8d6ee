"""Supervised fine-tuning data (``--sft``): conversations or prompt/response pairs from JSON lines.

Each line of a ``.jsonl`` file is Megatron's SFT format, ``{"messages": [{"role": "system" | "user" |
"assistant", "content": ...}, ...]}``, or ``{"prompt": ..., "response": ...}``. A conversation is
rendered with the tokenizer's chat template when it has one (a Hugging Face tokenizer_config.json's
``chat_template``, rendered as transformers renders it: in jinja2's immutable sandbox, with loop
controls, ``raise_exception`` and ``strftime_now``; the template came with a downloaded model, so a
template that reaches for what the sandbox forbids is refused naming its file), otherwise with this
default: every turn
is ``"<role>: <content>\\n"``, and an assistant turn's content is followed by the end of document. A
prompt/response pair is the prompt, then the response and the end of document. Only the assistant
turns' (the response's) tokens and their end of document count in the loss.

Each example is its own sequence of ``--seq-length`` tokens, padded after its end (and cut beyond it):
padded, not packed, so that neither attention nor positions leak across examples with the causal
kernels unchanged (packing would need a block-diagonal mask, which the fused attention the model
calls does not take). Examples are read in a seeded order, re-shuffled every epoch.
"""

from __future__ import annotations

import json
import os
import random
from typing import Optional, Sequence, Tuple

import torch


class SFTDataError(ValueError):
    """A line of an SFT file that cannot be trained on; names the file, the line and the fix."""


def _turns(record: dict, where: str) -> list[tuple[str, str]]:
    """(role, content) turns of one line; SFTDataError when there is nothing to learn from."""
    if isinstance(record.get("messages"), list):
        turns = []
        for turn in record["messages"]:
            if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or \
                    not isinstance(turn.get("content"), str):
                raise SFTDataError(f"{where}: every message needs a string role and content")
            turns.append((turn["role"], turn["content"]))
        if not any(role == "assistant" for role, _ in turns):
            raise SFTDataError(f"{where}: no assistant turn, so nothing to learn; drop the line or add the "
                               "assistant's answer")
        return turns
    if isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        return [("prompt", record["prompt"]), ("response", record["response"])]
    raise SFTDataError(f'{where}: expected {{"messages": [...]}} or {{"prompt": ..., "response": ...}}')


def read_sft_file(path: str) -> list[list[tuple[str, str]]]:
    """The examples of one SFT file, each a list of (role, content) turns."""
    if not os.path.isfile(path):
        raise SFTDataError(f"--data-path {path}: no such file (--sft reads .jsonl files of conversations)")
    examples = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"--data-path {path}, line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise SFTDataError(f"{where}: not JSON ({error})") from None
            if not isinstance(record, dict):
                raise SFTDataError(f"{where}: expected a JSON object")
            examples.append(_turns(record, where))
    if not examples:
        raise SFTDataError(f"--data-path {path}: no examples")
    return examples


def chat_template(tokenizer) -> Optional[str]:
    """The tokenizer's Jinja chat template, if its Hugging Face config has one."""
    return getattr(tokenizer, "chat_template", None)


def template_renderer(template: str, source: str):
    """``render(**variables)`` of chat template ``template`` (from file ``source``) in jinja2's immutable
    sandbox: no attribute of Python's internals, no mutation of what it is given. SFTDataError naming
    ``source`` for a template that does not parse, reaches past the sandbox, or raises."""
    import datetime

    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols])
    environment.globals.update(raise_exception=raise_exception,
                               strftime_now=lambda format: datetime.datetime.now().strftime(format))
    environment.filters["tojson"] = lambda value, ensure_ascii=False, indent=None, separators=None, \
        sort_keys=False: json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                    sort_keys=sort_keys)
    try:
        compiled = environment.from_string(template)
    except jinja2.exceptions.TemplateError as error:
        raise SFTDataError(f"{source}: its chat_template does not parse ({error})") from None

    def render(**variables) -> str:
        try:
            return compiled.render(**variables)
        except jinja2.exceptions.SecurityError as error:
            raise SFTDataError(f"{source}: its chat_template was refused: it reaches past the sandbox "
                               f"({error}); a template from a downloaded model may not touch Python objects")\
                from None
        except jinja2.exceptions.TemplateError as error:
            raise SFTDataError(f"{source}: its chat_template raised: {error}") from None
    return render


def encode_example(turns: list[tuple[str, str]], tokenizer) -> tuple[list[int], list[bool]]:
    """Token ids of one example and, per token, whether it counts in the loss."""
    ids: list[int] = []
    learn: list[bool] = []

    def add(text: str, counts: bool) -> None:
        piece = tokenizer.encode(text) if text else []
        ids.extend(piece)
        learn.extend([counts] * len(piece))

    if turns[0][0] == "prompt":
        add(turns[0][1], False)
        add(turns[1][1], True)
        ids.append(tokenizer.eod)
        learn.append(True)
        return ids, learn
    template = chat_template(tokenizer)
    if template is None:
        for role, content in turns:
            add(f"{role}: ", False)
            add(content, role == "assistant")
            if role == "assistant":
                ids.append(tokenizer.eod)
                learn.append(True)
            add("\n", False)
        return ids, learn
    render = template_renderer(template, getattr(tokenizer, "chat_template_source", "the tokenizer"))
    special = getattr(tokenizer, "special_tokens", {})
    done = ""
    for index, (role, _) in enumerate(turns):
        messages = [{"role": r, "content": c} for r, c in turns[:index + 1]]
        if role == "assistant":  # the generation prompt is context, the answer after it is learned
            prompt = render(messages=messages[:-1], add_generation_prompt=True, **special)
            add(prompt[len(done):], False)
            done = prompt
        text = render(messages=messages, add_generation_prompt=False, **special)
        add(text[len(done):], role == "assistant")
        done = text
    return ids, learn


class SFTDataset(torch.utils.data.Dataset):
    """Samples of ``seq_length`` tokens from SFT examples: tokens, next-token labels, the loss mask of the
    learned tokens, positions from 0. Owns the encoded examples; never packs two examples together."""

    def __init__(self, examples: Sequence[Tuple[list[int], list[bool]]], seq_length: int, num_samples: int,
                 seed: int, pad_id: int):
        self.examples, self.seq_length, self.num_samples = list(examples), seq_length, num_samples
        self.seed, self.pad_id = seed, pad_id
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return self.num_samples

    def _example(self, index: int) -> tuple[list[int], list[bool]]:
        epoch, offset = divmod(index, len(self.examples))
        if epoch not in self._orders:
            order = list(range(len(self.examples)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}
        return self.examples[self._orders[epoch][offset]]

    def __getitem__(self, index: int) -> dict:
        ids, learn = self._example(index)
        length = self.seq_length + 1
        ids, learn = ids[:length], learn[:length]
        ids = ids + [self.pad_id] * (length - len(ids))
        learn = learn + [False] * (length - len(learn))
        tokens = torch.tensor(ids, dtype=torch.long)
        return {"tokens": tokens[:-1], "labels": tokens[1:],
                "loss_mask": torch.tensor(learn[1:], dtype=torch.float32),
                "position_ids": torch.arange(self.seq_length, dtype=torch.long)}


def build_sft_datasets(paths: list[str], split: str, seq_length: int, seed: int,
                       num_samples: Tuple[int, int, int],
                       tokenizer) -> tuple[Optional[SFTDataset], Optional[SFTDataset], Optional[SFTDataset]]:
    """(train, valid, test) SFT datasets: the examples of ``paths`` cut into consecutive ranges by the
    ``--split`` weights, each read for its number of samples."""
    examples = [encode_example(turns, tokenizer) for path in paths for turns in read_sft_file(path)]
    weights = [float(part) for part in split.strip("'\" ").split(",")]
    weights += [0.0] * (3 - len(weights))
    bounds, start = [], 0
    for weight in weights:
        end = start + round(weight / sum(weights) * len(examples))
        bounds.append((start, min(end, len(examples))))
        start = end
    pad = tokenizer.pad if tokenizer.pad >= 0 else tokenizer.eod
    datasets = []
    for name, (begin, end), count in zip(("train", "valid", "test"), bounds, num_samples):
        if count == 0:
            datasets.append(None)
            continue
        if end <= begin:
            raise SFTDataError(f"--split {split}: the {name} split of {len(examples)} SFT examples is "
                               "empty; give "
                               "it a larger weight or more examples")
        datasets.append(SFTDataset(examples[begin:end], seq_length, count, seed, pad))
    return tuple(datasets)
