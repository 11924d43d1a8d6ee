"""torchtitan's Llama checkpoints (a PyTorch Distributed Checkpoint step folder) imported as ours, and ours
exported as one.

torchtitan saves its model's keys flat beside its optimizer, scheduler and data-loader states:
``tok_embeddings.weight``; per layer ``attention.wq|wk|wv|wo.weight`` (0.3 and later:
``attention.qkv_linear.wq|wk|wv.weight``), ``feed_forward.w1|w2|w3.weight`` (gate, down, up),
``attention_norm.weight``, ``ffn_norm.weight``; ``norm.weight``; ``output.weight`` (later
``lm_head.weight``). It keeps no model config: the shape comes from the tensors, the head count, query
groups, rotary base, norm epsilon and sequence length from the flags of the import, or from the
``model_args.json`` (torchtitan's ``TransformerModelArgs`` names) that the export writes beside its files,
so that a round trip keeps them; a flag that contradicts the recorded value is refused. Its q and k rows
are in Meta's interleaved rotary layout; its Hugging Face adapter permutes them into the half-split one
(the layout this stack's rotary takes), and so do the import and, the other way, the export. The folder
is read through ``pretrain.checkpoint.foreign.dcp_folder`` (its pickled metadata with DCP's records alone),
one tensor at a time; the export writes with torch's own ``torch.distributed.checkpoint.save``.
"""

from __future__ import annotations

import json
import os

import torch

from models.config import GPTConfig
from pretrain.checkpoint.dcp_storage import save_in_one_process
from pretrain.checkpoint.errors import CheckpointError
from pretrain.checkpoint.foreign.dcp_folder import DCPFolder
from pretrain.interop.hf_checkpoint import expected_shapes, write_weights_checkpoint
from pretrain.interop.hf_names import qkv_from, qkv_to

# torchtitan's spellings, newest first: (q, k, v), output
ATTENTION = (("attention.qkv_linear.wq", "attention.qkv_linear.wk", "attention.qkv_linear.wv"),
             ("attention.wq", "attention.wk", "attention.wv"))
OUTPUT = ("lm_head.weight", "output.weight")
MODEL_ARGS = "model_args.json"  # the head layout, rope theta, epsilon and length, beside the export's files
# the import's flags: torchtitan's name in MODEL_ARGS, the default when neither flag nor file gives it
LAYOUT = {"heads": ("n_heads", None), "query_groups": ("n_kv_heads", None),
          "rotary_base": ("rope_theta", 500000.0), "norm_epsilon": ("norm_eps", 1e-5),
          "seq_length": ("max_seq_len", 2048)}
FLAGS = {"heads": "--num-attention-heads", "query_groups": "--num-query-groups",
         "rotary_base": "--rotary-base", "norm_epsilon": "--norm-epsilon", "seq_length": "--seq-length"}


def recorded_layout(folder: str) -> dict:
    """The layout the export recorded in ``folder``'s ``MODEL_ARGS`` by our keyword names ({}: none).
    Plain JSON numbers only: a file of other content is refused by name."""
    path = os.path.join(folder, MODEL_ARGS)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as handle:
            saved = json.load(handle)
        found = {ours: saved[theirs] for ours, (theirs, _) in LAYOUT.items() if theirs in saved}
        if not all(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
                   for value in found.values()):
            raise ValueError("a value is not a positive number")
    except (OSError, ValueError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{path}: unreadable torchtitan model args ({error}); remove it and give the "
                              "layout flags") from None
    return found


def resolved_layout(folder: str, given: dict) -> dict:
    """The import's layout: each flag ``given`` (not None), else the folder's recorded value, else its
    default; a flag that contradicts the recorded value raises CheckpointError naming both."""
    recorded, layout = recorded_layout(folder), {}
    for name, (_, default) in LAYOUT.items():
        value = given.get(name)
        if value is not None and name in recorded and float(value) != float(recorded[name]):
            raise CheckpointError(f"{FLAGS[name]} {value:g} contradicts {os.path.join(folder, MODEL_ARGS)}, "
                                  f"which records {recorded[name]:g}: drop the flag")
        layout[name] = value if value is not None else recorded.get(name, default)
    if layout["heads"] is None:
        raise CheckpointError(f"--from-torchtitan {folder}: give --num-attention-heads (and "
                              "--num-query-groups for grouped queries): the folder records no model args")
    return layout


