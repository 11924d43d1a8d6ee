"""Fine-tuning Hugging Face models, against transformers' own code: an imported OLMo 2 and Gemma 2
fine-tune alike in every layout, the SFT loss is transformers' own loss over the answer tokens, the
fine-tune job learns its mapping, and a model whose config and tensors disagree is refused naming
what is wrong (every family's logits, export and refusals: ``test_hf_families``)."""

import json
import os
import shutil

import pytest
import torch

from launch.examples.hf_families import make_model
from pretrain.config.arguments import parse_config
from pretrain.interop.convert import main as convert
from pretrain.startup.validation import validate
from tests.data.bpe_files import write_hf_directory
from tests.data.synthetic import make_documents
from tests.parity import ONE_STEP_RTOL, assert_trajectory_close, assert_within
from tests.world import run_world

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """{family: HF directory} of the families these tests fine-tune or break, each with a tokenizer the run
    can read."""
    tokenizer = write_hf_directory(str(tmp_path_factory.mktemp("tokenizer")), make_documents(40),
                                   vocab_size=300)
    vocab = len(transformers.AutoTokenizer.from_pretrained(tokenizer))
    models = {}
    for family in ("llama3.1", "gpt2", "olmo2", "gemma2"):
        directory = str(tmp_path_factory.mktemp(family))
        for name in os.listdir(tokenizer):
            shutil.copy(os.path.join(tokenizer, name), directory)
        make_model(family, vocab, bos=0, eos=1).save_pretrained(directory)
        models[family] = directory
    return models


def _fine_tune(rank, world_size, checkpoint, layouts):
    from pretrain.training.trainer import Trainer

    results = []
    for layout in layouts:
        config = parse_config(["--pretrained-checkpoint", checkpoint, "--mock-data", "--seq-length", "16",
                               "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "10",
                               "--lr", "1e-3", "--lr-warmup-iters", "2", "--hidden-dropout", "0",
                               "--attention-dropout", "0", "--sample-prompt", "", "--log-interval", "5",
                               "--data-cache-path", checkpoint + "-cache", *layout])
        result = Trainer(config, validate(config, world_size), torch.device("cpu")).train()
        results.append((result.losses, result.grad_norms))
        torch.distributed.barrier()
    return results


@pytest.mark.parity
def test_a_fine_tune_reproduces_the_single_process_fine_tune(hf_models, tmp_path):
    """OLMo 2 (post norms, q/k norms over a projection split across tp) and Gemma 2 (sandwich norms,
    soft-capped scores and logits, GeGLU): backward through each follows one process at dp2 ZeRO-3 and
    tp2 + SP."""
    for family in ("olmo2", "gemma2"):
        checkpoint = str(tmp_path / family)
        convert(["--from-hf", hf_models[family], "--output", checkpoint])
        (losses, norms), = run_world(1, _fine_tune, checkpoint, [[]])[0]
        assert losses[-1] < losses[0]
        layouts = [["--zero-stage", "3", "--zero-persistence-threshold", "0"],
                   ["--tensor-model-parallel-size", "2", "--sequence-parallel"]]
        for rank_results in run_world(2, _fine_tune, checkpoint, layouts):
            for (got_losses, got_norms), what in zip(rank_results, ("dp2 ZeRO-3", "tp2 + SP")):
                assert_trajectory_close(got_losses, losses, f"{family} fine-tune {what}: loss")
                assert_trajectory_close(got_norms, norms, f"{family} fine-tune {what}: grad norm")


def test_models_that_do_not_map_are_refused_naming_why(hf_models, tmp_path):
    directory = hf_models["llama3.1"]
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(directory):
        os.symlink(os.path.join(directory, name), broken / name)
    os.remove(broken / "config.json")
    (broken / "config.json").write_text(json.dumps(
        {**json.load(open(os.path.join(directory, "config.json"))), "intermediate_size": 64}))
    with pytest.raises(SystemExit, match=r"make layers.0.mlp.fc1.weight of shape \(2, 48, 32\); the "
                                         r"architecture in config.json needs \(2, 64, 32\)"):
        convert(["--from-hf", str(broken), "--output", str(tmp_path / "out")])
    from safetensors.torch import load_file, save_file

    missing = tmp_path / "missing"
    missing.mkdir()
    gpt2 = hf_models["gpt2"]
    for name in os.listdir(gpt2):
        if name != "model.safetensors":
            os.symlink(os.path.join(gpt2, name), missing / name)
    tensors = load_file(os.path.join(gpt2, "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "transformer.h.1.mlp.c_fc.weight"},
              str(missing / "model.safetensors"))
    with pytest.raises(SystemExit, match="has no tensor transformer.h.1.mlp.c_fc.weight"):
        convert(["--from-hf", str(missing), "--output", str(tmp_path / "out2")])


def _first_sft_step(rank, world_size, checkpoint, data):
    from pretrain.training.trainer import Trainer

    config = parse_config(["--pretrained-checkpoint", checkpoint, "--sft", "--data-path",
                           data, "--split", "1,0,0",
                           "--seq-length", "24", "--micro-batch-size", "2", "--global-batch-size", "4",
                           "--train-iters", "1", "--sample-prompt", ""])
    trainer = Trainer(config, validate(config, world_size), torch.device("cpu"))
    samples = [trainer.data.train[index] for index in range(4)]  # the first global batch, in sampler order
    return trainer.train().losses[0], samples


def test_the_sft_loss_is_the_mean_over_answer_tokens_computed_by_hand(hf_models, tmp_path):
    directory = hf_models["llama3.1"]
    checkpoint = str(tmp_path / "llama")
    convert(["--from-hf", directory, "--output", checkpoint])
    data = tmp_path / "sft.jsonl"
    lines = [{"prompt": "def f(x):", "response": " return x"},
             {"messages": [{"role": "user", "content": "alpha"},
                           {"role": "assistant", "content": "beta gamma"}]},
             {"prompt": "import os", "response": "\nimport sys"},
             {"messages": [{"role": "system", "content": "short"}, {"role": "user", "content": "grad"},
                           {"role": "assistant", "content": "rank"}, {"role": "user", "content": "shard"},
                           {"role": "assistant", "content": "token layer"}]}]
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    (loss, samples), = run_world(1, _first_sft_step, checkpoint, str(data))
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    by_hand = []
    for micro in (samples[:2], samples[2:]):
        tokens = torch.stack([sample["tokens"] for sample in micro])
        with torch.no_grad():
            logits = model(tokens).logits
        per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.stack(
            [sample["labels"] for sample in micro]).flatten(), reduction="none")
        mask = torch.stack([sample["loss_mask"] for sample in micro]).flatten()
        assert 0 < mask.sum() < mask.numel()  # answers count, prompts and padding do not
        by_hand.append((per_token * mask).sum() / mask.sum())
    assert_within(abs(loss - sum(by_hand).item() / 2) / loss, "SFT loss by hand", 100 * ONE_STEP_RTOL)


