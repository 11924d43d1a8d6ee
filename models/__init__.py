"""The GPT built from parallel layers: its configuration (one field per Megatron flag), attention, MLP,
norms and rotary embeddings, the chunks of one pipeline stage, parameter and FLOP counts, generation."""
