"""Megatron-LM checkpoints read here and written back, against megatron-core's own code on the CPU.

megatron-core's GPTModel (GPT-3 class: LayerNorm, GeLU, learned positions, biases, tied embeddings) and a
Llama-class one (RMSNorm, SwiGLU, rotary, grouped queries, untied; local spec) at tp2 x pp2, and a
DeepSeek-class one (latent attention with query and key/value latents, each normed; a mixture of 4 experts,
top 2, beside a gated shared expert; one multi-token prediction depth, whose logits are compared too) at
tp2 x ep2, saved as Megatron-LM saves them (its legacy rank files,
and megatron-core's ``dist_checkpointing.save``: torch_dist), load here with megatron-core's logits (its own
re-cut to tp1 x pp1 gives them): in one process through ``pretrain.load_model``, and through ``--load`` at
dp2 (the experts at ep2) and at tp2 x pp2 ZeRO-3, on Megatron's iteration, data position and schedule; and
ours, saved at tp2 x pp2 ZeRO-3, and the DeepSeek-class one, converted to both formats load into
megatron-core's model (``load_state_dict(strict=True)``, ``dist_checkpointing.load``) with our logits.
Hostile and broken checkpoints are refused in one line before any process group exists.
"""

import os
import re
import shutil

import pytest
import torch

from models.mtp.depth import shifted
from pretrain import load_model
from pretrain.checkpoint.catalog import CheckpointError, read_manifest
from pretrain.config.arguments import parse_config
from pretrain.interop.convert import main as convert
from pretrain.startup.validation import validate
from tests.parity import ONE_STEP_RTOL, assert_within
from tests.pretrain.test_mtp import depth_logits
from tests.pretrain.megatron_oracle import (CONSUMED, ITERATION, VOCAB, megatron_loads, megatron_logits,
                                           save_megatron)
from tests.world import run_world

pytest.importorskip("megatron.core")
PROMPTS = [[5, 17, 2, 9, 40, 3, 11, 60], [1, 2, 3]]
INTEROP_RTOL = 100 * ONE_STEP_RTOL  # another implementation: one forward pass, on the logits' scale
FORMATS = ("torch", "torch_dist")


@pytest.fixture(scope="module")
def megatron_checkpoints(tmp_path_factory):
    """{architecture: (directory with torch/ and torch_dist/, megatron-core's logits of PROMPTS)}."""
    # the Llama class in virtual stages: model0, model1 in each legacy file
    models = [(architecture, layout, str(tmp_path_factory.mktemp(f"megatron-{architecture}")))
              for architecture, layout in (("gpt", (2, 2, 1, 1)), ("llama", (2, 2, 2, 1)),
                                           ("deepseek", (2, 1, 1, 2)), ("hybrid", (2, 2, 1, 1)))]
    run_world(4, save_megatron, models, timeout_s=300)
    logits = run_world(1, megatron_logits, [(architecture, os.path.join(out, "torch_dist"))
                                            for architecture, _, out in models], PROMPTS)[0]
    return {architecture: (out, theirs) for (architecture, _, out), theirs in zip(models, logits)}


def _relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def _logits(model, prompt: list[int]) -> torch.Tensor:
    """A loaded model's logits of ``prompt`` as the oracle gives megatron-core's: [1 + D, sequence,
    VOCAB], the language model's, then each prediction depth's (its input the tokens after, a zero
    after the last, as megatron-core's roll gives them)."""
    ids, positions = torch.tensor([prompt]), torch.arange(len(prompt))[None]
    aheads = [(shifted(ids, depth), shifted(positions, depth))
              for depth in range(1, model.config.mtp_depths + 1)]
    return depth_logits(model.gpt, ids, positions, aheads, VOCAB)


def _flags(directory: str, *layout: str) -> list[str]:
    return ["--load", directory, "--no-load-optim", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(VOCAB - 1), "--micro-batch-size", "1", "--train-iters", str(ITERATION + 1),
            "--sample-prompt", "", "--data-cache-path", directory + "-cache", *layout]


