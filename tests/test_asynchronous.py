"""fxpipe.AsyncTrainer: weight stashing (PipeDream), 2BW and stale-synchronous training, against what they mean.

The chain model multiplies its input by one scalar weight per stage, so every gradient is a product of the
other stages' weights: the final weights reveal which version each forward and backward used. The expected
weights are computed here from the orders alone (:func:`solvers.asynchronous.async_orders`), not from the
trainer's records.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import fxpipe
from models import SkipTied
from fxpipe.planning.memory_model import predict_worker_memory
from solvers.asynchronous import async_orders, check_orders, stashed_versions


class Chain(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        for i in range(n):
            setattr(self, f"w{i}", nn.Parameter(torch.tensor(1.0 + 0.1 * i, dtype=torch.float64)))
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.n):
            x = x * getattr(self, f"w{i}")
        return x


def _chain_pipe(p: int, chunks: int, checkpoint: str = "never"):
    model = Chain(p)
    x = torch.ones(4, 3, dtype=torch.float64)
    pipe = fxpipe.compile(model, ["cpu"] * p, (x,), chunks=chunks, stages=p, schedule="1f1b", profile="estimate",
                          checkpoint=checkpoint)
    return model, pipe


def _expected_chain(model, pipe, batches, groups, staleness, lr, ahead=0):
    """The weights after SGD where micro-batch j's forward and backward both use the version its forward saw."""
    p = len(pipe.specs)
    stage_of = {}
    for k, spec in enumerate(pipe.specs):
        for q in spec.module.parameters():
            stage_of[id(q)] = k
    names = [f"w{i}" for i in range(model.n)]
    where = [stage_of[id(getattr(model, n))] for n in names]
    last_of = {g: j for j, g in enumerate(groups)}
    seen = [[0] * len(groups) for _ in range(p)]   # seen[k][j]: stage k's version at F(k, j)
    lags = []
    for k, order in enumerate(async_orders(p, groups, staleness, ahead)):
        version = 0
        for kind, _, j in order:
            if kind == "F":
                seen[k][j] = version
                lags.append(groups[j] - version)
            elif last_of[groups[j]] == j:
                version += 1
    micro = [xb_part for xb, _ in batches for xb_part in xb.chunk(pipe.chunks)]
    hist = [[1.0 + 0.1 * i] for i in range(len(names))]   # Chain's initial weights
    for g in range(groups[-1] + 1):
        members = [j for j in range(len(groups)) if groups[j] == g]
        total = sum(micro[j].shape[0] for j in members)
        grads = []
        for i in range(len(names)):
            grads.append(sum(micro[j].shape[0] / total * micro[j].mean().item()
                             * math.prod(hist[l][seen[where[l]][j]] for l in range(len(names)) if l != i)
                             for j in members))
        for i in range(len(names)):
            hist[i].append(hist[i][-1] - lr * grads[i])
    return [h[-1] for h in hist], max(lags)


def _batches(n_batches: int, rows: int = 4):
    torch.manual_seed(3)
    return [(torch.rand(rows, 3, dtype=torch.float64) + 0.5, torch.zeros(rows, dtype=torch.float64))
            for _ in range(n_batches)]


