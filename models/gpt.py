"""GPT: an embedding, layers assembled from tensor-parallel parts, the output layer and loss.

Activations are [sequence, batch, hidden]. The model part a rank builds is chosen by
``layer_indices`` (global layer indices, so weights are named and initialised the same whatever the
pipeline split) and by ``pre_process`` (token/position embedding) / ``post_process`` (final norm,
output layer and loss). The only parallel decisions here are which layers to use. The architecture
(GPT-3 or Llama-class: norms, MLP activation, grouped queries, positions, tied or untied output)
comes from ``GPTConfig``; each layer is built by the layer registry (``models.layers.registry``) from
its entry in ``GPTConfig.layer_types()``: a transformer block, or a hybrid pattern's symbol.
"""

from __future__ import annotations

import torch
from torch import nn

from models.attention import LayerInputs
from models.config import GPTConfig
from models.layers.registry import LayerContext, build_layer, check_buildable
from models.layers.residual import dropout
from models.layers.stack import LayerStack
from models.moe.balancing import LoadBalancing
from models.mtp.depth import MTPDepth
from models.norms import build_norm
from models.rotary import RotaryFrequencies, rotary_tables
from parallel.comm import AxisGroup
from parallel.context import ContextParallel, DocumentBlocks
from parallel.experts import ExpertGroups
from parallel.param_meta import declare
from parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from parallel.tensor.layers import (VocabParallelEmbedding, VocabParallelOutput, vocab_parallel_logits,
                                    vocab_parallel_lookup, with_init)
from parallel.tensor.mappings import scatter_to_sequence_parallel
from parallel.tensor.random import RNGTracker, model_parallel_tracker
from parallel.tensor.weight_init import WeightInit