def interleaved_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows of each head from Meta's interleaved rotary pairs to the half-split layout (what
    torchtitan's Hugging Face adapter does on export)."""
    rows, columns = w.shape
    return w.view(heads, rows // heads // 2, 2, columns).transpose(1, 2).reshape(rows, columns)


def halves_to_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of ``interleaved_to_halves`` (the adapter's import)."""
    rows, columns = w.shape
    return w.view(heads, 2, rows // heads // 2, columns).transpose(1, 2).reshape(rows, columns)


class TorchtitanLlama:
    """A torchtitan Llama step folder read as ours: ``config`` (from its tensors and the given head
    layout) and ``parameters`` (our names, whole fp32 tensors, one at a time). Keeps no tensor."""

    def __init__(self, folder: str, heads: int, query_groups: int | None = None,
                 rotary_base: float = 500000.0, norm_epsilon: float = 1e-5, seq_length: int = 2048):
        self.folder = DCPFolder(folder)
        keys = set(self.folder.tensors)
        self.attention = next((names for names in ATTENTION if f"layers.0.{names[0]}.weight" in keys), None)
        self.output = next((name for name in OUTPUT if name in keys), None)
        if "tok_embeddings.weight" not in keys or self.attention is None or self.output is None:
            raise CheckpointError(f"{folder}: not a torchtitan Llama checkpoint (no tok_embeddings.weight, "
                                  "layers.0.attention.wq.weight or output weight among its tensors)")
        layers = 1 + max(int(key.split(".")[1]) for key in keys if key.startswith("layers."))
        vocab, hidden = self.folder.shape("tok_embeddings.weight")
        groups = query_groups or heads
        head_dim = self.folder.shape(f"layers.0.{self.attention[0]}.weight")[0] // heads
        if heads * head_dim != self.folder.shape(f"layers.0.{self.attention[0]}.weight")[0] or \
                self.folder.shape(f"layers.0.{self.attention[1]}.weight")[0] != groups * head_dim:
            raise CheckpointError(f"{folder}: its wq and wk rows do not split into --num-attention-heads "
                                  f"{heads} and --num-query-groups {groups} heads of one size; give the "
                                  "model's own")
        self.config = GPTConfig(
            num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
            group_query_attention=groups != heads, num_query_groups=groups if groups != heads else None,
            kv_channels=head_dim if head_dim * heads != hidden else None,
            ffn_hidden_size=self.folder.shape("layers.0.feed_forward.w1.weight")[0], vocab_size=vocab,
            seq_length=seq_length, max_position_embeddings=seq_length, normalization="RMSNorm", swiglu=True,
            position_embedding_type="rope", rotary_base=rotary_base, layernorm_epsilon=norm_epsilon,
            untie_embeddings_and_output_weights=True, disable_bias_linear=True, hidden_dropout=0.0,
            attention_dropout=0.0)

    def _get(self, key: str) -> torch.Tensor:
        return self.folder.read(key).float()

    def parameters(self):
        """(our name, whole fp32 tensor) of every parameter, in our model's order."""
        config, (wq, wk, wv) = self.config, self.attention
        yield "word_embedding.weight", self._get("tok_embeddings.weight")
        for layer in range(config.num_layers):
            theirs, ours = f"layers.{layer}.", f"layers.{layer}."
            yield ours + "attention_norm.weight", self._get(theirs + "attention_norm.weight")
            q = interleaved_to_halves(self._get(f"{theirs}{wq}.weight"), config.num_attention_heads)
            k = interleaved_to_halves(self._get(f"{theirs}{wk}.weight"), config.query_groups)
            yield ours + "attention.qkv.weight", qkv_from(config, q, k, self._get(f"{theirs}{wv}.weight"))
            yield ours + "attention.proj.weight", self._get(theirs + "attention.wo.weight")
            yield ours + "mlp_norm.weight", self._get(theirs + "ffn_norm.weight")
            yield ours + "mlp.fc1.weight", torch.stack([self._get(theirs + "feed_forward.w1.weight"),
                                                       self._get(theirs + "feed_forward.w3.weight")])
            yield ours + "mlp.fc2.weight", self._get(theirs + "feed_forward.w2.weight")
        yield "final_norm.weight", self._get("norm.weight")
        yield "output_layer.weight", self._get(self.output)


def _checked(parameters, shapes: dict):
    for name, tensor in parameters:
        if tuple(tensor.shape) != shapes[name]:
            raise CheckpointError(f"torchtitan's tensors make {name} of shape {tuple(tensor.shape)}; the "
                                  f"model they describe needs {shapes[name]}")
        yield name, tensor


def import_torchtitan(folder: str, output: str, **given) -> str:
    """Write the torchtitan Llama step ``folder`` as a weights-only checkpoint of ours under ``output``
    (``given``: ``TorchtitanLlama``'s head count and the rest, None where not given:
    ``resolved_layout``); returns its path."""
    model = TorchtitanLlama(folder, **resolved_layout(folder, given))
    shapes = list(expected_shapes(model.config).items())
    return write_weights_checkpoint(output, model.config, shapes, _checked(model.parameters(), dict(shapes)),
                                    folder,
                                    f"torchtitan Llama ({os.path.basename(os.path.normpath(folder))})")


def export_torchtitan(source, config: GPTConfig, folder: str, spelling: str = "0.3") -> None:
    """Write the model ``source`` (a ``reshard.PieceSource``) holds as a torchtitan Llama step folder with
    ``spelling``'s keys ("0.3": ``qkv_linear`` and ``lm_head``; "0.2": ``wq`` and ``output``)."""
    if not (not config.hybrid_layer_pattern and config.swiglu and config.normalization == "RMSNorm"
            and config.position_embedding == "rope"
            and config.disable_bias_linear and config.untie_embeddings_and_output_weights
            and not config.num_experts and not config.multi_latent_attention
            and not config.attention_output_gate and not config.mtp_depths):
        raise ValueError("--to torchtitan writes torchtitan's Llama: RMSNorm, SwiGLU, rotary, no biases, "
                         "untied embeddings, dense layers; this model is another")
    (wq, wk, wv), output = ATTENTION[0 if spelling == "0.3" else 1], OUTPUT[0 if spelling == "0.3" else 1]
    state = {"tok_embeddings.weight": source.whole("word_embedding.weight"),
             "norm.weight": source.whole("final_norm.weight"), output: source.whole("output_layer.weight")}
    for layer in range(config.num_layers):
        ours, theirs = f"layers.{layer}.", f"layers.{layer}."
        q, k, v = qkv_to(config, source.whole(ours + "attention.qkv.weight"))
        fc1 = source.whole(ours + "mlp.fc1.weight")
        state.update({
            theirs + "attention_norm.weight": source.whole(ours + "attention_norm.weight"),
            f"{theirs}{wq}.weight": halves_to_interleaved(q, config.num_attention_heads).contiguous(),
            f"{theirs}{wk}.weight": halves_to_interleaved(k, config.query_groups).contiguous(),
            f"{theirs}{wv}.weight": v.contiguous(),
            theirs + "attention.wo.weight": source.whole(ours + "attention.proj.weight"),
            theirs + "ffn_norm.weight": source.whole(ours + "mlp_norm.weight"),
            theirs + "feed_forward.w1.weight": fc1[0].contiguous(),
            theirs + "feed_forward.w3.weight": fc1[1].contiguous(),
            theirs + "feed_forward.w2.weight": source.whole(ours + "mlp.fc2.weight")})
    os.makedirs(folder, exist_ok=True)
    save_in_one_process(state, folder)
    args = {"dim": config.hidden_size, "n_layers": config.num_layers, "n_heads": config.num_attention_heads,
            "n_kv_heads": config.query_groups, "vocab_size": config.vocab_size,
            "norm_eps": config.layernorm_epsilon, "rope_theta": config.rotary_base,
            "max_seq_len": config.seq_length}
    with open(os.path.join(folder, MODEL_ARGS), "w") as handle:
        json.dump(args, handle, indent=1)
