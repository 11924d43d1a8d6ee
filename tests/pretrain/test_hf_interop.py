"""Hugging Face models in and out, against transformers' own code: tiny random GPT-2, Llama (grouped
queries, untied, saved sharded) and Qwen2 (query/key/value biases) made and saved by transformers are
imported, give transformers' logits at tp1, tp2 x pp2 and dp2 ZeRO-3, export back bit for bit, and
fine-tune alike in every layout; bad models are refused naming what is wrong."""

import json
import os

import pytest
import torch

from pretrain.config.arguments import parse_config
from pretrain.interop.convert import main as convert
from pretrain.startup.validation import validate
from tests.data.bpe_files import write_hf_directory
from tests.data.synthetic import make_documents
from tests.parity import ONE_STEP_RTOL, assert_trajectory_close, assert_within
from tests.world import run_world

transformers = pytest.importorskip("transformers")
PROMPTS = [[5, 17, 2, 9, 40, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [60, 61]]


def _hf_model(kind: str, vocab: int):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config)
    options = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=32, rope_theta=500000.0,
                   tie_word_embeddings=False)
    if kind == "llama":  # Llama 3.1's rope scaling, which changes both frequency pairs of a head here
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**options, rope_parameters=rope))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**options))


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """{kind: (HF directory, its logits on PROMPTS)}, each with a tokenizer the run can read."""
    documents = make_documents(40)
    models = {}
    for kind in ("gpt2", "llama", "qwen2"):
        directory = str(tmp_path_factory.mktemp(kind))
        write_hf_directory(directory, documents, vocab_size=300)
        vocab = len(transformers.AutoTokenizer.from_pretrained(directory))
        model = _hf_model(kind, vocab).eval()
        # the Llama in shards of a few tensors, with an index, as large checkpoints come
        model.save_pretrained(directory, max_shard_size="40KB" if kind == "llama" else "5GB")
        with torch.no_grad():
            logits = [model(torch.tensor([prompt])).logits[0, -1] for prompt in PROMPTS]
        models[kind] = (directory, logits)
    assert os.path.isfile(os.path.join(models["llama"][0], "model.safetensors.index.json"))
    return models


def _logits_in_layout(rank, world_size, checkpoint, layout):
    from pretrain.training.trainer import Trainer

    config = parse_config(["--load", checkpoint, "--mock-data", "--seq-length", "16",
                           "--micro-batch-size", "1",
                           "--train-iters", "1", "--sample-prompt", "", "--data-cache-path",
                           checkpoint + "-cache",
                           *layout])
    trainer = Trainer(config, validate(config, world_size), torch.device("cpu"))
    trainer.model.eval()
    return [trainer.runner.next_token_logits(prompt) for prompt in PROMPTS]


LAYOUTS = [(1, []), (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
           (2, ["--zero-stage", "3", "--zero-persistence-threshold", "0"])]


@pytest.mark.parity
def test_imported_models_give_transformers_logits_in_every_layout_and_export_back_bit_for_bit(hf_models,
                                                                                              tmp_path):
    for kind, (directory, theirs) in hf_models.items():
        checkpoint = str(tmp_path / kind)
        convert(["--from-hf", directory, "--output", checkpoint])
        for world, layout in LAYOUTS:
            for rank_logits in run_world(world, _logits_in_layout, checkpoint, layout):
                for ours, reference in zip(rank_logits, theirs):
                    # another implementation: the interop bound of one forward pass, on the logits' scale
                    error = ((ours - reference).abs().max() / reference.abs().max()).item()
                    assert_within(error, f"{kind} logits, world {world} {layout}", 100 * ONE_STEP_RTOL)
        exported = str(tmp_path / f"{kind}-hf")
        convert(["--load", checkpoint, "--to", "hf", "--output", exported])
        from safetensors.torch import load_file

        original = {}
        for name in sorted(os.listdir(directory)):
            if name.endswith(".safetensors"):
                original.update(load_file(os.path.join(directory, name)))
        again = load_file(os.path.join(exported, "model.safetensors"))
        assert again.keys() == original.keys()
        for name, tensor in again.items():
            assert torch.equal(tensor, original[name]), (kind, name)  # bit for bit
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
        with torch.no_grad():
            assert torch.equal(reloaded(torch.tensor([PROMPTS[0]])).logits[0, -1], theirs[0])
        tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
        assert (tokenizer.eos_token_id
                == json.load(open(os.path.join(exported, "config.json")))["eos_token_id"])


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
    checkpoint = str(tmp_path / "llama")
    convert(["--from-hf", hf_models["llama"][0], "--output", checkpoint])
    (losses, norms), = run_world(1, _fine_tune, checkpoint, [[]])[0]
    assert losses[-1] < losses[0]
    layouts = [["--zero-stage", "3", "--zero-persistence-threshold", "0"],
               ["--tensor-model-parallel-size", "2"]]
    for rank_results in run_world(2, _fine_tune, checkpoint, layouts):
        for (got_losses, got_norms), what in zip(rank_results, ("dp2 ZeRO-3", "tp2")):
            assert_trajectory_close(got_losses, losses, f"fine-tune {what}: loss")
            assert_trajectory_close(got_norms, norms, f"fine-tune {what}: grad norm")


def test_models_that_do_not_map_are_refused_naming_why(hf_models, tmp_path):
    directory, _ = hf_models["llama"]
    for change, message in [({"model_type": "mixtral", "num_local_experts": 8},
                             "model_type 'mixtral' is not"),
                            ({"model_type": "mistral", "sliding_window": 16},
                             "sliding-window attention is not"),
                            ({"rope_parameters": {"rope_type": "proportional", "factor": 8.0}},
                             "rope_type 'proportional' is not supported"),
                            ({"intermediate_size": 64},
                             "make layers.0.mlp.fc1.weight of shape (2, 48, 32); the "
                                                        "architecture in config.json needs (2, 64, 32)")]:
        broken = tmp_path / f"broken-{len(os.listdir(tmp_path))}"
        broken.mkdir()
        for name in os.listdir(directory):
            os.symlink(os.path.join(directory, name), broken / name)
        os.remove(broken / "config.json")
        (broken / "config.json").write_text(json.dumps(
            {**json.load(open(os.path.join(directory, "config.json"))), **change}))
        with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")):
            convert(["--from-hf", str(broken), "--output", str(tmp_path / "out")])
    from safetensors.torch import load_file, save_file

    missing = tmp_path / "missing"
    missing.mkdir()
    gpt2, _ = hf_models["gpt2"]
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
    directory, _ = hf_models["llama"]
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
