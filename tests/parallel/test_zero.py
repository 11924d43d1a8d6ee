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
        mine = (inputs.chunk(dp_size)[dp_rank].chunk(micro_batches),
                targets.chunk(dp_size)[dp_rank].chunk(micro_batches))
        for index, (x, y) in enumerate(zip(*mine)):
            loss = nn.functional.mse_loss(module(x.to(next(module.parameters()).dtype)).float(),
                                          y) / micro_batches
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
    module, optimizer = zero.initialize(model := _model(), _adam, zero.ZeroOptions(stage=0, clip_grad=0.5),
                                        _alone(), param_groups=_groups(model))
    _train(module, optimizer, _data(6, 8), 0, 1, micro_batches=4)
    return _full_params(module, optimizer)


def _stages_world(rank, world_size, cases):
    groups = create_process_groups(Topology(world_size))
    out = []
    for stage, bucket_size in cases:
        model = _model()
        numel = sum(p.numel() for p in model.parameters())
        whole = sum(p.numel() for p in model.parameters() if p.numel() <= 16)
        module, optimizer = zero.initialize(model, _adam,
                                            zero.ZeroOptions(stage=stage, bucket_size=bucket_size,
                                                             clip_grad=0.5, persistence_threshold=16,
                                                             prefetch_budget=0),  # the formulas' case
                                            groups.dp, param_groups=_groups(model), unit_modules=list(model))
        micro = 4 // world_size
        _train(module, optimizer, _data(5, 8), rank, world_size, micro_batches=micro)
        groups.stats.reset()
        _train(module, optimizer, _data(6, 8)[5:], rank, world_size, micro_batches=micro)
        sent = groups.stats.bytes_by_operation()
        out.append((_full_params(module, optimizer), sent, optimizer.model_state_bytes(), numel,
                    whole, micro))
    return out


@pytest.mark.parity
def test_stages_0_1_2_reproduce_one_process_with_accumulation(reference):
    cases = [(0, 50), (1, 50), (2, 50), (1, 10_000), (2, 7), (3, 50)]
    for world_size in (2, 4):
        for per_case in run_world(world_size, _stages_world, cases):
            for (stage, bucket), (params, sent, _, numel, whole, micro) in zip(cases, per_case):
                # 11 AdamW steps from reductions over dp ranks: another summation order than one process
                assert_tensors_close(params, reference,
                                     f"dp{world_size} stage {stage} bucket {bucket}: parameters")
                ring = (world_size - 1) / world_size
                if stage == 0:  # one all-reduce of all gradients per step
                    assert sent["all_reduce"] == pytest.approx(2 * ring * numel * 4, rel=0.02)
                elif stage == 1:  # reduce-scatter once, all-gather once: the same bytes as stage 0
                    assert (sent["reduce_scatter"] == sent["all_gather"]
                            == pytest.approx(ring * numel * 4, rel=0.02))
                elif stage == 2:  # reduce-scatters every micro-batch (no full gradient kept between them)
                    assert sent["reduce_scatter"] == pytest.approx(micro * ring * numel * 4, rel=0.02)
                    assert sent["all_gather"] == pytest.approx(ring * numel * 4, rel=0.02)
                else:  # stage 3 gathers the sharded weights in forward and again in backward, per micro-batch
                    assert sent["reduce_scatter"] == pytest.approx(micro * ring * numel * 4, rel=0.05)
                    sharded = numel - whole
                    assert sent["all_gather"] == pytest.approx((2 * micro * sharded + whole) * ring * 4,
                                                               rel=0.05)


def _bf16_bytes(rank, world_size):
    groups = create_process_groups(Topology(world_size))
    results = {}
    for fp32_grads in (True, False):
        for stage in (0, 1, 2, 3):
            model = _model(width=1024, dtype=torch.bfloat16)
            module, optimizer = zero.initialize(model, _adam,
                                                zero.ZeroOptions(stage=stage, bucket_size=100_000,
                                                                 main_grads_in_fp32=fp32_grads,
                                                                 prefetch_budget=0), groups.dp,
                                                unit_modules=list(model))
            _train(module, optimizer, _data(1, 8), rank, world_size, micro_batches=1)
            groups.stats.reset()
            _train(module, optimizer, _data(2, 8)[1:], rank, world_size, micro_batches=1)
            results[fp32_grads, stage] = (optimizer.model_state_bytes(), groups.stats.total_bytes(),
                                          sum(p.numel() for p in model.parameters()))
    return results


