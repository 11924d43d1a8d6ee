"""GPT train/valid/test datasets over indexed data, built by megatron-core.

`--data-path` follows Megatron-LM: `PREFIX`, `PREFIX1 PREFIX2 ...` (blended with equal weights;
Megatron-LM would weight by size and cap the blend at one epoch) or `W1 PREFIX1 W2 PREFIX2 ...`
(weighted blend). `--split` such as "969,30,1" divides every prefix's documents into train,
valid and test ranges. Samples are dicts of `tokens, labels, loss_mask, position_ids`, each of
`seq_length` elements (plus `dataset_id` in a blend); their order is a deterministic function
of the seed.

Index caches in `cache_dir`, by megatron-core's protocol:
- torch.distributed initialised: `build_gpt_datasets` is collective over the world group. Rank 0
  builds and writes the caches, every rank waits at a barrier and then reads them, so
  `cache_dir` must be one directory that all ranks see (a shared filesystem across nodes).
- not initialised (one process): the build holds an `fcntl.flock` on `cache_dir`, so processes
  sharing the cache never race. megatron-core's blended dataset calls
  `torch.distributed.get_rank()` unconditionally, so a blend is built inside a temporary
  one-rank gloo group (in-memory store), destroyed afterwards.
"""

import contextlib
import fcntl
import logging
import os
import struct
import sys
import warnings
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy
import torch
from torch.utils.data import Dataset

from data.sampler import collate



@contextlib.contextmanager
def _lean_megatron_import():
    """megatron.core's package import pulls in what the datasets never use, in every process that
    trains: it decorates its fused kernels with ``torch.compile`` (its ``jit_fuser``), which imports
    dynamo and inductor (about 2 s on this CPU), and its inference and timer modules import wandb when
    it is installed (about 2 s more). While the datasets are imported the decorator leaves functions as
    they are (megatron's own ``disable_jit_fuser``) and wandb reads as absent (megatron guards both
    imports and does without); afterwards both are as they were, so the metrics still import wandb."""
    compile_ = torch.compile
    torch.compile = lambda model=None, **options: model if model is not None else (lambda function: function)
    hide_wandb = "wandb" not in sys.modules
    if hide_wandb:
        sys.modules["wandb"] = None  # an ImportError for ``import wandb`` until restored
    try:
        yield
    finally:
        torch.compile = compile_
        if hide_wandb and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]


with warnings.catch_warnings(), _lean_megatron_import():
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import get_blend_from_list

logging.getLogger("megatron.core.datasets").setLevel(logging.WARNING)

Blend = Tuple[List[str], Optional[List[float]]]
Splits = Tuple[Optional[Dataset], Optional[Dataset], Optional[Dataset]]
SPLIT_NAMES = ("train", "valid", "test")


def build_gpt_datasets(
    data_path: Optional[List[str]],
    split: str,
    seq_length: int,
    seed: int,
    num_samples: Tuple[int, int, int],
    tokenizer,
    cache_dir: str,
    per_split: Optional[Sequence[Optional[List[str]]]] = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
) -> Splits:
    """Build (train, valid, test): GPTDatasets, or BlendedDatasets for several prefixes, of at
    least `num_samples` samples each (None for a split weighted 0 in `--split` or asked for 0
    samples). `per_split`: each split's own --train/valid/test-data-path instead of `data_path` and
    `--split`; neither: megatron-core's mock dataset (synthetic tokens, --mock-data). The three
    document flags are Megatron's, computed by megatron-core per sample (positions restarting after
    each end-of-document token, no loss on it); `with_documents` adds what attention needs. Validates every
    flag before megatron-core runs; never orders samples by anything but the seed, the data, the split
    and the sizes."""
    if seq_length <= 0:
        raise ValueError(f"--seq-length {seq_length}: must be positive")
    if not 0 <= seed < 2**32:
        raise ValueError(f"--seed {seed}: must be in [0, 2**32) (numpy's RandomState range)")
    if len(num_samples) != 3 or any(count < 0 for count in num_samples):
        raise ValueError(f"num_samples {num_samples}: expected three non-negative sample counts")
    blend, blends, dataset_class = None, None, GPTDataset
    # a shell array may hand over the quotes too ("--split '99,1,0'"), as Megatron allows
    split = split.strip("'\" ")
    if per_split is not None:
        blends = []
        for name, paths, count in zip(SPLIT_NAMES, per_split, num_samples):
            if count > 0 and not paths:
                raise ValueError(f"--{name}-data-path is missing: the run asks for {count} {name} samples")
            # a split asked for nothing: not built
            one = parse_data_path(paths) if paths and count > 0 else None
            for prefix in one[0] if one else []:
                _check_indexed_dataset(prefix, tokenizer, "1", [(0.0, 1.0)], (count, 0, 0))
            blends.append(one)
        split = None
    elif data_path is not None:
        blend = parse_data_path(data_path)
        split_matrix = _parse_split(split)
        for prefix in blend[0]:
            _check_indexed_dataset(prefix, tokenizer, split, split_matrix, num_samples)
    else:
        dataset_class = MockGPTDataset
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=blends,
        split=split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=False,
    )
    # A split asked for no samples is not built at all (megatron-core would still build one
    # epoch of it), so it may also be empty. Its bounds stay as derived from --split.
    if config.split_matrix is not None:
        config.split_matrix = [
            bounds if count > 0 else None for bounds, count in zip(config.split_matrix, num_samples)
        ]
    builder = BlendedMegatronDatasetBuilder(dataset_class, list(num_samples), lambda: True, config)
    os.makedirs(cache_dir, exist_ok=True)
    prefixes = blend[0] if blend else [p for one in blends or [] if one for p in one[0]]
    if torch.distributed.is_initialized():
        return tuple(builder.build())
    with _cache_lock(cache_dir), _one_rank_group_if(len(prefixes) > 1):
        return tuple(builder.build())


