"""Sweeps run end to end and resume: a grid (one size, two layouts) writes its table and plot; an IsoFLOP
sweep (sizes from a depth/width rule at one budget) sizes each run's iterations to its budget, skips the
size the budget cannot hold, records the held-out loss and both parameter counts, and feeds the fit; a
WSD study branches cooldowns from its stable run's checkpoints and says what it saved."""

import csv
import json

import pytest
import yaml

from launch.tools.scaling import scaling_law, sweep


def _common(stdlib_corpus) -> dict:
    prefix, tokenizer = stdlib_corpus
    return {"micro_batch_size": 4, "vocab_size": 512, "data_path": prefix, "tokenizer_model": tokenizer,
            "data_cache_dir": f"{prefix}-cache", "sample_prompt": "", "hidden_dropout": 0.0,
            "attention_dropout": 0.0, "lr_decay_style": "cosine", "min_lr": 3e-4}


def _rows(path) -> list[dict]:
    return list(csv.DictReader(open(path)))


def test_a_grid_sweep_writes_table_and_plot(stdlib_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    spec = {"name": "test", "output": str(tmp_path / "out"), "tokens_per_step": 256, "seq_length": 32,
            "train_iters": 3, "common": _common(stdlib_corpus),
            "models": {"2l-32": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2}},
            "layouts": {"dp2": {"nproc": 2}, "tp2": {"nproc": 2, "tensor_model_parallel_size": 2}},
            "lrs": [3e-3], "seeds": [1]}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    sweep.main([str(path)])
    rows = _rows(tmp_path / "out" / "results.csv")
    assert [row["layout"] for row in rows] == ["dp2", "tp2"] and all(row["val_loss"] == "" for row in rows)
    assert rows[0]["parameters"] == rows[1]["parameters"] and float(rows[0]["final_loss"]) > 0
    assert (tmp_path / "out" / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_isoflop_sweep_meets_its_budgets_resumes_and_is_fitted(stdlib_corpus, tmp_path, monkeypatch,
                                                                  capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    budgets = [2e9]
    spec = {"name": "iso", "output": str(tmp_path / "iso"), "mode": "isoflop", "budgets": budgets,
            "tokens_per_step": 256, "seq_length": 32, "min_iters": 10, "max_iters": 300, "eval_iters": 2,
            "common": {**_common(stdlib_corpus), "lr_warmup_fraction": 0.1},
            "sizes": {"layers": [1, 2, 3, 4, 5, 8], "width_per_layer": 8, "head_dim": 8},
            "layouts": {"one": {"nproc": 1}}, "lrs": [3e-3], "seeds": [1]}
    path = tmp_path / "iso.yaml"
    path.write_text(yaml.safe_dump(spec))
    sweep.main([str(path)])
    printed = capsys.readouterr().out
    assert "training FLOPs = tokens x models.counting.flops_per_token" in printed  # the formula, named
    assert "skipped: 8l-64 at 2e+09 FLOPs: 3 iteration(s) < min_iters 10" in printed
    rows = _rows(tmp_path / "iso" / "results.csv")
    assert [row["model"] for row in rows] == ["1l-8", "2l-16", "3l-24", "4l-32", "5l-40"]
    for row in rows:
        flops, budget = float(row["flops"]), float(row["budget"])
        assert abs(flops - budget) / budget < 0.05, row  # its iterations chosen to meet the budget
        assert float(row["tokens"]) == int(row["train_iters"]) * 256
        assert float(row["val_loss"]) > 0 and float(row["val_loss"]) != float(row["final_loss"])
        assert 0 < int(row["non_embedding_parameters"]) < int(row["parameters"])
    assert json.loads((tmp_path / "iso" / "sweep.json").read_text())["budgets"] == budgets
    sweep.main([str(path)])  # again: nothing left to train
    assert "5 runs, 5 already finished" in capsys.readouterr().out
    scaling_law.main(["fit", str(tmp_path / "iso" / "results.csv"), "--output", str(tmp_path / "fit"),
                      "--bootstrap", "5"])
    fit = json.loads((tmp_path / "fit" / "fit.json").read_text())
    budget, = fit["approach2"]["budgets"]  # one budget: its vertex, and no power law (said)
    assert budget["sizes"] == 5 and fit["approach2"]["a"] is None
    assert "power laws need 2 budgets" in capsys.readouterr().out
    assert fit["approach3"]["objective"] >= 0 and fit["input"]["loss_column"] == "val_loss"


GOOD = {"name": "bad", "tokens_per_step": 256, "seq_length": 32, "train_iters": 2,
        "models": {"m": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2}},
        "layouts": {"one": {"nproc": 1}}}
BAD_SWEEPS = [
    ({"tokens_per_step": 0}, "tokens_per_step 0: give a whole number > 0"),
    ({"train_iters": -2}, "train_iters -2: give a whole number > 0"),
    ({"mode": "isoflop", "budgets": [-1.0]}, "a budget of -1.0: give a number > 0"),
    ({"mode": "isoflop", "budgets": ["1e20"], "max_iters": 10}, "no run to train: m at 1e+20 FLOPs"),
    ({"models": 7}, "models must map names to settings"),
    ({"layouts": {"one": {"nproc": 0}}}, "layout one's nproc 0: give a whole number > 0"),
    ({"lrs": []}, "lrs []: give a list"),
    ({"mode": "wsd", "branch_iters": [10], "separate": ["linear"]}, "separate ['linear']: give a list of wsd "
                                                                    "and cosine"),
    ({"mode": "wsd", "branch_iters": [1, 2]}, "branch points [1, 2] are not distinct iterations >= 1 with a "
                                              "cooldown of at least 1"),
    ({"models": {"m": {"num_layers": 2, "hidden_size": 63, "num_attention_heads": 2}}},
     "model m with layout one: --num-attention-heads 2 does not divide --hidden-size 63"),
    ({"models": {"m": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "bogus_flag": 3}}},
     "model m with layout one: unknown flag --bogus-flag"),
    ({"layouts": {"tp3": {"nproc": 2, "tensor_model_parallel_size": 3}}}, "model m with layout tp3: "),
]


