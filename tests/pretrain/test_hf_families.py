"""Every Hugging Face family the interop maps, against transformers' own code.

A tiny random model of each family (made by transformers from the family's config class, with what
sets it apart switched on: rope scaling that changes the frequencies, sliding windows shorter than the
prompts, soft-capping, query/key norms, fused projections, tied embeddings) gives transformers' logits
through ``pretrain.load_model``, at tp2 + SP x pp2 and at tp2 x dp2 ZeRO-3; exports back bit for bit;
and a short SFT at tp2 x dp2 ZeRO-3 lowers transformers' own loss on held-out examples.
"""

import json
import os
import shutil

import pytest
import torch

from launch.examples.hf_families import FAMILIES, make_model
from pretrain import load_model
from pretrain.config.arguments import parse_config
from pretrain.interop.convert import main as convert
from pretrain.interop.hf_config import config_from_hf
from pretrain.interop.hf_tensor_plan import stored_name
from pretrain.startup.validation import validate
from tests.data.bpe_files import write_hf_directory
from tests.data.synthetic import WORDS, make_documents
from tests.parity import ONE_STEP_RTOL, assert_within
from tests.world import run_world

transformers = pytest.importorskip("transformers")
PROMPTS = [[5, 17, 2, 9, 40, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [60, 61]]  # 11 > every window
INTEROP_RTOL = 100 * ONE_STEP_RTOL  # another implementation: one forward pass, on the logits' scale
FEATURES = {"llama3.1": "llama3 rope, GQA, untied, sharded files", "llama3.2": "llama3 rope, tied",
            "mistral": "sliding window 4", "mistral-nemo": "head_dim 16 != h/a",
            "qwen2.5": "q/k/v biases, window on layer 2 of 2, tied",
            "qwen3": "per-head q/k norms, head_dim, yarn",
            "gemma2": "sandwich norms 1+w, GeGLU tanh, sqrt(h) embeddings, both soft-caps, "
                      "query_pre_attn_scalar, local/global layers",
            "gemma3": "gemma2's + q/k norms, local rope base, linear rope on global layers",
            "phi3": "fused qkv / gate_up, longrope, partial rotary, window 6",
            "olmo2": "post norms, q/k norms over the projection", "gpt2": "learned positions, Conv1D"}


def _relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def made_families(tmp_path_factory, names) -> dict:
    """{family: (HF directory, its last-token logits on PROMPTS)} for each of ``names``, every weight
    perturbed away from its initial value (norm weights included) so that each mapping is exercised."""
    tokenizer = write_hf_directory(str(tmp_path_factory.mktemp("tokenizer")), make_documents(40),
                                   vocab_size=300)
    vocab = len(transformers.AutoTokenizer.from_pretrained(tokenizer))
    made = {}
    for family in names:
        directory = str(tmp_path_factory.mktemp(family))
        for name in os.listdir(tokenizer):
            shutil.copy(os.path.join(tokenizer, name), directory)
        model = make_model(family, vocab, bos=0, eos=1).eval()
        generator = torch.Generator().manual_seed(len(made))
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
            for name, buffer in model.named_buffers():  # DeepSeek-V3's score-correction bias routes too
                if name.endswith("e_score_correction_bias"):
                    buffer.add_(torch.randn(buffer.shape, generator=generator) * 0.1)
        # the Llama in shards of a few tensors, with an index, as large checkpoints come
        model.save_pretrained(directory, max_shard_size="40KB" if family == "llama3.1" else "5GB")
        with torch.no_grad():
            made[family] = (directory, [model(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    return made


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return made_families(tmp_path_factory, FAMILIES)


@pytest.mark.parity
def test_load_model_gives_transformers_logits_and_the_export_round_trips_bit_for_bit(families, tmp_path):
    check_load_and_export(families, tmp_path)


def _convolutions_joined(tensors: dict) -> dict:
    """OLMo hybrid's q, k and v convolutions as one tensor: transformers saves them cut into three even
    pieces (its load-time concatenation undone by torch.chunk), not at the q / k / v widths its released
    checkpoints (and our export) have; joined, they are the same tensor. Other families' as they are."""
    out = dict(tensors)
    for prefix in [name[:-len("q_conv1d.weight")] for name in tensors if name.endswith(".q_conv1d.weight")]:
        out[prefix + "conv1d.weight"] = torch.cat([out.pop(f"{prefix}{p}_conv1d.weight") for p in "qkv"])
    return out


def check_load_and_export(families: dict, tmp_path) -> None:
    """Each family's directory through ``load_model`` gives transformers' logits within the interop bound;
    imported and exported again it is the same tensors bit for bit, which transformers loads to the same
    logits."""
    from safetensors.torch import load_file

    batch = torch.tensor([list(range(3, 23)), list(range(40, 60))])  # 20 tokens: past every window
    for family, (directory, _) in families.items():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        with torch.no_grad():
            want = theirs(batch).logits
            got = load_model(directory)(batch)
        assert got.shape == want.shape
        assert_within(_relative(got, want), f"{family}: load_model of the HF directory", INTEROP_RTOL)
        checkpoint, exported = str(tmp_path / family), str(tmp_path / f"{family}-hf")
        convert(["--from-hf", directory, "--output", checkpoint])
        loaded = load_model(checkpoint)
        text = "def f(x):\n    return x"  # the directory's tokenizer came with the model
        assert loaded.tokenizer.decode(loaded.tokenizer.encode(text)) == "<s>" + text
        with torch.no_grad():
            assert torch.equal(loaded(batch), got)  # the same weights through our own checkpoint
        convert(["--load", checkpoint, "--to", "hf", "--output", exported])
        original = {}
        for name in sorted(os.listdir(directory)):
            if name.endswith(".safetensors"):
                original.update(load_file(os.path.join(directory, name)))
        # (transformers saves Kimi Linear's dense MLPs under another name than Moonshot's, which we write)
        rename = stored_name(config_from_hf(json.load(open(os.path.join(directory, "config.json"))))
                             .hf_model_type)
        original = {rename(name): tensor for name, tensor in original.items()}
        original, again = (_convolutions_joined(tensors) for tensors in (
            original, load_file(os.path.join(exported, "model.safetensors"))))
        assert again.keys() == original.keys(), family
        for name, tensor in again.items():
            assert torch.equal(tensor, original[name]), (family, name)  # bit for bit
        assert json.load(open(os.path.join(exported, "config.json")))["architectures"] == \
            json.load(open(os.path.join(directory, "config.json")))["architectures"]
        with torch.no_grad():
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
            assert torch.equal(reloaded(batch).logits, want)


def _sft_examples(count: int, seed: int) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [{"prompt": f"def {rng.choice(WORDS)}_{rng.choice(WORDS)}(x):",
             "response": f"\n    return x * {rng.randint(0, 9)}"} for _ in range(count)]


def _held_out_loss(directory: str, examples: list[dict]) -> float:
    """transformers' mean loss on the response tokens of ``examples``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    total, count = 0.0, 0
    for example in examples:
        prompt = tokenizer(example["prompt"])["input_ids"]
        ids = tokenizer(example["prompt"] + example["response"])["input_ids"]
        labels = [-100] * len(prompt) + ids[len(prompt):]
        with torch.no_grad():
            loss = model(torch.tensor([ids]), labels=torch.tensor([labels])).loss.item()
        total, count = total + loss * (len(ids) - len(prompt)), count + len(ids) - len(prompt)
    return total / count


# the layouts a family's logits are checked in: (name, its flags); the second also fine-tunes at ZeRO-3
DENSE_LAYOUTS = (("tp2 + SP x pp2", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                                     "2", "--sequence-parallel"]),
                 ("tp2 x dp2 ZeRO-3", ["--tensor-model-parallel-size", "2"]))


def _layouts_and_fine_tune(rank, world_size, checkpoints, data, work, layouts):
    """Per family: the logits in the first of ``layouts``; in the second (at ZeRO-3) the logits, then a
    short SFT run saved under ``work``."""
    from pretrain.training.trainer import Trainer

    (_, first), (_, second) = layouts
    results = {}
    for family, checkpoint in checkpoints.items():
        common = ["--sample-prompt", "", "--data-cache-path", f"{work}/cache-{family}",
                  "--hidden-dropout", "0", "--attention-dropout", "0"]
        config = parse_config(["--load", checkpoint, "--mock-data", "--seq-length", "16",
                               "--micro-batch-size", "1", "--train-iters", "1", *first, *common])
        trainer = Trainer(config, validate(config, world_size), torch.device("cpu"))
        trainer.model.eval()
        split = [trainer.runner.next_token_logits(prompt) for prompt in PROMPTS]
        config = parse_config(["--pretrained-checkpoint", checkpoint, "--sft", "--data-path", data,
                               "--split", "1,0,0", "--seq-length", "24", "--micro-batch-size", "2",
                               "--global-batch-size", "8", "--train-iters", "12", "--lr", "2e-3",
                               "--lr-warmup-iters", "2", "--zero-stage", "3",
                               "--zero-persistence-threshold", "0", "--save", f"{work}/{family}",
                               "--save-interval", "12", "--log-interval", "6", *second, *common])
        trainer = Trainer(config, validate(config, world_size), torch.device("cpu"))
        trainer.model.eval()
        sharded = [trainer.runner.next_token_logits(prompt) for prompt in PROMPTS]
        trainer.model.train()
        trainer.train()
        results[family] = (split, sharded)
    return results


def check_layouts_and_fine_tune(families: dict, tmp_path, layouts, features: dict) -> list[str]:
    """Each family imported, its logits in both ``layouts`` within the interop bound of transformers', and
    a short SFT (in the second) that lowers transformers' own held-out loss; returns the table's rows."""
    checkpoints = {}
    for family, (directory, _) in families.items():
        checkpoints[family] = str(tmp_path / "imported" / family)
        convert(["--from-hf", directory, "--output", checkpoints[family]])
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(example) + "\n" for example in _sft_examples(64, seed=0)))
    held_out = _sft_examples(16, seed=1)
    results = run_world(4, _layouts_and_fine_tune, checkpoints, str(data), str(tmp_path / "work"), layouts,
                        timeout_s=900)[0]
    table = ["| family | features | worst logit error | held-out loss before -> after |", "|---|---|---|---|"]
    for family, (directory, theirs) in families.items():
        worst = 0.0
        for (layout, _), logits in zip(layouts, results[family]):
            for ours, reference in zip(logits, theirs):
                error = _relative(ours, reference)
                worst = max(worst, error)
                assert_within(error, f"{family} logits at {layout}", INTEROP_RTOL)
        tuned = str(tmp_path / f"{family}-tuned")
        convert(["--load", str(tmp_path / "work" / family), "--to", "hf", "--output", tuned])
        before, after = _held_out_loss(directory, held_out), _held_out_loss(tuned, held_out)
        assert after < before, (family, before, after)
        table.append(f"| {family} | {features[family]} | {worst:.1e} | {before:.3f} -> {after:.3f} |")
    return table


@pytest.mark.slow
@pytest.mark.parity
def test_every_family_in_tp_pp_and_zero3_layouts_and_a_short_fine_tune_lowers_its_held_out_loss(families,
                                                                                               tmp_path):
    print("\n" + "\n".join(check_layouts_and_fine_tune(families, tmp_path, DENSE_LAYOUTS, FEATURES)))


def test_mixture_of_experts_multimodal_and_unknown_configs_are_refused_naming_the_key(families, tmp_path):
    directory, _ = families["llama3.1"]
    base = json.load(open(os.path.join(directory, "config.json")))
    for change, message in [
            ({"model_type": "granitemoe", "num_local_experts": 8},
             "model_type 'granitemoe' with num_local_experts=8: this mixture-of-experts family is not mapped "
             "(mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3, gpt_oss, qwen3_next, kimi_linear are)"),
            ({"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8"}},
             "model_type 'deepseek_v3' with quantization_config.quant_method='fp8': quantized weights are "
             "not supported"),
            ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
              "router_jitter_noise": 0.1}, "mixtral with router_jitter_noise=0.1: router noise does not map"),
            ({"model_type": "llava", "vision_config": {"model_type": "clip_vision_model"}},
             "model_type 'llava' with vision_config: multimodal towers are not supported"),
            ({"model_type": "t5", "is_encoder_decoder": True}, "is_encoder_decoder=true: encoder-decoder"),
            ({"model_type": "gemma3_text", "use_bidirectional_attention": True},
             "use_bidirectional_attention=true: only causal attention maps"),
            ({"model_type": "falcon"}, "model_type 'falcon' is not supported"),
            ({"rope_parameters": {"rope_type": "proportional", "factor": 8.0}},
             "rope_type 'proportional' is not supported"),
            ({"model_type": "llama", "attention_bias": True}, "llama with attention_bias=True: biases"),
            ({"model_type": "qwen3", "layer_types": ["chunked_attention"] * 2, "use_sliding_window": True,
              "sliding_window": 4}, "qwen3 with layer_types ['chunked_attention']")]:
        broken = tmp_path / f"broken-{len(os.listdir(tmp_path))}"
        broken.mkdir()
        (broken / "config.json").write_text(json.dumps({**base, **change}))  # no weights: refused before
        with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")
                           .replace("[", r"\[").replace("]", r"\]")):
            convert(["--from-hf", str(broken), "--output", str(tmp_path / "out")])


def test_an_export_names_every_special_id_so_no_family_default_lies_beyond_the_vocabulary():
    from pretrain.interop.hf_config import config_to_hf

    phi3 = make_model("phi3", 12).config.to_dict()  # Phi-3's default pad id is 32000
    written = config_to_hf(config_from_hf(phi3), {"bos_token_id": 1, "eos_token_id": 2})
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (1, 2, None)
    transformers.AutoConfig.for_model(**written)  # and transformers takes it
