"""Every command of README.md run as written, scaled down, in one scratch working directory:

    python -m launch.tools.readme_commands [--clone] [--only SUBSTRING] [--keep DIR]

The commands are read from README.md itself (each ```bash block's lines, ``\\`` continuations joined,
comments dropped), so the check follows the README as it changes. Each runs in order (later ones read
what earlier ones wrote: the converts read the main job's checkpoint) with bash in a copy of the working
tree (``--clone``: a fresh ``git clone`` of HEAD, so "from a fresh clone" is meant literally), with
``.venv`` linked from this checkout and activated as the README assumes (making ``.venv`` downloads
torch: ``.ci/run`` does that, not this check). A command is scaled down only
by flags appended to it (a few iterations, a small sample) or by a placeholder replaced (``/local/nvme``,
``[--family gemma2]``); the sweeps' YAML files are scaled in the copy, their command unchanged. The
inputs the README assumes exist (corpus.txt, corpus.jsonl, vocab.json + merges.txt, the Hugging Face
model ``my-llama``, chats.jsonl) are built first from what the repository holds. Commands that need a
cluster or root are listed as skipped with the reason. One table row per command (the last lines of
each failure's output under it; every command's whole output in ``readme-logs/`` of the working
directory); the exit status is 1 when any failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from parallel.tensor.fp8 import preload_torchao

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# a few iterations, each logged, and a short sample at the end (pretrain's flags; the last one given wins)
TRAIN = ("--train-iters", "3", "--log-interval", "1", "--sample-tokens", "8")
CORPUS_BYTES = 1_500_000  # of standard-library sources in corpus.txt and corpus.jsonl
WIDTH = 72  # characters of a command shown in the table


@dataclasses.dataclass(frozen=True)
class Command:
    text: str  # as README.md writes it: continuation lines joined, comments dropped
    line: int  # its first line in README.md


@dataclasses.dataclass(frozen=True)
class Rule:
    pattern: str  # re.search on Command.text; the first rule that matches applies
    note: str  # what is done to it (or, with skip, why it is not run)
    skip: bool = False
    append: tuple[str, ...] = ()  # flags appended to the command
    replace: tuple[tuple[str, str], ...] = ()  # placeholders and what stands for them
    needs: tuple[str, ...] = ()  # inputs built first (PREPARE's keys)
    timeout: int = 300


RULES = (
    Rule(r"^sbatch\b", "needs a SLURM cluster (sbatch submits launch/slurm.sbatch to 4 nodes)",
         skip=True),
    Rule(r"\bMASTER_ADDR=|launch/multinode\.sh", "needs 4 nodes (MASTER_ADDR=node001); "
         "the multinode launcher is covered by tests/launch/test_multinode.py", skip=True),
    Rule(r"^sudo\b", "needs root privileges", skip=True),
    Rule(r"python -m pytest\b", "only -k test_layout (the whole suite takes ~10 minutes; CI runs it)",
         append=("-k", "test_layout")),
    Rule(r"^bash launch/main_job\.sh", "3 iterations, evaluated at 2, saved at 2 and 3",
         append=TRAIN + ("--eval-interval", "2", "--save-interval", "2")),
    Rule(r"^bash launch/finetune_job\.sh", "--family gemma2 given; 3 iterations instead of 300 (so the "
         "held-out answers are not expected right)", replace=(("[--family gemma2]", "--family gemma2"),),
         append=("--train-iters", "3", "--log-interval", "1"), timeout=400),
    Rule(r"^python -m launch\.torchrun .*--context-parallel-size", "3 iterations, micro-batch 1",
         append=TRAIN + ("--micro-batch-size", "1")),
    Rule(r"^python -m launch\.torchrun .*--nvme-path /local/nvme", "3 iterations; a scratch folder for "
         "/local/nvme", replace=(("/local/nvme", "local-nvme"),), append=TRAIN, needs=("local-nvme",)),
    Rule(r"^python -m launch\.torchrun .*--sft .*--data-path chats\.jsonl", "3 iterations, saved at 2 "
         "and 3; chats.jsonl made", append=TRAIN + ("--save-interval", "2"), needs=("chats.jsonl",)),
    Rule(r"^python -m launch\.torchrun .*--save ", "3 iterations, saved at 2 and 3",
         append=TRAIN + ("--save-interval", "2")),
    Rule(r"^python -m launch\.torchrun\b", "3 iterations", append=TRAIN),
    Rule(r"^python -m data\.tokenizers .*--input corpus\.txt", "as written; corpus.txt made (stdlib "
         "sources)", needs=("corpus.txt",)),
    Rule(r"^python -m data\.preprocess .*--vocab-file vocab\.json", "as written; corpus.jsonl, vocab.json "
         "and merges.txt made (a byte-level BPE trained with tokenizers)",
         needs=("corpus.jsonl", "vocab.json")),
    Rule(r"^python -m data\.preprocess .*--input corpus\.jsonl", "as written; corpus.jsonl made",
         needs=("corpus.jsonl",)),
    Rule(r"^python -m pretrain\.convert .*--from-hf my-llama\b", "as written; my-llama made (a tiny "
         "Llama 3.1 with a tokenizer and chat template, saved by transformers)", needs=("my-llama",)),
    Rule(r"^python -m pretrain\.convert\b", "as written (reads an earlier command's checkpoint)"),
    Rule(r"^python -c ", "as written (reads an earlier command's checkpoint)"),
    Rule(r"^python -m parallel\.topology\b", "as written"),
    Rule(r"^python -m launch\.plan\b", "as written"),
    Rule(r"^python -m launch\.sweep \S*isoflop\S*\.yaml$", "as written; its YAML scaled in the copy: "
         "every other model, budgets and iteration bounds / 50", needs=("sweep",), timeout=600),
    Rule(r"^python -m launch\.sweep \S+\.yaml$", "as written; its YAML scaled in the copy: 3 iterations, "
         "its first 2 models", needs=("sweep",), timeout=600),
    Rule(r"^python -m launch\.scaling_law fit\b", "as written (the scaled IsoFLOP sweep's table)"),
)


def strip_comment(line: str) -> str:
    """``line`` without its ``# ...`` comment: a ``#`` that starts a word outside quotes, as bash reads it."""
    quote, escaped = None, False
    for index, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index].rstrip()
    return line.rstrip()


