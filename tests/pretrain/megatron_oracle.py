"""megatron-core's own GPT models on the CPU, for interop tests: built at any tp x pp in a gloo world,
saved as Megatron-LM saves them (its legacy rank files, and megatron-core's ``dist_checkpointing.save``:
torch_dist), and their logits at tp1 x pp1, loaded back by ``dist_checkpointing.load`` (megatron-core's
own re-cut).

megatron-core assumes CUDA where a CPU forward and save pass: its global memory buffer and default
causal mask ask ``torch.cuda.current_device()`` / ``device="cuda"``, the tied embedding's copy on the last
pipeline stage is moved with ``.cuda()`` before its all-reduce, and its checkpoint writer calls
``torch.cuda.synchronize()``. The oracle's processes map the device to the CPU, ``.cuda()`` to the tensor
itself and the synchronize to nothing, and pass the causal mask themselves; the RNG tracker is
megatron-core's inference one (no CUDA RNG).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from tests.pretrain.megatron_hybrid_oracle import (GDN_FIELDS, MAMBA_FIELDS, hybrid_chunk,
                                                   install_mamba_stand_ins)

HIDDEN, HEADS, LAYERS, FFN, VOCAB, SEQ = 32, 4, 4, 48, 64, 16
ITERATION, CONSUMED = 7, 56
SCHEDULER = {"max_lr": 3e-4, "lr_warmup_steps": 16, "num_steps": CONSUMED, "lr_decay_style": "cosine",
             "lr_decay_steps": 800, "min_lr": 3e-5, "start_wd": 0.01, "end_wd": 0.01,
             "wd_incr_style": "constant", "wd_incr_steps": 800}
# the two classes of model: GPT-3's (LayerNorm, GeLU, learned positions, biases, tied) and Llama's
# (RMSNorm, SwiGLU, rotary, grouped queries, no biases, untied)
ARCHITECTURES = {
    "gpt": {"normalization": "LayerNorm", "swiglu": False, "position_embedding_type": "learned_absolute",
            "add_bias_linear": True, "group_query_attention": False, "num_query_groups": HEADS,
            "untie_embeddings_and_output_weights": False},
    "llama": {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
              "add_bias_linear": False, "group_query_attention": True, "num_query_groups": 2,
              "untie_embeddings_and_output_weights": True},
}
# and DeepSeek's class: a mixture of experts (SequentialMLP's, a gated shared expert beside them) with
# latent attention (a query latent and a key/value latent, each normed; plain rotary)
MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 24,
       "moe_shared_expert_intermediate_size": 16, "moe_shared_expert_gate": True, "moe_layer_freq": 1,
       "moe_token_dispatcher_type": "allgather", "moe_router_load_balancing_type": "aux_loss",
       "moe_aux_loss_coeff": 0.0}
LATENT = {"multi_latent_attention": True, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_head_dim": 8,
          "qk_pos_emb_head_dim": 4, "v_head_dim": 8, "rope_type": "yarn", "rotary_scaling_factor": 4.0,
          "original_max_position_embeddings": 4, "mscale": 1.0, "mscale_all_dim": 1.0, "qk_layernorm": True,
          "group_query_attention": False, "num_query_groups": HEADS}
ARCHITECTURES["deepseek"] = {**ARCHITECTURES["llama"], **MOE, **LATENT}
# with DeepSeek-V3's multi-token prediction: one depth (its layer the last layer's kind: latent attention and
# experts)
ARCHITECTURES["deepseek"].update(mtp_num_layers=1, mtp_loss_scaling_factor=0.1)
# and a HybridModel (Nemotron-H's class): Mamba-2, attention (with Qwen3-Next's output gate), a gated delta
# net (grouped heads, as Qwen3-Next's; 2 key heads per tp rank), MLP and expert layers by the pattern of
# megatron-core 0.16's --hybrid-override-pattern, Llama's otherwise
HYBRID = {"hybrid_override_pattern": "M*G-ME", "mamba_state_dim": 16, "mamba_head_dim": 8,
          "mamba_num_groups": 2, "is_hybrid_model": True, "attention_output_gate": True,
          "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 4,
          "linear_value_head_dim": 4, "linear_conv_kernel_dim": 4,
          **{key: value for key, value in MOE.items() if "shared_expert" not in key}}
ARCHITECTURES["hybrid"] = {**ARCHITECTURES["llama"], **HYBRID}


def _layers(arch: dict) -> int:
    return len(arch.get("hybrid_override_pattern", "")) or LAYERS


def megatron_args(architecture: str, tp: int, pp: int, world_size: int, ep: int = 1) -> argparse.Namespace:
    """The args Megatron-LM's pretrain_gpt.py keeps in a checkpoint for this model, as its parser names
    them (enums included: the reader must take them without importing Megatron)."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    arch = ARCHITECTURES[architecture]
    return argparse.Namespace(
        num_layers=_layers(arch), hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        kv_channels=HIDDEN // HEADS, seq_length=SEQ, max_position_embeddings=SEQ, rotary_base=10000,
        rotary_percent=1.0, norm_epsilon=1e-5, add_qkv_bias=False,
        apply_layernorm_1p=False,
        padded_vocab_size=VOCAB, vocab_size=None, make_vocab_size_divisible_by=16, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.02, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=tp,
        data_parallel_size=world_size // (tp * pp), global_batch_size=8,
        micro_batch_size=1, consumed_train_samples=CONSUMED, lr_warmup_init=0.0, transformer_impl="local",
        attention_backend=AttnBackend.auto, model_type=ModelType.encoder_or_decoder,
        params_dtype=torch.float32, **{"qk_layernorm": False, **arch})


