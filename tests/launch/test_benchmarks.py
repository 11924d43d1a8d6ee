"""The benchmarks run end to end on tiny settings and write their tables (numbers are not judged here)."""

import os

from launch.bench import activations as bench_activations, pipeline as bench_pipeline, zero as bench_zero


def test_zero_benchmark_compares_every_system_on_the_same_losses(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    tiny = ["--dp", "2", "--warmup", "1", "--steps", "1", "--layers", "1", "--hidden", "64", "--seq", "16",
            "--vocab", "256"]
    for mode in (["--worlds", "one", "--rounds", "1"],
                 ["--worlds", "separate", "--rounds", "1", "--model", "ours", "--systems", "torch DDP",
                  "ours stage 2"]):
        output = tmp_path / "zero.md"
        bench_zero.main([*tiny, *mode, "--output", str(output)])
        rows = [line.split("|") for line in output.read_text().splitlines() if line.startswith("| 2 |")]
        assert len(rows) == (7 if "one" in mode else 2)
        assert len({row[-2] for row in rows}) == 1  # every system ends on the same loss
        assert all(row[8].strip() == "-" for row in rows) == ("one" in mode)  # peak RSS: own worlds only
        assert all(row[5].strip() == "-" for row in rows) == ("separate" in mode)  # vs FSDP2: where it ran


def test_pipeline_and_activation_benchmarks_write_their_tables(tmp_path):
    pipeline, activations = tmp_path / "pipeline.md", tmp_path / "activations.md"
    bench_pipeline.main(["--pp", "2", "--micro-batches", "2", "--steps", "1", "--hidden", "64", "--seq", "16",
                         "--layers-per-stage", "2", "--schedules", "1f1b", "zbv", "--output", str(pipeline)])
    bench_activations.main(["--tp", "2", "--layers", "2", "--steps", "1", "--hidden", "64", "--seq", "32",
                            "--output", str(activations)])
    table = pipeline.read_text()
    for system in ("ours", "torch.distributed.pipelining"):
        assert all(f"| {system} | {kind} | 2 | 2 |" in table for kind in ("1f1b", "zbv")), table
    assert os.path.getsize(activations) > 0 and "full+partitioned" in activations.read_text()


def test_offload_benchmark_runs_every_system_to_the_same_loss(tmp_path, monkeypatch):
    from launch.bench import offload as bench_offload

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    output = tmp_path / "offload.md"
    bench_offload.main(["--hidden-size", "64", "--num-layers", "2", "--heads", "4", "--seq",
                        "16", "--iters", "2",
                        "--nvme-path", str(tmp_path), "--sub-group-size", "5000", "--output", str(output)])
    rows = [line for line in output.read_text().splitlines()
            if line.startswith("| ") and "system" not in line]
    assert len(rows) == 4 and len({row.split("|")[-2] for row in rows}) == 1  # equal final losses


def test_one_process_benchmark_times_both_loops_on_the_same_corpus(tmp_path, stdlib_corpus):
    from launch.bench import one_process as bench_one_process

    output = tmp_path / "one_process.md"
    cache = os.path.dirname(os.path.dirname(stdlib_corpus[0]))  # the fixture's corpus, built once
    bench_one_process.main(["--iters", "30", "--log-interval", "10", "--pairs", "1",
                            "--corpus-bytes", "400000",
                            "--cache-dir", cache, "--output", str(output)])
    rows = [line.split("|") for line in output.read_text().splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 1 and float(rows[0][4].strip().rstrip("x")) > 0
    assert 0 < float(rows[0][5]) < 7 and 0 < float(rows[0][6]) < 7  # both learned below log(512) = 6.2


def test_the_throughput_peers_are_the_same_models_as_ours():
    """transformers' GPT-2 and Llama built from each benchmark shape hold exactly our parameters (so the
    tokens/s compare like with like), at the GPU sizes too (built on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from launch.bench.throughput import SIZES, shape_flags
    from models.counting import num_parameters
    from pretrain.config.arguments import parse_config
    from pretrain.interop.hf_config import config_to_hf

    for size in ("smoke", "gpu"):
        for shape in ("gpt", "llama"):
            config = parse_config(shape_flags(size, shape)).model
            config.vocab_size = SIZES[size][shape][-1]
            with torch.device("meta"):
                theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config_to_hf(config, {})))
            assert type(theirs).__name__ == ("GPT2LMHeadModel" if shape == "gpt" else "LlamaForCausalLM")
            assert sum(p.numel() for p in theirs.parameters()) == num_parameters(config), (size, shape)