@pytest.mark.parametrize("mode,update_every,staleness,checkpoint", [
    ("stash", 1, None, "never"), ("stash", 1, None, "always"), ("stash", 2, None, "never"),
    ("2bw", None, None, "never"), ("2bw", None, None, "except_last"), ("ssp", None, 1, "never"),
    ("ssp", None, 2, "always"),
])
def test_backward_uses_the_version_its_forward_used(mode, update_every, staleness, checkpoint):
    """Also when the backward recomputes a checkpointed forward: the recomputation runs on the stashed version."""
    p, chunks, lr = 4, 2, 0.05
    model, pipe = _chain_pipe(p, chunks, checkpoint)
    batches = _batches(5)
    trainer = fxpipe.AsyncTrainer(pipe, lambda ps: torch.optim.SGD(ps, lr=lr), mode=mode,
                                  update_every=update_every, staleness=staleness)
    trainer.train(batches, lambda out, t: out.mean())
    m = len(batches) * chunks
    u = trainer.update_every
    groups = [j // chunks for j in range(m)] if mode == "ssp" else [j // u for j in range(m)]
    expected, lag = _expected_chain(model, pipe, batches, groups, trainer.staleness, lr, trainer.ahead)
    assert lag >= 1   # forwards really ran on stale weights: the test tells the versions apart
    got = [getattr(model, f"w{i}").item() for i in range(p)]
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert max(trainer.last["lag"]) == lag


def test_stashed_versions_are_bounded_by_the_in_flight_micro_batches_and_2bw_keeps_two():
    p = 4
    _, pipe = _chain_pipe(p, 4)
    stash = fxpipe.AsyncTrainer(pipe, lambda ps: torch.optim.SGD(ps, lr=0.01), mode="stash")
    stash.train(_batches(3), lambda out, t: out.mean())
    assert stash.last["versions"] == [stashed_versions(k, p, 12, 1) for k in range(p)] == [4, 3, 2, 1]
    two = fxpipe.AsyncTrainer(pipe, lambda ps: torch.optim.SGD(ps, lr=0.01), mode="2bw")
    two.train(_batches(3), lambda out, t: out.mean())
    assert two.last["versions"] == [2, 2, 2, 1] == two.version_bound()
    ssp = fxpipe.AsyncTrainer(pipe, lambda ps: torch.optim.SGD(ps, lr=0.01), mode="ssp", staleness=2)
    ssp.train(_batches(6), lambda out, t: out.mean())   # up to 2 mini-batches ahead: more in flight, bounded
    assert max(ssp.last["lag"]) == 2
    assert all(a <= b for a, b in zip(ssp.last["versions"], ssp.version_bound(24)))
    assert ssp.last["versions"][0] == 3
    assert ssp.predicted_memory()[0].activation_bytes > stash.predicted_memory()[0].activation_bytes
    # the memory model counts each stashed version once more as the stage's parameters
    plain = predict_worker_memory(pipe.plan, schedule="1f1b")
    for w, (a, b) in enumerate(zip(stash.predicted_memory(), plain)):
        assert a.param_bytes - b.param_bytes == pytest.approx(pipe.plan.stages[w].param_bytes * (4 - w))
        assert a.activation_bytes == b.activation_bytes


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                      lambda ps: torch.optim.Adam(ps, lr=0.01)], ids=["sgd", "adam"])
def test_staleness_zero_is_synchronous_training_exactly(make_opt):
    torch.manual_seed(0)
    model = Mlp()
    sync_model, flat_model = copy.deepcopy(model), copy.deepcopy(model)
    x, y = torch.randn(30, 6), torch.randint(0, 3, (30,))
    batches = [(x[i:i + 10], y[i:i + 10]) for i in range(0, 30, 10)]   # micro-batches of 3, 3, 3, 1
    loss_fn = nn.functional.cross_entropy
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x[:10],), chunks=4, stages=3, schedule="1f1b", profile="estimate")
    trainer = fxpipe.AsyncTrainer(pipe, make_opt, mode="ssp", staleness=0)
    losses = trainer.train(batches, loss_fn)
    assert trainer.last["lag"] == [0, 0, 0] and trainer.last["versions"] == [1, 1, 1]

    sync = fxpipe.compile(sync_model, ["cpu"] * 3, (x[:10],), chunks=4, stages=3, schedule="1f1b",
                          profile="estimate")
    opt, flat_opt = make_opt(list(sync_model.parameters())), make_opt(list(flat_model.parameters()))
    sync_losses = []
    for xb, yb in batches:
        sync_losses.append(sync.step(xb, yb, loss_fn, schedule="1f1b").item())
        opt.step()
        opt.zero_grad()
        flat_opt.zero_grad()
        loss_fn(flat_model(xb), yb).backward()
        flat_opt.step()
    for (name, a), b, c in zip(model.named_parameters(), sync_model.parameters(), flat_model.parameters()):
        assert torch.equal(a, b), name                                   # bit for bit the synchronous pipeline
        assert torch.allclose(a, c, rtol=1e-5, atol=1e-6), name          # and the unpartitioned model
    assert losses == pytest.approx(sync_losses, rel=1e-6)
    with torch.no_grad():   # the stages compute with the trained parameters again (every swap undone)
        assert torch.equal(pipe(x[:10]), sync(x[:10]))


@pytest.mark.parametrize("staleness", [1, 2])
def test_observed_lag_never_exceeds_the_staleness(staleness):
    p = 4
    _, pipe = _chain_pipe(p, 1)   # one micro-batch per mini-batch: free-running 1F1B would lag p - 1 = 3
    free = fxpipe.AsyncTrainer(pipe, lambda ps: torch.optim.SGD(ps, lr=0.01), mode="stash")   # same groups
    free.train(_batches(8), lambda out, t: out.mean())
    assert max(free.last["lag"]) == p - 1
    bounded = fxpipe.AsyncTrainer(pipe, lambda ps: torch.optim.SGD(ps, lr=0.01), mode="ssp", staleness=staleness)
    bounded.train(_batches(8), lambda out, t: out.mean())
    assert max(bounded.last["lag"]) == staleness
    assert all(lag <= staleness for lags in bounded.last["lags"] for lag in lags)


