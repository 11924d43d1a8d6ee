"""pretrain/interop/mxfp4.py: gpt-oss's MXFP4 expert weights dequantize to exactly what transformers'
own dequantizer (integrations/mxfp4.py, pure torch on the CPU) gives, in GptOssExperts' parameter shapes;
the checkpoint's _blocks/_scales names pair up, and malformed tensors or names are refused by name."""

import re

import pytest
import torch

from pretrain.interop.mxfp4 import QUANTIZED_SUFFIXES, dequantize_mxfp4, quantized_pairs

E, HIDDEN, INTER = 3, 64, 96  # 2 and 3 MXFP4 groups of 32 along the contracted dims

# FP4 E2M1 by code: 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit; code 0 and 1 are subnormal.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32,
            torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _packed(rows, groups, seed, nan_scale=False):
    """Random blocks [E, rows, groups, 16] holding every byte (so every nibble pair) and scales around
    the bias 127 (+-8) after every E8M0 byte 0..254 once (and 255, E8M0's NaN, with ``nan_scale``)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, rows, groups, 16), dtype=torch.uint8, generator=g)
    blocks.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    scales = torch.randint(127 - 8, 127 + 9, (E, rows, groups), dtype=torch.uint8, generator=g)
    every = torch.arange(256 if nan_scale else 255, dtype=torch.uint8)
    n = min(len(every), scales.numel())
    scales.view(-1)[:n] = every[torch.randperm(len(every), generator=g)][:n]
    return blocks, scales


def _bits(t):
    return t.view(INT_VIEW[t.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("proj", ["gate_up_proj", "down_proj"])
def test_matches_transformers_bit_for_bit(proj, dtype):
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=E))
    # the checkpoint's rows are the output features, the groups run along the input features
    rows, groups = (2 * INTER, HIDDEN // 32) if proj == "gate_up_proj" else (HIDDEN, INTER // 32)
    blocks, scales = _packed(rows, groups, seed=len(proj) + len(str(dtype)))
    ours = dequantize_mxfp4(blocks, scales, dtype, name=f"model.layers.0.mlp.experts.{proj}")
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert ours.shape == getattr(experts, proj).shape == theirs.shape
    assert ours.dtype == theirs.dtype == dtype and ours.is_contiguous()
    assert torch.equal(ours, theirs)
    assert torch.equal(_bits(ours), _bits(theirs))  # -0.0 and the subnormals too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nan_scale_is_read_as_transformers_reads_it(dtype):
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = _packed(2 * INTER, HIDDEN // 32, seed=5, nan_scale=True)
    ours = dequantize_mxfp4(blocks, scales, dtype)
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert ours.isinf().any() and not ours.isnan().any()  # 2 ** 128: 0 stays 0, 0.5 * 2 ** 128 is finite
    assert torch.equal(_bits(ours), _bits(theirs))


def test_against_the_e2m1_table():
    """Without transformers: value k of group j in row r is E2M1[nibble] * 2 ** (scale - 127), the even
    k in the low nibble of byte k // 2, and lands at [e, j * 32 + k, r]."""
    blocks, scales = _packed(5, 2, seed=7)
    out = dequantize_mxfp4(blocks, scales, torch.float64)
    assert out.shape == (E, 64, 5)
    for e in range(E):
        for r in range(5):
            for j in range(2):
                factor = 2.0 ** (int(scales[e, r, j]) - 127)
                for k in range(32):
                    byte = int(blocks[e, r, j, k // 2])
                    code = byte & 0xF if k % 2 == 0 else byte >> 4
                    want = E2M1[code] * factor
                    got = out[e, j * 32 + k, r].item()
                    assert got == want and (str(got)[0] == "-") == (str(want)[0] == "-")


def test_known_bytes():
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, :2] = torch.tensor([0x21, 0xF8], dtype=torch.uint8)  # 0.5, 1.0, -0.0, -6.0
    out = dequantize_mxfp4(blocks, torch.tensor([[[128]]], dtype=torch.uint8))  # * 2
    assert out[0, :4, 0].tolist() == [1.0, 2.0, -0.0, -12.0] and out[0, 2, 0].signbit()
    assert torch.equal(out[0, 4:, 0], torch.zeros(28))


def test_bad_tensors_are_refused_by_name():
    name = "model.layers.3.mlp.experts.down_proj"
    blocks, scales = _packed(4, 2, seed=1)
    cases = [
        (blocks.to(torch.int8), scales, "down_proj_blocks has dtype torch.int8"),
        (blocks, scales.float(), "down_proj_scales has dtype torch.float32"),
        (blocks[0], scales[0], "down_proj_blocks has shape (4, 2, 16)"),
        (blocks[..., :8], scales, "down_proj_blocks has shape (3, 4, 2, 8)"),
        (blocks, scales[:, :, :1], "down_proj_scales has shape (3, 4, 1)"),
        (blocks, scales.transpose(1, 2), "down_proj_scales has shape (3, 2, 4)"),
    ]
    for b, s, message in cases:
        with pytest.raises(ValueError, match=re.escape(f"{name[:-len('down_proj')]}{message}")):
            dequantize_mxfp4(b, s, name=name)
    with pytest.raises(ValueError, match="MXFP4 blocks has dtype torch.int8"):
        dequantize_mxfp4(blocks.to(torch.int8), scales)
    with pytest.raises(ValueError, match=f"cannot dequantize {name} to torch.int32"):
        dequantize_mxfp4(blocks, scales, torch.int32, name=name)
    with pytest.raises(TypeError, match="down_proj_scales is a list"):
        dequantize_mxfp4(blocks, scales.tolist(), name=name)


def test_quantized_pairs():
    assert QUANTIZED_SUFFIXES == ("_blocks", "_scales")
    layer = "model.layers.{}.mlp.experts."
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.router.weight",
             "model.layers.0.self_attn.sinks"]
    for i in range(2):
        for proj in ("gate_up_proj", "down_proj"):
            names += [layer.format(i) + proj + suffix for suffix in ("_scales", "_bias", "_blocks")]
    pairs = quantized_pairs(iter(names))
    assert pairs == {
        layer.format(i) + proj: (layer.format(i) + proj + "_blocks", layer.format(i) + proj + "_scales")
        for i in range(2) for proj in ("gate_up_proj", "down_proj")
    }
    assert quantized_pairs(["lm_head.weight"]) == {}

    lone_blocks = layer.format(1) + "down_proj_blocks"
    missing = layer.format(1) + "down_proj_scales"
    with pytest.raises(ValueError, match=re.escape(f"'{lone_blocks}' has no '{missing}'")):
        quantized_pairs([n for n in names if n != layer.format(1) + "down_proj_scales"])
    lone_scales = layer.format(0) + "gate_up_proj_scales"
    missing = layer.format(0) + "gate_up_proj_blocks"
    with pytest.raises(ValueError, match=re.escape(f"'{lone_scales}' has no '{missing}'")):
        quantized_pairs([n for n in names if n != layer.format(0) + "gate_up_proj_blocks"])
    with pytest.raises(ValueError, match="both plain and as MXFP4"):
        quantized_pairs(names + [layer.format(0) + "down_proj"])
    with pytest.raises(ValueError, match="no weight name"):
        quantized_pairs(["model.layers.0._blocks", "model.layers.0._scales"])