def commands(readme: str) -> list[Command]:
    """Every command of ``readme``'s ```bash blocks, in order."""
    found, block, pending, start = [], False, None, 0
    for number, line in enumerate(readme.splitlines(), 1):
        if line.strip().startswith("```"):
            block = line.strip() == "```bash"
            continue
        if not block:
            continue
        if pending is None:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            pending, start = "", number
        pending += line  # as bash joins a continuation: the backslash and the newline dropped
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        found.append(Command(strip_comment(pending).strip(), start))
        pending = None
    return found


def rule_of(command: Command) -> Rule | None:
    return next((rule for rule in RULES if re.search(rule.pattern, command.text)), None)


def scaled(command: Command, rule: Rule) -> str:
    """The line run for ``command``: its words, placeholders replaced, ``rule``'s flags appended."""
    text = command.text
    for placeholder, value in rule.replace:
        assert placeholder in text, (placeholder, text)
        text = text.replace(placeholder, value)
    return " ".join([text, *rule.append])


def _stdlib_documents():
    from data.default_corpus import standard_library_sources

    total = 0
    for path in standard_library_sources():
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
        if total + len(text) > CORPUS_BYTES:
            return
        total += len(text)
        yield text


def _byte_level_bpe(vocab_size: int = 2000, specials: tuple[str, ...] = ("<|endoftext|>",)):
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(_stdlib_documents(), vocab_size=vocab_size, special_tokens=list(specials),
                                  show_progress=False)
    return tokenizer


def _make_corpus_txt() -> None:
    with open("corpus.txt", "w") as handle:
        handle.writelines(_stdlib_documents())


def _make_corpus_jsonl() -> None:
    with open("corpus.jsonl", "w") as handle:
        handle.writelines(json.dumps({"text": text}) + "\n" for text in _stdlib_documents())


