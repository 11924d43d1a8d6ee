"""Pickles that come with another framework's checkpoint, read without running anything they name.

Megatron-LM pickles its ``args`` (an ``argparse.Namespace`` holding a few of Megatron's enums) into every
checkpoint, and PyTorch Distributed Checkpoint pickles its ``.metadata``. ``load_torch_file`` reads a
``torch.save`` file with ``torch.load(weights_only=True)``: tensors, containers, numbers, the Namespace,
and Megatron's enums as inert ``ForeignValue`` records (their name and value; nothing of Megatron is
imported or called). ``load_dcp_metadata`` unpickles a ``.metadata`` file allowing DCP's own metadata
records alone. Anything else a file names is refused by name (CheckpointError), and nothing is loaded.
"""

from __future__ import annotations

import argparse
import pickle
import re

import torch

from pretrain.checkpoint.errors import CheckpointError

# the enums Megatron-LM keeps in its args (--attention-backend, the model type pretrain sets), as pickled
MEGATRON_ENUMS = ("megatron.core.enums.ModelType", "megatron.core.transformer.enums.AttnBackend",
                  "megatron.core.transformer.enums.AttnMaskType", "megatron.core.transformer.enums.AttnType",
                  "megatron.core.transformer.enums.LayerType", "megatron.core.enums.Fp8Recipe")


class ForeignValue:
    """An enum member of a framework this reader does not import: its qualified name and value. Never
    calls anything; compares by both."""

    qualified = ""

    def __init__(self, *args):
        self.args = args

    def __eq__(self, other) -> bool:
        return (isinstance(other, ForeignValue)
                and (self.qualified, self.args) == (other.qualified, other.args))

    def __hash__(self) -> int:
        return hash((self.qualified, self.args))

    def __repr__(self) -> str:
        return f"{self.qualified}{self.args!r}"


def _stand_in(qualified: str) -> type[ForeignValue]:
    return type(qualified.rsplit(".", 1)[-1], (ForeignValue,), {"qualified": qualified})


_STAND_INS = [(_stand_in(name), name) for name in MEGATRON_ENUMS]
_REFUSED = re.compile(r"GLOBAL ([\w.]+)")


def load_torch_file(path: str, what: str) -> object:
    """The content of the ``torch.save`` file ``path`` (``what``: how a refusal names it), memory-mapped
    where the file allows; CheckpointError naming the first thing it would have to run."""
    with torch.serialization.safe_globals([argparse.Namespace, *_STAND_INS]):
        try:
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as error:  # a file in torch's older, not zip, format cannot be mapped
                if "zip" not in str(error).lower():
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            raise _refusal(path, what, "a readable torch file", error) from None


def load_failure(error: Exception) -> str:
    """Why ``torch.load(weights_only=True)`` failed, in a few words of its own, never torch's advice to
    retry with ``weights_only=False`` (which would run whatever a file from elsewhere holds)."""
    text = str(error)
    if "mmap can only be used" in text or "zip" in text.lower() and "central directory" in text.lower():
        return "not a torch.save zip archive"
    if "Weights only load failed" in text:
        detail = next((line.strip() for line in text.splitlines()[1:] if line.strip()
                       and "Please file an issue" not in line and "Check the documentation" not in line), "")
        return "its pickle is not plain data" + (f": {detail}" if detail else "")
    if isinstance(error, (KeyError, EOFError)) or not text:
        return f"not a torch.save file ({type(error).__name__}{': ' + text if text else ''})"
    return text.splitlines()[0]


def _refusal(path: str, what: str, expected: str, error: Exception) -> CheckpointError:
    """The one-line error of a file ``what`` at ``path`` that could not be read as ``expected``: missing,
    naming what it asked to run, or why it is unreadable."""
    if isinstance(error, FileNotFoundError):
        return CheckpointError(f"{path}: {what} is missing; nothing was loaded")
    refused = _REFUSED.search(str(error))
    if refused:
        return CheckpointError(f"{path}: {what} asks to run {refused.group(1)}, which a file from elsewhere "
                               "may not; refused, nothing was loaded")
    return CheckpointError(f"{path}: {what} is not {expected} ({load_failure(error)}); refused, nothing "
                           "was loaded")


_DCP = "torch.distributed.checkpoint."
_DCP_RECORDS = {
    _DCP + "metadata": ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"),
    _DCP + "filesystem": ("_StorageInfo",),
    _DCP + "planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"),
    "torch.serialization": ("_get_layout",),
    "torch": ("Size",),
    "collections": ("OrderedDict",),
    "pathlib": ("PosixPath", "PurePosixPath"),  # StorageMeta.checkpoint_id, as a writer was given it
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _DCP_RECORDS.get(module, ()) or (module == "torch"
                                                    and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def load_dcp_metadata(path: str):
    """The ``torch.distributed.checkpoint`` Metadata pickled at ``path``, its records alone allowed."""
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except Exception as error:
        raise _refusal(path, "its .metadata", "a Distributed Checkpoint's metadata", error) from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not a Distributed Checkpoint's "
                              "Metadata; refused")
    return metadata
