"""The pieces of ``launch/finetune_job.sh``: a small task, a small model to fine-tune on it, and the check.

    python -m launch.examples.finetune_demo make DIR [--family llama3.1]
                                                # DIR/train.jsonl, DIR/heldout.jsonl and DIR/hf: a random
                                                # model of the family (launch.examples.hf_families) with
                                                # its tokenizer, saved by transformers
    python -m launch.examples.finetune_demo answer HF_DIR HELDOUT.jsonl   # transformers generates the answers

The task: reverse three letters ("cab=" -> "bac"), 400 training prompts; the held-out prompts are
words the training set never shows, so answering them means the mapping was learned. The tokenizer
is one token per character (Hugging Face ``tokenizers``), the model is made from its family's config
class with ``transformers`` (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import json
import os
import random

from launch.examples.hf_families import ALL_FAMILIES
from parallel.tensor.fp8 import preload_torchao

LETTERS = "abcdefgh"


def _examples(count: int, rng: random.Random) -> list[dict]:
    words = ["".join(rng.choice(LETTERS) for _ in range(3)) for _ in range(count)]
    return [{"prompt": f"{word}=", "response": word[::-1]} for word in words]


def make(directory: str, family: str = "llama3.1", seed: int = 0, hidden_size: int = 64) -> None:
    preload_torchao()  # transformers imports it
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from launch.examples.hf_families import make_model

    rng = random.Random(seed)
    train = _examples(400, rng)
    seen = {example["prompt"] for example in train}
    heldout = [example for example in _examples(200, rng) if example["prompt"] not in seen][:20]
    os.makedirs(directory, exist_ok=True)
    for name, examples in (("train", train), ("heldout", heldout)):
        with open(os.path.join(directory, f"{name}.jsonl"), "w") as handle:
            handle.writelines(json.dumps(example) + "\n" for example in examples)
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: index for index, token in enumerate(specials + sorted(set(LETTERS + "=")))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(specials)
    hf = os.path.join(directory, "hf")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                         eos_token="</s>").save_pretrained(hf)
    model = make_model(family, len(vocab), hidden_size, window=8, bos=vocab["<s>"], eos=vocab["</s>"],
                       seed=seed)
    model.save_pretrained(hf)
    print(f"wrote {directory}: {len(train)} training and {len(heldout)} held-out prompts, a {family} "
          f"({type(model).__name__}) of {sum(p.numel() for p in model.parameters()):,} parameters in {hf}")


def answer(hf_dir: str, heldout: str) -> float:
    """transformers' greedy answers to the held-out prompts; the fraction right (printed with each)."""
    preload_torchao()  # transformers imports it
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    generate = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    right = 0
    examples = [json.loads(line) for line in open(heldout)]
    for example in examples:
        text = generate(example["prompt"], max_new_tokens=4, do_sample=False, return_full_text=False)[0]
        got = text["generated_text"].strip()
        right += got == example["response"]
        print(f"  {example['prompt']} -> {got!r} (expected {example['response']!r})")
    print(f"held-out prompts answered right: {right} of {len(examples)}")
    return right / len(examples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.examples.finetune_demo",
                                     description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    made = commands.add_parser("make")
    made.add_argument("directory")
    made.add_argument("--family", default="llama3.1", choices=ALL_FAMILIES,
                      help="the Hugging Face family of the model (launch.examples.hf_families)")
    answered = commands.add_parser("answer")
    answered.add_argument("hf_dir")
    answered.add_argument("heldout")
    args = parser.parse_args(argv)
    if args.command == "make":
        make(args.directory, args.family)
    else:
        answer(args.hf_dir, args.heldout)


if __name__ == "__main__":
    main()
