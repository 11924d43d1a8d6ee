"""Byte-level BPE tokenizers read from Hugging Face's formats, run by the `tokenizers` library.

- ``GPT2BPETokenizer``: GPT-2's ``vocab.json`` + ``merges.txt`` (Megatron's ``--vocab-file`` and
  ``--merge-file``), tokenizing as ``transformers.GPT2TokenizerFast`` does: byte-level pre-tokenizer
  without a prefix space, ``<|endoftext|>`` as a special token and the end of document.
- ``HuggingFaceTokenizer``: any ``tokenizer.json`` (a file, or a directory holding one, as
  ``save_pretrained`` writes), tokenizing as ``transformers.AutoTokenizer`` does, its own special
  tokens included (Llama's BOS); the end-of-document token is the tokenizer's ``eos_token``.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from data.file_digest import files_sha256
from data.tokenizers.base import SpecialIds, configured_chat_templates, write_hugging_face_files

GPT2_END_OF_TEXT = "<|endoftext|>"
# end-of-document tokens of common tokenizers, tried when a tokenizer.json comes without its config
KNOWN_EOS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>")


class _ByteLevelBPE(SpecialIds):
    """ids <-> text through a ``tokenizers.Tokenizer``, with the fields megatron-core's datasets read
    (``vocab_size``, ``eod``, ``pad``, ``unique_identifiers``). Never adds an end-of-document itself:
    callers append ``eod_id``."""

    def __init__(self, tokenizer: Tokenizer, eod_id: int, identity: str):
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eod_id = eod_id
        self.unique_identifiers = OrderedDict([("class", type(self).__name__), ("files_sha256", identity),
                                               ("vocab_size", self.vocab_size)])

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def save_for_hugging_face(self, directory: str) -> dict:
        """Write tokenizer.json and tokenizer_config.json for ``AutoTokenizer``; return the special ids."""
        return write_hugging_face_files(directory, self._tokenizer, self.special_tokens, self.chat_templates)


class GPT2BPETokenizer(_ByteLevelBPE):
    """GPT-2's byte-level BPE from ``vocab.json`` and ``merges.txt``."""

    def __init__(self, vocab_file: str, merge_file: str):
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not os.path.isfile(path):
                raise ValueError(f"{flag} {path}: no such file (GPT2BPETokenizer reads GPT-2's "
                                 "vocab.json and "
                                 "merges.txt)")
        try:
            bpe = models.BPE.from_file(vocab_file, merge_file)
        except Exception as error:  # the library raises a plain Exception for unreadable files
            raise ValueError(f"--vocab-file {vocab_file} / --merge-file {merge_file}: not GPT-2 BPE files "
                             f"({error})") from None
        tokenizer = Tokenizer(bpe)
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
        eod = tokenizer.token_to_id(GPT2_END_OF_TEXT)
        if eod is None:
            raise ValueError(f"--vocab-file {vocab_file}: has no {GPT2_END_OF_TEXT} token, GPT-2's end of "
                             "document")
        tokenizer.add_special_tokens([GPT2_END_OF_TEXT])
        self.special_tokens = {"bos_token": GPT2_END_OF_TEXT, "eos_token": GPT2_END_OF_TEXT,
                               "unk_token": GPT2_END_OF_TEXT}
        super().__init__(tokenizer, eod, files_sha256(vocab_file, merge_file))


class HuggingFaceTokenizer(_ByteLevelBPE):
    """A Hugging Face ``tokenizer.json``, and its ``tokenizer_config.json`` when it sits in a directory."""

    def __init__(self, path: str):
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ValueError(f"--tokenizer-model {path}: no tokenizer.json there (HuggingFaceTokenizer "
                             "reads a "
                             "tokenizer.json, or a directory that save_pretrained wrote)")
        try:
            tokenizer = Tokenizer.from_file(file)
        except Exception as error:  # the library raises a plain Exception for malformed files
            raise ValueError(f"--tokenizer-model {path}: not a Hugging Face tokenizer.json "
                             f"({error})") from None
        eos = _configured_eos(os.path.dirname(file))
        candidates = ([eos] if eos
                      else [token for token in KNOWN_EOS if tokenizer.token_to_id(token) is not None])
        if not candidates or tokenizer.token_to_id(candidates[0]) is None:
            raise ValueError(f"--tokenizer-model {path}: no end-of-document token found (no eos_token in "
                             f"tokenizer_config.json, none of {', '.join(KNOWN_EOS)} in the vocabulary); "
                             "give the "
                             "directory save_pretrained wrote, with its tokenizer_config.json")
        self.special_tokens = {**_configured_special(os.path.dirname(file)), "eos_token": candidates[0]}
        self.chat_templates, self.chat_template_source = configured_chat_templates(os.path.dirname(file))
        super().__init__(tokenizer, tokenizer.token_to_id(candidates[0]), files_sha256(file))


def _configured_special(directory: str) -> dict[str, str]:
    """The bos/eos/pad/unk tokens that tokenizer_config.json (or special_tokens_map.json) names, as text."""
    special: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path) as handle:
                entries = json.load(handle)
            for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
                value = entries.get(key)
                value = value.get("content") if isinstance(value, dict) else value
                if isinstance(value, str):
                    special[key] = value
    return special


def _configured_eos(directory: str) -> str | None:
    """The ``eos_token`` of tokenizer_config.json or special_tokens_map.json in ``directory``, if any."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path) as handle:
                eos = json.load(handle).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                return eos
    return None
