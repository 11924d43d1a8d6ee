"""Hybrid models: Megatron-LM's --hybrid-layer-pattern, its grammar and flags."""
