"""What every tokenizer kind shares: its special ids under both names, its chat templates, and writing its
Hugging Face files."""

from __future__ import annotations

import json
import os


class SpecialIds:
    """The special ids of a tokenizer under both its names: ``eod_id`` / ``pad_id`` (-1: none), and
    ``eod`` / ``pad`` as megatron-core's datasets read them. Subclasses set the ids."""

    eod_id: int
    pad_id: int = -1
    # {name: Jinja template} of a Hugging Face tokenizer directory ("default" is the chat template); set per
    # instance by ``configured_chat_templates``, never mutated
    chat_templates: dict[str, str] = {}
    chat_template_source: str = "the tokenizer"

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    @property
    def eod(self) -> int:
        return self.eod_id

    @property
    def pad(self) -> int:
        return self.pad_id


CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers' names for a tokenizer's templates
CHAT_TEMPLATE_DIR = "additional_chat_templates"


def configured_chat_templates(directory: str) -> tuple[dict[str, str], str]:
    """({name: template}, the file of the default one) that a Hugging Face tokenizer directory carries, as
    transformers reads them: chat_template.jinja (the default) and additional_chat_templates/NAME.jinja,
    else tokenizer_config.json's ``chat_template`` (a string, or a list of named templates). Text only:
    a template is rendered in a sandbox (``data.sft_dataset``), never run."""
    templates: dict[str, str] = {}
    source = os.path.join(directory, CHAT_TEMPLATE_FILE)
    if os.path.isfile(source):
        with open(source) as handle:
            templates["default"] = handle.read()
    folder = os.path.join(directory, CHAT_TEMPLATE_DIR)
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if name.endswith(".jinja") and os.path.isfile(path) and not os.path.islink(path):
                with open(path) as handle:
                    templates[name[:-len(".jinja")]] = handle.read()
    config = os.path.join(directory, "tokenizer_config.json")
    if not templates and os.path.isfile(config):
        with open(config) as handle:
            entry = json.load(handle).get("chat_template")
        if isinstance(entry, str):
            templates["default"] = entry
        elif isinstance(entry, list):
            templates = {item["name"]: item["template"] for item in entry if isinstance(item, dict)
                         and isinstance(item.get("name"), str) and isinstance(item.get("template"), str)}
        source = config
    return templates, source


def write_hugging_face_files(directory: str, tokenizer, special: dict[str, str],
                             chat_templates: dict[str, str] | None = None) -> dict:
    """tokenizer.json (``tokenizer``, a ``tokenizers.Tokenizer``), the tokenizer_config.json that makes
    ``AutoTokenizer`` load it with its ``special`` tokens (unk/bos/eos/pad_token -> text) and the chat
    templates as transformers writes them; return the special ids as a Hugging Face config names them
    (bos/eos/pad_token_id)."""
    os.makedirs(directory, exist_ok=True)
    for name, template in (chat_templates or {}).items():
        path = (os.path.join(directory, CHAT_TEMPLATE_FILE) if name == "default"
                else os.path.join(directory, CHAT_TEMPLATE_DIR, f"{name}.jinja"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as handle:
            handle.write(template)
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


