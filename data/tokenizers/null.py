"""Megatron's NullTokenizer: texts that are already token ids."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from data.tokenizers.base import SpecialIds


class NullTokenizer(SpecialIds):
    """Megatron's NullTokenizer: a text is space-separated token ids; ``vocab_size`` is V + 1 with id V
    the end of document. For data that is already ids (and mock data). Owns nothing but V."""

    def __init__(self, vocab_size: int):
        self.eod_id = int(vocab_size)
        self.vocab_size = self.eod_id + 1
        self.unique_identifiers = OrderedDict([("class", "NullTokenizer"), ("vocab_size", self.vocab_size)])

    def encode(self, text: str) -> list[int]:
        return [int(token) for token in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def save_for_hugging_face(self, directory: str) -> dict:
        """A NullTokenizer has no Hugging Face form (its texts are ids): only the end-of-document id."""
        return {"eos_token_id": self.eod_id}
