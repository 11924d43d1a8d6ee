"""The mixture-of-experts families the interop maps (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), against
transformers' own code: a tiny random model of each (made by transformers from the family's config class,
every weight perturbed) gives transformers' logits through ``pretrain.load_model``, at ep2 x tp2 + SP and
at ep2 x expert dp 2 ZeRO-3; exports back bit for bit; and a short SFT at ep2 ZeRO-3 lowers transformers'
own loss on held-out examples."""

import json
import os
import shutil

import pytest
import torch

from launch.examples.hf_families import MOE_FAMILIES, make_model
from pretrain import load_model
from pretrain.config.arguments import parse_config
from pretrain.interop.convert import main as convert
from pretrain.startup.validation import validate
from tests.data.bpe_files import write_hf_directory
from tests.data.synthetic import make_documents
from tests.parity import assert_within
from tests.pretrain.test_hf_families import INTEROP_RTOL, PROMPTS, _held_out_loss, _relative, _sft_examples
from tests.world import run_world

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def moe_families(tmp_path_factory):
    """{family: (HF directory, its last-token logits on PROMPTS)}, every weight perturbed."""
    tokenizer = write_hf_directory(str(tmp_path_factory.mktemp("tokenizer")), make_documents(40),
                                   vocab_size=300)
    vocab = len(transformers.AutoTokenizer.from_pretrained(tokenizer))
    made = {}
    for family in MOE_FAMILIES:
        directory = str(tmp_path_factory.mktemp(family))
        for name in os.listdir(tokenizer):
            shutil.copy(os.path.join(tokenizer, name), directory)
        model = make_model(family, vocab, bos=0, eos=1).eval()
        generator = torch.Generator().manual_seed(len(made))
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
            model.save_pretrained(directory)
            made[family] = (directory, [model(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    return made


def test_load_model_gives_transformers_logits_and_the_export_round_trips_bit_for_bit(moe_families, tmp_path):
    from safetensors.torch import load_file

    batch = torch.tensor([list(range(3, 23)), list(range(40, 60))])
    for family, (directory, _) in moe_families.items():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        with torch.no_grad():
            want = theirs(batch).logits
            got = load_model(directory)(batch)
        assert_within(_relative(got, want), f"{family}: load_model of the HF directory", INTEROP_RTOL)
        checkpoint, exported = str(tmp_path / family), str(tmp_path / f"{family}-hf")
        convert(["--from-hf", directory, "--output", checkpoint])
        convert(["--load", checkpoint, "--to", "hf", "--output", exported])
        original, again = load_file(os.path.join(directory, "model.safetensors")), \
            load_file(os.path.join(exported, "model.safetensors"))
        assert again.keys() == original.keys(), family
        assert all(torch.equal(tensor, original[name]) for name, tensor in again.items()), family
        assert json.load(open(os.path.join(exported, "config.json")))["architectures"] == \
            json.load(open(os.path.join(directory, "config.json")))["architectures"]
        with torch.no_grad():
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
            assert torch.equal(reloaded(batch).logits, want), family


def _layouts_and_fine_tune(rank, world_size, checkpoints, data, work):
    """Per family: the logits at ep2 x tp2 + SP (alltoall); at ep2 x expert dp 2 ZeRO-3 (allgather) the
    logits, then a short SFT run saved under ``work``."""
    from pretrain.training.trainer import Trainer

    results = {}
    for family, checkpoint in checkpoints.items():
        common = ["--sample-prompt", "", "--data-cache-path", f"{work}/cache-{family}", "--hidden-dropout",
                  "0", "--attention-dropout", "0", "--expert-model-parallel-size", "2"]
        split = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-token-dispatcher-type",
                 "alltoall"]
        config = parse_config(["--load", checkpoint, "--mock-data", "--seq-length", "16",
                               "--micro-batch-size", "1", "--train-iters", "1", *split, *common])
        trainer = Trainer(config, validate(config, world_size), torch.device("cpu"))
        trainer.model.eval()
        split = [trainer.runner.next_token_logits(prompt) for prompt in PROMPTS]
        config = parse_config(["--pretrained-checkpoint", checkpoint, "--sft", "--data-path", data,
                               "--split", "1,0,0", "--seq-length", "24", "--micro-batch-size", "2",
                               "--global-batch-size", "8", "--train-iters", "12", "--lr", "2e-3",
                               "--lr-warmup-iters", "2", "--zero-stage", "3", "--zero-persistence-threshold",
                               "0", "--save", f"{work}/{family}", "--save-interval", "12", "--log-interval",
                               "6", *common])
        trainer = Trainer(config, validate(config, world_size), torch.device("cpu"))
        trainer.model.eval()
        sharded = [trainer.runner.next_token_logits(prompt) for prompt in PROMPTS]
        trainer.model.train()
        trainer.train()
        results[family] = (split, sharded)
    return results


@pytest.mark.parity
def test_every_moe_family_at_ep2_with_tp_and_zero3_and_a_short_fine_tune_lowers_its_loss(moe_families,
                                                                                         tmp_path):
    checkpoints = {}
    for family, (directory, _) in moe_families.items():
        checkpoints[family] = str(tmp_path / "imported" / family)
        convert(["--from-hf", directory, "--output", checkpoints[family]])
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(example) + "\n" for example in _sft_examples(64, seed=0)))
    held_out = _sft_examples(16, seed=1)
    results = run_world(4, _layouts_and_fine_tune, checkpoints, str(data), str(tmp_path / "work"),
                        timeout_s=900)[0]
    table = ["| family | worst logit error | held-out loss before -> after |", "|---|---|---|"]
    for family, (directory, theirs) in moe_families.items():
        worst = 0.0
        for layout, logits in zip(("ep2 x tp2 + SP", "ep2 x expert dp 2 ZeRO-3"), results[family]):
            for ours, reference in zip(logits, theirs):
                worst = max(worst, _relative(ours, reference))
                assert_within(_relative(ours, reference), f"{family} logits at {layout}", INTEROP_RTOL)
        tuned = str(tmp_path / f"{family}-tuned")
        convert(["--load", str(tmp_path / "work" / family), "--to", "hf", "--output", tuned])
        before, after = _held_out_loss(directory, held_out), _held_out_loss(tuned, held_out)
        assert after < before, (family, before, after)
        table.append(f"| {family} | {worst:.1e} | {before:.3f} -> {after:.3f} |")
    print("\n" + "\n".join(table))
