"""The profiler's numbers: exact where they can be computed by hand."""

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.cost.profile import profile_graph
from fxpipe.frontend.trace import trace


class LinearReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        return torch.relu(self.lin(x))


@pytest.mark.parametrize("mode", ["estimate", "measure"])
def test_costs_of_linear_relu_by_hand(mode):
    gm = trace(LinearReLU())
    costs = profile_graph(gm, (torch.randn(5, 8),), torch.device("cpu"), mode=mode, warmup=0, repeats=1)
    assert costs["lin"].param_bytes == (8 * 4 + 4) * 4
    assert costs["lin"].output_bytes == 5 * 4 * 4
    assert costs["lin"].act_bytes == 0              # Linear saves its input (the caller's batch), not its weight
    assert costs["relu"].act_bytes == 5 * 4 * 4     # ReLU saves its output
    assert costs["x"].output_bytes == 5 * 8 * 4 and costs["x"].fwd_s == 0.0
    assert costs["lin"].fwd_s > 0 and costs["lin"].bwd_s > 0
    if mode == "estimate":
        assert costs["lin"].flops == 2 * 5 * 8 * 4
        assert costs["lin"].bwd_s == pytest.approx(2 * costs["lin"].fwd_s)


def test_a_linear_after_a_linear_saves_its_input():
    gm = trace(nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4)))
    costs = profile_graph(gm, (torch.randn(5, 8),), torch.device("cpu"), mode="estimate")
    assert costs["_0"].act_bytes == 0 and costs["_1"].act_bytes == 5 * 6 * 4


def test_shared_parameter_is_counted_once():
    from models import SkipTied
    model = SkipTied()
    gm = trace(model)
    costs = profile_graph(gm, (torch.randint(0, 13, (4, 5)),), torch.device("cpu"), mode="estimate")
    total = sum(c.param_bytes for c in costs.values())
    assert total == sum(p.numel() * 4 for p in model.parameters())  # parameters() dedups the tie


@pytest.mark.parametrize("timing", ["node", "graph"])
def test_profiling_leaves_buffers_rng_and_grads_untouched(timing):
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)).train()
    x = torch.randn(6, 4, requires_grad=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    given = x.detach().clone()
    rng = torch.random.get_rng_state()
    costs = profile_graph(trace(model), (x,), torch.device("cpu"), mode="measure", warmup=1, repeats=2,
                          timing=timing)
    assert costs["_0"].fwd_s > 0 and costs["_0"].bwd_s > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.random.get_rng_state())
    assert all(p.grad is None for p in model.parameters())
    assert x.grad is None and torch.equal(x, given)


def test_profiling_keeps_no_reference_to_the_graph():
    gm = trace(LinearReLU())
    profile_graph(gm, (torch.randn(5, 8),), torch.device("cpu"), mode="estimate")
    alive = weakref.ref(gm)
    del gm
    gc.collect()
    assert alive() is None


def test_an_in_place_aten_operation_is_timed_on_a_clone_of_its_inputs():
    """torch.export's graph names in-place operators by overload (``aten.masked_fill_.Scalar``): timed alone,
    such a node's input is a fresh leaf that requires grad, which autograd refuses to write into, so the
    profiler must see from the operator's schema that it mutates and clone first. The recorded input is
    left as it was, and the pipeline computes the model."""
    from fxpipe.frontend.export import export_graph

    class MaskInPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            y.masked_fill_(y > 0.5, 0.0)   # in place, on a value that requires grad
            return (y * 2).sum(dim=1)

    torch.manual_seed(0)
    model, x = MaskInPlace(), torch.randn(6, 8)
    gm = export_graph(model, (x,))
    inplace = [n for n in gm.graph.nodes if n.op == "call_function" and "masked_fill_" in str(n.target)]
    assert inplace, gm.graph
    costs = profile_graph(gm, (x,), torch.device("cpu"), mode="measure", warmup=0, repeats=1)
    assert costs[inplace[0].name].fwd_s > 0
    costs = profile_graph(gm, (x,), torch.device("cpu"), mode="measure", warmup=0, repeats=1, timing="graph")
    assert costs[inplace[0].name].fwd_s > 0   # in a whole-graph run it writes into its input, as in a step
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2, stages=2,
                          options=fxpipe.CompileOptions(frontend="export"))
    target = torch.randn(6)
    (model(x) * target).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    pipe.step((x,), target, lambda out, t: (out * t).mean())
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[n], rtol=1e-5, atol=1e-6), n


class _Sleeps(nn.Module):
    def forward(self, x):
        import time
        time.sleep(0.003)
        return x * 2


class _TwoNodes(nn.Module):
    def __init__(self):
        super().__init__()
        self.small = nn.Linear(4, 4)
        self.slow = _Sleeps()

    def forward(self, x):
        return self.slow(self.small(x))


def test_a_node_of_microseconds_is_timed_until_its_runs_add_up_and_a_slow_one_as_asked(monkeypatch):
    """A node timed once is the noise of one reading: a node is run again until its timings add up to
    MIN_TIMED_S (at most MAX_REPEATS runs); one slower than that runs warm-up + repeats times. The profiler's clock
    is the test's (each forward of ``small`` takes 0.3 ms of it, of ``slow`` 3 ms, of anything else nothing), so the
    counts do not depend on how loaded the machine is (on a loaded one a real microsecond node took long enough that
    fewer runs added up)."""
    import types

    import fxpipe.cost.profile as profile
    from fxpipe.cost.profile import MAX_REPEATS, MIN_TIMED_S

    now = [0.0]
    monkeypatch.setattr(profile, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    model = _TwoNodes()
    gm = trace(model, leaf_modules=[_Sleeps])
    calls = {"small": 0, "slow": 0}

    def ran(name: str, seconds: float) -> Any:
        def hook(*_: Any) -> None:
            calls[name] += 1
            now[0] += seconds
        return hook
    gm.get_submodule("small").register_forward_hook(ran("small", 0.3e-3))
    gm.get_submodule("slow").register_forward_hook(ran("slow", 3e-3))
    profile_graph(gm, (torch.randn(2, 4),), torch.device("cpu"), mode="measure", warmup=1, repeats=1)
    assert calls["slow"] == 1 + 1 + 1     # the recording run, warm-up, one timed run (3 ms >= MIN_TIMED_S)
    assert calls["small"] == 1 + 1 + 4    # timed until 4 runs of 0.3 ms add up to MIN_TIMED_S (1 ms)
    assert MIN_TIMED_S == 1e-3 and MAX_REPEATS >= 4
