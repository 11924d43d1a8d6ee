"""Tokenizers, chosen by Megatron's ``--tokenizer-type``: the spec and the builder (``spec``), the
shared base (``base``), one module per kind, and ``python -m data.tokenizers`` (train a sentencepiece
model). Each kind imports only the base: no module here imports the builder back."""