def megatron_model(architecture: str, tp: int, pp: int, seed: int, vocab: int = VOCAB, vp: int = 1,
           ep: int = 1) -> list:
    """This rank's model chunks (one per virtual stage) of megatron-core's GPTModel at tp x pp (x vp), its
    experts (if any) at ``ep``."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    arch = ARCHITECTURES[architecture]
    hybrid = "hybrid_override_pattern" in arch
    if hybrid:
        install_mamba_stand_ins()
    _cuda_on_cpu()
    virtual_size = vp if vp > 1 else None
    parallel_state.destroy_model_parallel()  # (a world builds one model after another)
    parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=virtual_size,
                                             expert_model_parallel_size=ep)
    initialize_rng_tracker(inference_rng_tracker=True)
    latent = {key: arch[key] for key in LATENT if key in arch and key not in ("group_query_attention",
                                                                           "num_query_groups")}
    mamba = {key: arch[key] for key in (*MAMBA_FIELDS, *GDN_FIELDS, "is_hybrid_model") if key in arch}
    if hybrid:  # (its GatedDeltaNet runs its own PyTorch delta rule)
        mamba["deterministic_mode"] = True
    config = (MLATransformerConfig if latent else TransformerConfig)(
        num_layers=_layers(arch), hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        num_query_groups=arch["num_query_groups"], normalization=arch["normalization"],
        gated_linear_unit=arch["swiglu"], activation_func=F.silu if arch["swiglu"] else F.gelu,
        add_bias_linear=arch["add_bias_linear"], hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, pipeline_dtype=torch.float32, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=virtual_size,
        expert_model_parallel_size=ep, attention_output_gate=arch.get("attention_output_gate", False),
        mtp_num_layers=arch.get("mtp_num_layers"), **_moe_config(arch), **latent, **mamba)
    torch.manual_seed(seed + 10 * parallel_state.get_pipeline_model_parallel_rank()
                      + parallel_state.get_tensor_model_parallel_rank())
    chunks = []
    for stage in range(vp):
        virtual = {"vp_stage": stage} if vp > 1 else {}
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, **virtual)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, **virtual)
        if hybrid:  # (0.16.1's hybrid stack has no virtual stages)
            chunks.append(_perturbed(hybrid_chunk(config, arch, vocab, SEQ, first, last), seed))
            continue
        spec = get_gpt_layer_local_spec(num_experts=arch.get("num_experts"), moe_grouped_gemm=False,
                                        normalization=arch["normalization"],
                                        multi_latent_attention=bool(latent),
                                        qk_layernorm=arch.get("qk_layernorm", False))
        if latent:  # (its local DotProductAttention takes no separate key and value widths)
            spec.submodules.self_attention.submodules.core_attention = _CausalAttention
        depths = {}
        if config.mtp_num_layers:  # (None where this stage builds no depth)
            depths["mtp_block_spec"] = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False,
                                                              vp_stage=stage)
        chunk = GPTModel(config, spec, **depths,
                         vocab_size=vocab, max_sequence_length=SEQ,
                         pre_process=first, post_process=last,
                         position_embedding_type=arch["position_embedding_type"],
                         share_embeddings_and_output_weights=not arch["untie_embeddings_and_output_weights"],
                         **virtual)
        chunks.append(_perturbed(chunk, seed))
    return chunks


def _perturbed(chunk, seed: int):
    """``chunk`` with its norms and biases (and a Mamba mixer's per-head vectors) away from their
    initial values, so a misplaced one shows: the same draw on every tp rank for what is replicated over
    tp (a norm's weight), each rank's own for a tp slice (a Mamba mixer's D, which starts at ones)."""
    from megatron.core import parallel_state

    stage = seed + 10 * parallel_state.get_pipeline_model_parallel_rank()
    replicated = torch.Generator().manual_seed(stage)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    split = torch.Generator().manual_seed(stage + 1000 * (1 + tp_rank))
    with torch.no_grad():
        for name, param in chunk.named_parameters():
            if param.ndim == 1:
                draw = split if getattr(param, "tensor_model_parallel", False) else replicated
                param.add_(0.1 * torch.randn(param.shape, generator=draw))
    return chunk


class _CausalAttention(torch.nn.Module):
    """Causal softmax attention with the scale latent attention gives it: the core attention of the
    oracle's latent-attention layers, whose projections, rotary and norms are megatron-core's. Takes
    megatron-core's [sequence, batch, heads, channels] and returns [sequence, batch, heads x channels]."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **kwargs):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, **kwargs):
        q, k, v = (tensor.permute(1, 2, 0, 3) for tensor in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def _moe_config(arch: dict) -> dict:
    """TransformerConfig's fields of an architecture's experts (Megatron-LM's --num-experts is its
    num_moe_experts)."""
    if "num_experts" not in arch:
        return {}
    fields = {key: value for key, value in arch.items() if key.startswith("moe_")}
    return {"num_moe_experts": arch["num_experts"], **fields}


def _cuda_on_cpu() -> None:
    """megatron-core's CUDA calls, answered on the CPU in this (oracle) process: the current device, a
    synchronize, ``.cuda()``, tensors made with ``device="cuda"`` (its optimizer's scalars and norms), and
    ``Tensor.type()``, whose CUDA names its optimizer checks a parameter against; and its router's
    Transformer Engine GEMM, left undefined where TE is not installed, and latent attention's test for
    TE, true where TE's modules are not there."""
    if getattr(torch, "_oracle_on_cpu", False):
        return
    torch._oracle_on_cpu = True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)  # (unbound without TE)
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):  # (TE taken for present: its linear is not)
        multi_latent_attention.HAVE_TE = False

    def on_cpu(make):
        def made(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return make(*args, **kwargs)
        return made

    for name in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    type_of = torch.Tensor.type
    torch.Tensor.type = lambda self, *args, **kwargs: (type_of(self, *args, **kwargs) if args or kwargs else
                                                       type_of(self).replace("torch.", "torch.cuda.", 1))


def save_megatron(rank: int, world_size: int, models: list[tuple[str, tuple[int, int, int, int], str]]
                  ) -> None:
    """In one world, each of ``models`` (architecture, its layout (tp, pp, vp, ep), directory) saved by
    ``_save``."""
    for architecture, (tp, pp, vp, ep), out in models:
        _save(rank, world_size, architecture, tp, pp, out, vp, ep)


def _save(rank: int, world_size: int, architecture: str, tp: int, pp: int, out: str, vp: int,
          ep: int) -> None:
    """megatron-core's model (``vp`` chunks per rank, experts at ``ep``) saved under ``out/torch``
    (Megatron-LM's legacy files: "model", or "model0", "model1".. per virtual stage; one per expert rank
    too, ``mp_rank_TT[_PPP]_EEE``, each written by expert data-parallel rank 0) and ``out/torch_dist``
    (``dist_checkpointing.save``), each with Megatron-LM's tracker."""
    from megatron.core import dist_checkpointing, parallel_state

    chunks = megatron_model(architecture, tp, pp, seed=1234, vp=vp, ep=ep)
    args = megatron_args(architecture, tp, pp, world_size, ep)
    args.virtual_pipeline_model_parallel_size = vp if vp > 1 else None
    names = ["model"] if vp == 1 else [f"model{stage}" for stage in range(vp)]
    common = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
              "opt_param_scheduler": SCHEDULER, "num_floating_point_operations_so_far": 0}
    folder = f"iter_{ITERATION:07d}"
    distributed = os.path.join(out, "torch_dist", folder)
    os.makedirs(distributed, exist_ok=True)
    torch.distributed.barrier()
    models = {name: chunk.sharded_state_dict() for name, chunk in zip(names, chunks)}
    dist_checkpointing.save({**common, **models}, distributed)
    tp_rank, pp_rank = (parallel_state.get_tensor_model_parallel_rank(),
                        parallel_state.get_pipeline_model_parallel_rank())
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    if parallel_state.get_expert_data_parallel_rank() == 0:
        name = (f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
                + (f"_{ep_rank:03d}" if ep > 1 else ""))
        os.makedirs(os.path.join(out, "torch", folder, name), exist_ok=True)
        models = {key: chunk.state_dict_for_save_checkpoint() for key, chunk in zip(names, chunks)}
        torch.save({**common, **models}, os.path.join(out, "torch", folder, name, "model_optim_rng.pt"))
    stop_writer_manager()
    torch.distributed.barrier()
    if rank == 0:
        for kind in ("torch", "torch_dist"):
            with open(os.path.join(out, kind, "latest_checkpointed_iteration.txt"), "w") as handle:
                handle.write(str(ITERATION))
    torch.distributed.barrier()


def stop_writer_manager() -> None:
    """Shut the process megatron-core's checkpoint writer starts for its results queue (a spawned
    multiprocessing manager it never stops): left running, it outlives the rank and holds up the test
    session's exit."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        filesystem_async._results_queue._manager.shutdown()
        filesystem_async._results_queue = None


def megatron_logits(rank: int, world_size: int, models: list[tuple[str, str]],
                    tokens: list[list[int]]) -> list[list[torch.Tensor]]:
    """In a world of one, for each of ``models`` (architecture, torch_dist directory): megatron-core's
    model at tp1 x pp1 loaded from it by ``dist_checkpointing.load``, and its logits [1 + depths,
    sequence, vocabulary] of each of ``tokens`` (``_logits``)."""
    from megatron.core import dist_checkpointing

    out = []
    for architecture, distributed in models:
        model, = megatron_model(architecture, 1, 1, seed=0)
        folder = os.path.join(distributed, f"iter_{ITERATION:07d}")
        model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, folder)["model"])
        out.append(_logits(model, tokens))
    return out


def causal_mask(tokens: torch.Tensor) -> torch.Tensor:
    """The causal mask megatron-core takes for ``tokens`` [batch, sequence] (its default asks CUDA)."""
    return torch.triu(torch.ones(tokens.shape[1], tokens.shape[1]), diagonal=1).bool()[None, None]


def _logits(model, tokens: list[list[int]]) -> list[torch.Tensor]:
    """megatron-core's model's logits of each sequence, its causal mask given (its default asks CUDA):
    [1 + D, sequence, VOCAB], the language model's, then each of its D prediction depths' (which its
    forward turns into losses alone: their hidden states are taken from the depths' block as it returns
    them, and put through its output layer)."""
    model.eval()
    out = []
    with torch.no_grad():
        for sequence in tokens:
            ids, positions = torch.tensor([sequence]), torch.arange(len(sequence))[None]
            depths = getattr(model, "mtp", None)
            if depths is None:
                out.append(model(ids, positions, attention_mask=causal_mask(ids))[None, 0, :, :VOCAB])
                continue
            returned = []
            hook = depths.register_forward_hook(lambda module, inputs, output: returned.append(output))
            model(ids, positions, attention_mask=causal_mask(ids), labels=ids)
            hook.remove()
            weight = (model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
                      else None)
            states = returned[0].chunk(1 + model.config.mtp_num_layers, dim=0)
            out.append(torch.stack([model.output_layer(state, weight=weight)[0][:, 0, :VOCAB]
                                    for state in states]))
    return out


def megatron_loads(rank: int, world_size: int, models: list[tuple[str, str, str]],
                   tokens: list[list[int]]) -> list[dict]:
    """In a world of one, for each of ``models`` (architecture, legacy directory, torch_dist directory):
    megatron-core's model at tp1 x pp1 loaded as Megatron-LM loads: the legacy rank file into
    ``load_state_dict(strict=True)``, the torch_dist checkpoint through ``dist_checkpointing.load``, each
    built with the padded vocabulary its args name; each one's logits of ``tokens`` (the first ``VOCAB``
    columns)."""
    return [_loads(architecture, legacy, distributed, tokens) for architecture, legacy, distributed in models]


def _loads(architecture: str, legacy: str, distributed: str, tokens: list[list[int]]) -> dict:
    from megatron.core import dist_checkpointing

    def folder_of(directory: str) -> str:
        with open(os.path.join(directory, "latest_checkpointed_iteration.txt")) as handle:
            return os.path.join(directory, f"iter_{int(handle.read()):07d}")

    legacy_state = torch.load(os.path.join(folder_of(legacy), "mp_rank_00", "model_optim_rng.pt"),
                              weights_only=False)
    model, = megatron_model(architecture, 1, 1, seed=0, vocab=legacy_state["args"].padded_vocab_size)
    out = {}
    for kind, directory in (("torch", legacy), ("torch_dist", distributed)):
        folder = folder_of(directory)
        if kind == "torch":
            state = legacy_state
        else:
            state = dist_checkpointing.load({"model": model.sharded_state_dict()}, folder)
        model.load_state_dict(state["model"], strict=True)
        out[kind] = (_logits(model, tokens), state["iteration"], vars(state["args"]))
    return out