def test_bf16_model_state_bytes_follow_the_formulas_and_bytes_sent_equal_stage_0():
    """Per parameter: bf16 weight (2), gradient (4 in fp32 main gradients, the default; 2 in bf16), fp32
    master and moments (12), sharded by stage. Bytes sent: gradients in their dtype, gathers in bf16."""
    for world_size in (2, 4):
        for results in run_world(world_size, _bf16_bytes):
            numel = results[True, 0][2]
            for fp32_grads, g in ((True, 4), (False, 2)):
                formula = {0: (2 + g + 12) * numel, 1: (2 + g) * numel + 12 * numel / world_size,
                           2: 2 * numel + (g + 12) * numel / world_size, 3: (2 + g + 12) * numel / world_size}
                # in ring passes of numel elements: stage 0 all-reduces the gradients (2 passes), stages 1-2
                # reduce-scatter them and gather the weights, stage 3 gathers the weights twice
                sent = {0: 2 * g, 1: g + 2, 2: g + 2, 3: g + 2 * 2}
                for stage in range(4):
                    measured, bytes_sent, _ = results[fp32_grads, stage]
                    case = (world_size, fp32_grads, stage, measured)
                    assert abs(measured - formula[stage]) / formula[stage] < 0.10, case
                    ratio = sent[stage] / sent[0]
                    assert abs(bytes_sent / results[fp32_grads, 0][1] - ratio) < 0.05 * ratio, case


def _fp16_overflow(rank, world_size, hysteresis):
    groups = create_process_groups(Topology(world_size))
    model = _model(dtype=torch.float16)
    scaler = zero.DynamicLossScaler(scale=1024.0, hysteresis=hysteresis)
    module, optimizer = zero.initialize(model, _adam, zero.ZeroOptions(stage=2), groups.dp,
                                        loss_scaler=scaler)
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
        assert results == [(True, 1024.0, 1024.0),
                           (True, 1024.0, 512.0)]  # hysteresis 2: backs off on the 2nd


def _deep_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])


def _live_parameters(rank, world_size, budgets):
    groups = create_process_groups(Topology(world_size))
    peaks = []
    for budget in budgets:
        model = _deep_model()
        module, optimizer = zero.initialize(model, _adam,
                                            zero.ZeroOptions(stage=3, persistence_threshold=32,
                                                             prefetch_budget=budget), groups.dp,
                                            unit_modules=list(model))
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
    for peaks in run_world(2, _live_parameters, [0, 2 * unit, 4 * unit, None]):
        (none, params0), (two, params2), (four, params4), (auto, _) = peaks
        assert none == unit  # without prefetch only the running module's weights are whole
        assert two == 2 * unit and four == 4 * unit  # prefetching fills the budget, never more
        assert auto == 2 * unit  # the default: room for the two largest units, whatever their size
        for a, b, c in zip(params0, params2, params4):
            assert torch.equal(a, b) and torch.equal(a, c)  # and changes no number


def _diverging_ranks(rank, world_size):
    groups = create_process_groups(Topology(world_size))
    model = _deep_model()
    module, optimizer = zero.initialize(model, _adam, zero.ZeroOptions(stage=3, persistence_threshold=32),
                                        groups.dp, unit_modules=list(model))
    x = torch.randn(4, 32)
    if rank == 1:
        x = model[1](x)  # rank 1 runs layer 1 before the sequence: the gather orders differ
    module(x).sum().backward()


def test_ranks_gathering_different_modules_fail_with_names_not_a_hang():
    from tests.world import WorldError

    with pytest.raises(WorldError,
                       match=r"ZeRO-3 ranks diverged: this rank gathers (0|1) while another gathers (0|1)"):
        run_world(2, _diverging_ranks, timeout_s=60)


