"""Multi-token prediction (DeepSeek-V3's; megatron-core's ``MultiTokenPredictionBlock``): its flags and
its depths."""
