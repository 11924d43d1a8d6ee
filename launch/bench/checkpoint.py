"""What a checkpoint costs the training: the step's stall per save, synchronous against ``--async-save``,
the bytes each rank writes against the total over the world, the time a resume takes to verify and
read a rank's pieces, and the memory a re-cut and a conversion take beyond the largest saved piece.

    python -m launch.bench.checkpoint [--hidden-size 1024 --num-layers 8] [--zero-stage 1 3] [--tp 2]
                                      [--dp 2] [--iters 6] [--save-interval 2] [--save-dir DIR]

Each stage trains the same GPT (fp32, dp x tp processes) twice from the same seed, saving every
``--save-interval`` iterations: synchronously, then in the background; the two runs' losses must agree
bit for bit. Reported: the mean stall per save (the time the step waited in ``Trainer.save``, from the
metrics' ``save_stall_s``) and its ratio, async over sync; the largest rank's file against the
model's state written once and spread evenly (fp32 parameters and AdamW's two moments, 12 bytes a
parameter, over the world: what a save that writes each replicated piece once would give); and for
one rank's file of the last checkpoint, the seconds to verify and read its pieces with one hash pass
(each piece's sha256 as it is read, as a resume does now) against two (the whole file hashed, then
read, as format 3 did).

Then the same model trained at dp ``--tp x --dp`` (tp 1) is re-cut, in this process, into the ranges
each rank of the dp x tp layout holds (those its ZeRO-3 checkpoint lists; each rank's targets allocated
first, as its masters and states are), and converted to one consolidated safetensors file: the peak of
anonymous memory (RssAnon, sampled every millisecond; the memory-mapped checkpoint's pages are the page
cache's, not the process's) above what the process held before, against the largest single saved piece
(all its kinds: masters and both moments).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from launch.bench.world import write_table
from launch.pretrain_run import run_pretrain
from models.config import GPTConfig
from models.counting import num_parameters
from pretrain.checkpoint.geometry import SliceGeometry
from launch.help_text import help_description


def _resume_read_seconds(directory: str, rank: int, passes: int) -> float:
    """Seconds to verify and read ``rank``'s file of the newest checkpoint, hashing it ``passes`` times."""
    from pretrain.checkpoint import catalog

    catalog._sha256.cache_clear()
    checkpoint, manifest = catalog.read_manifest(directory)
    entry = f"rank_{rank:05d}.pt"
    descriptor = os.open(os.path.join(checkpoint, entry), os.O_RDONLY)
    os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)  # read from the disk, not the page cache
    os.close(descriptor)
    started = time.perf_counter()
    catalog.verified(checkpoint, manifest, entry)  # the start-up check
    if passes == 2:
        catalog._sha256.cache_clear()
    content = catalog.read_rank_file(checkpoint, manifest, entry)
    for state in content.values():  # touch every tensor: a memory-mapped load reads lazily
        _touch(state)
    return time.perf_counter() - started


def _resume_pieces_seconds(directory: str, rank: int) -> float:
    """Seconds to read every piece of ``rank``'s file of the newest checkpoint, each checked against its
    sha256 as it is read (format 4: one pass)."""
    from pretrain.checkpoint import catalog
    from pretrain.checkpoint.reshard import SavedPieces

    checkpoint, manifest = catalog.read_manifest(directory)
    entry = f"rank_{rank:05d}.pt"
    descriptor = os.open(os.path.join(checkpoint, entry), os.O_RDONLY)
    os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(descriptor)
    started = time.perf_counter()
    source = SavedPieces(checkpoint, manifest, catalog.open_rank_file, strict=True)
    for pieces in source.by_name.values():
        for piece in pieces:
            if piece.where[0] == entry:
                for kind in ("master", *source.kinds):
                    _touch(source.values(piece, kind))
    source.rest(entry)
    return time.perf_counter() - started


class PeakAnonymous:
    """The peak of this process's anonymous memory (RssAnon) above its level at entry, sampled every
    millisecond by a thread."""

    def __enter__(self):
        import threading

        self.base = self.peak = _rss_anon()
        self._stop = threading.Event()

        def sample():
            while not self._stop.is_set():
                self.peak = max(self.peak, _rss_anon())
                self._stop.wait(0.001)
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def _rss_anon() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def _largest_piece(manifest: dict) -> int:
    """Bytes of the largest saved piece, all its kinds (fp32)."""
    return max(4 * length * len(kinds) for file in manifest["files"].values()
               for _, _, _, length, kinds, _ in file["pieces"])


def recut_and_convert_memory(source_directory: str, target_directory: str, output: str) -> dict:
    """Peak extra memory of re-cutting ``source_directory``'s newest checkpoint into the ranges each rank
    of ``target_directory``'s checkpoint holds, and of converting it to one file; the largest piece."""
    import torch

    from pretrain.checkpoint import catalog
    from pretrain.checkpoint.reshard import SavedPieces
    from pretrain.interop.convert import write_consolidated

    checkpoint, manifest = catalog.read_manifest(source_directory)
    _, held = catalog.read_manifest(target_directory)
    source = SavedPieces(checkpoint, manifest, catalog.open_rank_file, strict=True)
    kinds = ("master", *source.kinds)
    recut = 0
    for entry, recorded in sorted(held["files"].items()):
        ranges = [(name, SliceGeometry.of(*geometry), start, length)
                  for name, geometry, start, length, _, _ in recorded["pieces"]]
        targets = {(index, kind): torch.empty(length).fill_(1.0)  # this rank's masters and states, in
                   for index, (_, _, _, length) in enumerate(ranges) for kind in kinds}  # memory: not extra
        with PeakAnonymous() as peak:
            for index, (name, geometry, start, _) in enumerate(ranges):
                for kind in kinds:
                    source.fill(name, geometry, start, kind, targets[index, kind])
        recut = max(recut, peak.extra)
        del targets
    with PeakAnonymous() as peak:
        write_consolidated(source, manifest, output)
    return {"recut": recut, "convert": peak.extra, "piece": _largest_piece(manifest)}


