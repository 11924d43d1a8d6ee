"""The consolidated file and the Hugging Face GPT-2 export, from checkpoints of any layout."""

import json

import pytest
import torch
from safetensors.torch import load_file

from pretrain.interop.convert import main as convert
from tests.parity import TRAJECTORY_RTOL, assert_within
from tests.pretrain.test_trainer import TINY, _pp, _tp
from tests.world import run_world

TOKENS = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(3))


def _train_and_save(rank, world_size, corpus, directory, layout):
    """Three iterations, saved; on one process also the trained weights by name and the model's logits."""
    from pretrain.config.arguments import parse_config
    from pretrain.training.trainer import Trainer
    from pretrain.startup.validation import validate

    prefix, tokenizer = corpus
    config = parse_config(TINY + layout + ["--data-path", prefix, "--tokenizer-model",
                                           tokenizer, "--data-cache-dir",
                                           f"{prefix}-cache", "--train-iters", "3", "--save", directory])
    trainer = Trainer(config, validate(config, world_size), torch.device("cpu"))
    trainer.train()
    if world_size > 1:
        return None
    model = trainer.model[0].eval()
    with torch.no_grad():
        logits = model(TOKENS, torch.arange(32).expand(2, 32))[:, :, :config.model.vocab_size].transpose(0, 1)
    weights = {name: param.detach().clone() for param, name in trainer.parameter_names.items()}
    weights["word_embedding.weight"] = weights["word_embedding.weight"][:config.model.vocab_size]
    return weights, logits


@pytest.mark.parity
def test_consolidated_file_and_hf_export_match_the_trained_model(stdlib_corpus, tmp_path):
    single, grid = str(tmp_path / "single"), str(tmp_path / "grid")
    (weights, logits), = run_world(1, _train_and_save, stdlib_corpus, single, [])
    run_world(4, _train_and_save, stdlib_corpus, grid, [*_tp(2), *_pp(2), "--zero-stage", "1"])

    convert(["--load", single, "--output", str(tmp_path / "single.safetensors"), "--with-optimizer-states"])
    consolidated = load_file(str(tmp_path / "single.safetensors"))
    assert ({name: t for name, t in consolidated.items() if not name.startswith("optimizer.")}.keys()
            == weights.keys())
    for name, value in weights.items():
        assert torch.equal(consolidated[name], value), name  # the trained weights, exactly
        assert consolidated[f"optimizer.exp_avg_sq.{name}"].shape == value.shape

    convert(["--load", grid, "--output", str(tmp_path / "grid.safetensors")])  # tp2 x pp2: the same model
    grid_weights = load_file(str(tmp_path / "grid.safetensors"))
    assert {name: t.shape for name, t in grid_weights.items()} == {name: t.shape for name,
                                                                   t in weights.items()}
    # another layout sums in another order: the same weights up to float noise (Adam steps amplify it
    # on the tiniest gradients, so compare the whole model)
    difference = sum((grid_weights[name] - value).pow(2).sum() for name, value in weights.items()).sqrt()
    scale = sum(value.pow(2).sum() for value in weights.values()).sqrt()
    assert_within((difference / scale).item(), "tp2 x pp2 consolidated weights", TRAJECTORY_RTOL)
    # in shards of at most 64 KB (a larger tensor alone) with Hugging Face's index, by two processes: the
    # same tensors bit for bit
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    convert(["--load", grid, "--output", str(sharded / "model.safetensors"), "--max-shard-size", "64KB",
             "--workers", "2"])
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (sharded / "model.safetensors").exists()
    pieces = {}
    for name in files:
        part = load_file(str(sharded / name))
        assert sum(t.numel() * 4 for t in part.values()) <= 64_000 or len(part) == 1, name
        pieces.update(part)
    assert index["weight_map"].keys() == grid_weights.keys() == pieces.keys()
    assert all(torch.equal(pieces[name], value) for name, value in grid_weights.items())
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in grid_weights.values())

    transformers = pytest.importorskip("transformers")
    convert(["--load", grid, "--output", str(tmp_path / "hf"), "--to", "hf"])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "gpt2"
    model = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        theirs = model(TOKENS).logits
    torch.testing.assert_close(theirs, logits, rtol=1e-4, atol=1e-4)
    convert(["--load", grid, "--output", str(tmp_path / "hf-sharded"), "--to", "hf",
             "--max-shard-size", "64KB"])
    assert (tmp_path / "hf-sharded" / "model.safetensors.index.json").exists()
    with torch.no_grad():  # transformers reads the shards through the index: the same model
        assert torch.equal(transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf-sharded"))
                           .eval()(TOKENS).logits, theirs)
    # the tokenizer goes along: sentencepiece as a tokenizer.json, its ids and special ids in range
    from data.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer

    ours = SentencePieceTokenizer(stdlib_corpus[1])
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    for text in ("def f(x):\n    return x  # caf\u00e9\n", "  spaces\tand 12345"):
        assert tokenizer(text)["input_ids"] == ours.encode(text)
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["eos_token_id"] == ours.eod_id == tokenizer.eos_token_id < hf_config["vocab_size"]
    generate = transformers.pipeline("text-generation", model=str(tmp_path / "hf"))
    assert generate("def ", max_new_tokens=4, do_sample=False)[0]["generated_text"].startswith("def ")


def test_hf_export_refuses_what_no_hugging_face_class_expresses(stdlib_corpus, tmp_path, capsys):
    directory = str(tmp_path / "rope")
    run_world(1, _train_and_save, stdlib_corpus, directory, ["--position-embedding-type", "rope"])
    with pytest.raises(SystemExit, match="no Hugging Face class expresses this model \\(gpt2: "
                                         "--position-embedding-type rope; llama: --normalization LayerNorm, "
                                         "--disable-bias-linear False, --swiglu \\(the MLP is gelu\\)\\)"):
        convert(["--load", directory, "--output", str(tmp_path / "hf"), "--to", "hf"])
    # what a user points --load and --output at by mistake, each answered in one line
    for load, message in ((tmp_path / "nowhere", f"--load {tmp_path / 'nowhere'}: no such directory"),
                          (tmp_path / "rope" / "iter_0000003", f"--load {tmp_path / 'rope' / 'iter_0000003'} "
                           f"is one checkpoint: give the directory that holds it, --load {directory} "
                           "--ckpt-step 3")):
        with pytest.raises(SystemExit, match=f"^error: {message}$"):
            convert(["--load", str(load), "--output", str(tmp_path / "x.safetensors")])
    with pytest.raises(SystemExit, match=f"^error: --output {tmp_path / 'out'}: the consolidated model is a "
                       "safetensors file"):
        convert(["--load", directory, "--output", str(tmp_path / "out")])
    convert(["--load", directory, "--output", str(tmp_path / "one" / "model.safetensors"), "--max-shard-size",
             "5GB"])
    assert "fits in one shard of --max-shard-size 5GB: one file, no index" in capsys.readouterr().out