def batch_reader(dataset: Dataset) -> Callable[[List[int]], Dict[str, torch.Tensor]]:
    """A function from a list of sample indices to their collated micro-batch. For megatron-core's plain
    GPTDataset with the masks this module asks for (no per-document resets, no EOD loss mask, no attention
    mask) it reads every sample's tokens and builds the batch's masks in one go: what ``__getitem__`` then
    ``collate`` give, value for value, at a tenth of the cost (the per-sample masks, clones and index_puts
    were 1.5 ms of a 12-sample batch). Any other dataset (mock, blend, SFT) is read sample by sample."""
    config = getattr(dataset, "config", None)
    if (type(dataset) is not GPTDataset or not dataset.masks_and_position_ids_are_cacheable
            or not config.add_extra_token_to_sequence or config.create_attention_mask):
        return lambda indices: collate([dataset[index] for index in indices])
    return lambda indices: _gpt_batch(dataset, indices)


def _gpt_batch(dataset, indices: List[int]) -> Dict[str, torch.Tensor]:
    if not indices:
        raise ValueError("collate: no samples to stack")
    text = numpy.stack([dataset._query_document_sample_shuffle_indices(index)[0] for index in indices])
    text = torch.from_numpy(text.astype(numpy.int64))
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    pad = dataset._pad_token_id  # megatron-core's own padding: masked out of the loss, read as token 0
    loss_mask = (labels != pad).float()
    tokens.masked_fill_(tokens == pad, 0)
    labels.masked_fill_(labels == pad, 0)
    position_ids = torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s] -> [b, s]: the index of each token's document in its sequence. An end-of-document token
    ends its document (Megatron's --reset-attention-mask: no token after it sees it or anything before)."""
    ends = (tokens == eod).long()
    return ends.cumsum(dim=1) - ends


def with_documents(read: Callable[[List[int]], Dict[str, torch.Tensor]],
                   eod: int) -> Callable[[List[int]], Dict[str, torch.Tensor]]:
    """``read`` whose batches also hold "documents" (``document_ids`` of their tokens)."""
    def read_with_documents(indices: List[int]) -> Dict[str, torch.Tensor]:
        batch = read(indices)
        return {**batch, "documents": document_ids(batch["tokens"], eod)}
    return read_with_documents


def parse_data_path(data_path: Sequence[str]) -> Blend:
    """Megatron's `--data-path` list as (prefixes, weights); weights None for a single prefix,
    equal weights for unweighted prefixes. Only parses: never touches the files."""
    numeric = [_is_number(item) for item in data_path]
    weighted = len(data_path) % 2 == 0 and all(numeric[0::2]) and not any(numeric[1::2])
    if not data_path or (any(numeric) and not weighted):
        raise ValueError(
            f"--data-path {' '.join(data_path)}: expected PREFIX, PREFIX1 PREFIX2 ... "
            "or W1 PREFIX1 W2 PREFIX2 ..."
        )
    prefixes, weights = get_blend_from_list(list(data_path))
    if weights is not None and any(weight <= 0 for weight in weights):
        raise ValueError(f"--data-path {' '.join(data_path)}: weights must be positive")
    if len(prefixes) == 1:
        return prefixes, None
    return prefixes, weights if weights is not None else [1.0] * len(prefixes)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _parse_split(split: str) -> List[Optional[Tuple[float, float]]]:
    parts = split.split(",")
    if len(parts) > 3 or not all(_is_number(part) and float(part) >= 0 for part in parts):
        raise ValueError(
            f'--split {split}: expected up to three non-negative weights like "969,30,1"'
        )
    if sum(float(part) for part in parts) <= 0:
        raise ValueError(f"--split {split}: at least one weight must be positive")
    return convert_split_vector_to_split_matrix(parse_and_normalize_split(split))


def check_split_weights(split: str, wanted: Sequence[bool]) -> None:
    """Every split the run reads samples from (``wanted``: train, valid, test) has a weight in ``split``."""
    for name, bounds, needed in zip(SPLIT_NAMES, _parse_split(split.strip("'\" ")), wanted):
        if needed and bounds is None:
            fix = " or no --eval-interval" if name == "valid" else ""
            raise ValueError(f"--split {split}: the {name} split has weight 0 but the run reads {name} "
                             "samples; give "
                             f"it a weight (e.g. --split 969,30,1){fix}")


DTYPE_CODES = (1, 2, 3, 4, 5, 8)  # megatron-core's integer DType codes (uint8 ... int64, uint16)
FULL_SCAN_BYTES = 1 << 30  # token files up to this size are read whole for the id check; larger ones sampled
SAMPLED_BLOCKS, BLOCK_TOKENS = 64, 1 << 20


def _index_problem(path: str) -> str | None:
    """What is wrong with megatron-core's index file ``path`` (header, version, dtype code, and a size
    that matches its counts), or None: checked here because megatron-core asserts, then fails again in
    its destructor."""
    with open(path, "rb") as stream:
        head = stream.read(34)
    if len(head) < 34 or head[:9] != b"MMIDIDX\x00\x00":
        return "no MMIDIDX header"
    version, code, sequences, documents = struct.unpack("<QBQQ", head[9:34])
    if version != 1:
        return f"version {version}, not 1"
    if code not in DTYPE_CODES:
        return f"token dtype code {code} is not an integer type"
    expected = 34 + sequences * (4 + 8) + documents * 8
    if os.path.getsize(path) != expected:
        return f"{os.path.getsize(path)} bytes where its counts need {expected}"
    return None


def check_indexed_files(prefix: str, flag: str = "--data-path") -> IndexedDataset:
    """The .bin/.idx pair of ``prefix`` is whole; returns it opened. Checks: both files exist, the index
    parses, the .bin is exactly as long as the index says, and it holds documents and tokens.
    ValueError naming ``flag``, the file and the fix."""
    rebuild = "rebuild it with python -m data.preprocess"
    if prefix.endswith((".bin", ".idx")) and not os.path.isfile(prefix + ".bin"):
        raise ValueError(f"{flag} {prefix}: give the prefix of the .bin/.idx pair, {flag} {prefix[:-4]} "
                         "(Megatron's convention)")
    for path in (prefix + ".bin", prefix + ".idx"):
        if not os.path.isfile(path):
            raise ValueError(f"{flag} {prefix}: no {path} found; run python -m data.preprocess first")
    problem = _index_problem(prefix + ".idx")
    if problem:
        raise ValueError(f"{flag} {prefix}: {prefix}.idx is not a megatron index ({problem}); {rebuild}")
    dataset = IndexedDataset(prefix)
    lengths, pointers = dataset.index.sequence_lengths, dataset.index.sequence_pointers
    itemsize = numpy.dtype(dataset.index.dtype).itemsize
    expected = int(pointers[-1]) + int(lengths[-1]) * itemsize if len(lengths) else 0
    actual = os.path.getsize(prefix + ".bin")
    if actual != expected:
        raise ValueError(f"{flag} {prefix}: {prefix}.bin has {actual} bytes where its index describes "
                         f"{expected} "
                         f"(truncated, or the pair of another run); {rebuild}")
    starts = numpy.asarray(pointers, dtype=numpy.int64)
    ends = starts + numpy.asarray(lengths, dtype=numpy.int64) * itemsize
    outside = numpy.flatnonzero((starts < 0) | (ends > actual))
    if len(outside):
        first = int(outside[0])
        raise ValueError(f"{flag} {prefix}: {prefix}.idx points past {prefix}.bin (sequence {first}: bytes "
                         f"{int(starts[first])}..{int(ends[first])} of {actual}); {rebuild}")
    documents = numpy.asarray(dataset.index.document_indices, dtype=numpy.int64)
    if len(documents) == 0 or documents[0] != 0 or documents[-1] != len(lengths) or \
            (numpy.diff(documents) < 0).any():
        raise ValueError(f"{flag} {prefix}: {prefix}.idx has document boundaries outside its "
                         f"{len(lengths)} sequences; {rebuild}")
    tokens = int(numpy.asarray(lengths, dtype=numpy.int64).sum())
    if len(lengths) == 0 or tokens == 0:
        raise ValueError(f"{flag} {prefix}: holds {len(lengths)} documents and {tokens} tokens: nothing "
                         "to train "
                         "on; preprocess an input with text")
    return dataset


def _check_dtype(prefix: str, dtype, vocab_size: int, flag: str) -> None:
    if numpy.iinfo(dtype).max < vocab_size - 1:
        raise ValueError(f"{flag} {prefix}: stores {numpy.dtype(dtype).name} tokens, too small for the "
                         f"tokenizer's vocabulary of {vocab_size}; preprocess the data with this tokenizer")


def check_token_ids(prefix: str, dataset: IndexedDataset, vocab_size: int, flag: str = "--data-path") -> None:
    """The opened pair of ``prefix`` fits a tokenizer of ``vocab_size``: its dtype holds the vocabulary and
    no token id reaches it (every id read for files up to ``FULL_SCAN_BYTES``, ``SAMPLED_BLOCKS`` evenly
    spaced blocks beyond). ValueError naming ``flag``, the file and the fix."""
    dtype = dataset.index.dtype
    _check_dtype(prefix, dtype, vocab_size, flag)
    ids = numpy.memmap(prefix + ".bin", dtype=dtype, mode="r")
    if ids.nbytes <= FULL_SCAN_BYTES:
        largest = int(ids.max())
    else:
        starts = numpy.linspace(0, ids.size - BLOCK_TOKENS, SAMPLED_BLOCKS).astype(numpy.int64)
        largest = max(int(ids[start:start + BLOCK_TOKENS].max()) for start in starts)
    del ids
    if largest >= vocab_size:
        raise ValueError(f"{flag} {prefix}: holds token id {largest}, beyond the tokenizer's vocabulary of "
                         f"{vocab_size} (made with another tokenizer?); preprocess it with this "
                         "tokenizer, or "
                         "give the tokenizer it was made with")


def _check_indexed_dataset(
    prefix: str,
    tokenizer,
    split: str,
    split_matrix: List[Optional[Tuple[float, float]]],
    num_samples: Tuple[int, int, int],
) -> None:
    """The .bin/.idx pair is whole, its dtype holds the tokenizer's ids (the ids themselves are read by
    ``check_token_ids`` in the run's validation, once), and every split asked for samples has documents
    (megatron-core would loop forever on an empty split)."""
    dataset = check_indexed_files(prefix)
    _check_dtype(prefix, dataset.index.dtype, tokenizer.vocab_size, "--data-path")
    documents = len(dataset.sequence_lengths)
    if split_matrix is not None:
        check_split_weights(split, [count > 0 for count in num_samples])
    for name, bounds, count in zip(SPLIT_NAMES, split_matrix, num_samples):
        if bounds is None or count == 0:
            continue
        begin, end = (int(round(bound * documents)) for bound in bounds)
        if end == begin:
            raise ValueError(
                f"--split {split}: the {name} split of --data-path {prefix} ({documents} "
                "documents) is empty; give it a larger weight, 0 to skip it, or more documents"
            )


@contextlib.contextmanager
def _cache_lock(cache_dir: str) -> Iterator[None]:
    with open(os.path.join(cache_dir, "gpt_dataset.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def _one_rank_group_if(needed: bool) -> Iterator[None]:
    if not needed:
        yield
        return
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()
