"""The ZeRO optimizer as a library, called as a DeepSpeed or FSDP2 user calls it on a model that is not ours.

The model is a plain torch GPT written here (nanoGPT's shape: token and position embeddings, blocks of
pre-norm attention and GELU MLP in an ``nn.ModuleList``, a head tied to the embedding). Nothing from the
project but ``parallel.zero``: no group objects (the world group, or a torch ProcessGroup), no unit list
(stage 3 finds the blocks), torch's ``zero_grad(set_to_none=True)``, and a state_dict round trip.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel import zero
from tests.parity import TRAJECTORY_RTOL, assert_tensors_close
from tests.world import run_world


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v,
                                                         is_causal=True).transpose(1, 2).reshape(b, s, h))
        return x + self.mlp(self.ln_2(x))


class PlainGPT(nn.Module):
    def __init__(self, vocab=96, width=32, heads=4, layers=3, length=16):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _batches(steps, rank, world_size):
    generator = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 96, (4, 17), generator=generator) for _ in range(steps)]
    return [batch.chunk(world_size)[rank] for batch in data]


def _adamw(groups):
    return torch.optim.AdamW(groups, lr=3e-3, weight_decay=0.1)


def _steps(module, optimizer, batches):
    losses = []
    for batch in batches:
        logits = module(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in module.parameters())  # torch's meaning of set_to_none
        losses.append(loss.item())
    return losses


def _library_world(rank, world_size):
    pair = dist.new_group(list(range(world_size)))
    runs = {}
    for stage in (0, 1, 2, 3):
        for name, group in (("world", None), ("ProcessGroup", pair)):
            # DeepSpeed's stage3_param_persistence_threshold, low enough to shard this small model's blocks
            module, optimizer = zero.initialize(PlainGPT(), _adamw,
                                                zero.ZeroOptions(stage=stage,
                                                                 persistence_threshold=1000), group)
            batches = _batches(6, rank, world_size)
            losses = _steps(module, optimizer, batches[:3])
            # a state_dict round trip: a fresh model and optimizer take over after three steps
            state = optimizer.state_dict()
            fresh, restored = zero.initialize(PlainGPT(), _adamw,
                                              zero.ZeroOptions(stage=stage,
                                                               persistence_threshold=1000), group)
            restored.load_state_dict(state)
            losses += _steps(fresh, restored, batches[3:])
            units = len(restored.units.units) if restored.units is not None else 0
            with restored.gathered_parameters():
                runs[stage, name] = (losses, [p.detach().clone() for p in fresh.parameters()], units)
    return runs


@pytest.mark.parity
def test_zero_initialize_on_a_plain_torch_gpt_at_every_stage_without_project_objects():
    for runs in run_world(2, _library_world):
        reference, weights, _ = runs[0, "world"]
        for (stage, name), (losses, params, units) in runs.items():
            case = f"stage {stage} over the {name} group"
            assert all(abs(a - b) <= TRAJECTORY_RTOL * abs(b) for a,
                       b in zip(losses, reference)), (case, losses)
            assert_tensors_close(params, weights, case)
            if stage == 3:
                assert units >= 3, case  # the three blocks found as units (and the rest)


def test_the_librarys_defaults_are_the_trainers_and_overlap_at_every_model_size():
    """zero.initialize with ZeroOptions() runs as the trainer's flags do by default (stage 3 prefetches,
    buckets of the same size), its buckets cut a model into several at any size, as DDP's 25 MB ones do (a
    23M-parameter GPT in one 40M-element bucket reduced after backward, nothing overlapped), and stage 3's
    default budget leaves room to prefetch a block beside the embedding and head that enclose them."""
    from parallel.zero.grad_sync import OVERLAPPED_BUCKETS, bucket_size_for
    from parallel.zero.parameter_unit import default_prefetch_budget
    from pretrain.config.arguments import parse_config
    from pretrain.training.build import zero_options

    trainer = zero_options(parse_config(["--zero-stage", "0"]))  # clipping aside: a torch optimizer clips
    assert dataclasses.replace(trainer, clip_grad=0.0) == zero.ZeroOptions()  # nothing, Megatron at 1.0
    defaults = zero.ZeroOptions()
    for numel in (23_000_000, 350_000_000, 7_000_000_000):
        for stage in (0, 1, 2):
            size = bucket_size_for(defaults.bucket_size, numel, 2, stage)
            assert size <= defaults.bucket_size and -(-numel // size) >= OVERLAPPED_BUCKETS, (numel, stage)
    assert bucket_size_for(defaults.bucket_size, 2_000_000, 2, 1) == 1 << 20  # no bucket below 4 MB

    class Unit:  # what the budget reads of a ParameterUnit
        def __init__(self, module, numel):
            self.module, self.numel = module, numel
    model = PlainGPT(vocab=4096, width=32)  # the embedding and head (131k) outweigh a block (13k)
    units = [Unit(model, 131_072 + 512)] + [Unit(block, 12_704) for block in model.blocks]
    assert default_prefetch_budget(units) == 131_072 + 512 + 2 * 12_704
