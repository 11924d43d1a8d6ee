"""Which dataset samples each data-parallel rank reads, micro-batch by micro-batch.

The dataset is read in index order from the consumed-sample offset, in blocks of
`micro_batch_size * dp_size` consecutive indices: data-parallel rank r takes the r-th
`micro_batch_size` slice of every block. Tensor-parallel peers share a dp_rank and therefore read
the same samples. A trainer that records `consumed_samples` (global batch size per iteration) and
restarts a sampler at that offset reads exactly the samples an uninterrupted run would.
"""

from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch


class DataParallelSampler:
    """Yields, for each micro-batch step, this rank's list of `micro_batch_size` dataset indices.

    Like Megatron-LM's MegatronPretrainingSampler: it never shuffles (the GPT dataset's order is
    already shuffled by seed) and drops a final block smaller than `micro_batch_size * dp_size`.
    Usable as a `torch.utils.data.DataLoader` `batch_sampler`.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"total_samples {total_samples}: the dataset has no samples")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(
                f"consumed_samples {consumed_samples}: must be in [0, total_samples "
                f"{total_samples}]; the checkpoint was trained past the end of the dataset"
            )
        if micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size {micro_batch_size}: must be positive")
        if dp_size <= 0:
            raise ValueError(f"dp_size {dp_size}: the data-parallel size must be positive")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank}: must be in [0, dp_size {dp_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __len__(self) -> int:
        """Number of micro-batches this sampler yields."""
        block = self.micro_batch_size * self.dp_size
        return (self.total_samples - self.consumed_samples) // block

    def __iter__(self) -> Iterator[List[int]]:
        block = self.micro_batch_size * self.dp_size
        first = self.consumed_samples + self.dp_rank * self.micro_batch_size
        for step in range(len(self)):
            start = first + step * block
            yield list(range(start, start + self.micro_batch_size))


def collate(samples: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Stack GPT samples into [batch, seq] tensors: int64 tokens, labels and position_ids, float32
    loss_mask. Other keys (a blend's `dataset_id`) are dropped; never pads or truncates."""
    if not samples:
        raise ValueError("collate: no samples to stack")
    return {
        "tokens": torch.stack([sample["tokens"] for sample in samples]).long(),
        "labels": torch.stack([sample["labels"] for sample in samples]).long(),
        "loss_mask": torch.stack([sample["loss_mask"] for sample in samples]).float(),
        "position_ids": torch.stack([sample["position_ids"] for sample in samples]).long(),
    }


def micro_batches(
    dataset: Sequence[Dict[str, torch.Tensor]],
    sampler: DataParallelSampler,
    read: Optional[Callable[[List[int]], Dict[str, torch.Tensor]]] = None,
) -> Iterator[Dict[str, torch.Tensor]]:
    """An iterator of this rank's collated micro-batches, in sampler order; the trainer calls
    next() once per micro-batch. ``read`` turns a list of indices into a batch (default: each sample,
    then ``collate``). Checks up front that the sampler never reads past the dataset."""
    if sampler.total_samples > len(dataset):
        raise ValueError(
            f"total_samples {sampler.total_samples}: the dataset has only {len(dataset)} samples; "
            "lower --train-iters or build the dataset with more samples"
        )
    if read is None:
        return (collate([dataset[index] for index in indices]) for indices in sampler)
    return (read(indices) for indices in sampler)
