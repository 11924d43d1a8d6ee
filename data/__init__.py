"""Data pipeline: sentencepiece tokenizer, megatron indexed-format preprocessing, GPT datasets
built by megatron-core, and the data-parallel sampler that feeds the trainer.

Modules are imported on demand (`from data.tokenizer import Tokenizer`); importing this package
loads nothing heavy (megatron-core is only imported by the modules that use it).
"""