class GPTModel(LayerStack, nn.Module):
    """One rank's part of a GPT: [embedding] -> blocks ``layer_indices`` -> [final norm, output layer, loss].

    Owns the parameters of its part only. Tied (the default), the word embedding is also the output
    layer; a last pipeline stage without the embedding holds its own copy (``output_layer``), kept equal
    to the first stage's by the pipeline's embedding-group all-reduce. Untied, ``output_layer`` is a
    weight of its own on the last stage. With ``context`` (cp > 1) its input holds this cp rank's share of
    each sequence and attention exchanges keys and values over the cp group. Its MoE layers
    (--num-experts) hold this rank's experts of ``experts`` (``ExpertGroups``) and exchange tokens over
    them; ``balancing`` (``LoadBalancing``, one per rank, shared by its chunks) owns their balancing
    losses' scale and values and the expert biases. It never communicates over any
    other group than tp, cp and the expert groups.
    """

    def __init__(self, config: GPTConfig, tp: AxisGroup, *, seed: int, layer_indices: list[int] | None = None,
                 pre_process: bool = True, post_process: bool = True, sequence_parallel: bool = False,
                 rng: RNGTracker | None = None, context: ContextParallel | None = None,
                 experts: ExpertGroups | None = None, balancing: LoadBalancing | None = None):
        super().__init__()
        check_buildable(config)
        config.validate(tp.size)
        experts = experts or ExpertGroups.detached()
        config.validate_moe(config.num_layers, config.ffn_size, experts.etp.size, experts.ep.size)
        self.config, self.tp, self.sequence_parallel = config, tp, sequence_parallel
        self.context = context if context is not None and context.size > 1 else None
        self.pre_process, self.post_process = pre_process, post_process
        self.tied = not config.untie_embeddings_and_output_weights
        self.rng = rng or model_parallel_tracker(seed, tp.rank)
        h, std = config.hidden_size, config.init_method_std
        padded = config.padded_vocab_size(tp.size)
        word_init = WeightInit(seed, "embedding.word.weight", std)
        if pre_process:
            self.word_embedding = VocabParallelEmbedding(config.vocab_size, padded, h, tp, word_init)
            if config.position_embedding == "learned_absolute":
                positions = WeightInit(seed, "embedding.position.weight", std)
                self.position_embedding = nn.Embedding(config.max_positions, h,  # no throw-away draw
                                                       _weight=positions.full((config.max_positions, h)))
                with_init(self.position_embedding.weight, lambda: positions.full((config.max_positions, h)))
        self.embedding_dropout = dropout(config.hidden_dropout)  # (the prediction depths' embeddings too)
        self.frequencies = RotaryFrequencies(config)
        self.layer_indices = list(range(config.num_layers)) if layer_indices is None else list(layer_indices)
        # the MoE layers' load balancing (None without experts)
        self.balancing = balancing if balancing is not None or not config.num_experts \
            else LoadBalancing.for_model(config)
        built_with = LayerContext(config, tp, seed, sequence_parallel, self.rng, experts, self.balancing,
                                  self.context)
        entries = config.layer_types()
        self.layers = nn.ModuleList(build_layer(entries[i], built_with, i) for i in self.layer_indices)
        if post_process:
            self.final_norm = build_norm(config, h, sequence_parallel)
            if not (self.tied and pre_process):
                output_init = word_init if self.tied else WeightInit(seed, "output_layer.weight", std)
                self.output_layer = VocabParallelOutput(config.vocab_size, padded, h, tp, output_init,
                                                        sequence_parallel=sequence_parallel)
                if self.tied:  # summed with the first stage's gradient, counted once (on the first stage)
                    declare(self.output_layer.weight, tied_embedding=True, tied_copy=True)
        if pre_process and not post_process and (self.tied or config.mtp_depths):  # (the last stage's
            declare(self.word_embedding.weight, tied_embedding=True)  # copy: output layer, mtp_embedding)
        if post_process and config.mtp_depths and not pre_process and not self.tied:
            # the depths' embedding on a last stage of its own, untied: a copy of the first stage's, their
            # gradients summed as a tied embedding's are
            self.mtp_embedding = VocabParallelEmbedding(config.vocab_size, padded, h, tp, word_init)
            declare(self.mtp_embedding.weight, tied_embedding=True, tied_copy=True)
        self.mtp = nn.ModuleList()  # the prediction depths, on the last stage (none elsewhere)
        if post_process and config.mtp_depths:  # (the depths borrow the embedding: a last stage of its own
            # looks their tokens up in its copy, the tied embedding's or ``mtp_embedding``)
            kinds = config.mtp_layer_types()  # each layer numbered past the model's, depth by depth
            self.mtp.extend(MTPDepth(config, depth, tp, seed, sequence_parallel, [
                build_layer(entry, built_with, config.num_layers + depth * len(kinds) + j)
                for j, entry in enumerate(kinds)]) for depth in range(config.mtp_depths))

    def layers_with_depths(self) -> list[nn.Module]:
        """This part's layers, then its prediction depths' (what compile and recompute treat alike)."""
        return [*self.layers, *(layer for depth in self.mtp for layer in depth.layers)]

    def global_parameter_names(self) -> dict[nn.Parameter, str]:
        """Each parameter's name in the whole GPT, the same in every layout: block indices are global,
        and the last stage's copy of the embedding (tied, or the prediction depths') is named as it."""
        names = {}
        for name, param in self.named_parameters():
            parts = name.split(".")
            if parts[0] == "layers":
                parts[1] = str(self.layer_indices[int(parts[1])])
            tied_copy = self.tied and name == "output_layer.weight" or name == "mtp_embedding.weight"
            names[param] = "word_embedding.weight" if tied_copy else ".".join(parts)
        return names

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] -> hidden [s, b, h] (sequence-sharded under sequence parallelism); on a last
        pipeline stage (the prediction depths') from its copy of the embedding."""
        if self.pre_process or not self.tied:
            x = (self.word_embedding if self.pre_process else self.mtp_embedding)(tokens.t())
        else:  # (the last stage's copy of the tied embedding is its output layer)
            output = self.output_layer
            x = vocab_parallel_lookup(tokens.t(), output.weight, self.tp, output.weight_grads)
        if self.config.embedding_multiplier != 1.0:  # rounded to the activations' dtype first, as Gemma does
            x = x * torch.tensor(self.config.embedding_multiplier, device=x.device).to(x.dtype)
        if self.config.use_mup and self.config.mup_embedding_mult != 1.0:
            x = x * self.config.mup_embedding_mult
        if self.config.position_embedding == "learned_absolute":
            x = x + self.position_embedding(position_ids.t())
        x = self.embedding_dropout(x)
        return scatter_to_sequence_parallel(x, self.tp) if self.sequence_parallel else x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits, [s, b, padded_vocab / tp], times muP's output
        multiplier, soft-capped with --final-logit-softcapping."""
        return self.output_logits(self.final_norm(hidden))

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output layer on normed hidden states ``x`` (the last layer's, or a prediction depth's)."""
        if self.tied and self.pre_process:
            logits = vocab_parallel_logits(x, self.word_embedding.weight, self.tp, self.sequence_parallel)
        else:
            logits = self.output_layer(x)
        if self.config.logit_multiplier != 1.0:
            logits = logits * self.config.logit_multiplier
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _rotary(self, position_ids: torch.Tensor, dtype: torch.dtype, whole_sequence: bool) -> dict:
        """The rotary tables of this rank's tokens (``rotary``, and ``rotary_local`` where the windowed
        layers have a base of their own), their frequencies picked by the whole input's length."""
        if self.config.position_embedding != "rope":
            return {}
        length = position_ids.shape[1] * (self.context.size if self.context and not whole_sequence else 1)
        tables = {"rotary": rotary_tables(self.config, position_ids, dtype,
                                          self.frequencies(length, position_ids.device))}
        if self.config.rotary_base_local is not None:
            local = self.frequencies(length, position_ids.device, local=True)
            tables["rotary_local"] = rotary_tables(self.config, position_ids, dtype, local)
        return tables

    def layer_inputs(self, position_ids: torch.Tensor, dtype: torch.dtype,
                     documents: torch.Tensor | None = None, whole_sequence: bool = False) -> LayerInputs:
        """What every layer takes besides the hidden state (``forward``'s arguments of those names)."""
        context = None if whole_sequence else self.context
        blocks = None
        windows = set().union(*(layer.attention_windows() for layer in self.layers))
        if documents is not None and context is None and windows and DocumentBlocks.usable(
                documents.device, self.config.attn_logit_softcapping, self.config.attention_dropout):
            blocks = DocumentBlocks(documents, windows)
        return LayerInputs(documents=documents, context=context, document_blocks=blocks,
                           **self._rotary(position_ids, dtype, whole_sequence))

    def forward(self, tokens: torch.Tensor | None, position_ids: torch.Tensor,
                labels: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                whole_sequence: bool = False, ahead: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """Run this part. Input: ``tokens`` [b, s] on the first stage, else ``hidden`` from the previous
        stage, with their ``position_ids`` [b, s]; under context parallelism this cp rank's share of each
        sequence (``parallel.context.shard_sequence``) unless ``whole_sequence`` (sampling). ``documents``
        [b, S]: each token's document over the whole sequence; attention then stays within documents.
        Output: per-token loss [b, s] on the last stage when ``labels`` are given ([1 + D, b, s] with D
        prediction depths, whose tokens, positions and labels ``ahead`` gives: ``mtp.depth.depth_batch``'s
        ``mtp_tokens``, ``mtp_position_ids``, ``mtp_labels``, cut as the input is), the logits slice
        [s, b, v/tp] on the last stage without labels, else the hidden state for the next stage."""
        x, inputs = self.hidden_states(tokens, position_ids, hidden, documents, whole_sequence)
        if not self.post_process:
            return x
        if labels is None or not self.config.mtp_depths:
            return self.head(x, labels)
        if ahead is None:
            raise ValueError("labels for a model with prediction depths come with their tokens ahead "
                             "(``ahead``: models.mtp.depth.depth_batch)")
        return self._with_predictions(self.final_norm(x), labels, ahead, inputs)

    def hidden_states(self, tokens: torch.Tensor | None, position_ids: torch.Tensor,
                      hidden: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                      whole_sequence: bool = False) -> tuple[torch.Tensor, LayerInputs]:
        """This part's layers run (``forward``'s arguments): their output [s, b, h], not normed, and the
        inputs they took (which the prediction depths' layers take too)."""
        x = self.embed(tokens, position_ids) if self.pre_process else hidden
        inputs = self.layer_inputs(position_ids, x.dtype, documents, whole_sequence)
        return self.run_layers(x, inputs), inputs

    def depth_state(self, depth: int, hidden: torch.Tensor, ahead: torch.Tensor,
                    ahead_positions: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        """Prediction depth ``depth``'s (1..D) normed hidden state [s, b, h], from the previous depth's
        (the main model's normed output for depth 1) and the tokens ``depth`` positions ahead [b, s] with
        their positions: its logits through ``output_logits`` predict the tokens ``depth`` + 1 ahead."""
        return self.mtp[depth - 1](hidden, self.embed(ahead, ahead_positions), inputs)

    def head(self, hidden: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """The last stage's end: per-token loss [b, s] with ``labels``, else the logits slice [s, b, v/tp]."""
        logits = self.logits(hidden)
        if labels is None:
            return logits
        return self._loss(logits, labels)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels.t(), self.tp, self.config.vocab_size).t()

    def _with_predictions(self, normed: torch.Tensor, labels: torch.Tensor, ahead: tuple[torch.Tensor, ...],
                          inputs: LayerInputs) -> torch.Tensor:
        """Per-token losses [1 + D, b, s]: the language model's, then depth k's at each position i against
        the token k + 1 after it (``ahead``: the tokens, positions and labels each depth reads [D, b, s];
        the last k positions of a sequence hold a zero-label loss that the caller masks)."""
        losses, hidden = [self._loss(self.output_logits(normed), labels)], normed
        for depth, (tokens, positions, targets) in enumerate(zip(*ahead), start=1):
            hidden = self.depth_state(depth, hidden, tokens, positions, inputs)
            losses.append(self._loss(self.output_logits(hidden), targets))
        return torch.stack(losses)
