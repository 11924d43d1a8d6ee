"""What the linear-time mixers (Mamba-2, gated delta nets, Kimi delta attention) share: the short causal
convolution, document runs, the recompute-in-backward wrapper, megatron-core's initial values, the
group-major row orders of their fused weights, weights held under Megatron's names, and whether a kernel
library is installed. Each mixer's own room (``models.mamba``, ``models.gdn``, ``models.kda``) holds its
layer and kernels (Kimi delta attention's rule is ``models.gdn``'s)."""
