"""Tensor parallelism: layers split across the tensor-parallel group, and their loss."""