def test_orders_run_to_the_end_and_bound_the_lag_and_the_versions():
    for p in range(1, 6):
        for m in range(1, 14):
            for u in (1, 2, 3, 5):
                groups = [j // u for j in range(m)]
                for s, ahead in ((None, 0), (0, 0), (1, 0), (3, 0), (1, u), (3, 3 * u), (None, 2)):
                    orders = async_orders(p, groups, s, ahead)
                    check_orders(orders)
                    for k, order in enumerate(orders):
                        version, ends, flight, most = 0, {g: j for j, g in enumerate(groups)}, {}, 0
                        assert sorted(order) == sorted([("F", k, j) for j in range(m)] + [("B", k, j) for j in range(m)])
                        for kind, _, j in order:
                            if kind == "F":
                                assert s is None or groups[j] - version <= s
                                flight[j] = version
                                most = max(most, len(set(flight.values())))
                            else:
                                del flight[j]
                                version += ends[groups[j]] == j
                        assert most <= stashed_versions(k, p, m, u, ahead, s)
    with pytest.raises(ValueError, match="deadlocks"):
        check_orders([[("B", 0, 0), ("F", 0, 0)], [("F", 1, 0), ("B", 1, 0)]])


def test_bad_arguments_are_refused_before_training_naming_the_allowed_values():
    _, pipe = _chain_pipe(3, 2)

    def opt(ps):
        return torch.optim.SGD(ps, lr=0.1)
    with pytest.raises(ValueError, match=r"unknown asynchronous mode 'pipedream'.*'stash', '2bw', 'ssp'"):
        fxpipe.AsyncTrainer(pipe, opt, mode="pipedream")
    with pytest.raises(ValueError, match=r"staleness must be None or an integer >= 0, got -1"):
        fxpipe.AsyncTrainer(pipe, opt, mode="ssp", staleness=-1)
    with pytest.raises(ValueError, match=r"update_every must be None or an integer >= 1, got 0"):
        fxpipe.AsyncTrainer(pipe, opt, update_every=0)
    with pytest.raises(ValueError, match=r"schedule='gpipe'; allowed: '1f1b'"):
        fxpipe.AsyncTrainer(pipe, opt, schedule="gpipe")
    with pytest.raises(ValueError, match=r"update_every >= 2 \(stages - 1\).*got 1"):
        fxpipe.AsyncTrainer(pipe, opt, mode="2bw", update_every=1)
    with pytest.raises(ValueError, match=r"reduction must be one of \('auto', 'mean', 'sum'\).*'auto' a "
                                         r"\(loss_sum, count\) pair returned by loss_fn is weighted by its count"):
        fxpipe.AsyncTrainer(pipe, opt, reduction="token")
    before = [q.detach().clone() for q in pipe.parameters()]
    inter = fxpipe.compile(Chain(4), ["cpu"] * 2, (torch.ones(4, 3, dtype=torch.float64),), chunks=2, stages=4,
                           schedule="interleaved-1f1b", profile="estimate")
    with pytest.raises(ValueError, match=r"one stage per worker.*schedule='1f1b'"):
        fxpipe.AsyncTrainer(inter, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, pipe.parameters()))


def test_a_failing_loss_is_reported_and_the_trainer_runs_again():
    model, pipe = _chain_pipe(3, 2)
    trainer = fxpipe.AsyncTrainer(pipe, lambda ps: torch.optim.SGD(ps, lr=0.01), mode="stash")
    calls = []

    def failing(out, t):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("bad target")
        return out.mean()
    with pytest.raises(fxpipe.StageError, match="loss_fn failed on micro-batch 4.*bad target"):
        trainer.train(_batches(4), failing)
    assert all(not st.in_flight for st in trainer.stages)
    assert all(q.grad is None for q in model.parameters())
    trainer.train(_batches(4), lambda out, t: out.mean())
    assert trainer.last["versions"] == [3, 2, 1]


def test_skips_and_tied_weights_train_synchronously_at_staleness_zero():
    """The tied embedding crosses the stage boundary as a value: its gradient comes back to the owning stage."""
    torch.manual_seed(1)
    model = SkipTied(vocab=7, width=8, depth=4)
    twin = copy.deepcopy(model)
    tokens, target = torch.randint(0, 7, (16, 3)), torch.randint(0, 7, (16, 3))
    batches = [(tokens[i:i + 8], target[i:i + 8]) for i in (0, 8)]

    def loss_fn(logits, t):
        return nn.functional.cross_entropy(logits.reshape(-1, 7), t.reshape(-1))
    pipes = [fxpipe.compile(m, ["cpu"] * 3, (tokens[:8],), chunks=4, stages=3, schedule="1f1b", profile="estimate")
             for m in (model, twin)]
    fxpipe.AsyncTrainer(pipes[0], lambda ps: torch.optim.SGD(ps, lr=0.5), mode="ssp", staleness=0).train(
        batches, loss_fn)
    opt = torch.optim.SGD(twin.parameters(), lr=0.5)
    for xb, yb in batches:
        pipes[1].step(xb, yb, loss_fn, schedule="1f1b")
        opt.step()
        opt.zero_grad()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("mode", ["ssp", "stash"])
