"""What the checkpoint tests assert of saved states: nested states alike bit for bit, and a Distributed
Checkpoint of ours read by torch's own DCP reader."""

import shutil

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from pretrain.checkpoint.catalog import CheckpointError
from pretrain.interop.saved_model import saved_weights


def assert_same_states(got, want, where):
    """The same nested states: every tensor equal (and laid out alike), every other value equal."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            assert_same_states(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for index, (g, w) in enumerate(zip(got, want)):
            assert_same_states(g, w, f"{where}[{index}]")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want) and got.stride() == want.stride(), where
    else:
        assert got == want, where


def assert_dcp_holds_the_native_states(folder, native, tmp_path):
    """torch's own DCP reader (``dcp_to_torch_save``) finds in the Distributed Checkpoint, by our names,
    the masters and Adam states our native checkpoint of the same iteration holds, bit for bit; a byte
    changed in one rank's file is refused naming the file when a load first reads it."""
    dcp_to_torch_save(folder, str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    _, manifest, source = saved_weights(native)
    assert manifest["iteration"] == 10 and sorted(source.kinds) == ["exp_avg", "exp_avg_sq"]
    for name in source.by_name:
        for kind in ("master", *source.kinds):
            key = name if kind == "master" else f"optimizer.state.{name}.{kind}"
            assert torch.equal(whole[key], source.whole(name, kind)), key
        assert whole[f"optimizer.state.{name}.step"] == source.scalars(name)["step"] == 10
    damaged = shutil.copytree(folder, tmp_path / "damaged" / "iter_0000010")
    with open(damaged / "__1_0.distcp", "r+b") as handle:
        handle.seek(100)
        byte = handle.read(1)
        handle.seek(100)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: size or sha256 differs from the manifest"):
        _, _, source = saved_weights(str(tmp_path / "damaged"), 10)
        for name in source.by_name:
            source.whole(name)
