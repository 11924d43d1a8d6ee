"""Multi-token prediction (--mtp-num-layers): the depths train beside the language model and log their
losses as Megatron names them; tp2 + SP, pp2, cp2 and dp2 ZeRO-1/3 (and the per-token loss) follow one
process, and so do a hybrid whose depth is its pattern's part after / (M*M-/*-) at tp2 + SP, experts in
every layer and depth (untied) at ep2 and pp2, and documents at cp2; a dp2 checkpoint resumes at dp1 on
the trajectory; --mtp-num-layers 0 is the model without it, bit for bit; greedy speculative decoding with
the depths' drafts is greedy decoding; what is not built yet is refused by name."""

import json
import re

import pytest

from models.generate import generate, single_stage_logits
from models.mtp.speculative import speculative_greedy
from pretrain import load_model
from pretrain.config.arguments import ConfigError, parse_config
from pretrain.startup.validation import validate
from tests.parity import assert_trajectory_close
from tests.pretrain.test_context_parallel import DOCUMENTS
from tests.pretrain.test_trainer import SHORT, TINY, _train
from tests.world import run_world

MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3", "--position-embedding-type", "rope",
       *SHORT]
PER_TOKEN = ["--calculate-per-token-loss"]
# every layer a mixture of experts, the depths' too (DeepSeek-V3's MTP layers are), with the expert biases
EXPERTS = MTP + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
                 "--moe-aux-loss-coeff", "1e-2", "--moe-router-enable-expert-bias",
                 "--moe-router-score-function", "sigmoid", "--moe-token-dispatcher-type", "alltoall",
                 "--untie-embeddings-and-output-weights"]
# a hybrid's depth: the pattern's part after / (attention, then an MLP)
HYBRID = ["--hybrid-layer-pattern", "M*M-/*-", "--mamba-head-dim", "16", "--mamba-num-groups", "2",
          "--mamba-state-dim", "16", "--mamba-chunk-size", "8", "--normalization", "RMSNorm",
          "--position-embedding-type", "rope", "--swiglu", *SHORT]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
CP2 = ["--context-parallel-size", "2"]


def _follows(got, want, what, start=0):
    for name, g, w in zip(("loss", "grad norm"), got[:2], want[:2]):
        assert_trajectory_close(g, w[start:start + len(g)], f"{what}: {name}")


