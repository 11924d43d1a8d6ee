"""The sentencepiece tokenizer (``--tokenizer-type SentencePieceTokenizer``): training a BPE model on
documents and loading it for use.

Text round-trips exactly (`decode(encode(text)) == text`) for source code: no normalization, no
whitespace folding, no dummy prefix, and whitespace-only pieces (indentation) are learned. The
trainer reads text one line at a time, so a newline never occurs inside a learned piece: it is
encoded through byte fallback as the piece `<0x0A>`, one token per newline, exactly like any
character outside the vocabulary (tabs, rare unicode) is encoded as its UTF-8 bytes.

CLI (`data/tokenizers/__main__.py`): `python -m data.tokenizers --input FILE... --vocab-size N --output-prefix
P` writes `P.model`. """

import hashlib
import io
import os
from collections import OrderedDict
from typing import Iterable, Iterator, List, Sequence

import sentencepiece

from data.documents import read_documents
from data.tokenizers.base import SpecialIds, configured_chat_templates, write_hugging_face_files

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
SEED = 1234
MAX_TRAINING_LINES = 2_000_000
MAX_LINE_BYTES = 1 << 16


def train_tokenizer(
    inputs: List[str], vocab_size: int, output_prefix: str, max_lines: int = MAX_TRAINING_LINES
) -> str:
    """Train a byte-fallback BPE model on the documents of `inputs`, write `<output_prefix>.model`
    atomically and return its path. Deterministic for the same inputs; trains on a seeded sample
    of at most `max_lines` non-empty lines. Never writes a partial model or a `.vocab` file."""
    if vocab_size <= 0:
        raise ValueError(f"--vocab-size {vocab_size}: must be a positive number of pieces")
    lines = _TrainingLines(inputs)
    model_bytes = io.BytesIO()
    sentencepiece.set_random_generator_seed(SEED)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model_bytes,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=PAD_ID,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            max_sentence_length=MAX_LINE_BYTES,
            input_sentence_size=max_lines,
            shuffle_input_sentence=True,
            train_extremely_large_corpus=False,
            num_threads=min(2, os.cpu_count() or 1),
            minloglevel=2,
        )
    except RuntimeError as error:
        if lines.input_error is not None:
            raise lines.input_error from None
        raise ValueError(
            f"--vocab-size {vocab_size}: sentencepiece cannot train it on {inputs} ({error}); "
            "choose a vocabulary size in the range sentencepiece reports or give more text"
        ) from None
    path = output_prefix + ".model"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary_path = f"{path}.{os.getpid()}.tmp"
    with open(temporary_path, "wb") as stream:
        stream.write(model_bytes.getvalue())
    os.replace(temporary_path, path)
    return path


class _TrainingLines:
    """The non-empty lines of all input documents. sentencepiece wraps an exception raised by its
    sentence iterator into a RuntimeError, so a bad input is kept here to be re-raised as is."""

    def __init__(self, inputs: Iterable[str]) -> None:
        self.inputs = list(inputs)
        self.input_error = None

    def __iter__(self) -> Iterator[str]:
        try:
            for path in self.inputs:
                for document in read_documents(path):
                    yield from (line for line in document.split("\n") if line)
        except ValueError as error:
            self.input_error = error
            raise


