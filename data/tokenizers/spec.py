"""The tokenizers a run can read its data with, chosen by Megatron's ``--tokenizer-type``.

    SentencePieceTokenizer   --tokenizer-model X.model          (the default; ``data.tokenizers.sentencepiece_tokenizer``)
    GPT2BPETokenizer         --vocab-file vocab.json --merge-file merges.txt   (``data.tokenizers.byte_level_bpe``)
    HuggingFaceTokenizer     --tokenizer-model DIR or tokenizer.json           (``data.tokenizers.byte_level_bpe``)
    NullTokenizer            --vocab-size V: text is space-separated ids; V is the end of document

Every tokenizer has ``vocab_size``, ``eod`` / ``eod_id``, ``pad``, ``encode(text)``, ``decode(ids)``
and ``unique_identifiers`` (which key megatron-core's dataset caches by the tokenizer's content).
``build_tokenizer(TokenizerSpec(...))`` raises ValueError naming the flag and the fix.

CLI: `python -m data.tokenizers.spec --input FILE... --vocab-size N --output-prefix P` trains a sentencepiece
model `P.model` on the documents of FILE... (text files, or .jsonl with a "text" field).
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")


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
                raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file vocab.json and --merge-file "
                                 "merges.txt")
        elif self.vocab_file is not None:
            raise ValueError(f"--vocab-file / --merge-file are GPT-2 BPE files: add --tokenizer-type "
                             f"GPT2BPETokenizer (not {kind})")
        if kind in ("SentencePieceTokenizer", "HuggingFaceTokenizer") and self.tokenizer_model is None:
            what = "a sentencepiece .model" if kind == "SentencePieceTokenizer" else "a tokenizer.json or its directory"
            raise ValueError(f"--tokenizer-type {kind} needs --tokenizer-model ({what})")
        if kind in ("GPT2BPETokenizer", "NullTokenizer") and self.tokenizer_model is not None:
            raise ValueError(f"--tokenizer-model is not used by --tokenizer-type {kind}: drop it")
        if kind == "NullTokenizer" and (self.vocab_size is None or self.vocab_size < 1):
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size V (ids 0..V-1; V ends a document)")


class SpecialIds:
    """The special ids of a tokenizer under both its names: ``eod_id`` / ``pad_id`` (-1: none), and
    ``eod`` / ``pad`` as megatron-core's datasets read them. Subclasses set the ids."""

    eod_id: int
    pad_id: int = -1

    @property
    def eod(self) -> int:
        return self.eod_id

    @property
    def pad(self) -> int:
        return self.pad_id


def write_hugging_face_files(directory: str, tokenizer, special: dict[str, str]) -> dict:
    """tokenizer.json (``tokenizer``, a ``tokenizers.Tokenizer``) and the tokenizer_config.json that makes
    ``AutoTokenizer`` load it with its ``special`` tokens (unk/bos/eos/pad_token -> text); return their ids
    as a Hugging Face config names them (bos/eos/pad_token_id)."""
    import json
    import os

    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as handle:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
                   "clean_up_tokenization_spaces": False, **special}, handle, indent=1)
    with open(os.path.join(directory, "special_tokens_map.json"), "w") as handle:
        json.dump(special, handle, indent=1)
    ids = {f"{name[:-len('_token')]}_token_id": tokenizer.token_to_id(token) for name, token in special.items()}
    ids.pop("unk_token_id", None)
    return ids


class NullTokenizer(SpecialIds):
    """Megatron's NullTokenizer: a text is space-separated token ids; ``vocab_size`` is V + 1 with id V
    the end of document. For data that is already ids (and mock data). Owns nothing but V."""

    def __init__(self, vocab_size: int):
        self.eod_id = int(vocab_size)
        self.vocab_size = self.eod_id + 1
        self.unique_identifiers = OrderedDict([("class", "NullTokenizer"), ("vocab_size", self.vocab_size)])

    def encode(self, text: str) -> list[int]:
        return [int(token) for token in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def save_for_hugging_face(self, directory: str) -> dict:
        """A NullTokenizer has no Hugging Face form (its texts are ids): only the end-of-document id."""
        return {"eos_token_id": self.eod_id}


def build_tokenizer(spec: TokenizerSpec):
    """The tokenizer ``spec`` names, loaded (ValueError naming the flag when it cannot be)."""
    spec.check()
    if spec.tokenizer_type == "SentencePieceTokenizer":
        from data.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer

        return SentencePieceTokenizer(spec.tokenizer_model)
    if spec.tokenizer_type == "NullTokenizer":
        return NullTokenizer(spec.vocab_size)
    from data.tokenizers.byte_level_bpe import GPT2BPETokenizer, HuggingFaceTokenizer

    if spec.tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(spec.vocab_file, spec.merge_file)
    return HuggingFaceTokenizer(spec.tokenizer_model)


def add_tokenizer_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron's tokenizer flags, for tools that take them (``data.preprocess``)."""
    parser.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="SentencePieceTokenizer")
    parser.add_argument("--tokenizer-model", help="sentencepiece .model, or a Hugging Face tokenizer.json / directory")
    parser.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    parser.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    parser.add_argument("--vocab-size", type=int, help="NullTokenizer: ids below it; it ends a document")


def spec_from_arguments(args: argparse.Namespace) -> TokenizerSpec:
    return TokenizerSpec(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file, args.vocab_size)


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: train a sentencepiece tokenizer and print the model path and vocabulary size."""
    from data.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer, train_tokenizer

    parser = argparse.ArgumentParser(prog="python -m data.tokenizers.spec",
                                     description="Train a sentencepiece BPE tokenizer on documents.")
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="text files (one document each) or .jsonl files (one per line)")
    parser.add_argument("--vocab-size", type=int, required=True, help="number of pieces")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>.model")
    args = parser.parse_args(argv)
    try:
        path = train_tokenizer(args.input, args.vocab_size, args.output_prefix)
    except ValueError as error:
        parser.error(str(error))
    print(f"wrote {path} (vocab size {SentencePieceTokenizer(path).vocab_size})")


if __name__ == "__main__":
    main()
