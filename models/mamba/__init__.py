"""The Mamba-2 layer (megatron-core's MambaMixer): flags, its fused rows' orders, scan, kernels, mixer
(what it shares with the delta nets is ``models.linear_mixing``)."""
