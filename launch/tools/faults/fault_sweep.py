"""Bad inputs and faults against the command line, as a new user meets them: ``python -m
launch.tools.fault_sweep [--out runs/faults] [--only TEXT]``. Each case runs a 2-process job (or the
preprocessing CLI) on a tiny GPT and the stdlib corpus, and the table says per case: the exit status, the
seconds it took, whether it trained an iteration before stopping, whether a traceback was printed, and the
first ``error:`` line. Faults are injected by ``launch.tools.faults.fault_injection`` (kill -9, SIGSTOP, a
full disk). Writes ``sweep.md`` and ``sweep.json`` under ``--out``.

What a good answer looks like: a non-zero exit, one clear line naming the flag or file and the fix, no
traceback, and nothing trained when the problem could be seen before the first iteration.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from launch.torchrun import IN_PROCESS

REPOSITORY = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))  # the repository
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3", "--log-interval", "1",
        "--sample-prompt", "", "--train-iters", "4"]


class Workspace:
    """The corpus, a tokenizer, damaged copies and a saved checkpoint to break, in one temporary folder."""

    def __init__(self, root: str):
        from data.default_corpus import ensure_default_corpus

        self.root = root
        self.prefix, self.tokenizer = ensure_default_corpus(os.path.join(root, "corpus"), vocab_size=512,
                                                            max_bytes=400_000)
        self.data = ["--data-path", self.prefix, "--tokenizer-model", self.tokenizer,
                     "--data-cache-dir", os.path.join(root, "cache")]

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def damaged_data(self, name: str, cut_bin: bool = False, idx: bytes | None = None) -> str:
        prefix = self.path(name)
        for suffix in (".bin", ".idx"):
            shutil.copy(self.prefix + suffix, prefix + suffix)
        if cut_bin:
            with open(prefix + ".bin", "r+b") as handle:
                handle.truncate(os.path.getsize(prefix + ".bin") // 2)
        if idx is not None:
            with open(prefix + ".idx", "wb") as handle:
                handle.write(idx)
        return prefix

    def checkpoint(self, name: str) -> str:
        """A fresh copy of a checkpoint directory saved at iterations 2 and 4."""
        saved = self.path("saved")
        if not os.path.isdir(saved):
            run_job(self, ["--save", saved, "--save-interval", "2"])
        copy = self.path(name)
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(saved, copy)
        return copy


def run_job(space: Workspace, flags: list[str], data: bool = True, die_at: str = "never:0",
            timeout_s: int = 240) -> tuple[int, float, str, str]:
    command = [sys.executable, "-c", IN_PROCESS, "--standalone", "--nproc-per-node=2", "-m",
               "launch.tools.faults.fault_injection", *TINY, *(space.data if data else []), *flags]
    return _run(command, dict(DIE_RANK="1", DIE_AT=die_at), timeout_s)


def _run(command: list[str], env: dict, timeout_s: int) -> tuple[int, float, str, str]:
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPOSITORY, timeout=timeout_s,
                          env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled",
                                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **env))
    return done.returncode, time.monotonic() - started, done.stdout, done.stderr


def _flipped(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def cases(space: Workspace):
    """(name, a function that runs the case and returns run_job's result)."""
    header = open(space.prefix + ".idx", "rb").read()
    yaml_typo = space.path("typo.yaml")
    with open(yaml_typo, "w") as handle:
        handle.write("hiden_size: 64\n")
    a_file = space.path("a-file")
    open(a_file, "w").close()
    empty = space.path("empty.txt")
    open(empty, "w").close()

    def job(*flags, **options):
        return lambda: run_job(space, list(flags), **options)

    def preprocess(*flags):
        return lambda: _run([sys.executable, "-m", "data.preprocess", *flags], {}, 120)

    def damaged_rank_file():
        directory = space.checkpoint("damaged")
        _flipped(os.path.join(directory, "iter_0000004", "rank_00001.pt"))
        return run_job(space, ["--load", directory, "--train-iters", "6"])

    def missing_rank_file():
        directory = space.checkpoint("missing")
        os.remove(os.path.join(directory, "iter_0000004", "rank_00000.pt"))
        return run_job(space, ["--load", directory, "--train-iters", "6"])

    def garbage_manifest():
        directory = space.checkpoint("manifest")
        with open(os.path.join(directory, "iter_0000004", "manifest.json"), "w") as handle:
            handle.write("{not json")
        return run_job(space, ["--load", directory, "--train-iters", "6"])

    return [
        ("global batch not divisible", job("--global-batch-size", "3")),
        ("tp larger than the world", job("--tensor-model-parallel-size", "4")),
        ("flag typo --hiden-size", job("--hiden-size", "64")),
        ("YAML key typo hiden_size", job("--config", yaml_typo)),
        ("--config file missing", job("--config", space.path("nowhere.yaml"))),
        ("--train-iters not a number", job("--train-iters", "x")),
        ("--bf16 with --fp16", job("--bf16", "--fp16")),
        ("--zero-stage 5", job("--zero-stage", "5")),
        ("--offload-param nvme at stage 2", job("--zero-stage", "2", "--offload-param", "nvme")),
        ("heads do not divide hidden", job("--num-attention-heads", "5")),
        ("--seq-length 0", job("--seq-length", "0")),
        ("--lr negative", job("--lr", "-1")),
        ("--virtual-pipeline-size without pp", job("--virtual-pipeline-size", "2")),
        ("--eval-interval with --eval-iters 0", job("--eval-interval", "2", "--eval-iters", "0")),
        ("unsupported --fp8-format", job("--fp8-format", "hybrid")),
        ("--nvme-path missing", job("--zero-stage", "2", "--offload-optimizer", "nvme", "--nvme-path",
                                    space.path("no-such-dir"))),
        ("--tokenizer-model missing",
         job("--data-path", space.prefix, "--tokenizer-model", space.path("no.model"),
                                          data=False)),
        ("--tokenizer-model garbage",
         job("--data-path", space.prefix, "--tokenizer-model", space.prefix + ".idx",
                                          data=False)),
        ("--data-path missing",
         job("--data-path", space.path("nothing"), "--tokenizer-model", space.tokenizer,
                                    data=False)),
        ("truncated .bin", job("--data-path", space.damaged_data("cut", cut_bin=True), "--tokenizer-model",
                               space.tokenizer, data=False)),
        ("garbage .idx", job("--data-path", space.damaged_data("garbage", idx=os.urandom(400)),
                             "--tokenizer-model", space.tokenizer, data=False)),
        ("short .idx", job("--data-path", space.damaged_data("short", idx=header[:-8]), "--tokenizer-model",
                           space.tokenizer, data=False)),
        ("ids beyond the tokenizer", job("--data-path", space.prefix, "--tokenizer-type", "NullTokenizer",
                                         "--vocab-size", "100", data=False)),
        ("--vocab-size below the tokenizer", job("--vocab-size", "100")),
        ("empty train split", job("--split", "0,50,50")),
        ("--save under a file", job("--save", os.path.join(a_file, "ckpt"))),
        ("--save not creatable", job("--save", "/proc/no-ckpt")),
        ("--load garbage manifest", garbage_manifest),
        ("--load flipped byte in rank 1's file", damaged_rank_file),
        ("--load rank file missing", missing_rank_file),
        ("--ckpt-step that was never saved", lambda: run_job(space, ["--load", space.checkpoint("step"),
                                                                     "--ckpt-step", "3",
                                                                     "--train-iters", "6"])),
        ("--hidden-size contradicts --load", lambda: run_job(space, ["--load", space.checkpoint("shape"),
                                                                     "--hidden-size", "128",
                                                                     "--train-iters", "6"])),
        ("preprocess: empty input", preprocess("--input", empty, "--output-prefix", space.path("p"),
                                               "--tokenizer-model", space.tokenizer)),
        ("preprocess: input missing", preprocess("--input", space.path("none.txt"), "--output-prefix",
                                                 space.path("p"), "--tokenizer-model", space.tokenizer)),
        ("kill -9 of rank 1 at iteration 3", job("--save", space.path("killed"), "--save-interval", "2",
                                                 die_at="iteration:3")),
        ("disk full on rank 1 (RLIMIT_FSIZE) before save 4",
         job("--save", space.path("full"), "--save-interval",
                                                                  "2", die_at="full:3")),
        ("rank 1 hangs (SIGSTOP), 10 s timeout", job("--distributed-timeout-s", "10", die_at="hang:3")),
    ]


DESCRIPTION = """Bad inputs and faults against the command line, as a new user meets them: each case is a
2-process python -m pretrain job (or the preprocessing command) on a tiny GPT and the stdlib corpus with one
thing wrong (a misspelt flag, a damaged file, kill -9 of a rank, a hung rank, a full disk), tabulated in
DIR/sweep.md and DIR/sweep.json: the exit status, the seconds it took, whether it trained, whether a
traceback was printed, and the first error: line. The cases' pretrain flags are fixed (python -m pretrain
--help lists every flag); this command takes only the options below."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.tools.fault_sweep", description=DESCRIPTION)
    parser.add_argument("--out", default="runs/faults", metavar="DIR",
                        help="where sweep.md and sweep.json go (default: runs/faults)")
    parser.add_argument("--only", metavar="TEXT", help="run the cases whose name contains this text")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        space = Workspace(root)
        for name, case in cases(space):
            if args.only and args.only not in name:
                continue
            code, seconds, stdout, stderr = case()
            errors = [line[len("error: "):] for line in stderr.splitlines() if line.startswith("error: ")]
            rows.append({"case": name, "exit": code, "seconds": round(seconds, 1),
                         "trained": any(line.startswith("iter ") for line in stdout.splitlines()),
                         "traceback": "Traceback" in stderr, "errors": errors})
            print(f"{name}: exit {code} in {seconds:.1f} s: {errors[0] if errors else stderr[-300:]!r}",
                  flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep.json"), "w") as handle:
        json.dump(rows, handle, indent=1)
    lines = ["| case | exit | s | trained | traceback | message |", "|---|---|---|---|---|---|"]
    for row in rows:
        message = " / ".join(row["errors"]).replace(root, "$TMP").replace("|", "\\|") or "(none)"
        lines.append(f"| {row['case']} | {row['exit']} | {row['seconds']} | "
                     f"{'yes' if row['trained'] else 'no'} | "
                     f"{'yes' if row['traceback'] else 'no'} | {message} |")
    with open(os.path.join(args.out, "sweep.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
