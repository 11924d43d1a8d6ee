"""A deterministic synthetic corpus of Python-like documents for the data tests."""

import json
import random

VOCAB_SIZE = 400
WORDS = ["alpha", "beta", "gamma", "delta", "rank", "shard", "token", "layer", "grad", "batch"]


def make_documents(count: int, seed: int = 0) -> list:
    """Small Python modules with tabs, indentation, trailing spaces, blank lines and unicode."""
    rng = random.Random(seed)
    return [_make_document(rng, index) for index in range(count)]


def _make_document(rng: random.Random, index: int) -> str:
    lines = [f"# document {index}: café → λ 😀", "import os", "", ""]
    for _ in range(rng.randint(3, 8)):
        name = f"{rng.choice(WORDS)}_{rng.choice(WORDS)}"
        lines += [
            f"def {name}(x, y={rng.randint(0, 999)}):",
            f'    """{rng.choice(WORDS)} {rng.choice(WORDS)}."""',
            f"\tif x > {rng.randint(0, 99)}:  ",
            f"        return x * {rng.random():.3f}",
            "    return   y",
            "",
        ]
    return "\n".join(lines) + "\n"


def write_jsonl(path, texts) -> str:
    """Write one {"text": ...} object per line; return the path as a string."""
    with open(path, "w", encoding="utf-8") as stream:
        for text in texts:
            stream.write(json.dumps({"text": text}) + "\n")
    return str(path)
