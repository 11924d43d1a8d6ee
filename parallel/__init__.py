"""Parallelism: topology and process groups, counted collectives, tensor/pipeline layers, ZeRO."""
