"""``python -m launch.tools.scaling.prose_corpus DIR``: a corpus this project never tuned on, for scaling
studies that must not flatter its defaults: English prose from this machine, the help topics of Python's
documentation (``pydoc_data.topics``) and the descriptions of every installed package (their
``METADATA`` bodies), a sentencepiece tokenizer trained on it (vocabulary 1024) and megatron-core's
indexed files. Writes ``DIR/prose.model`` and ``DIR/prose_text_document.{bin,idx}``; no download."""

from __future__ import annotations

import argparse
import glob
import json
import os
import site

from data.preprocess import main as preprocess
from data.tokenizers.sentencepiece_tokenizer import train_tokenizer


def documents() -> list[str]:
    """The help topics, then each installed distribution's description longer than 500 characters."""
    import pydoc_data.topics

    found = [text for _, text in sorted(pydoc_data.topics.topics.items()) if text.strip()]
    metadata = (path for root in site.getsitepackages() for path in glob.glob(f"{root}/*.dist-info/METADATA"))
    for path in sorted(metadata):
        with open(path, errors="replace") as handle:
            body = handle.read().split("\n\n", 1)[-1]  # after the header block
        if len(body) > 500:
            found.append(body)
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.tools.scaling.prose_corpus", description=__doc__)
    parser.add_argument("output", help="directory for the corpus and its tokenizer")
    args = parser.parse_args(argv)
    os.makedirs(args.output, exist_ok=True)
    source = os.path.join(args.output, "prose.jsonl")
    with open(source, "w") as handle:
        handle.writelines(json.dumps({"text": text}) + "\n" for text in documents())
    model = train_tokenizer([source], 1024, os.path.join(args.output, "prose"))
    preprocess(["--input", source, "--output-prefix", os.path.join(args.output, "prose"), "--tokenizer-type",
                "SentencePieceTokenizer", "--tokenizer-model", model, "--append-eod", "--workers", "1"])


if __name__ == "__main__":
    main()
