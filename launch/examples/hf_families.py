"""Tiny random models of every Hugging Face family the interop maps, made by transformers from each family's
own config class (nothing is downloaded), each with the features that set the family apart switched on:
rope scaling that changes the frequencies, sliding windows shorter than a test prompt, grouped queries,
an explicit head_dim, biases, query/key norms, soft-capping, fused projections.

    make_model(family, vocab_size, hidden_size=32, window=4, bos=None, eos=None) -> a transformers model

``FAMILIES`` lists the dense ones, ``MOE_FAMILIES`` the mixtures of experts, ``HYBRID_FAMILIES`` the
hybrids (Mamba-2, gated delta nets); ``launch/finetune_job.sh --family NAME`` and the interop tests use them.
"""

from __future__ import annotations

from parallel.tensor.fp8 import preload_torchao

FAMILIES = ("llama3.1", "llama3.2", "mistral", "mistral-nemo", "qwen2.5", "qwen3", "gemma2", "gemma3",
            "phi3", "olmo2", "gpt2")
# top-2 of 4 experts each
MOE_FAMILIES = ("mixtral", "qwen2-moe", "qwen3-moe", "olmoe", "deepseek-v3", "gpt-oss")
# hybrids: Nemotron-H (M * - E, sigmoid-routed experts), Mamba2, Granite 4.0-H (with experts and without),
# Qwen3-Next (gated delta nets, gated attention, experts with a gated shared one), Kimi Linear (Kimi delta
# attention, latent attention without positions, sigmoid-routed experts), OLMo hybrid (gated delta nets
# with beta up to 2, post-norm attention without positions)
HYBRID_FAMILIES = ("nemotron-h", "mamba2", "granite-4.0-h", "granite-4.0-h-dense", "qwen3-next",
                   "kimi-linear", "olmo-hybrid")
ALL_FAMILIES = FAMILIES + MOE_FAMILIES + HYBRID_FAMILIES


