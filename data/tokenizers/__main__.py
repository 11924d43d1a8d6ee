"""``python -m data.tokenizers --input FILE... --vocab-size N --output-prefix P``: train a sentencepiece
BPE model ``P.model`` on the documents of FILE... (text files, or .jsonl with a "text" field)."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: train a sentencepiece tokenizer and print the model path and vocabulary size."""
    from data.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer, train_tokenizer

    parser = argparse.ArgumentParser(prog="python -m data.tokenizers",
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