def test_inputs_carrying_the_callers_graph_hand_their_gradient_on_once(mode):
    """An input computed by the caller (an encoder outside the pipeline) used to fail in the second micro-batch's
    backward ("backward through the graph a second time"); each is now a detached leaf in the stream and one
    backward hands its gradient on. At staleness 0 that gradient is pipe.step's, bit for bit."""
    torch.manual_seed(0)
    model, encoder = Mlp(), nn.Linear(6, 6)
    sync_model, sync_encoder = copy.deepcopy(model), copy.deepcopy(encoder)
    x, y = torch.randn(20, 6), torch.randint(0, 3, (20,))
    loss_fn = nn.functional.cross_entropy
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x[:10],), chunks=4, stages=3, schedule="1f1b", profile="estimate")
    trainer = fxpipe.AsyncTrainer(pipe, lambda ps: torch.optim.SGD(ps, lr=0.1), mode=mode,
                                  **({"staleness": 0} if mode == "ssp" else {}))
    batches = [(encoder(x[i:i + 10]), y[i:i + 10]) for i in (0, 10)]
    trainer.train(batches, loss_fn)
    assert all(t.grad is None for t, _ in batches)   # the caller's tensors are not leaves: nothing kept on them
    assert encoder.weight.grad is not None and encoder.weight.grad.abs().sum() > 0
    if mode == "stash":
        return   # every micro-batch its own update: no synchronous counterpart to compare with
    sync = fxpipe.compile(sync_model, ["cpu"] * 3, (x[:10],), chunks=4, stages=3, schedule="1f1b",
                          profile="estimate")
    opt = torch.optim.SGD(list(sync_model.parameters()), lr=0.1)
    for i in (0, 10):
        sync.step(sync_encoder(x[i:i + 10]), y[i:i + 10], loss_fn, schedule="1f1b")
        opt.step()
        opt.zero_grad()
    for a, b in zip(encoder.parameters(), sync_encoder.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("compression", ["fp16", "int8", "topk:0.25", "int8/topk:0.25"])
def test_compressed_boundaries_at_staleness_zero_train_as_pipe_step_does(compression):
    """Boundary compression is an option of the asynchronous executor too: at staleness 0 the stream trains
    bit for bit as pipe.step with the same codecs, top-k's error feedback kept per slot of a mini-batch (its
    residual from mini-batch b reaches the same slot of b + 1, as from one step to the next), and the bytes
    moved are counted."""
    torch.manual_seed(0)
    model = Mlp()
    sync_model = copy.deepcopy(model)
    x, y = torch.randn(30, 6), torch.randint(0, 3, (30,))
    batches = [(x[i:i + 10], y[i:i + 10]) for i in range(0, 30, 10)]
    loss_fn = nn.functional.cross_entropy
    options = fxpipe.CompileOptions(compression=compression)
    pipe = fxpipe.compile(model, ["cpu"] * 3, (x[:10],), chunks=4, stages=3, schedule="1f1b", profile="estimate",
                          options=options)
    sync = fxpipe.compile(sync_model, ["cpu"] * 3, (x[:10],), chunks=4, stages=3, schedule="1f1b",
                          profile="estimate", options=options)
    trainer = fxpipe.AsyncTrainer(pipe, lambda ps: torch.optim.SGD(ps, lr=0.1), mode="ssp", staleness=0)
    losses = trainer.train(batches, loss_fn)
    opt = torch.optim.SGD(list(sync_model.parameters()), lr=0.1)
    sync_losses, sent = [], 0
    for xb, yb in batches:
        sync_losses.append(sync.step(xb, yb, loss_fn, schedule="1f1b").item())
        sent += sync.last_step["bytes_moved"]["sent"]
        opt.step()
        opt.zero_grad()
    for (name, a), b in zip(model.named_parameters(), sync_model.parameters()):
        assert torch.equal(a, b), name
    assert losses == pytest.approx(sync_losses, rel=1e-6)   # summed in float64 here, float32 there
    moved = trainer.last["bytes_moved"]
    assert moved["sent"] == sent and moved["sent"] < moved["raw"]
    assert pipe.compression.slots is None   # the stream's slot map does not outlive it