def _make_vocab() -> None:
    _byte_level_bpe().save_model(".")  # vocab.json and merges.txt, as GPT-2's


CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _make_llama() -> None:
    preload_torchao()  # transformers imports it
    import transformers

    from launch.examples.hf_families import make_model

    specials = ("<|begin_of_text|>", "<|end_of_text|>", "<|end|>", "<|user|>", "<|assistant|>")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_byte_level_bpe(1000, specials)._tokenizer, bos_token=specials[0],
        eos_token=specials[1])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained("my-llama")
    model = make_model("llama3.1", len(tokenizer), hidden_size=64, bos=tokenizer.bos_token_id,
                       eos=tokenizer.eos_token_id)
    model.save_pretrained("my-llama")


def _make_chats() -> None:
    words = ["def", "class", "import", "return", "yield", "lambda", "while", "assert"]
    with open("chats.jsonl", "w") as handle:
        for index in range(64):
            word = words[index % len(words)] * (1 + index % 3)
            chat = [{"role": "user", "content": f"reverse {word}"},
                    {"role": "assistant", "content": word[::-1]}]
            handle.write(json.dumps({"messages": chat}) + "\n")


SCALED = "# scaled down by python -m launch.tools.readme_commands\n"


def _scale_sweep(command: str) -> None:
    """The sweep's YAML (in the working copy) scaled: a grid to 3 iterations and its first 2 models; an
    IsoFLOP study to every other model, its budgets and iteration bounds divided by 50 (the same sizes
    per budget, 1/50 of the iterations), 2 evaluation batches."""
    import yaml

    path = command.split()[-1]
    with open(path) as handle:
        text = handle.read()
    if text.startswith(SCALED):  # scaled by an earlier run in this working directory
        return
    sweep = yaml.safe_load(text)
    if sweep.get("mode", "grid") == "grid":
        sweep.update(train_iters=3, models=dict(list(sweep["models"].items())[:2]))
    else:
        sweep.update(budgets=[float(budget) / 50 for budget in sweep["budgets"]],
                     min_iters=max(1, sweep.get("min_iters", 20) // 50), eval_iters=2)
        if sweep.get("max_iters"):
            sweep["max_iters"] //= 50
        if sweep.get("models"):
            sweep["models"] = dict(list(sweep["models"].items())[::2])
    with open(path, "w") as handle:
        handle.write(SCALED)
        yaml.safe_dump(sweep, handle, sort_keys=False)


PREPARE = {"corpus.txt": _make_corpus_txt, "corpus.jsonl": _make_corpus_jsonl, "vocab.json": _make_vocab,
           "my-llama": _make_llama, "chats.jsonl": _make_chats,
           "local-nvme": lambda: os.makedirs("local-nvme", exist_ok=True)}


def prepare(work: str, needs: tuple[str, ...], command: str, log: str) -> None:
    """Build each input of ``needs`` in ``work`` (once: one that exists is kept), its output to ``log``."""
    here = os.getcwd()
    with open(log, "a") as output, contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        os.chdir(work)
        try:
            for need in needs:
                print(f"preparing {need}", flush=True)
                if need == "sweep":
                    _scale_sweep(command)
                elif not os.path.exists(need):
                    PREPARE[need]()
        finally:
            os.chdir(here)


def make_workdir(work: str, clone: bool) -> None:
    """``work``: a fresh clone of HEAD (``clone``) or a copy of the working tree (tracked and untracked files
    git does not ignore), with this checkout's ``.venv`` linked in."""
    os.makedirs(work, exist_ok=True)
    if clone:
        subprocess.run(["git", "clone", "--quiet", REPOSITORY, work], check=True)
    else:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=REPOSITORY, check=True, capture_output=True, text=True).stdout
        for name in filter(None, listed.split("\0")):
            source = os.path.join(REPOSITORY, name)
            if os.path.isfile(source):
                os.makedirs(os.path.dirname(os.path.join(work, name)), exist_ok=True)
                shutil.copy2(source, os.path.join(work, name))
    os.symlink(os.path.join(REPOSITORY, ".venv"), os.path.join(work, ".venv"))


def run_one(line: str, work: str, log: str, timeout: int) -> tuple[int, float]:
    """Run ``line`` with bash in ``work`` as a shell with .venv activated would; its output to ``log``;
    (exit status, seconds). Past ``timeout`` its process group is ended (status 124)."""
    venv = os.path.join(work, ".venv")
    env = dict(os.environ, VIRTUAL_ENV=venv, PATH=os.path.join(venv, "bin") + os.pathsep + os.environ["PATH"])
    env.pop("PYTHONPATH", None)
    start = time.monotonic()
    with open(log, "a") as output:
        output.write(f"$ {line}\n")
        output.flush()
        process = subprocess.Popen(["bash", "-c", line], cwd=work, env=env, stdout=output,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            status = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            status = 124
    return status, time.monotonic() - start


def _short(text: str, width: int = WIDTH) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def _last_lines(log: str, count: int = 8) -> list[str]:
    with open(log, errors="replace") as handle:
        lines = [line.rstrip() for line in handle if line.strip() and not line.startswith("wandb:")]
    return lines[-count:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.tools.readme_commands",
                                     description=__doc__.split("\n\n")[0].rstrip(":") + ".")
    parser.add_argument("--clone", action="store_true",
                        help="run in a fresh git clone of HEAD (default: a copy of the working tree)")
    parser.add_argument("--only", metavar="SUBSTRING",
                        help="run only the commands whose README text holds SUBSTRING (with --keep DIR of an "
                             "earlier run, the outputs they read are there)")
    parser.add_argument("--keep", metavar="DIR",
                        help="work in DIR and keep it (made when missing, else used as it is); default: a "
                             "temporary folder, removed at the end unless a command failed")
    args = parser.parse_args(argv)
    with open(os.path.join(REPOSITORY, "README.md")) as handle:
        found = commands(handle.read())
    work = os.path.abspath(args.keep) if args.keep else tempfile.mkdtemp(prefix="readme-commands-")
    if os.path.isdir(work) and os.listdir(work):
        print(f"using {work} as it is (its earlier outputs kept)")
    else:
        make_workdir(work, args.clone)
    logs = os.path.join(work, "readme-logs")
    os.makedirs(logs, exist_ok=True)
    print(f"{len(found)} commands in README.md; working directory {work}", flush=True)
    print("| # | command | result | s | scaling |\n|---|---|---|---|---|", flush=True)
    failed, began = 0, time.monotonic()
    for number, command in enumerate(found, 1):
        if args.only and args.only not in command.text:
            continue
        rule = rule_of(command)
        if rule is None or rule.skip:
            failed += rule is None
            result = "skipped" if rule else "FAIL"
            note = rule.note if rule else "no scaling rule or skip reason: add one to RULES"
            print(f"| {number} | `{_short(command.text)}` | {result} | | {note} |", flush=True)
            continue
        line = scaled(command, rule)
        log = os.path.join(logs, f"{number:02d}.log")
        open(log, "w").close()
        try:
            prepare(work, rule.needs, line, log)
        except Exception as error:  # an input this script builds: its own failure, not the README's
            status, seconds, result = 1, 0.0, "FAIL (preparing its inputs)"
            with open(log, "a") as handle:
                handle.write(f"{type(error).__name__}: {error}\n")
        else:
            status, seconds = run_one(line, work, log, rule.timeout)
            result = "pass" if status == 0 else "FAIL (timeout)" if status == 124 else f"FAIL (exit {status})"
        print(f"| {number} | `{_short(command.text)}` | {result} | {seconds:.0f} | {rule.note} |", flush=True)
        if status:
            failed += 1
            print("\n".join(f"    {text}" for text in _last_lines(log)), flush=True)
    removed = not args.keep and not failed  # (a temporary folder: said removed, not named as kept)
    where = (f"{work} removed (--keep DIR keeps the outputs)" if removed
             else f"outputs in {work}, logs in {logs}")
    print(f"{failed} failed, {time.monotonic() - began:.0f} s; {where}")
    if removed:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
