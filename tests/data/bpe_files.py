"""Byte-level BPE vocabularies made locally with the `tokenizers` library (nothing is downloaded):
GPT-2's vocab.json + merges.txt, and a Llama-style tokenizer directory written by transformers."""

from __future__ import annotations

import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers


def _trained(texts: list[str], vocab_size: int, special: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def write_gpt2_files(directory: str, texts: list[str], vocab_size: int = 600) -> tuple[str, str]:
    """GPT-2-style vocab.json and merges.txt (with <|endoftext|>) in ``directory``."""
    os.makedirs(directory, exist_ok=True)
    vocab, merges = _trained(texts, vocab_size, ["<|endoftext|>"]).model.save(directory)
    return vocab, merges


def write_hf_directory(directory: str, texts: list[str], vocab_size: int = 600) -> str:
    """A Llama-style tokenizer (BOS <s> added to every text, EOS </s>) saved by transformers."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = _trained(texts, vocab_size, ["<s>", "</s>", "<pad>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>",
                                                                              tokenizer.token_to_id("<s>"))])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(directory)
    return directory
