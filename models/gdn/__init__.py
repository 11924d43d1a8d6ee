"""The gated delta net layer (``G`` in ``--hybrid-layer-pattern``): megatron-core's ``GatedDeltaNet``, its
flags, the delta rule's PyTorch forms and the kernel it calls on a GPU."""
