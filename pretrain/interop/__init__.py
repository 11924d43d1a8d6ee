"""Other formats: Hugging Face models in and out (the name mapping per architecture, streamed import and
export) and ``python -m pretrain.convert`` (a checkpoint to one file, to Hugging Face, or from it)."""
