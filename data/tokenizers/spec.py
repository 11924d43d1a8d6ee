"""The tokenizers a run can read its data with, chosen by Megatron's ``--tokenizer-type``.

    SentencePieceTokenizer   --tokenizer-model X.model
                             (the default; ``data.tokenizers.sentencepiece_tokenizer``)
    Llama2Tokenizer          --tokenizer-model X.model: the same, each text started with BOS
    GPT2BPETokenizer         --vocab-file vocab.json --merge-file merges.txt
                             (``data.tokenizers.byte_level_bpe``)
    HuggingFaceTokenizer     --tokenizer-model DIR or tokenizer.json
                             (``data.tokenizers.byte_level_bpe``)
    NullTokenizer            --vocab-size V: text is space-separated ids
                             (``data.tokenizers.null``)

Every tokenizer has ``vocab_size``, ``eod`` / ``eod_id``, ``pad``, ``encode(text)``, ``decode(ids)``
and ``unique_identifiers`` (which key megatron-core's dataset caches by the tokenizer's content).
``build_tokenizer(TokenizerSpec(...))`` raises ValueError naming the flag and the fix.

``python -m data.tokenizers`` trains a sentencepiece model (``data/tokenizers/__main__.py``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

TOKENIZER_TYPES = ("SentencePieceTokenizer", "Llama2Tokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer",
                   "NullTokenizer")


@dataclass(frozen=True)
class TokenizerSpec:
    """Which tokenizer and its files: the flags, picklable (preprocessing workers rebuild it)."""

    tokenizer_type: str = "SentencePieceTokenizer"
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None

    def check(self) -> None:
        """Raise ValueError naming the flags when this type lacks its files or gets another type's."""
        kind = self.tokenizer_type
        if kind not in TOKENIZER_TYPES:
            raise ValueError(f"--tokenizer-type {kind} is not one of {', '.join(TOKENIZER_TYPES)}")
        if (self.vocab_file is None) != (self.merge_file is None):
            given, missing = ("--vocab-file", "--merge-file") if self.merge_file is None else \
                ("--merge-file", "--vocab-file")
            raise ValueError(f"{given} without {missing}: GPT-2 BPE needs both vocab.json and merges.txt "
                             f"(--tokenizer-type GPT2BPETokenizer --vocab-file ... --merge-file ...)")
        if kind == "GPT2BPETokenizer":
            if self.vocab_file is None:
                raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file vocab.json and "
                                 "--merge-file "
                                 "merges.txt")
        elif self.vocab_file is not None:
            raise ValueError(f"--vocab-file / --merge-file are GPT-2 BPE files: add --tokenizer-type "
                             f"GPT2BPETokenizer (not {kind})")
        if kind in ("SentencePieceTokenizer", "Llama2Tokenizer", "HuggingFaceTokenizer") \
                and self.tokenizer_model is None:
            what = ("a sentencepiece .model" if kind != "HuggingFaceTokenizer"
                    else "a tokenizer.json or its directory")
            raise ValueError(f"--tokenizer-type {kind} needs --tokenizer-model ({what})")
        if kind in ("GPT2BPETokenizer", "NullTokenizer") and self.tokenizer_model is not None:
            raise ValueError(f"--tokenizer-model is not used by --tokenizer-type {kind}: drop it")
        if kind == "NullTokenizer" and (self.vocab_size is None or self.vocab_size < 1):
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size V (ids 0..V-1; V ends a "
                             "document)")


def build_tokenizer(spec: TokenizerSpec):
    """The tokenizer ``spec`` names, loaded (ValueError naming the flag when it cannot be)."""
    spec.check()
    if spec.tokenizer_type in ("SentencePieceTokenizer", "Llama2Tokenizer"):
        from data.tokenizers.sentencepiece_tokenizer import Llama2Tokenizer, SentencePieceTokenizer

        kind = Llama2Tokenizer if spec.tokenizer_type == "Llama2Tokenizer" else SentencePieceTokenizer
        return kind(spec.tokenizer_model)
    if spec.tokenizer_type == "NullTokenizer":
        from data.tokenizers.null import NullTokenizer

        return NullTokenizer(spec.vocab_size)
    from data.tokenizers.byte_level_bpe import GPT2BPETokenizer, HuggingFaceTokenizer

    if spec.tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(spec.vocab_file, spec.merge_file)
    return HuggingFaceTokenizer(spec.tokenizer_model)


def add_tokenizer_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron's tokenizer flags, for tools that take them (``data.preprocess``)."""
    parser.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="SentencePieceTokenizer")
    parser.add_argument("--tokenizer-model",
                        help="sentencepiece .model, or a Hugging Face tokenizer.json / directory")
    parser.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    parser.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    parser.add_argument("--vocab-size", type=int, help="NullTokenizer: ids below it; it ends a document")


def spec_from_arguments(args: argparse.Namespace) -> TokenizerSpec:
    return TokenizerSpec(args.tokenizer_type, args.tokenizer_model, args.vocab_file,
                         args.merge_file, args.vocab_size)
