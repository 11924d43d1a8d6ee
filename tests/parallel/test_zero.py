"""The ZeRO optimizer on a plain nn.Module: stages 0-2 against one process, bytes, fp16 overflow."""

import pytest
import torch
from torch import nn

from parallel import zero
from parallel.comm import AxisGroup, CommStats
from parallel.process_groups import create_process_groups
from parallel.topology import Topology
from tests.parity import NO_DROPOUT, assert_tensors_close
from tests.world import run_world


def _model(width: int = 16, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                         nn.Linear(width, 4)).to(dtype)


def _data(steps: int, per_step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(per_step, 8, generator=generator), torch.randn(per_step, 4, generator=generator))
            for _ in range(steps)]


def _adam(groups):
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)


def _groups(module):
    params = list(module.parameters())
    return [{"params": [p for p in params if p.ndim > 1]}, {"params": [p for p in params if p.ndim == 1],
                                                           "weight_decay": 0.0}]


def _train(module, optimizer, data, dp_rank, dp_size, micro_batches):
    for inputs, targets in data:
        mine = inputs.chunk(dp_size)[dp_rank].chunk(micro_batches), targets.chunk(dp_size)[dp_rank].chunk(micro_batches)
        for index, (x, y) in enumerate(zip(*mine)):
            loss = nn.functional.mse_loss(module(x.to(next(module.parameters()).dtype)).float(), y) / micro_batches
            with optimizer.no_sync() if index < micro_batches - 1 else torch.enable_grad():
                optimizer.scale_loss(loss).backward()
        result = optimizer.step()
        optimizer.zero_grad()
    return result


def _full_params(module, optimizer):
    with optimizer.gathered_parameters():
        return [p.detach().clone() for p in module.parameters()]


def _alone() -> AxisGroup:
    return AxisGroup("dp", (0,), None, CommStats())


@pytest.fixture(scope="module")
def reference():
    module, optimizer = zero.initialize(model := _model(), _adam, stage=0, group=_alone(), param_groups=_groups(model),
                                        clip_grad=0.5)
    _train(module, optimizer, _data(6, 8), 0, 1, micro_batches=4)
    return _full_params(module, optimizer)


def _stages_world(rank, world_size, cases):
    groups = create_process_groups(Topology(world_size))
    out = []
    for stage, bucket_size in cases:
        model = _model()
        numel = sum(p.numel() for p in model.parameters())
        whole = sum(p.numel() for p in model.parameters() if p.numel() <= 16)
        module, optimizer = zero.initialize(model, _adam, stage=stage, group=groups.dp, bucket_size=bucket_size,
                                            param_groups=_groups(model), clip_grad=0.5,
                                            unit_modules=list(model), persistence_threshold=16)
        micro = 4 // world_size
        _train(module, optimizer, _data(5, 8), rank, world_size, micro_batches=micro)
        groups.stats.reset()
        _train(module, optimizer, _data(6, 8)[5:], rank, world_size, micro_batches=micro)
        sent = groups.stats.bytes_by_operation()
        out.append((_full_params(module, optimizer), sent, optimizer.model_state_bytes(), numel, whole, micro))
    return out


@pytest.mark.parity
def test_stages_0_1_2_reproduce_one_process_with_accumulation(reference):
    cases = [(0, 50), (1, 50), (2, 50), (1, 10_000), (2, 7), (3, 50)]
    for world_size in (2, 4):
        for per_case in run_world(world_size, _stages_world, cases):
            for (stage, bucket), (params, sent, _, numel, whole, micro) in zip(cases, per_case):
                # 11 AdamW steps from reductions over dp ranks: another summation order than one process
                assert_tensors_close(params, reference, f"dp{world_size} stage {stage} bucket {bucket}: parameters")
                ring = (world_size - 1) / world_size
                if stage == 0:  # one all-reduce of all gradients per step
                    assert sent["all_reduce"] == pytest.approx(2 * ring * numel * 4, rel=0.02)
                elif stage == 1:  # reduce-scatter once, all-gather once: the same bytes as stage 0
                    assert sent["reduce_scatter"] == sent["all_gather"] == pytest.approx(ring * numel * 4, rel=0.02)
                elif stage == 2:  # reduce-scatters every micro-batch (no full gradient kept between them)
                    assert sent["reduce_scatter"] == pytest.approx(micro * ring * numel * 4, rel=0.02)
                    assert sent["all_gather"] == pytest.approx(ring * numel * 4, rel=0.02)
                else:  # stage 3 gathers the sharded weights in forward and again in backward, per micro-batch
                    assert sent["reduce_scatter"] == pytest.approx(micro * ring * numel * 4, rel=0.05)
                    sharded = numel - whole
                    assert sent["all_gather"] == pytest.approx((2 * micro * sharded + whole) * ring * 4, rel=0.05)


