"""Hugging Face model directories in and out: import one as a weights-only checkpoint of ours, export any
checkpoint of ours (any layout) as one, tokenizer files included. Both stream one tensor at a time.

    import: HF_DIR (config.json, model.safetensors or model.safetensors.index.json + shards, tokenizer
            files) -> CKPT/iter_0000000/{manifest.json, model.safetensors, tokenizer/} and CKPT/latest
    export: a checkpoint -> DIR/{config.json, generation_config.json, model.safetensors, tokenizer files}

The imported checkpoint records the architecture (a ``--load`` of it needs no shape flags) and its
tokenizer; it loads into any layout as fine-tuning does (``pretrain.checkpoint.checkpointer``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator

import torch

from models.config import GPTConfig
from models.counting import stage_model
from parallel.param_meta import meta
from parallel.zero.export import StreamedSafetensors
from pretrain.interop.safetensors_shards import plan_shards, write_index
from data.file_digest import files_sha256
from data.tokenizers.base import CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_FILE
from pretrain.checkpoint.catalog import WEIGHTS_FILE, CheckpointError, write_durably
from pretrain.interop.hf_config import HFMappingError, config_from_hf, config_to_hf
from pretrain.interop.mxfp4 import dequantize_mxfp4, quantized_pairs
from pretrain.interop.hf_names import expert_bias_names
from pretrain.interop.hf_qwen3_next import DEPTH_KEYS
from pretrain.interop.hf_tensor_plan import copies_of, export_plan, import_plan, stored_name

# every file transformers writes for a tokenizer (its named templates in CHAT_TEMPLATE_DIR beside them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", CHAT_TEMPLATE_FILE)
IGNORED_BUFFERS = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")  # buffers some exports keep


class _HFTensors:
    """The tensors of a Hugging Face model directory, single-file or sharded, opened lazily, named as
    ``rename`` says (the family's rules' names); with ``mxfp4`` its quantized tensors (``X_blocks`` and
    ``X_scales``) read as ``X`` dequantized. The last
    tensor read is kept (a layer's stacked experts are read once for all of them)."""

    def __init__(self, directory: str, mxfp4: bool = False, rename=None):
        from safetensors import safe_open

        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as handle:
                self.where = {name: os.path.join(directory, file) for name,
                              file in json.load(handle)["weight_map"].items()}
        elif os.path.isfile(os.path.join(directory, "model.safetensors")):
            path = os.path.join(directory, "model.safetensors")
            with safe_open(path, "pt") as handle:
                self.where = {name: path for name in handle.keys()}
        else:
            raise CheckpointError(f"--from-hf {directory}: no model.safetensors or "
                                  "model.safetensors.index.json "
                                  "(save the model with save_pretrained(safe_serialization=True))")
        rename = rename or (lambda name: name)  # (the files' names -> the rules' names)
        self.stored = {rename(name): name for name in self.where}
        self.where = {rename(name): path for name, path in self.where.items()}
        self._open = {}
        self._safe_open = safe_open
        self.quantized = quantized_pairs(self.where) if mxfp4 else {}
        self._last: tuple[str | None, torch.Tensor | None] = (None, None)

    def names(self) -> set[str]:
        """The tensors as the model reads them: the plain ones and the dequantized ones."""
        parts = {part for pair in self.quantized.values() for part in pair}
        return (set(self.where) - parts) | set(self.quantized)

    def get(self, name: str) -> torch.Tensor:
        if self._last[0] != name:
            if name in self.quantized:
                blocks, scales = self.quantized[name]
                tensor = dequantize_mxfp4(self._read(blocks), self._read(scales), name=name)
            else:
                tensor = self._read(name)
            self._last = (name, tensor)
        return self._last[1]

    def _read(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise CheckpointError(f"the Hugging Face model has no tensor {name} (a model of another "
                                  "architecture, "
                                  "or a damaged save)")
        path = self.where[name]
        if path not in self._open:
            self._open = {path: self._safe_open(path, "pt")}  # one shard open at a time
        return self._open[path].get_tensor(self.stored[name])


def expected_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Our parameters' whole shapes (vocabulary unpadded), from the model built on the meta device."""
    chunk = stage_model(config)[0]
    shapes = {}
    for param, name in chunk.global_parameter_names().items():
        shape = list(param.shape)
        if meta(param).unpadded_rows is not None:
            shape[0] = meta(param).unpadded_rows
        shapes[name] = tuple(shape)
    return shapes


class HFModel:
    """A Hugging Face model directory read as ours: its config mapped (``config``, refused by name before
    any weight is read), and each of our parameters built from its tensors on request (``parameters``).
    Owns the open files; keeps no tensor."""

    def __init__(self, hf_dir: str):
        try:
            with open(os.path.join(hf_dir, "config.json")) as handle:
                self.hf = json.load(handle)
        except (OSError, ValueError) as error:
            raise CheckpointError(f"--from-hf {hf_dir}: no readable config.json ({error})") from None
        try:
            self.config = config_from_hf(self.hf)
        except HFMappingError as error:
            raise CheckpointError(f"--from-hf {hf_dir}: {error}") from None
        self.directory = hf_dir
        quantization = self.hf.get("quantization_config") or {}
        self.tensors = _HFTensors(hf_dir, mxfp4=quantization.get("quant_method") == "mxfp4",
                                  rename=stored_name(self.config.hf_model_type))
        self.plan = list(import_plan(self.config))
        depths = {name for ours, theirs, _ in self.plan if ours.startswith("mtp.") for name in theirs}
        if depths and not depths & set(self.tensors.names()):  # transformers' own saves leave them out:
            self.config = config_from_hf({**self.hf, **dict.fromkeys(DEPTH_KEYS, 0)})  # the model alone
            self.plan = list(import_plan(self.config))
        self.expected = expected_shapes(self.config)
        self.bias_names = expert_bias_names(self.config, self.config.hf_model_type)
        used = {name for _, theirs, _ in self.plan for name in theirs} | set(self.bias_names.values())
        tied = not self.config.untie_embeddings_and_output_weights
        unused = sorted(name for name in self.tensors.names() if name not in used
                        and not name.endswith(IGNORED_BUFFERS) and not (name == "lm_head.weight" and tied)
                        and name not in copies_of(self.config))
        if unused:
            raise CheckpointError(f"--from-hf {hf_dir}: tensors with no place in the model: "
                                  f"{', '.join(unused[:5])}"
                                  + (f" and {len(unused) - 5} more" if len(unused) > 5 else ""))

    def parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(our name, its whole fp32 tensor) for every parameter, one at a time; CheckpointError naming
        the tensors whose shapes the config does not give."""
        for ours, theirs, join in self.plan:
            tensor = join(*(self.tensors.get(name).float() for name in theirs))
            if tuple(tensor.shape) != self.expected[ours]:
                raise CheckpointError(f"--from-hf {self.directory}: {' and '.join(theirs)} make {ours} of "
                                      f"shape {tuple(tensor.shape)}; the architecture in config.json needs "
                                      f"{self.expected[ours]}")
            yield ours, tensor


    def run_states(self) -> dict:
        """The checkpoint's run states the model carries: the expert-bias table (DeepSeek-V3's
        score-correction biases; dense layers' rows zero), else none."""
        if not self.bias_names:
            return {}
        table = torch.zeros(len(self.config.moe_layers_with_depths()), self.config.num_experts)
        for layer, name in self.bias_names.items():
            bias = self.tensors.get(name).float()
            if tuple(bias.shape) != (self.config.num_experts,):
                raise CheckpointError(f"--from-hf {self.directory}: {name} has shape {tuple(bias.shape)}, "
                                      f"the config's experts need ({self.config.num_experts},)")
            table[layer] = bias
        return {"load_balancing": {"expert_bias": table.tolist()}}


def import_hf(hf_dir: str, output: str) -> str:
    """Write ``hf_dir``'s model as a weights-only checkpoint under ``output``; return its path."""
    model = HFModel(hf_dir)
    hf = model.hf
    return write_weights_checkpoint(
        output, model.config, [(ours, model.expected[ours]) for ours, _, _ in model.plan], model.parameters(),
        hf_dir, f"Hugging Face {hf.get('architectures', [hf['model_type']])[0]}",
        lambda staging: _copy_tokenizer(hf_dir, os.path.join(staging, "tokenizer")), model.run_states())


def write_weights_checkpoint(output: str, config: GPTConfig, shapes: list[tuple[str, tuple]], tensors,
                             source: str, label: str, tokenizer=None, states: dict | None = None) -> str:
    """A weights-only checkpoint of ``config`` under ``output`` (its iteration 0, made ``latest`` unless
    ``output`` has a ``latest`` already: a pointer never moves back): ``tensors`` yields (our name, whole
    tensor) in the order of ``shapes``; ``tokenizer(staging)`` copies the tokenizer files and returns their
    flags (or None). Staged, then renamed into place: a failed import leaves nothing behind, and an
    existing iteration 0 is never replaced. Returns the checkpoint's path."""
    final = os.path.join(output, "iter_0000000")
    if os.path.exists(final):
        raise CheckpointError(f"{final} exists: an import is iteration 0 and never replaces a checkpoint; "
                              "give a new --output")
    staging = final + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    writer = StreamedSafetensors(os.path.join(staging, WEIGHTS_FILE), shapes,
                                 metadata={"source": os.path.abspath(source)})
    try:
        for ours, tensor in tensors:
            writer.write(ours, tensor)
    except BaseException:
        writer.abort()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    writer.close()
    files = {WEIGHTS_FILE: {"bytes": os.path.getsize(os.path.join(staging, WEIGHTS_FILE)),
                            "sha256": files_sha256(os.path.join(staging, WEIGHTS_FILE))}}
    manifest = {"kind": "weights", "iteration": 0, "consumed_samples": 0, "layout": None, "files": files,
                "config": {name: getattr(config, name) for name in GPTConfig.__dataclass_fields__},
                "tokenizer": tokenizer(staging) if tokenizer else None, "states": states or {},
                "source": label}
    write_durably(os.path.join(staging, "manifest.json"), json.dumps(manifest, indent=1).encode())
    os.replace(staging, final)
    if not os.path.exists(os.path.join(output, "latest")):
        write_durably(os.path.join(output, "latest"), b"iter_0000000")
    return final


def _copy_tokenizer(source: str, target: str) -> dict | None:
    """Copy the tokenizer files of ``source``; the tokenizer flags that read them (paths relative to the
    checkpoint), or None when there are none."""
    present = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(source, name))]
    if not any(name in present for name in ("tokenizer.json", "vocab.json", "tokenizer.model")):
        return None
    os.makedirs(target)
    for name in present:
        shutil.copy(os.path.join(source, name), target)
    templates = os.path.join(source, CHAT_TEMPLATE_DIR)
    if os.path.isdir(templates):
        os.makedirs(os.path.join(target, CHAT_TEMPLATE_DIR))
        for name in os.listdir(templates):
            path = os.path.join(templates, name)
            if name.endswith(".jinja") and os.path.isfile(path) and not os.path.islink(path):
                shutil.copy(path, os.path.join(target, CHAT_TEMPLATE_DIR))
    return tokenizer_flags(present, "tokenizer")  # relative to the checkpoint


