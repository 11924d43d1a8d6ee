"""The tokenizer of a Megatron-LM checkpoint: Megatron keeps only its flags in the args
(``tokenizer_type``, ``tokenizer_model``, ``vocab_file``, ``merge_file``), paths on the machine that
trained it. An export of ours copies the files into the iteration folder (``tokenizer/``) and names them
there, relative to it; a reader takes a tokenizer only from files inside the folder it reads (never a path
elsewhere that an untrusted args object names).
"""

from __future__ import annotations

import os
import shutil

FOLDER = "tokenizer"
FILE_FLAGS = ("tokenizer_model", "vocab_file", "merge_file")


def copy_tokenizer(spec, folder: str) -> dict:
    """Copy the files of ``spec`` (a ``data.tokenizers.spec.TokenizerSpec``) into ``folder/tokenizer``;
    the args that name them, relative to ``folder`` ({} for a tokenizer without files)."""
    args = {}
    for flag in FILE_FLAGS:
        source = getattr(spec, flag)
        if source is None:
            continue
        target = os.path.join(folder, FOLDER)
        os.makedirs(target, exist_ok=True)
        if os.path.isdir(source):  # a Hugging Face tokenizer directory: its plain files
            target = os.path.join(target, os.path.basename(os.path.normpath(source)))
            os.makedirs(target, exist_ok=True)
            for name in sorted(os.listdir(source)):
                path = os.path.join(source, name)
                if os.path.isfile(path) and not os.path.islink(path):
                    shutil.copy(path, target)
        else:
            shutil.copy(source, target)
            target = os.path.join(target, os.path.basename(source))
        args[flag] = os.path.relpath(target, folder)
    return {"tokenizer_type": spec.tokenizer_type, **args} if args else {}


def tokenizer_in(args, folder: str) -> dict | None:
    """The tokenizer flags of a Megatron checkpoint's ``args`` when every file they name is inside the
    iteration ``folder`` (paths relative to it), else None."""
    kind, named = getattr(args, "tokenizer_type", None), {}
    for flag in FILE_FLAGS:
        value = getattr(args, flag, None)
        if value is None:
            continue
        parts = str(value).replace("\\", "/").split("/")
        if os.path.isabs(str(value)) or ".." in parts or not os.path.exists(os.path.join(folder, value)):
            return None
        named[flag] = str(value)
    return {"tokenizer_type": kind, **named} if named and isinstance(kind, str) else None