def _bf16_bytes(rank, world_size):
    groups = create_process_groups(Topology(world_size))
    results = {}
    for stage in (0, 1, 2, 3):
        model = _model(width=1024, dtype=torch.bfloat16)
        module, optimizer = zero.initialize(model, _adam, stage=stage, group=groups.dp, bucket_size=100_000,
                                            unit_modules=list(model))
        _train(module, optimizer, _data(1, 8), rank, world_size, micro_batches=1)
        groups.stats.reset()
        _train(module, optimizer, _data(2, 8)[1:], rank, world_size, micro_batches=1)
        results[stage] = (optimizer.model_state_bytes(), groups.stats.total_bytes(),
                          sum(p.numel() for p in model.parameters()))
    return results


def test_bf16_model_state_bytes_follow_the_formulas_and_bytes_sent_equal_stage_0():
    for world_size in (2, 4):
        for results in run_world(world_size, _bf16_bytes):
            numel = results[0][2]
            formula = {0: 16 * numel, 1: 4 * numel + 12 * numel / world_size, 2: 2 * numel + 14 * numel / world_size,
                       3: 16 * numel / world_size}
            for stage, (measured, sent, _) in results.items():
                assert abs(measured - formula[stage]) / formula[stage] < 0.10, (world_size, stage, measured)
                # stages 1-2 send what stage 0 sends; stage 3 gathers the weights twice: 1.5x
                ratio = 1.5 if stage == 3 else 1.0
                assert abs(sent / results[0][1] - ratio) < 0.05 * ratio, (world_size, stage, sent)


def _fp16_overflow(rank, world_size, hysteresis):
    groups = create_process_groups(Topology(world_size))
    model = _model(dtype=torch.float16)
    scaler = zero.DynamicLossScaler(scale=1024.0, hysteresis=hysteresis)
    module, optimizer = zero.initialize(model, _adam, stage=2, group=groups.dp, loss_scaler=scaler)
    before = [p.detach().clone() for p in module.parameters()]
    if rank == 1:  # only one rank sees the overflow: one inf in the first weight's gradient
        poison = torch.zeros_like(next(module.parameters()))
        poison.view(-1)[0] = float("inf")
        next(module.parameters()).register_hook(lambda grad: grad + poison)
    results = []
    for step in range(2):
        x, y = _data(1, 8)[0]
        loss = nn.functional.mse_loss(module(x.half()).float(), y)
        optimizer.scale_loss(loss).backward()
        result = optimizer.step()
        optimizer.zero_grad()
        results.append((result.skipped, result.loss_scale, optimizer.loss_scale))
    unchanged = all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
    return results, unchanged


def test_fp16_overflow_on_one_rank_makes_every_rank_skip_and_back_off():
    for (results, unchanged) in run_world(2, _fp16_overflow, 1):
        assert results == [(True, 1024.0, 512.0), (True, 512.0, 256.0)]
        assert unchanged
    for (results, unchanged) in run_world(2, _fp16_overflow, 2):
        assert results == [(True, 1024.0, 1024.0), (True, 1024.0, 512.0)]  # hysteresis 2: backs off on the 2nd


def _deep_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])


