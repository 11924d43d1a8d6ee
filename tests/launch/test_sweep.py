"""A small sweep runs end to end (2 model sizes x 2 layouts), writes its table and plot, and a second
invocation skips the finished runs."""

import csv

import yaml

from launch.tools import sweep


def test_sweep_writes_table_and_plot_and_resumes(stdlib_corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    prefix, tokenizer = stdlib_corpus
    spec = {"name": "test", "output": str(tmp_path / "out"), "tokens_per_step": 256, "seq_length": 32,
            "train_iters": 3, "common": {"micro_batch_size": 2, "vocab_size": 512, "data_path": prefix,
                                        "tokenizer_model": tokenizer, "data_cache_dir": f"{prefix}-cache",
                                        "sample_prompt": "", "hidden_dropout": 0.0, "attention_dropout": 0.0},
            "models": {"2l-32": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2},
                       "4l-64": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4}},
            "layouts": {"dp2": {"nproc": 2}, "tp2": {"nproc": 2, "tensor_model_parallel_size": 2}},
            "lrs": [3e-3], "seeds": [1]}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    sweep.main([str(path)])
    rows = list(csv.DictReader(open(tmp_path / "out" / "results.csv")))
    assert len(rows) == 4 and len({row["run"] for row in rows}) == 4
    assert all(float(row["final_loss"]) > 0 and float(row["flops"]) > 0 for row in rows)
    sizes = {row["model"]: int(row["parameters"]) for row in rows}
    assert sizes["2l-32"] < sizes["4l-64"]
    assert (tmp_path / "out" / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()

    sweep.main([str(path)])  # again: nothing left to train
    assert "4 runs, 4 already finished" in capsys.readouterr().out
    assert len(list(csv.DictReader(open(tmp_path / "out" / "results.csv")))) == 4