class SentencePieceTokenizer(SpecialIds):
    """A loaded sentencepiece model: ids <-> text, plus the special ids training needs.

    It is also the `tokenizer` megatron-core's `GPTDatasetConfig` reads (`vocab_size`, `eod`,
    `pad`, `unique_identifiers`). The identifiers hash the model bytes, so dataset caches follow
    the model's content, not its path. It never adds BOS/EOS itself: callers append `eod_id`.
    """

    def __init__(self, model_path: str) -> None:
        try:
            with open(model_path, "rb") as stream:
                model_bytes = stream.read()
        except OSError as error:
            raise ValueError(
                f"--tokenizer-model {model_path}: cannot read it ({error.strerror}); "
                "train one with python -m data.tokenizers"
            ) from None
        self._processor = sentencepiece.SentencePieceProcessor()
        try:
            self._processor.LoadFromSerializedProto(model_bytes)
        except RuntimeError:  # sentencepiece's message is its parser's internals
            raise ValueError(
                f"--tokenizer-model {model_path}: not a sentencepiece model (the file does not parse "
                "as one); "
                "give the .model file the data was preprocessed with, or train one with python -m "
                "data.tokenizers"
            ) from None
        if self._processor.eos_id() < 0:
            raise ValueError(
                f"--tokenizer-model {model_path}: the model has no end-of-document (eos) piece; "
                "train it with python -m data.tokenizers, which reserves one"
            )
        self.model_path = model_path
        self.chat_templates, self.chat_template_source = configured_chat_templates(
            os.path.dirname(os.path.abspath(model_path)))  # a Hugging Face directory's tokenizer.model
        self.vocab_size = self._processor.vocab_size()
        self.eod_id = self._processor.eos_id()
        self.pad_id = self._processor.pad_id()
        self.unique_identifiers = OrderedDict(
            [
                ("class", type(self).__name__),
                ("model_sha256", hashlib.sha256(model_bytes).hexdigest()),
                ("vocab_size", self.vocab_size),
            ]
        )

    def save_for_hugging_face(self, directory: str) -> dict:
        """Write the same tokenizer as Hugging Face files (tokenizer.json, tokenizer_config.json), so that
        ``AutoTokenizer`` gives the same ids; return its special-token ids. The BPE merges are the pairs
        whose joined piece is in the vocabulary, the better-scored first (as sentencepiece merges), spaces
        are sentencepiece's '▁', and unknown characters fall back to their bytes."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, normalizers

        processor = self._processor
        pieces = [processor.id_to_piece(i) for i in range(self.vocab_size)]
        vocab = {piece: i for i, piece in enumerate(pieces)}
        merges = []
        for i, piece in enumerate(pieces):
            if processor.is_control(i) or processor.is_unknown(i) or processor.is_byte(i):
                continue
            pairs = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                     if piece[:k] in vocab and piece[k:] in vocab]
            merges += [(processor.get_score(i), vocab[a], vocab[b], a, b) for a, b in pairs]
        merges.sort(key=lambda merge: (-merge[0], merge[1], merge[2]))
        tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges],
                                           unk_token=processor.id_to_piece(processor.unk_id()), fuse_unk=True,
                                           byte_fallback=True))
        tokenizer.normalizer = normalizers.Replace(" ", "▁")
        tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                               decoders.Fuse()])
        special = {name: processor.id_to_piece(index) for name, index in
                   (("unk_token", processor.unk_id()), ("bos_token", processor.bos_id()),
                    ("eos_token", processor.eos_id()), ("pad_token", processor.pad_id())) if index >= 0}
        tokenizer.add_special_tokens([token for name, token in special.items() if name != "unk_token"])
        return write_hugging_face_files(directory, tokenizer, special, self.chat_templates)

    def encode(self, text: str) -> List[int]:
        """Token ids of `text`, without any special token."""
        return self._processor.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids (plain ints, numpy or torch integers)."""
        return self._processor.decode([int(token_id) for token_id in ids])


class Llama2Tokenizer(SentencePieceTokenizer):
    """``--tokenizer-type Llama2Tokenizer``: a sentencepiece model used as Megatron's Llama-2 tokenizer,
    which starts every encoded text with the model's BOS piece (its end of document is the EOS piece)."""

    def __init__(self, model_path: str) -> None:
        super().__init__(model_path)
        if self._processor.bos_id() < 0:
            raise ValueError(f"--tokenizer-model {model_path}: --tokenizer-type Llama2Tokenizer starts "
                             "every text with the BOS piece, which this model has none of: use "
                             "SentencePieceTokenizer")

    def encode(self, text: str) -> List[int]:
        """BOS, then the token ids of ``text``."""
        return [self._processor.bos_id()] + self._processor.encode(text)