def _config(family: str, vocab: int, hidden: int, window: int, special: dict):
    preload_torchao()  # transformers imports it
    import transformers

    heads, layers, positions = 4, 2, 64
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden // 2,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                  max_position_embeddings=positions, pad_token_id=0, **special)
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    if family == "llama3.1":
        return transformers.LlamaConfig(**common, rope_parameters=llama3, tie_word_embeddings=False)
    if family == "llama3.2":  # the small Llama 3.2: tied embeddings with llama3 rope
        return transformers.LlamaConfig(**common, rope_parameters={**llama3, "factor": 32.0},
                                        tie_word_embeddings=True)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=window, tie_word_embeddings=False)
    if family == "mistral-nemo":  # head_dim independent of hidden / heads
        return transformers.MistralConfig(**common, head_dim=2 * hidden // heads, sliding_window=None,
                                          rope_theta=1_000_000.0, tie_word_embeddings=False)
    if family == "qwen2.5":  # q/k/v biases; the second layer windowed
        return transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=window,
                                        max_window_layers=1, tie_word_embeddings=True)
    if family == "qwen3":  # per-head q/k norms, head_dim of its own, yarn
        yarn = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 4.0,
                "original_max_position_embeddings": 16}
        return transformers.Qwen3Config(**common, head_dim=2 * hidden // heads, tie_word_embeddings=False,
                                        rope_parameters=yarn)
    gemma = dict(head_dim=2 * hidden // heads, query_pre_attn_scalar=24, sliding_window=window,
                 hidden_activation="gelu_pytorch_tanh")
    if family == "gemma2":  # sliding and global layers alternating, both soft-caps
        return transformers.Gemma2Config(**common, **gemma, attn_logit_softcapping=5.0,
                                         final_logit_softcapping=4.0)
    if family == "gemma3":  # q/k norms, a local rope base, linear scaling on the global layers
        return transformers.Gemma3TextConfig(
            **common, **gemma, layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    if family == "phi3":  # fused qkv and gate_up, longrope, partial rotary (Phi-4-mini's 0.75 kind)
        pairs = int(hidden // heads * 0.5) // 2
        return transformers.Phi3Config(
            **common, original_max_position_embeddings=16, sliding_window=window + 2,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "short_factor": [1.0 + i / 4 for i in range(pairs)],
                             "long_factor": [2.0 + i for i in range(pairs)]})
    if family == "olmo2":  # norms after attention and the MLP, q/k norms over the whole projection
        return transformers.Olmo2Config(**common, tie_word_embeddings=False)
    moe = dict(num_experts_per_tok=2, tie_word_embeddings=False)
    if family == "mixtral":  # every layer MoE, renormalised top-k
        return transformers.MixtralConfig(**common, num_local_experts=4, sliding_window=None, **moe)
    if family == "qwen2-moe":  # the first layer dense, a gated shared expert, q/k/v biases, raw top-k
        return transformers.Qwen2MoeConfig(**common, num_experts=4, moe_intermediate_size=hidden // 2,
                                           shared_expert_intermediate_size=hidden, mlp_only_layers=[0], **moe)
    if family == "qwen3-moe":  # per-head q/k norms, renormalised top-k
        return transformers.Qwen3MoeConfig(**common, num_experts=4, moe_intermediate_size=hidden // 2,
                                           norm_topk_prob=True, head_dim=2 * hidden // heads, **moe)
    if family == "olmoe":  # q/k norms over the projection, top-k not renormalised
        return transformers.OlmoeConfig(**common, num_experts=4, **moe)
    if family == "deepseek-v3":  # latent attention under yarn, sigmoid group-limited routing, a shared expert
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                "mscale_all_dim": 0.707, "original_max_position_embeddings": 16, "beta_fast": 32.0,
                "beta_slow": 1.0}
        return transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": heads}, n_routed_experts=4, moe_intermediate_size=hidden // 2,
            n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
            q_lora_rank=hidden // 2, kv_lora_rank=hidden // 4, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=12, rope_parameters=yarn, **moe)
    if family == "gpt-oss":  # sinks, sliding and full layers alternating, clamped SwiGLU, biases everywhere
        yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}
        return transformers.GptOssConfig(**common, num_local_experts=4, sliding_window=window,
                                         layer_types=["sliding_attention", "full_attention"],
                                         head_dim=2 * hidden // heads, rope_parameters=yarn, swiglu_limit=1.5,
                                         **moe)
    mamba = dict(layer_norm_epsilon=1e-5, tie_word_embeddings=False)
    if family == "nemotron-h":  # no positions, relu2 MLPs and experts, group-limited sigmoid routing
        return transformers.NemotronHConfig(
            **{**common, "num_hidden_layers": 5}, hybrid_override_pattern="M*M-E", head_dim=hidden // heads,
            mamba_num_heads=4, mamba_head_dim=hidden // 2, ssm_state_size=8, n_groups=2, chunk_size=4,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2,
            moe_shared_expert_intermediate_size=hidden, n_group=2, topk_group=1, routed_scaling_factor=2.5,
            mlp_hidden_act="relu2", **mamba)
    if family == "mamba2":
        return transformers.Mamba2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=3,
                                         num_heads=4, head_dim=hidden // 2, expand=2, state_size=8,
                                         n_groups=2, chunk_size=4, pad_token_id=0, **mamba, **special)
    if family.startswith("granite-4.0-h"):  # a mixer then a feed-forward part per layer; rotary; the MoE's
        experts = 0 if family.endswith("dense") else 4  # shared MLP
        return transformers.GraniteMoeHybridConfig(
            **{**common, "num_hidden_layers": 3, "intermediate_size": hidden // 2},
            layer_types=["mamba", "attention", "mamba"], shared_intermediate_size=hidden,
            num_local_experts=experts, num_experts_per_tok=2, mamba_n_heads=4, mamba_d_head=hidden // 2,
            mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=4, rms_norm_eps=1e-5,
            attention_multiplier=(hidden // heads) ** -0.5,
            embedding_multiplier=1.5, position_embedding_type="rope",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=experts == 0)
    if family == "qwen3-next":  # G E * - G E: the middle layer's MLP dense; partial rotary; grouped heads
        return transformers.Qwen3NextConfig(
            **{**common, "num_hidden_layers": 3}, head_dim=hidden // heads,
            layer_types=["linear_attention", "full_attention", "linear_attention"], mlp_only_layers=[1],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=hidden // 4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=hidden // 2, shared_expert_intermediate_size=hidden,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            tie_word_embeddings=False)
    if family == "kimi-linear":  # K - + E K E: the first layer's MLP dense; grouped sigmoid routing; its
        # norms' epsilon 1e-5 (Kimi-Linear-48B's) beside the latent norms' 1e-6
        return transformers.KimiLinearConfig(
            **{**common, "num_hidden_layers": 3, "num_key_value_heads": heads}, rms_norm_eps=1e-5,
            q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
            num_experts=4, num_experts_per_token=2, moe_intermediate_size=hidden // 2, num_shared_experts=1,
            num_expert_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
            linear_attn_config={"num_heads": 4, "head_dim": 8, "short_conv_kernel_size": 4,
                                "kda_layers": [1, 3], "full_attn_layers": [2]}, tie_word_embeddings=False)
    if family == "olmo-hybrid":  # G - * - G -: NoPE as released; beta up to 2; grouped heads
        return transformers.OlmoHybridConfig(
            **{**common, "num_hidden_layers": 3}, rms_norm_eps=1e-6, rope_parameters=None,
            layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=hidden // 4,
            linear_allow_neg_eigval=True, tie_word_embeddings=False)
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=hidden, n_layer=layers,
                                       n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       **special)
    raise ValueError(f"--family {family}: choose from {', '.join(ALL_FAMILIES)}")


def make_model(family: str, vocab_size: int, hidden_size: int = 32, window: int = 4, bos: int | None = None,
               eos: int | None = None, seed: int = 0, **overrides):
    """A random ``family`` model from transformers' own classes (AutoModelForCausalLM.from_config);
    ``overrides``: config attributes set over the family's."""
    import torch
    preload_torchao()  # transformers imports it
    import transformers

    special = {key: value for key, value in (("bos_token_id", bos), ("eos_token_id", eos))
               if value is not None}
    torch.manual_seed(seed)
    config = _config(family, vocab_size, hidden_size, window, special)
    for name, value in overrides.items():
        setattr(config, name, value)
    return transformers.AutoModelForCausalLM.from_config(config)
