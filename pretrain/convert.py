"""Turn a sharded checkpoint of any layout into one file, or into a Hugging Face GPT-2 model.

    python -m pretrain.convert --load DIR --output OUT.safetensors [--with-optimizer-states]
    python -m pretrain.convert --load DIR --output HF_DIR --to hf

``consolidated`` (default): one safetensors file of the whole model's fp32 weights under their
layout-independent names (vocabulary padding removed; the names of a single-process GPTModel), with the
iteration and the model config as metadata, and optionally every per-element optimizer state
(``optimizer.<state>.<name>``). ``hf``: a directory that ``transformers`` loads as GPT2LMHeadModel
(model.safetensors with GPT-2's names and layouts, config.json); refused, naming the option, when the
model is not GPT-2's architecture. Both stream: one parameter is rebuilt from the rank files at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from models.config import GPTConfig
from parallel.zero.export import StreamedSafetensors
from pretrain.checkpoint import CheckpointError, read_rank_files
from pretrain.reshard import CheckpointPieces, ReshardError


def _model_config(manifest: dict) -> GPTConfig:
    fields = GPTConfig.__dataclass_fields__
    return GPTConfig(**{key: value for key, value in manifest["config"].items() if key in fields})


def _natural(name: str) -> list:
    """Sort key: embeddings, then blocks by number, then the final norm."""
    parts = name.split(".")
    rank = {"word_embedding": 0, "position_embedding": 1, "layers": 2}.get(parts[0], 3)
    return [rank] + [int(p) if p.isdigit() else p for p in parts[1:]]


def write_consolidated(pieces: CheckpointPieces, manifest: dict, output: str, with_states: bool = False) -> None:
    names = sorted(pieces.by_name, key=_natural)
    kinds = ["master"] + (pieces.kinds if with_states else [])
    entries = [(name if kind == "master" else f"optimizer.{kind}.{name}", pieces.shape(name))
               for kind in kinds for name in names]
    config = {key: value for key, value in manifest["config"].items() if key in GPTConfig.__dataclass_fields__}
    metadata = {"iteration": str(manifest["iteration"]), "model": json.dumps(config)}
    writer = StreamedSafetensors(output, entries, metadata=metadata)
    try:
        for kind in kinds:
            for name in names:
                writer.write(name if kind == "master" else f"optimizer.{kind}.{name}", pieces.whole(name, kind))
    except BaseException:
        writer.abort()
        raise
    writer.close()


def gpt2_mismatches(config: GPTConfig) -> list[str]:
    """Options that GPT-2's architecture (GPT2LMHeadModel) cannot express, as the flags that set them."""
    gpt2 = {"position-embedding-type": (config.position_embedding, "learned_absolute"),
            "normalization": (config.normalization, "LayerNorm"),
            "swiglu / --squared-relu": (config.activation, "gelu"),
            "num-query-groups": (config.query_groups, config.num_attention_heads),
            "kv-channels": (config.head_dim, config.hidden_size // config.num_attention_heads),
            "disable-bias-linear": (config.disable_bias_linear, False), "qk-layernorm": (config.qk_layernorm, False),
            "apply-layernorm-1p": (config.apply_layernorm_1p, False),
            "untie-embeddings-and-output-weights": (config.untie_embeddings_and_output_weights, False)}
    return [f"--{flag} {value}" for flag, (value, wanted) in gpt2.items() if value != wanted]


def _gpt2_tensors(config: GPTConfig):
    """(GPT-2 name, our name, transform) in GPT-2's order. Conv1D weights are [in, out] (ours [out, in]);
    our fused QKV rows are grouped head by head (q, k, v of head 0, then head 1), GPT-2's q | k | v."""
    heads, d = config.num_attention_heads, config.hidden_size // config.num_attention_heads

    def qkv(tensor: torch.Tensor) -> torch.Tensor:
        regrouped = tensor.reshape(heads, 3, d, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape)
        return regrouped.t() if regrouped.dim() == 2 else regrouped

    def conv1d(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.t() if tensor.dim() == 2 else tensor

    def same(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    yield "transformer.wte.weight", "word_embedding.weight", same
    yield "transformer.wpe.weight", "position_embedding.weight", same
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}", f"transformer.h.{i}"
        for kind in ("weight", "bias"):
            yield f"{theirs}.ln_1.{kind}", f"{ours}.attention_norm.{kind}", same
            yield f"{theirs}.attn.c_attn.{kind}", f"{ours}.attention.qkv.{kind}", qkv
            yield f"{theirs}.attn.c_proj.{kind}", f"{ours}.attention.proj.{kind}", conv1d
            yield f"{theirs}.ln_2.{kind}", f"{ours}.mlp_norm.{kind}", same
            yield f"{theirs}.mlp.c_fc.{kind}", f"{ours}.mlp.fc1.{kind}", conv1d
            yield f"{theirs}.mlp.c_proj.{kind}", f"{ours}.mlp.fc2.{kind}", conv1d
    for kind in ("weight", "bias"):
        yield f"transformer.ln_f.{kind}", f"final_norm.{kind}", same


def write_hf_gpt2(pieces: CheckpointPieces, manifest: dict, directory: str) -> None:
    config = _model_config(manifest)
    mismatches = gpt2_mismatches(config)
    if mismatches:
        raise CheckpointError(f"--to hf writes GPT-2's architecture, which cannot express {', '.join(mismatches)}: "
                              "convert with --to consolidated instead")
    os.makedirs(directory, exist_ok=True)
    tensors = list(_gpt2_tensors(config))
    shapes = {name: pieces.shape(name) for _, name, _ in tensors}
    entries = [(theirs, tuple(transform(torch.empty(shapes[ours], device="meta")).shape))
               for theirs, ours, transform in tensors]
    writer = StreamedSafetensors(os.path.join(directory, "model.safetensors"), entries, metadata={"format": "pt"})
    try:
        for theirs, ours, transform in tensors:
            writer.write(theirs, transform(pieces.whole(ours)))
    except BaseException:
        writer.abort()
        raise
    writer.close()
    hf_config = {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": config.vocab_size,
        "n_positions": config.max_positions, "n_embd": config.hidden_size, "n_layer": config.num_layers,
        "n_head": config.num_attention_heads, "n_inner": config.ffn_size, "activation_function": "gelu",
        "layer_norm_epsilon": config.layernorm_epsilon, "resid_pdrop": config.hidden_dropout,
        "embd_pdrop": config.hidden_dropout, "attn_pdrop": config.attention_dropout, "tie_word_embeddings": True,
        "torch_dtype": "float32"}
    with open(os.path.join(directory, "config.json"), "w") as handle:
        json.dump(hf_config, handle, indent=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pretrain.convert", description=__doc__.split("\n")[0])
    parser.add_argument("--load", required=True, help="checkpoint directory (its newest complete checkpoint)")
    parser.add_argument("--output", required=True, help="the .safetensors file, or the directory for --to hf")
    parser.add_argument("--to", choices=["consolidated", "hf"], default="consolidated")
    parser.add_argument("--with-optimizer-states", action="store_true", help="consolidated: add the optimizer states")
    args = parser.parse_args(argv)
    try:
        _, manifest, states = read_rank_files(args.load)
        pieces = CheckpointPieces(states)
        if args.to == "hf":
            write_hf_gpt2(pieces, manifest, args.output)
        else:
            write_consolidated(pieces, manifest, args.output, args.with_optimizer_states)
    except (CheckpointError, ReshardError) as error:
        sys.exit(f"error: {error}")
    print(f"wrote {args.output} from iteration {manifest['iteration']} of {args.load}")


if __name__ == "__main__":
    main()
