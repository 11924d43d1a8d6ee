"""Multi-head latent attention (DeepSeek-V2/V3, Megatron's --multi-latent-attention): flags and module."""