def _touch(value) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        value.sum()
    elif isinstance(value, dict):
        for item in value.values():
            _touch(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _touch(item)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.checkpoint",
                                     description=help_description(__doc__))
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--save-interval", type=int, default=2)
    parser.add_argument("--save-dir", help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--output", default="runs/bench/checkpoint.md")
    args = parser.parse_args(argv)
    params = num_parameters(GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                      num_attention_heads=args.heads, seq_length=args.seq,
                                      vocab_size=args.vocab))
    world = args.tp * args.dp
    rows = [f"GPT of {params / 1e6:.1f}M parameters, fp32, dp {args.dp} x tp {args.tp}, a save every "
            f"{args.save_interval} of {args.iters} iterations", "",
            "| stage | save | stall per save s | async / sync | largest rank file MiB "
            "| vs 12 B x params / world | resume read s, 1 hash pass | 2 passes | final loss |",
            "|---|---|---|---|---|---|---|---|---|"]
    common = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
              "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
              "--vocab-size", str(args.vocab), "--mock-data", "--tokenizer-type", "NullTokenizer",
              "--micro-batch-size", "1",
              "--global-batch-size", str(2 * args.dp), "--tensor-model-parallel-size", str(args.tp),
              "--train-iters", str(args.iters), "--lr", "1e-4", "--log-interval", "1",
              "--save-interval", str(args.save_interval), "--save-keep-last", "1",
              "--hidden-dropout", "0", "--attention-dropout", "0"]
    root = args.save_dir or tempfile.mkdtemp(prefix="bench-checkpoint-")
    for stage in args.zero_stage:
        stalls, losses = {}, {}
        for mode in ("sync", "async"):
            directory = os.path.join(root, f"stage{stage}-{mode}")
            shutil.rmtree(directory, ignore_errors=True)
            flags = [*common, "--zero-stage", str(stage), "--save", directory,
                     "--data-cache-path", os.path.join(root, "cache")]
            lines = run_pretrain(world, flags + (["--async-save"] if mode == "async" else []))
            saved = [line["save_stall_s"] for line in lines[1:]  # the line after a save carries its stall
                     if (line["iteration"] - 1) % args.save_interval == 0]
            stalls[mode], losses[mode] = sum(saved) / len(saved), [line["loss"] for line in lines]
            from pretrain.checkpoint.catalog import read_manifest

            sizes = [file["bytes"] for file in read_manifest(directory)[1]["files"].values()]
            largest, fair = max(sizes), 12 * params / world
            one, two = _resume_pieces_seconds(directory, 0), _resume_read_seconds(directory, 0, 2)
            rows.append(f"| {stage} | {mode} | {stalls[mode]:.3f} | "
                        + (f"{stalls['async'] / stalls['sync']:.3f}x" if mode == "async" else "1.000x")
                        + f" | {largest / 2**20:.1f} | {largest / fair:.2f}x | {one:.2f} | {two:.2f} | "
                          f"{losses[mode][-1]:.6f} |")
            if (stage, mode) != (3, "sync"):  # the re-cut below reads that one's listing
                shutil.rmtree(directory, ignore_errors=True)
        assert losses["sync"] == losses["async"], "the background save changed the trajectory"
        print("\n".join(rows), flush=True)
    if 3 in args.zero_stage:  # the re-cut of dp (tp x dp) into the stage-3 dp x tp layout, and a conversion
        source = os.path.join(root, "dp-only")
        shutil.rmtree(source, ignore_errors=True)
        flags = [*common, "--zero-stage", "3", "--save", source,
                 "--data-cache-path", os.path.join(root, "cache")]
        flags[flags.index("--tensor-model-parallel-size") + 1] = "1"
        flags[flags.index("--global-batch-size") + 1] = str(2 * world)
        flags[flags.index("--train-iters") + 1] = flags[flags.index("--save-interval") + 1] = "2"
        run_pretrain(world, flags)
        found = recut_and_convert_memory(source, os.path.join(root, "stage3-sync"),
                                         os.path.join(root, "consolidated.safetensors"))
        rows += ["", f"| peak extra memory, dp {world} ZeRO-3 checkpoint | MiB | / largest piece "
                     f"({found['piece'] / 2**20:.1f} MiB, masters and moments) |", "|---|---|---|"]
        for what, key in ((f"re-cut into dp {args.dp} x tp {args.tp} (largest rank)", "recut"),
                          ("conversion to one safetensors file", "convert")):
            rows.append(f"| {what} | {found[key] / 2**20:.1f} | {found[key] / found['piece']:.2f}x |")
        print("\n".join(rows[-4:]), flush=True)
    write_table(args.output, rows)
    if not args.save_dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
