"""Stage partition and schedules: every schedule is complete, ordered and deadlock-free.

The schedules are checked by running every stage's real executor and exchange at once, one thread
per stage, over a simulated network (``SimulatedP2P``) with either of two semantics:

    gloo  every operation on its own: a send completes when its receive (same pair, same tag) is
          posted, whatever else either rank has posted
    nccl  a rank's batches run one after another on one stream; an operation completes only when
          its peer's matching operation is in the batch the peer is running now, and sends and
          receives between a pair match in posting order whatever their tags (so a mismatch would
          deliver the wrong tensor: the simulation refuses it)

A rank blocks only in ``wait``. When every unfinished rank waits on something that can no longer
arrive, that is a deadlock. Values flow for real, and the weights' gradients must equal a
sequential run's.
"""

import threading
import weakref

import pytest
import torch

from parallel import comm
from parallel.pipeline.p2p import StageExchange
from parallel.pipeline.partition import chunk_layers, validate_partition, virtual_stage
from parallel.pipeline.executor import PipelineExecutor
from parallel.pipeline.schedules import (SPLIT_SCHEDULES, V_SCHEDULES, Action, schedule_actions,
                                         validate_schedule)
from parallel.pipeline.timeline import simulate


def test_interleaved_partition_follows_megatron():
    assert [chunk_layers(8, 2, stage, chunk, vp=2) for stage in (0, 1) for chunk in (0, 1)] == \
        [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert [chunk_layers(6, 2, s, split=[2, 4]) for s in (0, 1)] == [[0, 1], [2, 3, 4, 5]]
    # an uneven split per virtual stage, in a micro-batch's path: interleaved, and in a V
    assert [chunk_layers(6, 2, stage, chunk, vp=2, split=[0, 2, 3, 1]) for stage in (0, 1)
            for chunk in (0, 1)] == [[], [2, 3, 4], [0, 1], [5]]
    assert [chunk_layers(6, 2, stage, chunk, vp=2, split=[1, 2, 2, 1], v=True) for stage in (0, 1)
            for chunk in (0, 1)] == [[0], [5], [1, 2], [3, 4]]
    # a V (zbv): down the stages with chunk 0, back up with chunk 1
    assert [chunk_layers(8, 2, stage, chunk, vp=2, v=True) for stage in (0, 1) for chunk in (0, 1)] == \
        [[0, 1], [6, 7], [2, 3], [4, 5]]


@pytest.mark.parametrize("args, message", [
    ((6, 4),
     "--num-layers 6 is not divisible by --pipeline-model-parallel-size 4 x --virtual-pipeline-size 1"),
    ((8, 2, 3),
     "--num-layers 8 is not divisible by --pipeline-model-parallel-size 2 x --virtual-pipeline-size 3"),
    ((2, 4), "--pipeline-model-parallel-size 4 is larger than --num-layers 2"),
    ((6, 2, 1, [2, 3]), "must be 2 counts .--pipeline-model-parallel-size 2 x 1 chunks. summing to "
                        "--num-layers 6"),
    ((6, 2, 2, [3, 0, 0, 3]), "virtual stage 1 of 4 would hold no layer, embedding or loss"),
])
def test_bad_partitions_name_the_flags(args, message):
    with pytest.raises(ValueError, match=message if "." in message else message.replace("(", r"\(")):
        validate_partition(*args)


MEGATRON_LAYOUTS = [("Et*3|(tt|)*29,m|L", 16, 61), ("E|t*4|t*3|tL", 2, 8), ("Ett|t|tt|tL", 2, 6),
                    ("(t|)*7tL", 4, 8), ("Et|tt|t*3|(t)*2L", 2, 8)]


@pytest.mark.parametrize("layout, pp, layers", MEGATRON_LAYOUTS)
def test_layout_strings_cut_as_megatron_core_cuts_them(layout, pp, layers):
    """``--pipeline-model-parallel-layout`` against megatron-core's own parser: the same layers in each
    virtual stage (its MTP layer, which is not built here, refused by name)."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from parallel.pipeline.layer_split import layout_split

    theirs = PipelineParallelLayerLayout(layout, pp)
    stages = [theirs.layout[virtual % pp][virtual // pp].count(LayerType.decoder)
              for virtual in range(pp * theirs.virtual_pipeline_model_parallel_size)]
    if "m" in layout:
        with pytest.raises(ValueError, match="multi-token prediction layers .m. are not built here"):
            layout_split(layout, pp, layers)
        return
    if "E" not in layout:
        with pytest.raises(ValueError, match="the embedding .E. must be in the first virtual stage"):
            layout_split(layout, pp, layers)
        return
    assert layout_split(layout, pp, layers) == (tuple(stages), theirs.virtual_pipeline_model_parallel_size)


def test_megatron_split_flags_cut_as_megatron_core_cuts_them():
    """--decoder-first/last-pipeline-num-layers (with virtual stages too) and the account-for flags against
    megatron-core's get_num_layers_to_build, stage by stage."""
    from types import SimpleNamespace
    from unittest import mock

    from megatron.core.transformer import transformer_block

    from parallel.pipeline.layer_split import SplitRequest

    cases = [(SplitRequest(first=1), 7, 4, 1), (SplitRequest(first=2, last=2), 8, 3, 1),
             (SplitRequest(first=4, last=2), 14, 3, 2), (SplitRequest(embedding=True, loss=True), 6, 4, 1),
             (SplitRequest(embedding=True, loss=True), 4, 2, 3), (SplitRequest(loss=True), 7, 2, 2)]
    for request, layers, pp, vp in cases:
        config = SimpleNamespace(pipeline_model_parallel_layout=None, num_layers=layers,
                                 pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
                                 num_layers_in_first_pipeline_stage=request.first,
                                 num_layers_in_last_pipeline_stage=request.last,
                                 account_for_embedding_in_pipeline_split=request.embedding,
                                 account_for_loss_in_pipeline_split=request.loss)
        theirs = []
        for virtual in range(pp * vp):
            with mock.patch.object(transformer_block.parallel_state,
                                   "get_virtual_pipeline_model_parallel_world_size",
                                   return_value=vp if vp > 1 else None):
                theirs.append(transformer_block.get_num_layers_to_build(config, virtual // pp, virtual % pp))
        assert request.split(layers, pp, vp) == tuple(theirs), (request, layers, pp, vp)


@pytest.mark.parametrize("args, message", [
    (("interleaved", 3, 2, 2), "multiple of --pipeline-model-parallel-size 2"),
    (("interleaved", 2, 4, 2), "needs the micro-batches per step"),
    (("1f1b", 4, 2, 2), "--virtual-pipeline-size 2 runs 2 model chunks per stage: it needs "
                        "--pipeline-schedule interleaved"),
])
def test_bad_schedules_name_the_flags(args, message):
    with pytest.raises(ValueError, match=message):
        validate_schedule(*args)


class Deadlock(Exception):
    pass


class _Op:
    def __init__(self, rank, send, peer, tag, tensor, sequence):
        self.rank, self.send, self.peer, self.tag, self.tensor, self.sequence = (rank, send, peer, tag,
                                                                                 tensor, sequence)
        self.done = False
        self.batch = None


class _Work:
    def __init__(self, network, ops):
        self.network, self.ops = network, ops

    def is_completed(self):
        return all(op.done for op in self.ops)

    def wait(self):
        self.network.wait(self)
        return True


class SimulatedP2P:
    """Stands in for ``comm.batch_isend_irecv`` for ``pp`` ranks running in threads."""

    def __init__(self, pp: int, semantics: str):
        self.pp, self.semantics = pp, semantics
        self.lock = threading.Condition()
        self.batches = [[] for _ in range(pp)]  # per rank: posted batches, in order
        self.head = [0] * pp  # per rank: the batch its stream runs now (nccl)
        self.posted = {}  # (src, dst, tag or None) -> number of operations posted so far, per side
        self.waiting, self.running = [], pp  # works being waited on; ranks not finished
        self.failure = None
        self.max_sent_alive = [0] * pp  # per rank: sent tensors still alive when it posts (weak references)
        self._sent = [[] for _ in range(pp)]

    def batch_isend_irecv(self, sends, recvs, group):
        rank = group.rank
        with self.lock:
            self._sent[rank] = [ref for ref in self._sent[rank] if ref() is not None]
            self.max_sent_alive[rank] = max(self.max_sent_alive[rank], len(self._sent[rank]))
            ops = []
            for entries, send in ((sends, True), (recvs, False)):
                for tensor, peer, tag in entries:
                    key = (rank, peer, send, tag if self.semantics == "gloo" else None)
                    self.posted[key] = self.posted.get(key, 0) + 1
                    ops.append(_Op(rank, send, peer, tag, tensor, self.posted[key]))
                    if send:
                        self._sent[rank].append(weakref.ref(tensor))
            for op in ops:
                op.batch = len(self.batches[rank])
            self.batches[rank].append(ops)
            self._progress()
            return [_Work(self, ops)]

    def _active(self, op):
        return self.semantics == "gloo" or op.batch == self.head[op.rank]

    def _progress(self):
        changed = True
        while changed:
            changed = False
            ops = [op for batches in self.batches for batch in batches for op in batch if not op.done]
            pending = [op for op in ops if op.send]
            receives = {(op.peer, op.rank, op.tag if self.semantics == "gloo" else None, op.sequence): op
                        for op in ops if not op.send}
            for send in pending:
                tag = send.tag if self.semantics == "gloo" else None
                recv = receives.get((send.rank, send.peer, tag, send.sequence))
                if recv is None or not (self._active(send) and self._active(recv)):
                    continue
                if recv.tag != send.tag:
                    self.failure = AssertionError(
                        f"rank {send.rank} sent tag {send.tag} where rank {recv.rank} receives tag "
                        f"{recv.tag}: "
                        "NCCL matches in posting order and would deliver the wrong tensor")
                    self.lock.notify_all()
                    return
                recv.tensor.copy_(send.tensor)
                send.done = recv.done = True
                send.tensor = recv.tensor = None  # the network holds no tensor once delivered
                changed = True
            for rank in range(self.pp):
                while self.head[rank] < len(self.batches[rank]) and all(
                        op.done for op in self.batches[rank][self.head[rank]]):
                    self.head[rank] += 1
                    changed = True
        self.lock.notify_all()

    def wait(self, work):
        with self.lock:
            self.waiting.append(work)
            try:
                while not work.is_completed():
                    if self.failure is not None:
                        raise self.failure
                    if len(self.waiting) == self.running and not any(w.is_completed() for w in self.waiting):
                        self.failure = Deadlock("every stage waits on a neighbour")
                        self.lock.notify_all()
                        raise self.failure
                    self.lock.wait(timeout=10)
            finally:
                self.waiting.remove(work)

    def finished(self):
        with self.lock:
            self.running -= 1
            self.lock.notify_all()


class _Group:
    def __init__(self, rank, pp):
        self.rank, self.ranks, self.size, self.axis = rank, tuple(range(pp)), pp, "pp"


WIDTH = 3


def _weights(pp, vp):
    """One weight vector per virtual stage (chunk-major order, as the layers are cut)."""
    generator = torch.Generator().manual_seed(pp * 10 + vp)
    return [torch.randn(WIDTH, generator=generator) * 0.5 + 1 for _ in range(pp * vp)]


def _inputs(m):
    generator = torch.Generator().manual_seed(m)
    return [torch.randn(1, WIDTH, generator=generator) for _ in range(m)]


def _forward(x, weight, is_last):
    y = torch.tanh(x * weight)
    return y.sum() if is_last else y


def _reference(kind, m, pp, vp):
    weights = [w.clone().requires_grad_() for w in _weights(pp, vp)]
    for x in _inputs(m):
        for v, weight in enumerate(weights):
            x = _forward(x, weight, v == len(weights) - 1)
        x.backward()
    return [w.grad for w in weights]


def _run_stages(kind, m, pp, vp, semantics):
    """Every stage's executor in its own thread over the simulated network; returns (weights' gradients,
    peak live micro-batches per stage, the network)."""
    network = SimulatedP2P(pp, semantics)
    initial = _weights(pp, vp)
    weights = [w.clone().requires_grad_() for w in initial]
    inputs = _inputs(m)
    peaks, errors = [0] * pp, []

    def stage_main(stage):
        try:
            exchange = StageExchange(_Group(stage, pp), (1, WIDTH), torch.float32, torch.device("cpu"))
            v = kind in V_SCHEDULES
            executor = PipelineExecutor(exchange, stage, pp, vp, v)

            def forward_step(chunk, micro_batch, received):
                place = virtual_stage(stage, chunk, pp, v)
                x = inputs[micro_batch] if received is None else received
                return _forward(x, weights[place], place == pp * vp - 1)

            deferred = {}

            def input_backward(chunk, micro_batch, output, grad, hidden, last):
                """B of a split schedule: the input's gradient now, the weight's kept for W."""
                weight = weights[virtual_stage(stage, chunk, pp, v)]
                inputs_ = [weight] if hidden is None else [hidden, weight]
                grads = torch.autograd.grad(output, inputs_, grad)
                deferred[(chunk, micro_batch)] = grads[-1]
                return None if hidden is None else grads[0]

            def weight_pass(chunk, micro_batch, last):
                torch.autograd.backward(weights[virtual_stage(stage, chunk, pp, v)],
                                        deferred.pop((chunk, micro_batch)))

            orders = [schedule_actions(kind, m, pp, s, vp) for s in range(pp)]
            program = simulate(orders, pp, vp, v=v).program(stage)
            if kind in SPLIT_SCHEDULES:
                stats = executor.run(program, forward_step, input_backward, weight_pass)
                assert not deferred
            else:
                stats = executor.run(program, forward_step)
            peaks[stage] = sum(stats.max_live_micro_batches.values()) if v else \
                max(stats.max_live_micro_batches.values())
        except BaseException as error:  # noqa: BLE001 - reported by the test thread
            errors.append(error)
        finally:
            network.finished()

    original = comm.batch_isend_irecv
    comm.batch_isend_irecv = network.batch_isend_irecv
    try:
        threads = [threading.Thread(target=stage_main, args=(s,)) for s in range(pp)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        comm.batch_isend_irecv = original
    if errors:
        raise errors[0]
    return [w.grad for w in weights], peaks, network


CASES = [("gpipe", m, pp, 1) for pp in (2, 3, 4, 8) for m in (1, 2, 4, 8, 16)] + \
        [("1f1b", m, pp, 1) for pp in (2, 3, 4, 8) for m in (1, 2, 4, 8, 16)] + \
        [("interleaved", groups * pp, pp, vp) for pp, vp in [(2, 2), (2, 3), (4, 2), (4, 4), (3, 2), (8, 2)]
         for groups in (1, 2, 3)] + \
        [("zb-h1", m, pp, 1) for pp in (2, 3, 4, 8) for m in (1, 2, 4, 8, 16)] + \
        [("zbv", m, pp, 2) for pp in (1, 2, 3, 4, 8) for m in (1, 2, 4, 7, 8, 16)]


@pytest.mark.parametrize("semantics", ["gloo", "nccl"])
def test_schedules_run_without_deadlock_and_compute_the_sequential_gradients(semantics):
    """All schedules at pp 2-8 over both networks (one test: the cases are milliseconds each). Also the
    memory bounds: 1f1b keeps at most pp - stage micro-batches alive, interleaved Megatron's warm-up
    bound, and no stage keeps more sent tensors alive than there are stages."""
    for kind, m, pp, vp in CASES:
        case = f"{kind} m={m} pp={pp} vp={vp} over {semantics}"
        try:
            grads, peaks, network = _run_stages(kind, m, pp, vp, semantics)
        except Deadlock:
            raise AssertionError(f"deadlock: {case}") from None
        for got, want in zip(grads, _reference(kind, m, pp, vp)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=case)  # summed in another order
        if kind == "gpipe":
            assert peaks == [m] * pp, case
        elif kind == "1f1b":
            assert peaks == [min(pp - stage, m) for stage in range(pp)], case
        elif kind == "zb-h1":  # the executor frees a micro-batch's activations at B; its W holds no more
            assert peaks == [min(pp - stage, m) for stage in range(pp)], case
        elif kind == "zbv":  # chunks of half a stage; B frees them, W holds only its products' operands
            assert max(peaks) <= 2 * pp + 1, case
        else:
            assert peaks[0] <= min(m * vp, 2 * (pp - 1) + (vp - 1) * pp + 1), case
        assert max(network.max_sent_alive) <= pp, (case, network.max_sent_alive)


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16), (8, 8)])
def test_zb_h1_cuts_the_bubble_to_f_plus_b_minus_w_and_holds_no_more_than_1f1b_s_first_stage(pp, m):
    """Equal stages, each action's time given: the idle time of every stage is (pp - 1)(F + B + W) for 1F1B
    and (pp - 1)(F + B - W) for ZB-H1 (Qi et al.), and ZB-H1 holds at most pp micro-batches on any stage."""
    costs = {"F": 1.0, "B": 1.25, "W": 0.75}
    for kind, idle in (("1f1b", 3.0), ("zb-h1", 1.5)):
        timeline = simulate([schedule_actions(kind, m, pp, s) for s in range(pp)], pp, costs=costs)
        for stage in range(pp):
            assert timeline.step_time - timeline.busy(stage) == pytest.approx((pp - 1) * idle), (kind, stage)
            assert timeline.peak_live(stage) == (pp if kind == "zb-h1" else pp - stage)


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zbv_idles_only_while_the_first_micro_batch_comes_down_the_v(pp, m):
    """Equal chunk actions and m >= 2 pp - 1: every stage idles (pp - 1) F (stage s waits s forwards at the
    start, and the others as long at the end), a sixth of 1F1B's (pp - 1)(F + B + W) over whole stages, and
    holds 2 pp chunks' activations: pp stages' worth, 1F1B's first stage's."""
    timeline = simulate([schedule_actions("zbv", m, pp, s, 2) for s in range(pp)], pp, 2, v=True)
    for stage in range(pp):
        assert timeline.step_time - timeline.busy(stage) == pp - 1
        assert timeline.peak_live(stage) == 2 * pp


def test_an_order_that_deadlocks_is_refused():
    orders = [[Action("F", 0, 0), Action("B", 0, 0)], [Action("B", 0, 0), Action("F", 0, 0)]]
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(orders, 2)