def test_bad_stage_and_bucket_size_are_refused():
    with pytest.raises(ValueError, match="--zero-stage 5 is unknown"):
        zero.initialize(_model(), _adam, zero.ZeroOptions(stage=5), _alone())
    with pytest.raises(ValueError, match="--zero-bucket-size must be >= 1"):
        zero.initialize(_model(), _adam, zero.ZeroOptions(stage=1, bucket_size=0), _alone())


def _resident_bytes() -> int:
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmRSS:"))


def _construction_peak(rank, world_size, on_meta):
    import ctypes

    from models.config import GPTConfig
    from models.counting import num_parameters
    from models.gpt import GPTModel
    from pretrain.observability.metrics import peak_memory_bytes, reset_peak_memory

    # large blocks straight from mmap (glibc's M_MMAP_THRESHOLD): a freed unit goes back to the system,
    # so resident memory measures what is alive rather than what glibc keeps for reuse
    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)
    groups = create_process_groups(Topology(world_size))
    config = GPTConfig(num_layers=8, hidden_size=512, num_attention_heads=8, seq_length=16, vocab_size=512,
                       **NO_DROPOUT)
    for device in ("cpu", "meta"):  # load the libraries a first model touches before measuring
        with torch.device(device):
            GPTModel(GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                               seq_length=4, vocab_size=16,
                               **NO_DROPOUT),
                     groups.tp, seed=0)
    cpu = torch.device("cpu")
    reset_peak_memory(cpu)
    before = _resident_bytes()
    with torch.device("meta") if on_meta else torch.device("cpu"):
        model = GPTModel(config, groups.tp, seed=0)
    _, optimizer = zero.initialize(model, _adam, zero.ZeroOptions(stage=3), groups.dp,
                                   unit_modules=list(model.layers))
    peak = peak_memory_bytes(cpu) - before
    unit = max(u.numel for u in optimizer.units.units) * 4
    full = _full_params(model, optimizer)
    return (peak, optimizer.model_state_bytes(), unit, num_parameters(config) * 4,
            [p.sum().item() for p in full])


def test_stage3_builds_the_model_unit_by_unit_without_holding_it_whole():
    for (meta_peak, states, unit, model_bytes, meta_sums), (eager_peak, _, _, _, eager_sums) in zip(
            run_world(2, _construction_peak, True), run_world(2, _construction_peak, False)):
        assert meta_sums == eager_sums  # the same numbers as building it whole
        assert eager_peak >= model_bytes  # built whole first
        assert meta_peak <= states + 3 * unit  # built on meta: the shards plus about one unit in flight
        assert eager_peak - meta_peak >= 0.5 * model_bytes, (eager_peak, meta_peak)


def _accumulation_world(rank, world_size, stages, steps, per_rank):
    """One global batch per step, as 1 micro-batch or as ``per_rank`` accumulated ones per rank: in fp32,
    and in bf16 with gradients accumulated and reduced in bf16 or in fp32 main gradients. Every run starts
    from the same (bf16-representable) weights. Returns per run: this rank's reduced gradient of the first
    step (fp32) and the losses of every step."""
    groups = create_process_groups(Topology(world_size))
    generator = torch.Generator().manual_seed(2)
    data = [(torch.randn(per_rank * world_size, 8, generator=generator),
             torch.randn(per_rank * world_size, 4, generator=generator)) for _ in range(steps)]
    runs = {}
    for stage in stages:
        for dtype, fp32_grads, micro in [(torch.float32, True, 1), (torch.bfloat16, False, 1),
                                         (torch.bfloat16, False, per_rank), (torch.bfloat16, True, 1),
                                         (torch.bfloat16, True, per_rank)]:
            model = _model(width=64, dtype=torch.bfloat16).to(dtype)
            module, optimizer = zero.initialize(model, lambda g: torch.optim.AdamW(g, lr=1e-3),
                                                zero.ZeroOptions(stage=stage, persistence_threshold=16,
                                                                 main_grads_in_fp32=fp32_grads), groups.dp,
                                                unit_modules=list(model))
            losses, first_grad = [], None
            for inputs, targets in data:
                mine = (inputs.chunk(world_size)[rank].chunk(micro),
                        targets.chunk(world_size)[rank].chunk(micro))
                total = torch.zeros(())
                for index, (x, y) in enumerate(zip(*mine)):
                    loss = nn.functional.mse_loss(module(x.to(dtype)).float(), y) / micro
                    with optimizer.no_sync() if index < micro - 1 else torch.enable_grad():
                        loss.backward()
                    total += loss.detach()
                optimizer.step()  # leaves the reduced gradients in place (no clipping, no loss scale)
                if first_grad is None:
                    first_grad = torch.cat([slot.grad().float() for slot in optimizer.slots])
                optimizer.zero_grad()
                losses.append(total.item())
            runs[stage, dtype, fp32_grads, micro] = (first_grad, losses)
    return runs


