"""The data of a run: its tokenizer, its train and validation datasets, and each rank's micro-batches.

Datasets come from ``--data-path`` (split by ``--split``), from ``--train/valid/test-data-path``, from
megatron-core's mock GPT dataset (``--mock-data``), from SFT conversations (``--sft``: ``--data-path`` names
.jsonl files, ``data.sft_dataset``), or from the built-in stdlib corpus when none is given. Micro-batches are
read in index order from the consumed-sample offset, so a resumed run reads exactly what an uninterrupted one
would. """

from __future__ import annotations

import os

from data.gpt_dataset import batch_reader, build_gpt_datasets, with_documents
from data.sampler import DataParallelSampler, micro_batches
from data.tokenizers.spec import TokenizerSpec, build_tokenizer
from pretrain.config.schema import Config


class TrainingData:
    """Owns the tokenizer and the datasets of one rank; hands out micro-batch iterators. Never decides
    how many samples a step takes (``BatchSchedule``) or which stage reads data (the caller says)."""

    def __init__(self, config: Config, train_samples: int, valid_samples: int, dp_rank: int, dp_size: int):
        data, train = config.data, config.training
        self.micro_batch_size, self.dp_rank, self.dp_size = train.micro_batch_size, dp_rank, dp_size
        self.documents = data.reset_attention_mask
        per_split = None
        if data.data_path is not None or data.mock_data:
            prefixes = data.data_path
            self.tokenizer = build_tokenizer(data.tokenizer_spec(config.model.vocab_size))
        elif data.train_data_path is not None:
            prefixes, per_split = None, (data.train_data_path, data.valid_data_path, data.test_data_path)
            self.tokenizer = build_tokenizer(data.tokenizer_spec(config.model.vocab_size))
        else:
            from data.default_corpus import ensure_default_corpus

            prefix, tokenizer_model = ensure_default_corpus(data.data_cache_dir,
                                                            data.default_corpus_vocab_size,
                                                            data.default_corpus_max_bytes)
            prefixes, self.tokenizer = [prefix], build_tokenizer(TokenizerSpec("SentencePieceTokenizer",
                                                                               tokenizer_model))
        if data.sft:
            from data.sft_dataset import build_sft_datasets

            self.train, self.valid, _ = build_sft_datasets(
                prefixes, data.split, config.model.seq_length, train.seed, (train_samples, valid_samples, 0),
                self.tokenizer)
            return
        self.train, self.valid, _ = build_gpt_datasets(
            prefixes, data.split, config.model.seq_length, train.seed, (train_samples, valid_samples, 0),
            self.tokenizer, os.path.join(data.data_cache_dir, "indices"), per_split=per_split,
            reset_position_ids=data.reset_position_ids, reset_attention_mask=data.reset_attention_mask,
            eod_mask_loss=data.eod_mask_loss)

    def batches(self, dataset, total_samples: int, consumed: int):
        """This rank's micro-batches of ``dataset`` from sample ``consumed`` up to ``total_samples``."""
        sampler = DataParallelSampler(total_samples, consumed, self.micro_batch_size,
                                      self.dp_rank, self.dp_size)
        read = batch_reader(dataset)
        if self.documents:
            read = with_documents(read, self.tokenizer.eod)
        return micro_batches(dataset, sampler, read)
