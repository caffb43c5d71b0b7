"""ZB-V and DualPipeV: two stages per worker in a V, split backward; exact against one full-batch backward; the
timeline in the schedule's order."""

import pytest
import torch
from torch import nn

import fxpipe
from equivalence import max_relative_error
from models import SkipTied
from solvers.schedules import check_schedule, inflight, stage_worker, worker_orders
from solvers.simulate import simulate


def _reference(model, x, target, loss_fn):
    model.zero_grad(set_to_none=True)
    out = model(x)
    loss = loss_fn(out, target)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), out.detach(), grads


@pytest.mark.parametrize("schedule,devices,chunks,checkpoint", [
    ("zb-v", 2, 3, "never"), ("zb-v", 2, 4, "except_last"), ("zb-v", 4, 5, "never"),
    ("dualpipev", 2, 5, "except_last"), ("dualpipev", 4, 8, "never")])
def test_zb_v_step_equals_one_full_batch_backward_with_a_long_skip_and_tied_weights(schedule, devices, chunks,
                                                                                    checkpoint):
    torch.manual_seed(7)
    model = SkipTied(vocab=11, width=8, depth=2 * devices)
    tokens, target = torch.randint(0, 11, (11, 3)), torch.randint(0, 11, (11, 3))   # uneven micro-batches
    pipe = fxpipe.compile(model, ["cpu"] * devices, (tokens,), chunks=chunks, schedule=schedule,
                          checkpoint=checkpoint, profile="estimate")
    plan = pipe.plan
    assert plan.schedule == schedule and len(plan.stages) == 2 * devices and plan.workers == devices
    assert len(fxpipe.Plan.from_dict(plan.to_dict()).stages) == 2 * devices   # survives JSON
    # the certificate says where the stages really are and what it is exact for (not "stage k on device k")
    assert f"on its {schedule} worker" in plan.solver["exact_over"] and "device k" not in plan.summary()
    assert f"{schedule} simulated" in plan.solver["objective"]
    # the embedding (stage 0) and the tied head (the last stage) are on worker 0, the V's two ends
    assert {stage_worker(schedule, 0, devices), stage_worker(schedule, 2 * devices - 1, devices)} == {0}

    def loss_fn(logits, t):
        return nn.functional.cross_entropy(logits.reshape(-1, 11), t.reshape(-1))
    ref_loss, ref_out, ref_grads = _reference(model, tokens, target, loss_fn)
    loss, out = pipe.step(tokens, target, loss_fn, return_outputs=True)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert max_relative_error(out, ref_out) <= 1e-5
    assert set(grads) == set(ref_grads)
    worst = max((max_relative_error(grads[n], ref_grads[n]), n) for n in ref_grads)
    assert worst[0] <= 1e-5, worst
    timings = pipe.last_step["timings"]
    for w, order in enumerate(worker_orders(schedule, 2 * devices, chunks, devices)):
        mine = sorted((t for t in timings if stage_worker(schedule, t.stage, devices) == w), key=lambda t: t.start_s)
        assert [(t.kind, t.stage, t.micro_batch) for t in mine] == order   # one worker, in the schedule's order
    with torch.no_grad():   # inference with the same plan
        assert max_relative_error(pipe(tokens), ref_out) <= 1e-5


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13])
def test_zb_v_order_is_a_valid_dependency_order(p, m):
    orders = worker_orders("zb-v", 2 * p, m, p)
    for w, order in enumerate(orders):
        stages = {w, 2 * p - 1 - w}
        assert sorted(order) == sorted((k, s, i) for k in "FIW" for s in stages for i in range(m))
    # every operation runs after what it needs, whatever the durations: replay the workers in order,
    # one ready operation at a time, and never get stuck
    done, position = set(), [0] * p

    def ready(op):
        kind, s, i = op
        if kind == "F":
            return s == 0 or ("F", s - 1, i) in done
        if kind == "I":
            return ("F", s, i) in done and (s == 2 * p - 1 or ("I", s + 1, i) in done)
        return ("I", s, i) in done
    while any(position[w] < len(orders[w]) for w in range(p)):
        progressed = False
        for w in range(p):
            if position[w] < len(orders[w]) and ready(orders[w][position[w]]):
                done.add(orders[w][position[w]])
                position[w] += 1
                progressed = True
        assert progressed, f"deadlock with p={p}, m={m} at {position}"
    # the memory model holds each stage's forwards until their weight pass
    for s in range(2 * p):
        held = peak = 0
        for kind, k, _ in orders[stage_worker("zb-v", s, p)]:
            if k == s and kind != "I":
                held += 1 if kind == "F" else -1
                peak = max(peak, held)
        assert inflight("zb-v", s, 2 * p, m) == peak <= m


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_simulated_zb_v_is_no_slower_than_zb_h1_which_is_no_slower_than_1f1b(p, m):
    # a balanced chain: the same model (forward 1, backward 2 per device's share) on p devices
    one = {s: simulate([1.0] * p, [2.0] * p, m, s).iteration_s for s in ("1f1b", "zb-h1")}
    v = simulate([0.5] * (2 * p), [1.0] * (2 * p), m, "zb-v", workers=p).iteration_s
    assert v <= one["zb-h1"] <= one["1f1b"]
    assert v < one["1f1b"] or p == 1
    assert v >= m * 3.0   # never faster than the work of one device


def test_zb_v_refuses_a_shape_it_cannot_run():
    with pytest.raises(ValueError, match="use 4 stages"):
        check_schedule("zb-v", 3, 2, 4)
    model = SkipTied(vocab=11, width=8, depth=4)
    tokens = torch.randint(0, 11, (8, 3))
    with pytest.raises(ValueError, match="stages = 2 x the devices used"):
        fxpipe.compile(model, ["cpu"] * 2, (tokens,), chunks=4, stages=3, schedule="zb-v", profile="estimate")