def test_every_tool_refuses_bad_input_in_one_line_naming_it(tmp_path, capsys):
    """launch.sweep (its grid and IsoFLOP modes), launch.scaling_law and pretrain.convert: each bad input is
    one line naming the key or flag (and the file), before any run trains or anything is read."""
    from pretrain.interop import convert

    def refused(main, argv) -> str:
        try:
            main(argv)
        except SystemExit as stop:
            said = str(stop.code)
            assert said.startswith("error: ") and "\n" not in said, said
            return said
        raise AssertionError(f"{argv} was not refused")

    for number, (change, message) in enumerate(BAD_SWEEPS):
        path = tmp_path / f"sweep{number}.yaml"
        path.write_text(yaml.safe_dump({**GOOD, "output": str(tmp_path / f"out{number}"), **change}))
        assert message in refused(sweep.main, [str(path)]), (change, message)
        assert not (tmp_path / f"out{number}" / "runs").exists()  # nothing started
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\n  bad: [\n")
    assert "not valid YAML (" in refused(sweep.main, [str(broken)])
    assert "No such file" in refused(sweep.main, [str(tmp_path / "none.yaml")])
    table = tmp_path / "table.csv"
    table.write_text("parameters,tokens,val_loss\n1,2,abc\n")
    assert "line 2: val_loss is 'abc'" in refused(scaling_law.main, ["fit", str(table), "--output",
                                                                     str(tmp_path / "fit")])
    assert "--budget -5: give compute budgets" in refused(scaling_law.main, [
        "fit", str(table), "--output", str(tmp_path / "fit"), "--budget", "-5"])
    for argv, message in ((["--load", str(tmp_path), "--output", "x.safetensors", "--workers", "0"],
                           "--workers 0: give 1 or more processes"),
                          (["--load", str(tmp_path), "--output", "x.safetensors", "--ckpt-step", "-1"],
                           "--ckpt-step -1: give an iteration"),
                          (["--load", str(tmp_path), "--output", "x.safetensors", "--max-shard-size", "big"],
                           "--max-shard-size big: give a positive size"),
                          (["--load", str(tmp_path), "--output", str(tmp_path / "x")],
                           "the consolidated model is a safetensors file"),
                          (["--load", str(tmp_path / "none"), "--output", "x.safetensors"],
                           "no such directory"),
                          (["--from-hf", str(tmp_path), "--output", str(tmp_path / "ck")],
                           "no readable config.json")):
        assert message in refused(convert.main, argv), (argv, message)


def test_a_wsd_study_branches_cooldowns_from_its_stable_run_resumes_and_says_its_compute(
        stdlib_corpus, tmp_path, monkeypatch, capsys):
    """Points of 5 and 10 iterations cooling down over their last 40%: the stable run saves at the branch
    points 3 and 6 in two segments, each branch ends at its point with a held-out loss, decaying from the
    stable peak, equal to a separate WSD run of its point; started again the study trains nothing; the fit
    says the study's compute against separate runs' (6 + 2 + 4 of 15 iterations) before anything else, even
    where two points are too few rows for its laws."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    output = tmp_path / "wsd"
    spec = {"name": "wsd", "output": str(output), "mode": "wsd", "branch_iters": [10, 5],
            "cooldown_fraction": 0.4, "separate": ["wsd"], "tokens_per_step": 256, "seq_length": 32,
            "eval_iters": 2,
            "common": {**_common(stdlib_corpus), "lr_warmup_iters": 1, "lr_wsd_decay_style": "linear"},
            "models": {"2l-32": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2}},
            "layouts": {"one": {"nproc": 1}}, "lrs": [3e-3], "seeds": [1]}
    path = tmp_path / "wsd.yaml"
    path.write_text(yaml.safe_dump(spec))
    sweep.main([str(path)])
    said = capsys.readouterr().out  # each branch is its separate WSD run here (one epoch of the data)
    assert "2l-32-one-lr0.003-s1-cooldown5: " in said and said.count("(+0.00%)") == 2, said
    rows = _rows(output / "results.csv")
    assert [row["train_iters"] for row in rows] == ["5", "10"]
    for row in rows:
        assert int(row["tokens"]) == 256 * int(row["train_iters"]) and float(row["val_loss"]) > 0
        branch = [json.loads(line) for line in open(output / "runs" / f"{row['run']}.jsonl")]
        start = {"5": 3, "10": 6}[row["train_iters"]]
        assert [line["iteration"] for line in branch] == list(range(start + 1, int(row["train_iters"]) + 1))
        assert branch[-1]["lr"] < branch[0]["lr"] <= 3e-3
    stable = output / "stable" / "2l-32-one-lr0.003-s1"
    assert sorted(name.name for name in stable.iterdir() if name.name.startswith("iter_")) == [
        "iter_0000003", "iter_0000006"]
    stable_log = output / "runs" / "2l-32-one-lr0.003-s1-stable.jsonl"
    assert [json.loads(line)["iteration"] for line in open(stable_log)] == list(range(1, 7))
    assert json.loads((output / "sweep.json").read_text())["study_fraction"] == (6 + 2 + 4) / 15
    assert (output / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sweep.main([str(path)])
    assert "2 runs, 2 already finished" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="2 rows cannot fit Approach 3"):
        scaling_law.main(["fit", str(output / "results.csv"), "--output", str(tmp_path / "fit")])
    said = capsys.readouterr().out
    assert "study compute: " in said and "separate runs of the points: 80%" in said


def test_hybrid_sizes_repeat_the_pattern_and_keep_its_proportions():
    """An IsoFLOP ``sizes`` rule with a pattern: each size the pattern repeated, wider as it deepens, its
    FLOPs counted by layer kind."""
    from launch.tools.scaling.isoflop import generated_models
    from models.counting import flops_per_token
    from models.config import GPTConfig

    models = generated_models({"layers": [1, 2, 4], "width_per_layer": 32, "head_dim": 16,
                               "pattern": "M-M*-"})
    assert list(models) == ["1p-32", "2p-64", "4p-128"]
    assert models["2p-64"] == {"hybrid_layer_pattern": "M-M*-M-M*-", "hidden_size": 64,
                               "num_attention_heads": 4}
    flops = [flops_per_token(GPTConfig(**flags, vocab_size=256, seq_length=32, mamba_head_dim=16,
                                       mamba_num_groups=1, mamba_state_dim=16)) for flags in models.values()]
    assert flops == sorted(flops) and len(set(flops)) == 3