def _live_parameters(rank, world_size, budgets):
    groups = create_process_groups(Topology(world_size))
    peaks = []
    for budget in budgets:
        model = _deep_model()
        module, optimizer = zero.initialize(model, _adam, stage=3, group=groups.dp, unit_modules=list(model),
                                            persistence_threshold=32, prefetch_budget=budget)
        for step in range(3):
            x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step))
            module(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 0:
                optimizer.units.max_live_elements = 0  # the first step records the order, no prefetch yet
        peaks.append((optimizer.units.max_live_elements, _full_params(module, optimizer)))
    return peaks


def test_prefetch_keeps_live_parameters_within_the_budget():
    unit = 32 * 32
    for peaks in run_world(2, _live_parameters, [0, 2 * unit, 4 * unit]):
        (none, params0), (two, params2), (four, params4) = peaks
        assert none == unit  # without prefetch only the running module's weights are whole
        assert two == 2 * unit and four == 4 * unit  # prefetching fills the budget, never more
        for a, b, c in zip(params0, params2, params4):
            assert torch.equal(a, b) and torch.equal(a, c)  # and changes no number


def _diverging_ranks(rank, world_size):
    groups = create_process_groups(Topology(world_size))
    model = _deep_model()
    module, optimizer = zero.initialize(model, _adam, stage=3, group=groups.dp, unit_modules=list(model),
                                        persistence_threshold=32)
    x = torch.randn(4, 32)
    if rank == 1:
        x = model[1](x)  # rank 1 runs layer 1 before the sequence: the gather orders differ
    module(x).sum().backward()


def test_ranks_gathering_different_modules_fail_with_names_not_a_hang():
    from tests.world import WorldError

    with pytest.raises(WorldError, match=r"ZeRO-3 ranks diverged: this rank gathers (0|1) while another gathers (0|1)"):
        run_world(2, _diverging_ranks, timeout_s=60)


def test_bad_stage_and_bucket_size_are_refused():
    with pytest.raises(ValueError, match="--zero-stage 5 is unknown"):
        zero.initialize(_model(), _adam, stage=5, group=_alone())
    with pytest.raises(ValueError, match="--zero-bucket-size must be >= 1"):
        zero.initialize(_model(), _adam, stage=1, group=_alone(), bucket_size=0)


def _resident_bytes() -> int:
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmRSS:"))


def _construction_peak(rank, world_size, on_meta):
    import ctypes

    from models.config import GPTConfig
    from models.counting import num_parameters
    from models.gpt import GPTModel
    from pretrain.metrics import peak_memory_bytes, reset_peak_memory

    # large blocks straight from mmap (glibc's M_MMAP_THRESHOLD): a freed unit goes back to the system,
    # so resident memory measures what is alive rather than what glibc keeps for reuse
    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)
    groups = create_process_groups(Topology(world_size))
    config = GPTConfig(num_layers=8, hidden_size=512, num_attention_heads=8, seq_length=16, vocab_size=512,
                       **NO_DROPOUT)
    for device in ("cpu", "meta"):  # load the libraries a first model touches before measuring
        with torch.device(device):
            GPTModel(GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=4, vocab_size=16,
                               **NO_DROPOUT),
                     groups.tp, seed=0)
    cpu = torch.device("cpu")
    reset_peak_memory(cpu)
    before = _resident_bytes()
    with torch.device("meta") if on_meta else torch.device("cpu"):
        model = GPTModel(config, groups.tp, seed=0)
    _, optimizer = zero.initialize(model, _adam, stage=3, group=groups.dp, unit_modules=list(model.layers))
    peak = peak_memory_bytes(cpu) - before
    unit = max(u.numel for u in optimizer.units.units) * 4
    full = _full_params(model, optimizer)
    return peak, optimizer.model_state_bytes(), unit, num_parameters(config) * 4, [p.sum().item() for p in full]


def test_stage3_builds_the_model_unit_by_unit_without_holding_it_whole():
    for (meta_peak, states, unit, model_bytes, meta_sums), (eager_peak, _, _, _, eager_sums) in zip(
            run_world(2, _construction_peak, True), run_world(2, _construction_peak, False)):
        assert meta_sums == eager_sums  # the same numbers as building it whole
        assert eager_peak >= model_bytes  # built whole first
        assert meta_peak <= states + 3 * unit  # built on meta: the shards plus about one unit in flight
        assert eager_peak - meta_peak >= 0.5 * model_bytes, (eager_peak, meta_peak)
