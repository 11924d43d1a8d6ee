"""``pretrain.load_model``: a checkpoint of any layout, or a Hugging Face directory, as one plain module.

For evaluation, notebooks and tests, as ``AutoModelForCausalLM.from_pretrained`` is for transformers:
one process, no process group, no torchrun. The GPT is built as a single-process ``GPTModel`` (tp 1,
every layer) and filled one parameter at a time from the saved pieces (re-cut from whatever layout
saved them) or from the Hugging Face tensors (mapped as an import maps them).
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from models.config import GPTConfig
from models.gpt import GPTModel
from parallel.comm import DetachedGroup
from parallel.param_meta import meta
from pretrain.checkpoint.catalog import CheckpointError, run_states


class LoadedModel(nn.Module):
    """A whole GPT on one process. ``model(input_ids)`` ([batch, sequence] token ids) gives logits
    [batch, sequence, vocabulary]; ``tokenizer`` is the model's tokenizer (None when the source has
    none) and ``config`` its ``GPTConfig``. Owns the weights; never communicates. Starts in eval mode."""

    def __init__(self, config: GPTConfig, gpt: GPTModel, tokenizer):
        super().__init__()
        self.config, self.gpt, self.tokenizer = config, gpt, tokenizer

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        logits = self.gpt(input_ids, position_ids, whole_sequence=True)  # [s, b, padded vocabulary]
        return logits[..., :self.config.vocab_size].transpose(0, 1)


def _weights(path: str) -> tuple[GPTConfig, object, object, dict]:
    """(config, iterator of (our name, whole fp32 tensor), tokenizer, run states) of a checkpoint or an HF
    directory."""
    from pretrain.interop.hf_checkpoint import TOKENIZER_FILES, HFModel, tokenizer_flags
    from pretrain.interop.saved_model import model_config, saved_tokenizer, saved_weights

    if os.path.isfile(os.path.join(path, "config.json")):
        model = HFModel(path)
        present = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(path, name))]
        tokenizer = None
        if present:
            from data.tokenizers.spec import TokenizerSpec, build_tokenizer

            tokenizer = build_tokenizer(TokenizerSpec(**tokenizer_flags(present, path)))
        return model.config, model.parameters(), tokenizer, model.run_states()
    checkpoint, manifest, pieces = saved_weights(path)
    try:
        tokenizer = saved_tokenizer(checkpoint, manifest)
    except ValueError as error:  # said, not left for ``.tokenizer.encode`` to fail on
        warnings.warn(f"no tokenizer: {error}; the model's .tokenizer is None", stacklevel=3)
        tokenizer = None
    config = model_config(manifest)
    return (config, ((name, pieces.whole(name)) for name in sorted(pieces.by_name)), tokenizer,
            run_states(manifest))


def load_model(path: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The model at ``path`` (a checkpoint directory of ours, any layout, or a Hugging Face model
    directory) on this process's CPU in ``dtype``, with its tokenizer as ``.tokenizer``; a plain
    ``nn.Module`` in eval mode. CheckpointError naming what cannot be read."""
    if not os.path.isdir(path):
        raise CheckpointError(f"load_model({path!r}): no such directory")
    config, weights, tokenizer, states = _weights(path)
    config.hidden_dropout = config.attention_dropout = 0.0
    with torch.device("meta"):
        gpt = GPTModel(config, DetachedGroup("tp", 1), seed=0)
    padded = {name: meta(param).unpadded_rows for param, name in gpt.global_parameter_names().items()}
    gpt.to_empty(device="cpu")  # new tensors: the declared metadata is read above
    parameters = {name: param for param, name in gpt.global_parameter_names().items()}
    filled = set()
    with torch.no_grad():
        for name, tensor in weights:
            if name not in parameters:
                raise CheckpointError(f"load_model({path!r}): {name} has no place in the model")
            param = parameters[name]
            param.zero_()  # vocabulary padding rows stay zero
            rows = padded[name]
            (param[:rows] if rows is not None else param).copy_(tensor)
            filled.add(name)
    missing = sorted(set(parameters) - filled)
    if missing:
        raise CheckpointError(f"load_model({path!r}): the checkpoint lacks {', '.join(missing[:5])}")
    if gpt.balancing is not None and "load_balancing" in states:  # the routing's expert biases
        gpt.balancing.load_state_dict(states["load_balancing"])
    return LoadedModel(config, gpt.to(dtype), tokenizer).eval()
