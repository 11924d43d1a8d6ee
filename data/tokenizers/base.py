"""What every tokenizer kind shares: its special ids under both names, and writing its Hugging Face files."""

from __future__ import annotations

import json
import os


class SpecialIds:
    """The special ids of a tokenizer under both its names: ``eod_id`` / ``pad_id`` (-1: none), and
    ``eod`` / ``pad`` as megatron-core's datasets read them. Subclasses set the ids."""

    eod_id: int
    pad_id: int = -1

    @property
    def eod(self) -> int:
        return self.eod_id

    @property
    def pad(self) -> int:
        return self.pad_id


def write_hugging_face_files(directory: str, tokenizer, special: dict[str, str]) -> dict:
    """tokenizer.json (``tokenizer``, a ``tokenizers.Tokenizer``) and the tokenizer_config.json that makes
    ``AutoTokenizer`` load it with its ``special`` tokens (unk/bos/eos/pad_token -> text); return their ids
    as a Hugging Face config names them (bos/eos/pad_token_id)."""
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as handle:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
                   "add_eos_token": False,
                   "clean_up_tokenization_spaces": False, **special}, handle, indent=1)
    with open(os.path.join(directory, "special_tokens_map.json"), "w") as handle:
        json.dump(special, handle, indent=1)
    ids = {f"{name[:-len('_token')]}_token_id": tokenizer.token_to_id(token) for name,
           token in special.items()}
    ids.pop("unk_token_id", None)
    return ids


