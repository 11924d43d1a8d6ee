"""The Mamba-2 layer (megatron-core's MambaMixer): flags, initial values, convolution, scan, mixer."""