def test_accumulated_bf16_gradients_are_as_close_to_fp32_as_one_micro_batch():
    """The same global batch as 1 micro-batch and as 32 accumulated ones per rank (dp2), against fp32:
    the first step's reduced gradient (relative error) and 12 steps' losses (mean |loss - fp32 loss|).
    In bf16 main gradients every accumulation rounds the running sum to 8 bits of mantissa, so the error
    grows with the micro-batches; fp32 main gradients (the default) round each micro-batch's gradient
    once, as one micro-batch's is."""
    stages, per_rank = (0, 2, 3), 32
    runs = run_world(2, _accumulation_world, stages, 12, per_rank)[0]
    for stage in stages:
        grad, losses = runs[stage, torch.float32, True, 1]
        table = {}
        for name, fp32_grads in (("bf16 grads", False), ("fp32 main grads", True)):
            for micro in (1, per_rank):
                got, trajectory = runs[stage, torch.bfloat16, fp32_grads, micro]
                table[name, micro] = (((got - grad).norm() / grad.norm()).item(),
                                      sum(abs(a - b) for a, b in zip(trajectory, losses)) / len(losses))
        print(f"stage {stage}: (gradient error, mean |loss - fp32|):",
              {f"{name} x{micro}": f"{g:.2e} {loss:.2e}" for (name, micro), (g, loss) in table.items()})
        one, accumulated = table["fp32 main grads", 1][0], table["fp32 main grads", per_rank][0]
        assert accumulated <= 1.1 * one, (stage, table)
        assert table["bf16 grads", per_rank][0] > 1.5 * one, (stage, table)  # what fp32 main gradients fix


def _overlapped_gathers(rank, world_size):
    groups = create_process_groups(Topology(world_size))
    results = {}
    for stage in (1, 2):
        for overlap in (False, True):
            model = _model(width=64)
            module, optimizer = zero.initialize(model, _adam,
                                                zero.ZeroOptions(stage=stage, bucket_size=500,
                                                                 overlap_param_gather=overlap), groups.dp,
                                                param_groups=_groups(model))
            in_flight = []
            for inputs, targets in _data(4, 8):
                x, y = inputs.chunk(world_size)[rank], targets.chunk(world_size)[rank]
                in_flight.append(optimizer.flat.gathers_in_flight)  # gathers behind the forward about to run
                nn.functional.mse_loss(module(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
            results[stage, overlap] = (in_flight, _full_params(module, optimizer),
                                       sum(len(buffer.buckets) for buffer in optimizer.buffers))
    return results


def test_overlapped_parameter_gathers_run_behind_the_forward_and_change_no_number():
    """--overlap-param-gather: after a step every bucket's all-gather is still in flight when the next
    forward starts (each module waits for its own), and the parameters are the same, bit for bit."""
    for results in run_world(2, _overlapped_gathers):
        for stage in (1, 2):
            serial, serial_params, buckets = results[stage, False]
            overlapped, overlapped_params, _ = results[stage, True]
            assert (buckets > 1 and serial == [0] * 4
                    and overlapped == [0] + [buckets] * 3), (stage, overlapped)
            for a, b in zip(serial_params, overlapped_params):
                assert torch.equal(a, b)
