"""What a new user types at the conversion and training commands, answered as they should be: a conversion
never writes into a directory that holds a checkpoint (ours, Megatron-LM's, a torchtitan step), unless
--add-to-output adds beside checkpoints of its own kind without moving 'latest' back, and the checkpoint it
would have hit still resumes bit for bit; --load of a directory that is no checkpoint is refused naming
what it is; flags that mean nothing where given, and nonsense values, are refused in one line; the
torchtitan round trip keeps rope theta; a Megatron export keeps its data-parallel size and tokenizer; a
missing distrib_optim.pt and a garbage common.pt are named as such."""

import hashlib
import os

import pytest
import torch

from pretrain.config.arguments import ConfigError, parse_config
from pretrain.interop.convert import main as convert
from pretrain.startup.validation import validate
from tests.pretrain.test_trainer import TINY
from tests.world import run_world

LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
PROMPT = [[5, 17, 2, 9, 40, 3, 11, 60]]


def _flags(corpus, *extra):
    prefix, tokenizer = corpus
    return TINY + LLAMA + ["--data-path", prefix, "--tokenizer-model", tokenizer, "--data-cache-dir",
                           f"{prefix}-cache", *extra]


def _train(rank, world_size, runs):
    """Each run's losses (flags in turn, in this one-process world)."""
    from pretrain.training.trainer import Trainer

    out = []
    for flags in runs:
        config = parse_config(flags)
        out.append(Trainer(config, validate(config, world_size), torch.device("cpu")).train().losses)
    return out


def _digests(directory) -> dict:
    """Every file under ``directory`` by relative path: its sha256."""
    found = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as handle:
                found[os.path.relpath(path, directory)] = hashlib.sha256(handle.read()).hexdigest()
    return found


def _refused(argv, message):
    with pytest.raises(SystemExit, match=message):
        convert(argv)


def _config_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        validate(parse_config(flags), 1)


@pytest.fixture(scope="module")
def trained(stdlib_corpus, tmp_path_factory):
    """(checkpoint directory at iteration 3, the 4-iteration run's losses, the resumed run's flags)."""
    directory = str(tmp_path_factory.mktemp("convert-outputs") / "ck")
    base = [flag for flag in _flags(stdlib_corpus) if flag not in ("--train-iters", "10")] + [
        "--lr-decay-iters", "4"]
    straight, _ = run_world(1, _train, [base + ["--train-iters", "4"],
                                        base + ["--train-iters", "3", "--save", directory]])[0]
    return directory, straight, base + ["--train-iters", "4", "--load", directory]


def test_no_conversion_overwrites_a_checkpoint_and_latest_never_moves_back(trained, tmp_path, capsys):
    directory, straight, resume = trained
    before = _digests(directory)
    holds = r"already holds checkpoints of ours \(latest: iter_0000003\)"
    # ours as Megatron's, as a torchtitan step, and a torchtitan import, into our run's directory
    _refused(["--load", directory, "--to", "megatron", "--ckpt-format", "torch", "--output", directory],
             f"^error: --output {directory} {holds}: writing there would overwrite or mix with it; give a "
             "new")
    _refused(["--load", directory, "--to", "torchtitan", "--output", directory], holds)
    titan = str(tmp_path / "step-3")
    convert(["--load", directory, "--to", "torchtitan", "--output", titan])
    _refused(["--from-torchtitan", titan, "--output", directory], holds + r".*or add --add-to-output")
    _refused(["--load", directory, "--to", "torchtitan", "--output", titan],
             "already holds a PyTorch Distributed Checkpoint")
    _refused(["--load", directory, "--to", "hf", "--output", directory], holds)
    assert _digests(directory) == before
    # added beside them on request: iteration 0, while latest stays at 3
    convert(["--from-torchtitan", titan, "--output", directory, "--add-to-output"])
    assert "latest stays iter_0000003" in capsys.readouterr().err
    assert open(os.path.join(directory, "latest")).read() == "iter_0000003"
    _refused(["--from-torchtitan", titan, "--output", directory, "--add-to-output"],
             "iter_0000000 exists: an import is iteration 0 and never replaces a checkpoint")
    assert {path: digest for path, digest in _digests(directory).items()
            if not path.startswith("iter_0000000")} == before
    # Megatron's: a second export of the same iteration is refused even with --add-to-output
    megatron = str(tmp_path / "megatron")
    convert(["--load", directory, "--to", "megatron", "--ckpt-format", "torch", "--output", megatron])
    _refused(["--load", directory, "--to", "megatron", "--output", megatron],
             r"already holds a Megatron-LM checkpoint directory \(latest_checkpointed_iteration.txt: 3\)")
    _refused(["--load", directory, "--to", "megatron", "--output", megatron, "--add-to-output"],
             "iter_0000003 exists: an export never replaces a checkpoint")
    # and the run resumes from its untouched checkpoint on the straight run's trajectory, bit for bit
    resumed, = run_world(1, _train, [resume])[0]
    assert resumed == straight[3:]