@pytest.mark.parity
def test_the_depths_train_log_their_losses_and_follow_one_process(stdlib_corpus, tmp_path, capsys):
    metrics, saved, trained = tmp_path / "metrics.jsonl", str(tmp_path / "dp2"), str(tmp_path / "trained")
    logged = ["--metrics-file", str(metrics), "--save", trained]
    references = [SHORT, SHORT + ["--mtp-num-layers", "0"], MTP + logged, MTP + PER_TOKEN, HYBRID, EXPERTS]
    plain, off, mtp, per_token, hybrid, experts = run_world(1, _train, references, stdlib_corpus)[0]
    assert off[:3] == plain[:3]  # no depths: the model without them, bit for bit
    assert mtp[1] != plain[1]  # the depths' gradients join the language model's
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    depths = [[line[f"mtp_{depth} loss"] for line in lines] for depth in (1, 2)]
    assert all(len(losses) >= 2 and losses[-1] < losses[0] for losses in depths), depths  # they learn
    layouts = {"tp2 + SP": (MTP + TP2, mtp),
               "tp2 + SP, full recompute (the depths' layers recomputed too)": (
                   MTP + TP2 + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                "--recompute-num-layers", "1"], mtp),
               "dp2 ZeRO-1, per-token loss": (MTP + PER_TOKEN + ["--zero-stage", "1"], per_token),
               "cp2, per-token loss (each depth's shifted tokens taken before the cut)": (
                   MTP + PER_TOKEN + CP2, per_token),
               "hybrid M*M-/*-: tp2 + SP": (HYBRID + TP2, hybrid),
               "experts in every layer and depth: ep2": (EXPERTS + ["--expert-model-parallel-size", "2"],
                                                         experts),
               "experts, untied: pp2 (the last stage's depths embed with a copy of the first's embedding)": (
                   EXPERTS + ["--pipeline-model-parallel-size", "2"], experts),
               "pp2 zb-h1 (the depths on the last stage, embedding with its copy of the tied embedding; "
               "their weight gradients in the weight pass)": (
                   MTP + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"], mtp),
               "experts, untied: pp2 zbv (the depths and the first chunk's embedding both on rank 0)": (
                   EXPERTS + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv"], experts)}
    zero3 = MTP + ["--zero-stage", "3", "--zero-persistence-threshold", "0", "--save", saved,
                   "--save-interval", "3"]  # (and saved at 3 as it goes)
    results = run_world(2, _train, [flags for flags, _ in layouts.values()] + [zero3], stdlib_corpus)
    for rank_results in results:
        for (name, (_, reference)), result in zip({**layouts, "dp2 ZeRO-3": (zero3, mtp)}.items(),
                                                  rank_results):
            _follows(result, reference, name)
    resumed, = run_world(1, _train, [MTP + ["--load", saved, "--ckpt-step", "3"]], stdlib_corpus)[0]
    _follows(resumed, mtp, "saved at dp2 ZeRO-3, resumed at dp1", start=3)
    # the depths' drafts, verified by the main model: greedy decoding's text, token for token
    model = load_model(trained).gpt.eval()
    accepted = proposed = 0
    for prompt in ([5, 17, 2, 9, 40, 3, 11, 60], [1, 2, 3], list(range(100, 120))):
        greedy = generate(single_stage_logits(model), prompt, 12, window=64)
        drafted, took, offered = speculative_greedy(model, prompt, 12)
        assert drafted == greedy, (prompt, drafted, greedy)
        accepted, proposed = accepted + took, proposed + offered
    assert proposed > 0
    print(f"accepted drafts: {accepted} of {proposed} ({accepted / proposed:.0%})")
    # and from the command line, on text
    from launch.tools.draft import main as draft
    assert draft(["--load", trained, "--prompt", "def ", "--tokens", "12", "--check"]) == 0
    said = capsys.readouterr().out
    assert "drafts accepted: " in said and "greedy decoding without drafts: the same tokens" in said, said


@pytest.mark.parity
def test_the_depths_stay_within_documents(short_documents):
    """With --reset-attention-mask a depth's target in the next document is masked (Megatron's roll within
    packed sequences): cp2 follows one process (each rank's share of the whole sequences' masks, and of
    each depth's mean)."""
    flags = MTP + DOCUMENTS + ["--eod-mask-loss"]
    (reference, *_), = run_world(1, _train, [flags], short_documents)[0]
    for (result, *_), in run_world(2, _train, [flags + CP2], short_documents):
        assert_trajectory_close(result, reference, "documents: cp2: loss")


@pytest.mark.parametrize("flags, message", [
    (["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2"],
     "--mtp-num-layers 1 with --pipeline-model-parallel-size 2: the last stage's depths embed their tokens "
     "with its copy of the embedding (not its learned positions"),
    (["--mtp-num-layers", "-1"], "--mtp-num-layers must be >= 0, got -1"),
    (["--mtp-use-repeated-layer"], "a layer repeated over the depths is not"),
    (["--mtp-num-layers", "1", "--qk-clip", "--optimizer", "muon"], "--mtp-num-layers 1 with --qk-clip / "
     "--log-max-attention-logit: its per-layer settings do not cover the depths' layers yet"),
    (["--mtp-num-layers", "1", "--window-size", "7", "0"], "with --window-size: its per-layer settings"),
])
def test_what_is_not_built_yet_is_refused_by_name(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(parse_config(TINY + ["--mock-data"] + flags), 2)


def test_the_planner_prices_each_depth_on_the_last_stage_its_mixing_without_a_weight_pass():
    """A depth costs its projection, its layer and the output layer once more, and its layer's mixing; on
    the last pipeline stage, whose weight pass (zero-bubble's W) holds products only, as a layer's does."""
    from launch.tools.planning.schedule_price import stage_costs
    from models.counting import forward_flops_parts

    flags = TINY + ["--vocab-size", "512", "--position-embedding-type", "rope"]
    plain, deep = (parse_config(flags + extra).model for extra in ([], ["--mtp-num-layers", "2"]))
    layers, (head, mixing) = forward_flops_parts(plain)
    deep_layers, (deep_head, deep_mixing) = forward_flops_parts(deep)
    assert deep_layers == layers and mixing == 0
    h, output = plain.hidden_size, 512 * plain.hidden_size
    assert deep_head == head + 2 * (layers[0][0] + 2 * (2 * h * h + output))
    assert deep_mixing == 2 * layers[0][1]
    (forward, backward, weights), = stage_costs(deep, None, 1)
    assert weights == sum(m for m, _ in layers) + deep_head
    assert forward - weights == sum(a for _, a in layers) + 2 * layers[0][1]
    assert backward == weights + 2 * (forward - weights)


def _with_mtp_layer(tmp_path, family: str, renamed, **overrides):
    """A tiny transformers ``family`` model and transformers' generic ``MtpModel`` of one layer on it, both
    perturbed, saved as the family's release keeps them: the main model by ``save_pretrained``, the MTP
    layer's tensors renamed by ``renamed(main)`` (MtpModel's prefix -> the release's), each expert apart.
    Returns
    (main, MTP model, directory, the saved tensors)."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from launch.examples.hf_families import make_model

    main = make_model(family, 96, bos=0, eos=1, **overrides).eval()
    depth = transformers.modeling_layers.MtpModel(main, 1).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in depth.named_parameters():  # (transformers' generic MtpModel leaves the
            if ".experts." in name:                       # fused experts as torch.empty left them)
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        for module in (main, depth):
            for param in module.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
        for name, buffer in [*main.named_buffers(), *depth.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                buffer.add_(torch.randn(buffer.shape, generator=generator) * 0.1)
    directory = str(tmp_path / family)
    main.save_pretrained(directory)
    tensors, renamed = load_file(f"{directory}/model.safetensors"), renamed(main)
    for name, tensor in depth.state_dict().items():
        prefix = next((p for p in renamed if name.startswith(p)), None)
        if prefix is None:
            continue
        saved = renamed[prefix] + name[len(prefix):]
        if saved.endswith("experts.gate_up_proj"):  # its experts as the checkpoint holds them, one by one
            for expert in range(tensor.shape[0]):
                gate, up = tensor[expert].chunk(2, dim=0)
                tensors[f"{saved[:-len('gate_up_proj')]}{expert}.gate_proj.weight"] = gate.contiguous()
                tensors[f"{saved[:-len('gate_up_proj')]}{expert}.up_proj.weight"] = up.contiguous()
        elif saved.endswith("experts.down_proj"):
            for expert in range(tensor.shape[0]):
                tensors[f"{saved[:-len('down_proj')]}{expert}.down_proj.weight"] = tensor[expert].contiguous()
        else:
            tensors[saved] = tensor.contiguous()
    save_file(tensors, f"{directory}/model.safetensors", metadata={"format": "pt"})
    return main, depth, directory, tensors


@pytest.fixture(scope="module")
def mtp_prompt():
    import torch

    ids = torch.tensor([[5, 17, 2, 9, 40, 3, 11, 60, 7, 1]])
    ahead = torch.cat([ids[:, 1:], torch.tensor([[23]])], dim=1)  # the tokens one ahead (a last one given)
    return ids, ahead, torch.arange(ids.shape[1])[None]


def _logits_of(mtp_prompt, main, depth) -> tuple:
    """The main logits and the MTP layer's of transformers' ``main`` and ``depth`` (an MtpModel on it)."""
    import torch

    ids, ahead, positions = mtp_prompt
    with torch.no_grad():
        hidden = main.model(ids).last_hidden_state
        return main.lm_head(hidden), depth._project_to_logits(
            depth.forward_layer(0, hidden, positions, None, input_ids=ahead))


def depth_logits(gpt, ids, positions, aheads: list, vocabulary: int):
    """[1 + D, s, vocabulary]: the logits of one-process GPTModel ``gpt`` for ``ids`` [1, s] and of each of
    its depths, depth k reading ``aheads[k - 1]`` (the tokens k ahead and their positions)."""
    import torch

    with torch.no_grad():
        x, inputs = gpt.hidden_states(ids, positions, whole_sequence=True)
        hidden = gpt.final_norm(x)
        out = [gpt.output_logits(hidden)]
        for depth, (tokens, ahead_positions) in enumerate(aheads, start=1):
            hidden = gpt.depth_state(depth, hidden, tokens, ahead_positions, inputs)
            out.append(gpt.output_logits(hidden))
    return torch.stack(out)[:, :, 0, :vocabulary]


def _our_logits(mtp_prompt, ours) -> tuple:
    """The main logits and the first depth's of our ``ours`` (a GPTModel) [s, 96]."""
    ids, ahead, positions = mtp_prompt
    return tuple(depth_logits(ours, ids, positions, [(ahead, positions + 1)], 96))


def _round_trip(tmp_path, directory: str, tensors: dict) -> str:
    """The directory imported and exported again: the same tensors bit for bit. Returns the export."""
    import torch
    from safetensors.torch import load_file

    from pretrain.interop.convert import main as convert

    checkpoint, exported = str(tmp_path / "ours"), str(tmp_path / "exported")
    convert(["--from-hf", directory, "--output", checkpoint])
    convert(["--load", checkpoint, "--to", "hf", "--output", exported])
    again = load_file(f"{exported}/model.safetensors")
    assert again.keys() == tensors.keys()
    assert all(torch.equal(again[name], tensors[name]) for name in tensors)
    return exported


def test_deepseek_v3s_mtp_layer_gives_transformers_logits_and_round_trips(tmp_path, mtp_prompt):
    """A tiny DeepSeek-V3 with one MTP layer (its weights under ``model.layers.{N}``, with the embedding and
    head copies, as DeepSeek's release keeps them): ``load_model`` gives the main logits of transformers'
    model and the MTP layer's of transformers' ``MtpModel`` built on it, within the interop bound; the
    export is the same tensors bit for bit (the MTP layer's and its copies included)."""
    pytest.importorskip("transformers")
    from tests.pretrain.test_hf_families import INTEROP_RTOL, _relative

    def renamed(main):
        layer = f"model.layers.{main.config.num_hidden_layers}"
        return {"layers.0.mtp_block.": f"{layer}.", "layers.0.post_norm.": f"{layer}.shared_head.norm.",
                "layers.0.": f"{layer}."}

    main, depth, directory, tensors = _with_mtp_layer(tmp_path, "deepseek-v3", renamed)
    layer = f"model.layers.{main.config.num_hidden_layers}"
    # (and the release's copies of the embedding and the head in the MTP layer)
    tensors[f"{layer}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"{layer}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    from safetensors.torch import save_file
    save_file(tensors, f"{directory}/model.safetensors", metadata={"format": "pt"})
    theirs, ours = _logits_of(mtp_prompt, main, depth), _our_logits(mtp_prompt, load_model(directory).gpt)
    for what, mine, reference in zip(("main", "MTP layer"), ours, theirs):
        assert _relative(mine, reference[0]) <= INTEROP_RTOL, what
    _round_trip(tmp_path, directory, tensors)


def test_qwen3_nexts_mtp_layer_gives_transformers_logits_and_its_loader_reads_ours(tmp_path, mtp_prompt):
    """A tiny Qwen3-Next (its last layer full attention, as the release's) with its MTP layer under
    ``mtp.`` as Qwen's release keeps it (``fc``, ``pre_fc_norm_embedding`` / ``_hidden``, ``layers.0``,
    ``norm``): ``load_model`` gives transformers' main logits and its ``MtpModel``'s; the export is the
    same tensors bit for bit, and transformers' own ``MtpModel.from_pretrained`` reads it with our MTP
    logits."""
    transformers = pytest.importorskip("transformers")
    import torch

    from tests.pretrain.test_hf_families import INTEROP_RTOL, _relative

    renamed = {"layers.0.enorm.": "mtp.pre_fc_norm_embedding.", "layers.0.hnorm.": "mtp.pre_fc_norm_hidden.",
               "layers.0.eh_proj.": "mtp.fc.", "layers.0.post_norm.": "mtp.norm.",
               "layers.0.mtp_block.": "mtp.layers.0."}
    last_full = ["linear_attention", "linear_attention", "full_attention"]
    main, depth, directory, tensors = _with_mtp_layer(tmp_path, "qwen3-next", lambda main: renamed,
                                                      layer_types=last_full, num_mtp_layers=1,
                                                      mtp_layer_types=["full_attention"])
    model = load_model(directory).gpt
    assert model.config.hybrid_layer_pattern == "GEG-*E/*E"
    theirs, ours = _logits_of(mtp_prompt, main, depth), _our_logits(mtp_prompt, model)
    for what, mine, reference in zip(("main", "MTP layer"), ours, theirs):
        assert _relative(mine, reference[0]) <= INTEROP_RTOL, what
    exported = _round_trip(tmp_path, directory, tensors)
    reread = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    their_reading = transformers.modeling_layers.MtpModel.from_pretrained(reread).eval()
    again = _logits_of(mtp_prompt, reread, their_reading)
    assert _relative(ours[1], again[1][0]) <= INTEROP_RTOL
    assert not torch.equal(their_reading.layers[0].enorm.weight, their_reading.layers[0].hnorm.weight)


def test_nemotron_hs_mtp_blocks_give_transformers_blocks_logits_and_round_trip(tmp_path, mtp_prompt):
    """Nemotron-H's multi-token prediction (Nemotron 3's: transformers keeps its config, vLLM builds it): one
    step of an attention block and an expert block under ``mtp.layers.0`` / ``.1``, the first holding
    enorm, hnorm and eh_proj, the last ``final_layernorm``. Made of transformers' own Nemotron-H blocks and
    norms, joined as vLLM's NemotronHMultiTokenPredictor joins them: ``load_model`` gives their MTP logits
    and the main model's; the export is the same tensors bit for bit."""
    pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file, save_file
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock, NemotronHRMSNorm

    from launch.examples.hf_families import make_model
    from tests.pretrain.test_hf_families import INTEROP_RTOL, _relative

    main = make_model("nemotron-h", 96, bos=0, eos=1, num_nextn_predict_layers=1,
                      mtp_layers_block_type=["full_attention", "moe"]).eval()
    config, width = main.config, main.config.hidden_size
    blocks = torch.nn.ModuleList(NemotronHBlock(config, config.layers_block_type.index(kind))
                                 for kind in ("full_attention", "moe"))
    norms = torch.nn.ModuleDict({name: NemotronHRMSNorm(width, eps=config.layer_norm_epsilon)
                                 for name in ("enorm", "hnorm", "final_layernorm")})
    eh_proj = torch.nn.Linear(2 * width, width, bias=False)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in (main, blocks, norms, eh_proj):
            for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
                if ".experts." in name:  # (transformers leaves fused experts as torch.empty made them)
                    tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.02)
                tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.1)
    directory = str(tmp_path / "nemotron-h")
    main.save_pretrained(directory)
    tensors = load_file(f"{directory}/model.safetensors")
    for number, block in enumerate(blocks):
        for name, tensor in block.state_dict().items():
            if name.startswith("mixer.experts."):  # each expert apart, as the release keeps them
                for expert in range(tensor.shape[0]):
                    tensors[f"mtp.layers.{number}.mixer.experts.{expert}.{name.split('.')[-1]}.weight"] = \
                        tensor[expert].contiguous()
            else:
                tensors[f"mtp.layers.{number}.{name}"] = tensor.contiguous()
    tensors.update({"mtp.layers.0.enorm.weight": norms["enorm"].weight.detach().clone(),
                    "mtp.layers.0.hnorm.weight": norms["hnorm"].weight.detach().clone(),
                    "mtp.layers.0.eh_proj.weight": eh_proj.weight.detach().clone(),
                    "mtp.layers.1.final_layernorm.weight": norms["final_layernorm"].weight.detach().clone()})
    save_file(tensors, f"{directory}/model.safetensors", metadata={"format": "pt"})
    ids, ahead, _ = mtp_prompt
    model = load_model(directory).gpt
    assert model.config.hybrid_layer_pattern == "M*M-E/*E"
    with torch.no_grad():
        hidden = main.model(ids).last_hidden_state
        x = eh_proj(torch.cat([norms["enorm"](main.model.embeddings(ahead)), norms["hnorm"](hidden)], dim=-1))
        for block in blocks:
            x = block(x)
        theirs = (main.lm_head(hidden), main.lm_head(norms["final_layernorm"](x)))

    for what, mine, reference in zip(("main", "MTP blocks"), _our_logits(mtp_prompt, model), theirs):
        assert _relative(mine, reference[0]) <= INTEROP_RTOL, what
    _round_trip(tmp_path, directory, tensors)
