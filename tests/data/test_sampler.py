import pytest
import torch

from data.sampler import DataParallelSampler, collate, micro_batches

MICRO_BATCH, DP_SIZE, MICRO_BATCHES_PER_ITERATION = 2, 4, 3
GLOBAL_BATCH = MICRO_BATCH * DP_SIZE * MICRO_BATCHES_PER_ITERATION


def all_ranks(total, consumed):
    """Per rank, the list of its micro-batches (lists of indices)."""
    return [list(DataParallelSampler(total, consumed, MICRO_BATCH, rank, DP_SIZE))
            for rank in range(DP_SIZE)]


def test_ranks_are_disjoint_and_cover_each_block():
    total, consumed = 103, 5
    per_rank = all_ranks(total, consumed)
    steps = (total - consumed) // (MICRO_BATCH * DP_SIZE)
    assert [len(batches) for batches in per_rank] == [steps] * DP_SIZE
    for step in range(steps):
        block = [index for rank in range(DP_SIZE) for index in per_rank[rank][step]]
        start = consumed + step * MICRO_BATCH * DP_SIZE
        assert block == list(range(start, start + MICRO_BATCH * DP_SIZE))


def test_resume_reads_what_an_uninterrupted_run_reads():
    total = 10 * GLOBAL_BATCH + 7
    uninterrupted = all_ranks(total, 0)
    for iterations_done in (1, 4, 10):
        resumed = all_ranks(total, iterations_done * GLOBAL_BATCH)
        skip = iterations_done * MICRO_BATCHES_PER_ITERATION
        assert resumed == [batches[skip:] for batches in uninterrupted]


@pytest.mark.parametrize(
    "arguments, message",
    [
        ((10, 0, 2, 4, 4), "dp_rank 4: must be in \\[0, dp_size 4\\)"),
        ((10, 0, 2, -1, 4), "dp_rank -1"),
        ((10, 0, 2, 0, 0), "dp_size 0"),
        ((10, 0, 0, 0, 1), "--micro-batch-size 0"),
        ((10, 11, 2, 0, 1), "consumed_samples 11"),
        ((0, 0, 2, 0, 1), "total_samples 0"),
    ],
)
def test_bad_arguments(arguments, message):
    with pytest.raises(ValueError, match=message):
        DataParallelSampler(*arguments)


def fake_sample(index, seq=5):
    return {
        "tokens": torch.full((seq,), index),
        "labels": torch.full((seq,), index + 1),
        "loss_mask": torch.ones(seq),
        "position_ids": torch.arange(seq),
        "dataset_id": 0,
    }


def test_collate_stacks_batch_major_tensors():
    batch = collate([fake_sample(3), fake_sample(4)])
    assert sorted(batch) == ["labels", "loss_mask", "position_ids", "tokens"]
    assert batch["tokens"].tolist() == [[3] * 5, [4] * 5]
    assert batch["loss_mask"].dtype == torch.float32 and batch["labels"].dtype == torch.int64


def test_micro_batches_follow_the_sampler_and_check_the_dataset_size():
    dataset = [fake_sample(index) for index in range(16)]
    batches = micro_batches(dataset, DataParallelSampler(16, 8, 2, dp_rank=1, dp_size=2))
    assert [batch["tokens"][:, 0].tolist() for batch in batches] == [[10, 11], [14, 15]]
    with pytest.raises(ValueError, match="total_samples 17: the dataset has only 16 samples"):
        micro_batches(dataset, DataParallelSampler(17, 0, 2, dp_rank=0, dp_size=2))
