"""torchtitan's Llama step folders in and out: a transformers Llama's weights in torchtitan's keys (its
Hugging Face adapter's rotary permutation applied, as the adapter's ``from_hf`` does), written by torch's own
``torch.distributed.checkpoint.save`` beside the optimizer state torchtitan keeps, import here with
transformers' logits; ours export back to the same tensors bit for bit in both key spellings, read by DCP's
own loader. torchtitan itself is not installed here (it asks for torchdata and its own stack), so its
keys and DCP's reader stand in for its model class."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pretrain import load_model
from pretrain.interop.convert import main as convert
from tests.parity import ONE_STEP_RTOL, assert_within

transformers = pytest.importorskip("transformers")
HEADS, GROUPS, LAYERS = 4, 2, 2
INTEROP_RTOL = 100 * ONE_STEP_RTOL
PROMPTS = [[5, 17, 2, 9, 40, 3, 11, 60], [1, 2, 3]]


def _adapter_from_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """torchtitan's Llama3StateDictAdapter._reverse_permute: Hugging Face's q/k rows to Meta's layout."""
    rows, columns = w.shape
    return w.view(heads, 2, rows // heads // 2, columns).transpose(1, 2).reshape(rows, columns)


def _torchtitan_state(hf, spelling: str) -> dict[str, torch.Tensor]:
    attention = "attention.qkv_linear." if spelling == "0.3" else "attention."
    state = {"tok_embeddings.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"],
             ("lm_head.weight" if spelling == "0.3" else "output.weight"): hf["lm_head.weight"]}
    for layer in range(LAYERS):
        theirs, ours = f"model.layers.{layer}.", f"layers.{layer}."
        state.update({
            f"{ours}{attention}wq.weight": _adapter_from_hf(hf[theirs + "self_attn.q_proj.weight"], HEADS),
            f"{ours}{attention}wk.weight": _adapter_from_hf(hf[theirs + "self_attn.k_proj.weight"], GROUPS),
            f"{ours}{attention}wv.weight": hf[theirs + "self_attn.v_proj.weight"],
            ours + "attention.wo.weight": hf[theirs + "self_attn.o_proj.weight"],
            ours + "feed_forward.w1.weight": hf[theirs + "mlp.gate_proj.weight"],
            ours + "feed_forward.w3.weight": hf[theirs + "mlp.up_proj.weight"],
            ours + "feed_forward.w2.weight": hf[theirs + "mlp.down_proj.weight"],
            ours + "attention_norm.weight": hf[theirs + "input_layernorm.weight"],
            ours + "ffn_norm.weight": hf[theirs + "post_attention_layernorm.weight"]})
    return {key: value.detach().clone().contiguous() for key, value in state.items()}


def test_a_torchtitan_step_imports_with_transformers_logits_and_exports_back_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=HEADS, num_key_value_heads=GROUPS,
                                      intermediate_size=48, num_hidden_layers=LAYERS, vocab_size=64,
                                      rope_theta=500000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                      max_position_embeddings=64)
    reference = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
        expected = [reference(torch.tensor([prompt])).logits[0] for prompt in PROMPTS]
    hf = reference.state_dict()
    head_layout = ["--num-attention-heads", str(HEADS), "--num-query-groups", str(GROUPS), "--rotary-base",
                   "500000", "--norm-epsilon", "1e-6", "--seq-length", "64"]
    for spelling in ("0.3", "0.2"):
        step = tmp_path / f"step-10-{spelling}"
        saved = _torchtitan_state(hf, spelling)
        # what torchtitan keeps beside the weights (the import leaves it)
        extra = {"optimizer.state.tok_embeddings.weight.exp_avg": torch.zeros(64, 32),
                 "train_state": {"step": 10}}
        dcp.save({**saved, **extra}, storage_writer=dcp.FileSystemWriter(str(step)), no_dist=True)
        ours = tmp_path / f"imported-{spelling}"
        convert(["--from-torchtitan", str(step), "--output", str(ours), *head_layout])
        model = load_model(str(ours))
        for prompt, want in zip(PROMPTS, expected):
            got = model(torch.tensor([prompt]))[0]
            assert_within(((got - want).abs().max() / want.abs().max()).item(),
                          f"torchtitan {spelling} import: logits", INTEROP_RTOL)
        back = tmp_path / f"exported-{spelling}"
        convert(["--load", str(ours), "--to", "torchtitan", "--torchtitan-keys", spelling, "--output",
                 str(back)])
        read = {key: torch.empty_like(value) for key, value in saved.items()}
        dcp.load(read, storage_reader=dcp.FileSystemReader(str(back)), no_dist=True)
        for key, value in saved.items():
            assert torch.equal(read[key], value), key
    with pytest.raises(SystemExit, match=r"^error: .*step-10-0.3: its wq and wk rows do not split into "
                                         r"--num-attention-heads 3"):
        convert(["--from-torchtitan", str(tmp_path / "step-10-0.3"), "--output", str(tmp_path / "bad"),
                 "--num-attention-heads", "3"])