def tokenizer_flags(present: list[str], folder: str) -> dict:
    """The tokenizer flags that read the Hugging Face tokenizer files ``present`` in ``folder``."""
    if "tokenizer.json" in present:
        return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": folder}
    if "vocab.json" in present and "merges.txt" in present:
        return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": os.path.join(folder, "vocab.json"),
                "merge_file": os.path.join(folder, "merges.txt")}
    return {"tokenizer_type": "SentencePieceTokenizer",
            "tokenizer_model": os.path.join(folder, "tokenizer.model")}


def export_hf(source, config: GPTConfig, tokenizer, directory: str,
              max_shard_bytes: int | None = None, states: dict | None = None) -> None:
    """Write the model that ``source`` (a ``reshard.PieceSource``: ``whole(name)``) holds as a Hugging
    Face model directory, with ``tokenizer``'s files (None: none) and its special ids; its weights in
    shards of at most ``max_shard_bytes`` with their index (None: one file); ``states``: the checkpoint's
    run states (the expert biases, where the family keeps them as tensors). One of our tensors is
    rebuilt at a time."""
    try:
        plan = list(export_plan(config))
        biases = expert_bias_names(config)
        special = tokenizer.save_for_hugging_face(directory) if tokenizer is not None else {}
        hf_config = config_to_hf(config, special)
    except HFMappingError as error:
        raise CheckpointError(f"--to hf: {error}") from None
    os.makedirs(directory, exist_ok=True)
    cached: dict[str, torch.Tensor] = {}

    def ours(name: str) -> torch.Tensor:  # q, k and v (gate and up) come from one of our tensors in turn
        if name not in cached:
            cached.clear()
            cached[name] = source.whole(name)
        return cached[name]

    table = (states or {}).get("load_balancing", {}).get("expert_bias")
    if biases and table is None:
        raise CheckpointError("--to hf: the checkpoint has no expert-bias table "
                              f"(--moe-router-enable-expert-bias was on): {next(iter(biases.values()))} "
                              "cannot be written")
    extra = {theirs: torch.tensor(table[layer], dtype=torch.float32) for layer, theirs in biases.items()}
    shapes = [(theirs, tuple(transform(*(torch.empty(source.shape(name), device="meta")
                                         for name in names)).shape))
              for theirs, names, transform in plan] + [(name, tuple(t.shape)) for name, t in extra.items()]
    path = os.path.join(directory, "model.safetensors")
    shards = plan_shards(path, shapes, 4, max_shard_bytes)
    transforms = {theirs: (names, transform) for theirs, names, transform in plan}
    for shard, entries in shards:
        writer = StreamedSafetensors(shard, entries, metadata={"format": "pt"})
        try:
            for theirs, _ in entries:
                if theirs in extra:
                    writer.write(theirs, extra[theirs])
                    continue
                names, transform = transforms[theirs]
                writer.write(theirs, transform(*(ours(name) if len(names) == 1 else source.whole(name)
                                                 for name in names)))
        except BaseException:
            writer.abort()
            raise
        writer.close()
    if len(shards) > 1:
        write_index(path, shards, 4)
    with open(os.path.join(directory, "config.json"), "w") as handle:
        json.dump(hf_config, handle, indent=1)
    generation = {key: value for key, value in special.items() if value is not None}
    with open(os.path.join(directory, "generation_config.json"), "w") as handle:
        json.dump({**generation, "do_sample": False, "max_new_tokens": 64}, handle, indent=1)