@pytest.mark.slow
def test_the_fine_tune_job_learns_its_mapping_and_transformers_answers(tmp_path):
    """launch/finetune_job.sh end to end: import, ZeRO-3 bf16 on 2 processes, export, generate."""
    import subprocess

    job = subprocess.run(["bash", "launch/finetune_job.sh"], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, WORK=str(tmp_path / "work"), OMP_NUM_THREADS="1",
                                  WANDB_MODE="disabled"),
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert job.returncode == 0, job.stderr[-3000:]
    right = int(job.stdout.split("held-out prompts answered right: ")[1].split()[0])
    assert right >= 16, job.stdout[-2000:]  # of 20 prompts the training set never showed


TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_templates_come_in_and_go_out_and_a_tokenizerless_model_still_converts(hf_models, tmp_path,
                                                                                    capsys):
    """transformers 5 keeps a template in chat_template.jinja (named ones in additional_chat_templates/):
    imported, our SFT renders what transformers renders, and the export carries them. A directory without
    tokenizer files imports with a note, exports its weights and config, loads, and a run that would pair
    it with the built-in corpus's tokenizer is refused naming why."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data.sft_dataset import template_renderer
    from pretrain.interop.load_model import load_model
    from pretrain.interop.saved_model import saved_tokenizer
    from pretrain.checkpoint.catalog import read_manifest
    from pretrain.config.arguments import ConfigError

    source = tmp_path / "chat"
    shutil.copytree(hf_models["llama3.1"], source)
    theirs = AutoTokenizer.from_pretrained(source)
    theirs.chat_template = {"default": TEMPLATE, "terse": "{{ messages[-1]['content'] }}"}
    theirs.save_pretrained(source)
    assert (source / "chat_template.jinja").exists() and (source / "additional_chat_templates").is_dir()
    checkpoint = str(tmp_path / "chat-ckpt")
    convert(["--from-hf", str(source), "--output", checkpoint])
    ours = saved_tokenizer(*read_manifest(checkpoint))
    messages = [{"role": "user", "content": "hi \u00e9"}, {"role": "assistant", "content": "hello"}]
    render = template_renderer(ours.chat_template, ours.chat_template_source)
    for prompt in (False, True):
        assert render(messages=messages, add_generation_prompt=prompt, **ours.special_tokens) == \
            theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    exported = tmp_path / "chat-hf"
    convert(["--load", checkpoint, "--to", "hf", "--output", str(exported)])
    again = AutoTokenizer.from_pretrained(exported)
    assert again.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(messages,
                                                                                             tokenize=False)
    assert again.apply_chat_template(messages, tokenize=False, chat_template="terse") == "hello"

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(hf_models["gpt2"], name), bare)
    checkpoint = str(tmp_path / "bare-ckpt")
    capsys.readouterr()
    convert(["--from-hf", str(bare), "--output", checkpoint])
    assert "has no tokenizer files" in capsys.readouterr().err
    convert(["--load", checkpoint, "--to", "hf", "--output", str(tmp_path / "bare-hf")])
    assert "no tokenizer files written" in capsys.readouterr().err
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        original = AutoModelForCausalLM.from_pretrained(bare).eval()(tokens).logits
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "bare-hf").eval()(tokens).logits
        loaded = load_model(checkpoint)
        assert loaded.tokenizer is None
        torch.testing.assert_close(loaded(tokens), original, rtol=1e-5, atol=1e-5)
    assert torch.equal(exported, original)
    with pytest.raises(ConfigError, match="the checkpoint's model has a vocabulary of .* brought no "
                                          "tokenizer"):
        validate(parse_config(["--pretrained-checkpoint", checkpoint, "--default-corpus-vocab-size",
                               "4096"]), 1)
