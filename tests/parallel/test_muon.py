"""Muon as a library: ours against torch.optim.Muon (both learning-rate rules) with AdamW beside it on a GPT
and a Llama-class model that are not ours, and through ``zero.initialize`` at every stage: a user's
torch.optim.Muon is run on whole matrices, never on flat shards; an optimizer that reads whole tensors and
has no such path is refused."""

import pytest
import torch
import torch.nn.functional as F

from parallel import zero
from parallel.muon import Muon, settings_of_torch_muon
from tests.parallel.test_zero_library import PlainGPT, _batches
from tests.parity import assert_tensors_close, assert_trajectory_close
from tests.world import run_world

LR, WEIGHT_DECAY = 3e-3, 0.1


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=16))


def _logits(model, tokens):
    out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def _is_matrix(name: str, param) -> bool:
    """Muon's parameters as Megatron picks them: the layers' matrices, not embeddings or the output layer."""
    return param.ndim == 2 and not any(part in name for part in ("wte", "wpe", "embed_tokens", "lm_head"))


def _groups(model):
    matrices = [p for n, p in model.named_parameters() if _is_matrix(n, p)]
    rest = [p for n, p in model.named_parameters() if not _is_matrix(n, p)]
    return matrices, rest


def _train(model, step, batches):
    losses = []
    for batch in batches:
        logits = _logits(model, batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        step()
        losses.append(loss.item())
    return losses


def _torch_pair(model, rule):
    matrices, rest = _groups(model)
    muon = torch.optim.Muon(matrices, lr=LR, weight_decay=WEIGHT_DECAY, adjust_lr_fn=rule)
    adamw = torch.optim.AdamW(rest, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def step():
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    return step


def _ours(model, rule, precision="torch"):
    matrices, rest = _groups(model)
    like_torch = settings_of_torch_muon(torch.optim.Muon(matrices, lr=LR, weight_decay=WEIGHT_DECAY,
                                                         adjust_lr_fn=rule))[0]
    return Muon([{**like_torch, "params": matrices, "precision": precision},
                 {"params": rest, "use_muon": False}], lr=LR, weight_decay=WEIGHT_DECAY)


@pytest.mark.parametrize("rule", [None, "match_rms_adamw"])
def test_our_muon_equals_torch_muon_with_adamw_for_20_steps(rule):
    """One process, a nanoGPT-shaped GPT and a transformers Llama: our Muon (torch's settings: bf16
    iterations, its learning-rate rule) on the matrices and AdamW on the rest, against torch.optim.Muon and
    torch.optim.AdamW side by side, within the fp32 trajectory bound at every step and in the weights."""
    batches = _batches(20, 0, 1)
    for make in (PlainGPT, _llama):
        reference, ours = make(), make()
        want = _train(reference, _torch_pair(reference, rule), batches)
        optimizer = _ours(ours, rule)

        def step():
            optimizer.step()
            optimizer.zero_grad()
        got = _train(ours, step, batches)
        assert_trajectory_close(got, want, f"{make.__name__} {rule}")
        assert_tensors_close(list(ours.parameters()), list(reference.parameters()), f"{make.__name__} {rule}")


def _library_world(rank, world_size):
    """A user's torch.optim.Muon over a Llama's matrices (the rest frozen) through zero.initialize at every
    stage in one process, and our Muon with fp32 iterations over the whole GPT at dp2, stages 0-3."""
    import torch.distributed as dist

    runs = {}
    batches = _batches(8, 0, 1)
    if world_size == 1:
        reference = _llama()
        for name, param in reference.named_parameters():
            param.requires_grad_(_is_matrix(name, param))
        torch_muon = torch.optim.Muon([p for p in reference.parameters() if p.requires_grad], lr=LR)
        runs["torch"] = _train(reference, lambda: (torch_muon.step(), torch_muon.zero_grad()), batches)
        for stage in (0, 1, 2, 3):
            model = _llama()
            for name, param in model.named_parameters():
                param.requires_grad_(_is_matrix(name, param))
            _, optimizer = zero.initialize(model, lambda groups: torch.optim.Muon(groups, lr=LR),
                                           zero.ZeroOptions(stage=stage, persistence_threshold=100))
            runs[stage] = _train(model, lambda: (optimizer.step(), optimizer.zero_grad()), batches)
        try:
            zero.initialize(PlainGPT(), lambda groups: torch.optim.Adafactor(groups),
                            zero.ZeroOptions(stage=2))
        except ValueError as error:
            runs["Adafactor"] = str(error)
        return runs
    for stage in (0, 1, 2, 3):
        model = PlainGPT()
        matrices, rest = _groups(model)
        muon = {id(p) for p in matrices}  # one momentum per element of a matrix, AdamW's two elsewhere
        formula = zero.expected_parameter_state_bytes(model.parameters(), stage, world_size, 4,
                                                      persistence_threshold=100,
                                                      moments=lambda p: 1 if id(p) in muon else 2)
        _, optimizer = zero.initialize(
            model, lambda groups: Muon(groups, lr=LR, weight_decay=WEIGHT_DECAY, precision="highest"),
            zero.ZeroOptions(stage=stage, persistence_threshold=100),
            param_groups=[{"params": matrices}, {"params": rest, "use_muon": False}])
        runs[stage] = _train(model, lambda: (optimizer.step(), optimizer.zero_grad()),
                             [batch.chunk(world_size)[rank] for batch in batches])
        with optimizer.gathered_parameters():
            runs[stage, "weights"] = [p.detach().clone() for p in model.parameters()]
        runs[stage, "bytes"] = (optimizer.model_state_bytes(), formula)
    runs["fp16"] = _fp16_skip(rank, world_size)
    dist.barrier()
    return runs


def _fp16_skip(rank, world_size):
    """fp16 at dp2 ZeRO-2: steps on batches 0, 1 (its loss made infinite: skipped) and 2, against steps on 0
    and 2 alone. Equal bit for bit: the skipped step left the weights and Muon's momentum as they were
    (hysteresis 2 keeps the loss scale, so both runs scale alike)."""
    batches = [batch.chunk(world_size)[rank] for batch in _batches(3, 0, 1)]
    outcomes = []
    for poisoned in (True, False):
        model = PlainGPT().half()
        matrices, rest = _groups(model)
        scaler = zero.DynamicLossScaler(scale=2.0 ** 8, hysteresis=2)
        _, optimizer = zero.initialize(
            model, lambda groups: Muon(groups, lr=LR, precision="highest"), zero.ZeroOptions(stage=2),
            param_groups=[{"params": matrices}, {"params": rest, "use_muon": False}], loss_scaler=scaler)
        skipped = []
        for index, batch in enumerate(batches):
            if index == 1 and not poisoned:
                continue
            logits = model(batch[:, :-1]).float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            optimizer.scale_loss(loss * (float("inf") if index == 1 else 1.0)).backward()
            skipped.append(optimizer.step().skipped)
            optimizer.zero_grad()
        momentum = [state["momentum_buffer"].clone() for state in optimizer.optimizer.state.values()
                    if "momentum_buffer" in state]
        outcomes.append((skipped, [p.detach().clone() for p in model.parameters()], momentum))
    return outcomes


@pytest.mark.parity
def test_zero_initialize_runs_muon_on_whole_matrices_at_every_stage():
    """torch.optim.Muon through ZeRO 0-3 equals it unwrapped; our Muon at dp2, ZeRO 0-3, equals one process
    within the fp32 trajectory bound; Adafactor (row and column statistics) is refused in one line."""
    one, = run_world(1, _library_world)
    assert one["Adafactor"].startswith("Adafactor reads whole tensors") and "\n" not in one["Adafactor"]
    for stage in (0, 1, 2, 3):
        assert_trajectory_close(one[stage], one["torch"], f"torch.optim.Muon through ZeRO-{stage}")
    reference = PlainGPT()
    optimizer = _ours(reference, None, "highest")
    optimizer.param_groups[0].update(scale_mode="spectral", extra_scale_factor=1.0,
                                     coefficient_type="quintic", momentum=0.95, nesterov=False)
    want = _train(reference, lambda: (optimizer.step(), optimizer.zero_grad()), _batches(8, 0, 1))
    ranks = run_world(2, _library_world)
    for runs in ranks:
        (skipped, weights, momentum), (clean, weights_clean, momentum_clean) = runs["fp16"]
        assert skipped == [False, True, False] and clean == [False, False] and momentum
        assert all(map(torch.equal, weights, weights_clean))
        assert all(map(torch.equal, momentum, momentum_clean))
    for stage in (0, 1, 2, 3):  # each rank's loss is of its half of the batch
        got = [(a + b) / 2 for a, b in zip(ranks[0][stage], ranks[1][stage])]
        assert_trajectory_close(got, want, f"our Muon at dp2 ZeRO-{stage}")
        for runs in ranks:
            measured, formula = runs[stage, "bytes"]
            print(f"ZeRO-{stage} dp2 Muon model-state bytes: measured {measured}, formula {formula:.0f}")
            assert 0 <= measured - formula <= 64, (stage, measured, formula)  # AdamW step counters: 4 B
        for runs in ranks:  # (the key bias's gradient is rounding noise, which AdamW normalises: against dp2)
            assert_tensors_close(runs[stage, "weights"], runs[0, "weights"], f"ZeRO-{stage} against ZeRO-0")