def test_load_of_a_directory_that_is_no_checkpoint_is_refused(trained, tmp_path):
    directory, _, resume = trained
    titan = str(tmp_path / "step-3")
    convert(["--load", directory, "--to", "torchtitan", "--output", titan])
    flags = [flag for flag in resume if flag not in ("--load", directory)]
    _config_refused(flags + ["--load", titan], f"^--load {titan} is a PyTorch Distributed Checkpoint .*: "
                                               "import it with python -m pretrain.convert --from-torchtitan")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.md").write_text("notes")
    _config_refused(flags + ["--load", str(tmp_path / "docs")],
                    r"holds no checkpoint \(it has notes.md\): give the directory a run's --save wrote")
    for fresh in ("empty", "first-save"):  # no checkpoint yet: a restart loop's first start
        (tmp_path / fresh).mkdir()
    (tmp_path / "first-save" / "iter_0000002.tmp").mkdir()
    for fresh in ("empty", "first-save", "missing"):
        validate(parse_config(flags + ["--load", str(tmp_path / fresh)]), 1)


def test_bad_flags_and_values_get_one_line(trained, tmp_path, capsys):
    directory, _, resume = trained
    for flag, value in (("--target-tensor-parallel-size", "0"), ("--target-tensor-parallel-size", "-2"),
                        ("--target-pipeline-parallel-size", "0"), ("--target-pipeline-parallel-size", "-1")):
        _refused(["--load", directory, "--to", "megatron", "--ckpt-format", "torch", flag, value, "--output",
                  str(tmp_path / "m")], f"^error: {flag} {value}: give 1 or more ranks$")
    meaningless = [(["--ckpt-format", "torch_dist"],
                    "--ckpt-format means something with --to megatron only"),
                   (["--to", "megatron", "--target-tensor-parallel-size", "2"],
                    "--target-tensor-parallel-size means something with --to megatron --ckpt-format torch"),
                   (["--to", "hf", "--with-optimizer-states"],
                    "--with-optimizer-states means something with"),
                   (["--rotary-base", "10000"], "--rotary-base means something with --from-torchtitan only")]
    for extra, message in meaningless:
        _refused(["--load", directory, "--output", str(tmp_path / "x.safetensors"), *extra],
                 f"^error: {message}")
    _refused(["--load", directory, "--list", "--output", str(tmp_path / "x")],
             "^error: --output with --list: --list only describes --load and writes nothing")
    assert not os.path.exists(tmp_path / "m") and not os.path.exists(tmp_path / "x")
    flags = [flag for flag in resume if flag not in ("--load", directory)]
    _config_refused(flags + ["--muon-momentum", "0.9"], "^--muon-momentum sets Muon up, and --optimizer is "
                                                        "adam: add --optimizer muon or drop the flag$")
    _config_refused(flags + ["--optimizer", "muon", "--muon-extra-scale-factor", "-1"],
                    "^--muon-extra-scale-factor -1: a factor on every Muon update must be > 0")
    _config_refused(flags + ["--use-mup", "--mup-attn-scale-power", "-1"],
                    r"^--mup-attn-scale-power -1: the power of head_dim in the attention scale is in "
                    r"\(0, 1\]")
    _config_refused(flags + ["--lr-warmup-iters", "30", "--lr-decay-iters", "20"],
                    r"^the warm-up \(240 samples: .*\) is not shorter than the decay \(160 samples")
    with pytest.raises(SystemExit):
        convert(["--help"])
    assert "else 500000" in capsys.readouterr().out.replace("\n", " ").replace("  ", " ")


