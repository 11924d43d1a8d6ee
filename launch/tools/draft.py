"""Greedy speculative decoding with a checkpoint's multi-token prediction depths (DeepSeek-V3's use of
them at inference, ``models.mtp.speculative``):

    python -m launch.tools.draft --load CHECKPOINT_OR_HF_DIR --prompt "def " --tokens 64

prints the continuation (greedy decoding's, token for token: each round the depths draft the tokens after
the main model's next one and a second pass of the main model keeps those its own choices agree with) and
how many drafts were accepted of those proposed. With ``--check`` plain greedy decoding runs too and the two
texts are compared. A checkpoint of any layout or a Hugging Face directory (``pretrain.load_model``); one
without depths, or without a tokenizer, is refused in one line.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.tools.draft", description=__doc__.splitlines()[0])
    parser.add_argument("--load", required=True, help="a checkpoint (any layout) or a Hugging Face directory")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens (default 64)")
    parser.add_argument("--check", action="store_true",
                        help="also decode greedily without drafts and compare")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error(f"--tokens must be >= 1, got {args.tokens}")

    from models.generate import generate, single_stage_logits
    from models.mtp.speculative import speculative_greedy
    from pretrain import load_model
    from pretrain.checkpoint.errors import CheckpointError

    try:
        loaded = load_model(args.load)
    except (CheckpointError, ValueError) as error:
        print(f"error: --load {args.load}: {error}", file=sys.stderr)
        return 2
    if not loaded.config.mtp_depths:
        print(f"error: --load {args.load}: the model has no multi-token prediction depths "
              "(--mtp-num-layers) to draft with", file=sys.stderr)
        return 2
    if loaded.tokenizer is None:
        print(f"error: --load {args.load}: holds no tokenizer to encode --prompt with", file=sys.stderr)
        return 2
    prompt = loaded.tokenizer.encode(args.prompt)
    model = loaded.gpt.eval()
    try:
        new, accepted, proposed = speculative_greedy(model, prompt, args.tokens)
    except ValueError as error:  # (a sequence past the model's learned positions)
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(args.prompt + loaded.tokenizer.decode(new))
    print(f"drafts accepted: {accepted} of {proposed} ({accepted / max(proposed, 1):.0%}), "
          f"{model.config.mtp_depths} per round")
    if args.check:
        greedy = generate(single_stage_logits(model), prompt, args.tokens, window=model.config.max_positions)
        same = greedy == new
        print("greedy decoding without drafts: " + ("the same tokens" if same else "differs"))
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
