"""Device profiles: the planner's step time priced by achieved rates predicts Megatron-LM's published runs;
a profile measured here is read back by ``launch.plan --device FILE``; a bad profile is refused by name."""

import json

import pytest

from launch.bench import device_rates, published_runs
from launch.tools.planning.devices import PROFILES, DeviceProfile, load_profile
from launch.tools.planning.plan_command import main as plan_main

GPT3_175B = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length",
             "2048", "--max-position-embeddings", "2048", "--vocab-size", "51200", "--bf16"]


def test_the_profiles_predict_published_runs_on_a_thousand_gpus_and_more(tmp_path):
    """Narayanan et al. 2021, table 1: the runs on 1,024-3,072 A100s (tp 8, pp 4-64) within 15% of their
    measured step time; Llama 3 405B on 8,192 and 16,384 H100s (its uneven interleaved cut) within 20%; the
    table holds every published run with its source (docs/published_runs.md says why MT-NLG's DeepSpeed
    pipeline and BLOOM run slower than this prices them)."""
    results = published_runs.main(["--output", str(tmp_path / "runs.md")])
    large = [r for r in results if r["gpus"] >= 1000 and r["source"] == published_runs.NARAYANAN]
    assert len(large) == 5
    for r in large:
        assert abs(r["predicted"] / r["measured"] - 1) <= 0.15, r
    llama = [r for r in results if "Llama" in r["name"]]
    assert len(llama) == 2 and all(abs(r["predicted"] / r["measured"] - 1) <= 0.20 for r in llama), llama
    table = (tmp_path / "runs.md").read_text()
    assert all(source in table for source in ("Narayanan", "MT-NLG", "BLOOM", "Llama"))


def test_a_measured_profile_is_read_back_by_the_planner(tmp_path, capsys):
    """gpu_check's rates section (here its CPU smoke) writes a profile; ``launch.plan --device FILE`` prices
    a GPT-3 175B search with it, in step seconds."""
    path = tmp_path / "profile.json"
    measured = device_rates.main(["--smoke", "--output", str(path)])
    assert load_profile(str(path)) == measured
    assert [size for size, _ in measured.matmul] == [64, 128, 256]
    capsys.readouterr()
    plan_main([*GPT3_175B, "--world-size", "1024", "--device", str(path), "--inter-node-bandwidth",
               "400Gbit", "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
               "--zero-stage", "1", "--top", "1"])
    assert "step s" in capsys.readouterr().out


def test_profiles_interpolate_by_shape_and_bad_ones_are_refused_by_name(tmp_path, capsys):
    a100 = PROFILES["a100"]
    rates = [a100.matmul_rate(size) for size in (64, 256, 300, 1024, 1500, 4096, 20000)]
    assert rates == sorted(rates) and rates[-1] == a100.matmul[-1][1] and rates[1] == a100.matmul[0][1]
    assert a100.matmul_rate(128) == pytest.approx(a100.matmul[0][1] / 2)  # too thin to fill the device
    good = json.loads(a100.to_json())
    for change, message in (({"bogus": 1}, "expected a JSON object of the fields"),
                            ({"memory_bandwidth": -1}, "must be a positive number"),
                            ({"matmul": [[512, 1e12], [256, 2e12]]}, "matmul sizes must rise")):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({**good, **change}))
        with pytest.raises(ValueError, match=message):
            load_profile(str(path))
    with pytest.raises(ValueError, match="neither a built-in device"):
        load_profile(str(tmp_path / "missing.json"))
    with pytest.raises(SystemExit, match="--device 'v100' is neither a built-in device"):
        plan_main([*GPT3_175B, "--world-size", "64", "--device", "v100"])
    assert load_profile("H100") is PROFILES["h100"] and isinstance(PROFILES["h200"], DeviceProfile)