def test_round_trips_keep_rope_theta_tokenizer_and_name_what_is_missing(trained, tmp_path, capsys):
    from pretrain import load_model
    from pretrain.interop.saved_model import describe
    from pretrain.checkpoint.catalog import read_manifest

    directory, _, _ = trained
    ours = load_model(directory)
    want = ours(torch.tensor(PROMPT))
    assert ours.config.rotary_base == 10000  # Megatron's default, not torchtitan's 500000
    titan, back = str(tmp_path / "step-3"), str(tmp_path / "back")
    convert(["--load", directory, "--to", "torchtitan", "--output", titan])
    convert(["--from-torchtitan", titan, "--output", back])  # no flag: the recorded layout
    with pytest.warns(UserWarning, match="no tokenizer: .* was imported without tokenizer files"):
        imported = load_model(back)
    assert torch.equal(imported(torch.tensor(PROMPT)), want)
    _refused(["--from-torchtitan", titan, "--output", str(tmp_path / "b2"), "--rotary-base", "500000"],
             r"--rotary-base 500000 contradicts .*model_args.json, which records 10000: drop the flag")
    # Megatron's: the run's dp in its args, the tokenizer beside it (load_model's tokenizer encodes alike)
    megatron = str(tmp_path / "megatron")
    convert(["--load", directory, "--to", "megatron", "--ckpt-format", "torch", "--with-optimizer-states",
             "--output", megatron])
    capsys.readouterr()
    convert(["--load", megatron, "--list"])
    listed = capsys.readouterr().out
    assert "saved at tp1 x pp1 x vp1 x ep1 x dp1" in listed and "distributed optimizer's fp32" in listed
    text = "def f(x):\n    return x\n"
    assert load_model(megatron).tokenizer.encode(text) == ours.tokenizer.encode(text)
    # its distrib_optim.pt gone: named, on --list and on --load
    os.remove(os.path.join(megatron, "iter_0000003", "mp_rank_00", "distrib_optim.pt"))
    convert(["--load", megatron, "--list"])
    assert "no distrib_optim.pt beside the rank files" in capsys.readouterr().out
    _config_refused(_loading(trained, megatron),
                    "its args say --use-distributed-optimizer, but the distrib_optim.pt that holds its "
                    "optimizer states is missing")
    # torch_dist's common.pt replaced by garbage: refused as such, with no advice to run its pickle
    dist = str(tmp_path / "dist")
    convert(["--load", directory, "--to", "megatron", "--output", dist])
    with open(os.path.join(dist, "iter_0000003", "common.pt"), "wb") as handle:
        handle.write(os.urandom(256))
    with pytest.raises(SystemExit) as refusal:
        convert(["--load", dist, "--list"])
    assert "common.pt is not a readable torch file" in str(refusal.value)
    assert "weights_only" not in str(refusal.value).split("readable torch file", 1)[1]
    # --list names the optimizer the states belong to
    checkpoint, manifest = read_manifest(directory)
    assert "--optimizer adam's (Adam's two moments)" in "\n".join(describe(checkpoint, manifest))
    manifest["states"]["optimizer"] = {"name": "muon"}
    assert "--optimizer muon's (Muon's momentum" in "\n".join(describe(checkpoint, manifest))


def _loading(trained, load):
    """The resumed run's flags with ``--load load`` instead."""
    directory, _, resume = trained
    return [flag for flag in resume if flag not in ("--load", directory)] + ["--load", load]
