"""Data pipeline: tokenizers (sentencepiece, GPT-2 BPE, Hugging Face, null), megatron indexed-format
preprocessing, GPT datasets built by megatron-core, and the data-parallel sampler that feeds the trainer.

Modules are imported on demand (`from data.tokenizers.spec import build_tokenizer`); importing this package
loads nothing heavy (megatron-core is only imported by the modules that use it).
"""
