"""Export of ZeRO-sharded weights to one file that the single-process GPT loads."""

import pytest
import torch

from models.config import GPTConfig
from models.gpt import GPTModel
from parallel import zero
from parallel.comm import AxisGroup, CommStats
from parallel.process_groups import create_process_groups
from parallel.topology import Topology
from parallel.zero.export import export_fp32_state_dict
from tests.parity import NO_DROPOUT, ONE_STEP_RTOL, assert_within
from tests.world import run_world

CONFIG = GPTConfig(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=128,
                   **NO_DROPOUT)


def _batch(seed):
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(seed))
    return tokens, torch.arange(16).expand(4, 16)


def _train_and_export(rank, world_size, stage, directory):
    groups = create_process_groups(Topology(world_size))
    model = GPTModel(CONFIG, groups.tp, seed=0)
    # masters cut below a bucket: export joins the pieces
    options = zero.ZeroOptions(stage=stage, persistence_threshold=64, bucket_size=500, sub_group_size=200)
    _, optimizer = zero.initialize(model, lambda g: torch.optim.AdamW(g, lr=1e-2), options, groups.dp,
                                   unit_modules=list(model.layers))
    for step in range(3):
        tokens, positions = _batch(step)
        mine = tokens.chunk(world_size)[rank]
        model(mine, positions[:len(mine)], labels=mine).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    tokens, positions = _batch(99)
    with torch.no_grad():
        loss = model(tokens, positions, labels=tokens).mean().item()
    path = f"{directory}/stage{stage}.safetensors"
    export_fp32_state_dict(model, optimizer, path)
    return loss, path


@pytest.mark.parity
def test_exported_weights_give_the_same_loss_in_the_single_process_model(tmp_path):
    from safetensors.torch import load_file

    for stage in (1, 3):
        (loss, path), _ = run_world(2, _train_and_export, stage, str(tmp_path))
        single = GPTModel(CONFIG, AxisGroup("tp", (0,), None, CommStats()), seed=123)
        single.load_state_dict(load_file(path), strict=True)
        tokens, positions = _batch(99)
        with torch.no_grad():
            exported = single(tokens, positions, labels=tokens).mean().item()
            assert_within(abs(exported - loss) / loss, f"stage {stage} exported loss", ONE_STEP_RTOL)
        assert not list(tmp_path.glob("*.tmp"))
