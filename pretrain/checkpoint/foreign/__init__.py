"""Other frameworks' checkpoints read as ours, and ours written as theirs: Megatron-LM's legacy rank files
and megatron-core's torch_dist (``megatron_checkpoint`` recognises and describes one, ``megatron_pieces``
reads its weights for the re-cut, ``megatron_export`` writes ours back), PyTorch Distributed Checkpoint
folders (``dcp_folder``), and every pickle in them read without running anything (``safe_pickle``)."""