def _loaded_logits(rank, world_size, directories, layout, save=None):
    """Per checkpoint (directory, flags of its own): the trainer built on it in ``layout``: its
    next-token logits after each prompt, the iteration and sample it resumes at; with ``save``, the last
    one then trains its one iteration and saves under ``save``."""
    from pretrain.training.trainer import Trainer

    out = []
    for number, (directory, own) in enumerate(directories):
        last = save and number == len(directories) - 1
        config = parse_config(_flags(directory, *layout, *own) + (["--save", save, "--save-interval", "1"]
                                                                  if last else []))
        trainer = Trainer(config, validate(config, world_size), torch.device("cpu"))
        trainer.model.eval()
        logits = [trainer.runner.next_token_logits(prompt)[:VOCAB] for prompt in PROMPTS]
        out.append((logits, trainer.start_iteration, trainer.progress.consumed_samples))
        if last:
            trainer.model.train()
            trainer.train()
        torch.distributed.barrier()
    return out


@pytest.mark.parity
def test_both_formats_load_in_any_layout_and_ours_go_back_with_megatron_cores_logits(megatron_checkpoints,
                                                                                     tmp_path):
    directories = []
    for architecture, (out, theirs) in megatron_checkpoints.items():
        for kind in FORMATS:
            directory = os.path.join(out, kind)
            directories.append((architecture, kind, directory, theirs))
            model = load_model(directory)
            for prompt, reference in zip(PROMPTS, theirs):
                assert_within(_relative(_logits(model, prompt), reference),
                              f"{architecture} {kind}: load_model logits (and its depths')", INTEROP_RTOL)
    layouts = {2: ("dp2", []),
               4: ("tp2 x pp2 ZeRO-3", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                                        "2", "--zero-stage", "3", "--zero-persistence-threshold", "0"])}
    saved = str(tmp_path / "ours")  # the Llama-class model after one more iteration at tp2 x pp2 ZeRO-3
    directories.sort(key=lambda entry: entry[0] == "llama")  # (the last one trains and saves)
    for world_size, (name, layout) in layouts.items():
        # each architecture in one format per layout, the other in the other layout (load_model read both)
        chosen = [entry for n, entry in enumerate(directories) if (n // 2 + n) % 2 == (world_size == 4)]
        # (the experts at ep2 beside dp2; at tp2 they route each tp rank's share: --sequence-parallel; the
        # hybrid's pipeline cut where its pattern says)
        experts = ["--expert-model-parallel-size", "2"] if world_size == 2 else ["--sequence-parallel"]
        own = {"deepseek": experts, "hybrid": experts + (["--hybrid-layer-pattern", "M*G|-ME"]
                                                         if world_size == 4 else [])}
        results = run_world(world_size, _loaded_logits,
                            [(entry[2], own.get(entry[0], [])) for entry in chosen],
                            layout,
                            saved if world_size == 4 else None, timeout_s=300)[0]
        for (architecture, kind, _, theirs), (logits, iteration, consumed) in zip(chosen, results,
                                                                                 strict=True):
            assert (iteration, consumed) == (ITERATION, CONSUMED), (architecture, kind, name)
            for ours, reference in zip(logits, theirs):
                assert_within(_relative(ours, reference[0, -1]), f"{architecture} {kind} at {name}: logits",
                              INTEROP_RTOL)
    # and back: our tp2 x pp2 ZeRO-3 checkpoint of iteration 8, the DeepSeek-class one and the hybrid, as
    # Megatron-LM's legacy files (tp1 x pp1, loaded with load_state_dict(strict=True)) and torch_dist
    # (dist_checkpointing.load), megatron-core's logits ours; cut at tp2 x pp2 (tp2 x ep2), each reads back
    # here with the same logits
    deepseek, hybrid = (os.path.join(megatron_checkpoints[name][0], "torch")
                        for name in ("deepseek", "hybrid"))
    sources = {"llama": (saved, ITERATION + 1, CONSUMED + 8, ["--target-pipeline-parallel-size", "2"]),
               "deepseek": (deepseek, ITERATION, CONSUMED, ["--target-expert-parallel-size", "2",
                                                            "--target-pipeline-parallel-size", "2"]),
               "hybrid": (hybrid, ITERATION, CONSUMED, ["--target-pipeline-parallel-size", "2"])}
    exported, expected = [], {}
    for architecture, (source, _, _, cut_flags) in sources.items():
        model = load_model(source)
        expected[architecture] = [_logits(model, prompt) for prompt in PROMPTS]
        out = {kind: str(tmp_path / f"{architecture}-to-{kind}") for kind in (*FORMATS, "cut")}
        for kind in FORMATS:
            convert(["--load", source, "--to", "megatron", "--ckpt-format", kind, "--output", out[kind]])
        convert(["--load", source, "--to", "megatron", "--ckpt-format", "torch",
                 "--target-tensor-parallel-size", "2", *cut_flags, "--output", out["cut"]])
        exported.append((architecture, out["torch"], out["torch_dist"], out["cut"]))
    loaded = run_world(1, megatron_loads, [entry[:3] for entry in exported], PROMPTS)[0]
    for (architecture, _, _, cut), by_kind in zip(exported, loaded):
        _, iteration, consumed, _ = sources[architecture]
        for kind, (logits, saved_iteration, args) in by_kind.items():
            assert (saved_iteration, args["consumed_train_samples"]) == (iteration, consumed), kind
            for got, want in zip(logits, expected[architecture]):
                assert_within(_relative(got, want), f"{architecture} exported as {kind}: megatron-core's "
                              "logits", INTEROP_RTOL)
        again = load_model(cut)
        for prompt, want in zip(PROMPTS, expected[architecture]):
            assert_within(_relative(_logits(again, prompt), want),
                          f"{architecture} exported cut, read back", INTEROP_RTOL)


def _copy(source: str, target) -> str:
    shutil.copytree(source, target)
    return str(target)


def test_hostile_and_broken_megatron_checkpoints_are_refused_in_one_line(megatron_checkpoints, tmp_path,
                                                                         capsys):
    """A pickle that would run a command, a missing shard (legacy file, .distcp file), a tensor of
    another shape than the args' model, args whose layers do not divide into the saved stages, and a
    whole resume that would need optimizer states: each one line, before any process group."""
    out, _ = megatron_checkpoints["llama"]
    legacy = os.path.join(out, "torch")

    def refused(directory: str, pattern: str, *extra: str) -> None:
        with pytest.raises((CheckpointError, ValueError), match=pattern) as caught:
            config = parse_config(_flags(directory, *extra))
            validate(config, 1)
            load_model(directory)
        assert "\n" not in str(caught.value)

    iteration = f"iter_{ITERATION:07d}"
    hostile = _copy(legacy, tmp_path / "hostile")
    first = os.path.join(hostile, iteration, "mp_rank_00_000", "model_optim_rng.pt")
    state = torch.load(first, weights_only=False)
    state["args"].exploit = _Exploit(str(tmp_path / "pwned"))
    torch.save(state, first)
    refused(hostile, r"asks to run (os|posix)\.system, which a file from elsewhere may not; refused")
    assert not os.path.exists(tmp_path / "pwned")

    missing = _copy(legacy, tmp_path / "missing")
    os.remove(os.path.join(missing, iteration, "mp_rank_01_001", "model_optim_rng.pt"))
    refused(missing, r"mp_rank_01_001/model_optim_rng\.pt: a legacy rank file is missing")
    shard = _copy(os.path.join(out, "torch_dist"), tmp_path / "shard")
    os.remove(os.path.join(shard, iteration, "__1_0.distcp"))
    refused(shard, r"__1_0\.distcp: missing \(it holds ")

    shaped = _copy(legacy, tmp_path / "shaped")
    last = os.path.join(shaped, iteration, "mp_rank_00_001", "model_optim_rng.pt")
    state = torch.load(last, weights_only=False)
    state["model1"]["decoder.layers.0.mlp.linear_fc2.weight"] = torch.zeros(32, 7)  # (virtual stage 1)
    torch.save(state, last)
    refused(shaped, r"decoder\.layers\.0\.mlp\.linear_fc2\.weight has shape \[32, 7\]; the model its args "
                    r"describe needs \[32, 24\]")

    uneven = _copy(legacy, tmp_path / "uneven")
    for name in os.listdir(os.path.join(uneven, iteration)):
        path = os.path.join(uneven, iteration, name, "model_optim_rng.pt")
        state = torch.load(path, weights_only=False)
        state["args"].num_layers = 5
        torch.save(state, path)
    refused(uneven, r"--num-layers 5 does not divide into 2 pipeline stages")

    with pytest.raises(ValueError, match=r"a Megatron-LM \(torch, tp2 x pp2 x vp2\) checkpoint of iteration "
                                         r"7; it holds no optimizer states: add --no-load-optim"):
        validate(parse_config([flag for flag in _flags(legacy) if flag != "--no-load-optim"]), 1)

    convert(["--load", os.path.join(out, "torch_dist"), "--list"])
    listing = capsys.readouterr().out
    for expected in ("Megatron-LM (torch_dist, tp2 x pp2 x vp2)", "iteration 7",
                     f"consumed samples {CONSUMED}", "4 layers, hidden 32, 4 heads in 2 query groups",
                     "RMSNorm", "swiglu", "rope", "untied", "optimizer states: none"):
        assert expected in listing, (expected, listing)
    assert read_manifest(legacy)[1]["states"]["opt_param_scheduler"]["lr_decay_style"] == "cosine"


class _Exploit:
    """Unpickles as os.system(...): what a hostile checkpoint hides in its args."""

    def __init__(self, witness: str):
        self.witness = witness

    def __reduce__(self):
        return os.system, (f"touch {self.witness}",)


def test_megatron_lm_mains_hybrid_spellings_load_and_what_it_cannot_be_is_refused(megatron_checkpoints,
                                                                                  tmp_path, capsys):
    """The hybrid's legacy files as Megatron-LM main writes them: the pattern's ``|`` places the stages
    (here ``M*|G-ME``, uneven: layer 2 moves to the second stage and the layers there renumber), the
    convolution's tensors are direct mixer parameters (``conv1d_weight``), the args keep
    ``hybrid_layer_pattern``; megatron-core's logits still. A pattern of multi-token-prediction depths,
    layers allotted by ratios alone and Megatron's GPT path to gated delta nets (a mixer and its MLP in
    one layer) are refused by name."""
    out, theirs = megatron_checkpoints["hybrid"]
    iteration = f"iter_{ITERATION:07d}"
    main = _copy(os.path.join(out, "torch"), tmp_path / "main")
    for tp in range(2):
        paths = [os.path.join(main, iteration, f"mp_rank_{tp:02d}_{pp:03d}", "model_optim_rng.pt")
                 for pp in range(2)]
        first, second = (torch.load(path, weights_only=False) for path in paths)
        moved = {key: value for key, value in first["model"].items() if key.startswith("decoder.layers.2.")}
        first["model"] = {key: value for key, value in first["model"].items() if key not in moved}
        renumbered = {}
        for key, value in [*((k.replace("layers.2.", "layers.0.", 1), v) for k, v in moved.items()),
                           *((_shifted(key), value) for key, value in second["model"].items())]:
            renumbered[key.replace("mixer.conv1d.weight", "mixer.conv1d_weight")
                       .replace("mixer.conv1d.bias", "mixer.conv1d_bias")] = value
        second["model"] = renumbered
        for state, path in zip((first, second), paths):
            state["args"].hybrid_layer_pattern, state["args"].hybrid_override_pattern = "M*|G-ME", None
            torch.save(state, path)
    convert(["--load", main, "--list"])
    listing = capsys.readouterr().out
    assert "Megatron-LM (torch, tp2 x pp2)" in listing and "layers 'M*G-ME'" in listing, listing
    model = load_model(main)
    for prompt, reference in zip(PROMPTS, theirs):
        assert_within(_relative(_logits(model, prompt), reference), "main's hybrid files: logits",
                      INTEROP_RTOL)

    for change, pattern in (({"hybrid_layer_pattern": "M*G-ME/*-"},
                             r"has multi-token prediction depths \(after /\): a hybrid's are not read yet"),
                            ({"hybrid_override_pattern": None, "hybrid_attention_ratio": 0.25},
                             r"saved with --hybrid-attention-ratio and no layer pattern"),
                            ({"experimental_attention_variant": "gated_delta_net",
                              "linear_attention_freq": 4},
                             r"saved by Megatron's GPT path with --experimental-attention-variant "
                             r"gated_delta_net \(a mixer and its MLP in each layer\): not read yet")):
        broken = _copy(main, tmp_path / f"broken{len(pattern)}")
        for name in os.listdir(os.path.join(broken, iteration)):
            path = os.path.join(broken, iteration, name, "model_optim_rng.pt")
            state = torch.load(path, weights_only=False)
            vars(state["args"]).update({"hybrid_layer_pattern": None, **change})
            torch.save(state, path)
        with pytest.raises((CheckpointError, ValueError), match=pattern) as caught:
            load_model(broken)
        assert "\n" not in str(caught.value)


def _shifted(key: str) -> str:
    """A second-stage legacy key one layer later (its stage now starts a layer earlier)."""
    match = re.match(r"decoder\.layers\.(\d+)\.(.+)", key)
    return f"decoder.layers.{int(match.group(1)) + 1}.{match.group(2)}" if match else key
