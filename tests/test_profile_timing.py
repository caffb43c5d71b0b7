"""Whole-graph timing (``timing="graph"``, the CUDA default): the run, the marks and the apportioning, on CPU
through the same code path as CUDA (a ``perf_counter`` clock, or a scripted one that makes every number known)."""

import statistics

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.cost import graph_timing
from fxpipe.cost.clock import CudaEventClock, PerfCounterClock, clock_for
from fxpipe.cost.graph_timing import apportion, backward_weights, default_timing, time_graph
from fxpipe.cost.profile import profile_graph
from fxpipe.frontend.trace import trace

CALLS = ("call_module", "call_function", "call_method")


class Sized(nn.Module):
    """Four call nodes (lin, relu, size, mul); ``size`` has no backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return torch.relu(y) * y.size(0)


class ScriptedClock:
    """Marks read scripted times in turn; waits are counted. Each node's cost is then a known number."""

    def __init__(self, times: list[float]) -> None:
        self.times, self.used, self.waits = list(times), 0, 0

    def mark(self) -> float:
        self.used += 1
        return self.times[self.used - 1]

    def wait(self) -> None:
        self.waits += 1

    def seconds(self, start: float, end: float) -> float:
        return end - start


class RecordingClock(PerfCounterClock):
    """The CPU clock, keeping its marks so the test can read the whole-graph times it measured."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def mark(self) -> float:
        self.marks.append(super().mark())
        return self.marks[-1]


def _calls(gm):
    return [n.name for n in gm.graph.nodes if n.op in CALLS]


def _run_script(fwd_gaps, bwd_s, start=0.0):
    """The marks of one run: a start mark, one after each node, then two around the backward."""
    marks = [start]
    for gap in fwd_gaps:
        marks.append(marks[-1] + gap)
    return marks + [marks[-1] + 1.0, marks[-1] + 1.0 + bwd_s]


def test_one_run_gives_each_node_its_gap_and_apportions_the_backward_exactly():
    gm = trace(Sized())
    assert _calls(gm) == ["lin", "relu", "size", "mul"]
    clock = ScriptedClock(_run_script([1.0, 2.0, 0.5, 3.0], 12.0))
    alone = {"lin": (1.0, 2.0), "relu": (1.0, 1.0), "size": (1.0, 0.0), "mul": (0.5, 1.0)}
    timed = time_graph(gm, (torch.randn(4, 8),), alone, clock, warmup=0, repeats=1)
    assert clock.used == 7 and clock.waits == 2                       # 1 + 4 forward marks, 2 backward; 2 waits
    assert timed.fwd_s == {"lin": 1.0, "relu": 2.0, "size": 0.5, "mul": 3.0}
    assert timed.fwd_total_s == 6.5 and timed.bwd_total_s == 12.0
    # shares: forward gap x alone backward/forward = 1*2, 2*1, 0.5*0, 3*2 = 2, 2, 0, 6 (of 10)
    assert timed.bwd_s == pytest.approx({"lin": 2.4, "relu": 2.4, "size": 0.0, "mul": 7.2})


def test_repeats_take_each_nodes_median_scaled_to_the_median_total():
    gm = trace(Sized())
    runs = [([100.0] * 4, 100.0),                                     # the warm-up: ignored
            ([1.0, 4.0, 1.0, 0.0], 4.0), ([2.0, 1.0, 2.0, 0.0], 8.0), ([3.0, 3.0, 3.0, 0.0], 6.0)]
    script = [t for i, (gaps, bwd) in enumerate(runs) for t in _run_script(gaps, bwd, start=1000.0 * i)]
    alone = {name: (1.0, 1.0) for name in _calls(gm)}
    timed = time_graph(gm, (torch.randn(4, 8),), alone, ScriptedClock(script), warmup=1, repeats=3)
    assert timed.fwd_total_s == 6.0 and timed.bwd_total_s == 6.0     # medians of (6, 5, 9) and (4, 8, 6)
    # medians per node 2, 3, 2, 0 (sum 7) scaled to 6
    assert timed.fwd_s == pytest.approx({"lin": 12 / 7, "relu": 18 / 7, "size": 12 / 7, "mul": 0.0})
    assert sum(timed.fwd_s.values()) == pytest.approx(6.0) and sum(timed.bwd_s.values()) == pytest.approx(6.0)


def test_apportioning_sums_to_the_total_whatever_the_weights():
    assert apportion(6.0, {"a": 1.0, "b": 2.0}) == pytest.approx({"a": 2.0, "b": 4.0})
    assert apportion(6.0, {"a": 0.0, "b": 0.0, "c": 0.0}) == {"a": 2.0, "b": 2.0, "c": 2.0}
    assert apportion(6.0, {"a": -1.0, "b": 3.0}) == pytest.approx({"a": 0.0, "b": 6.0})
    assert apportion(1.0, {}) == {}
    # no share from the ratios (no node has a forward): the alone backward times
    assert backward_weights({"a": 0.0, "b": 0.0}, {"a": (1.0, 3.0), "b": (1.0, 1.0)}) == {"a": 3.0, "b": 1.0}


def test_profile_graph_uses_the_injected_clock_for_the_forward_and_the_backward_total():
    gm = trace(Sized())
    clock = ScriptedClock(_run_script([1.0, 2.0, 0.5, 3.0], 12.0))
    costs = profile_graph(gm, (torch.randn(4, 8),), torch.device("cpu"), timing="graph", clock=clock,
                          warmup=0, repeats=1)
    assert {n: costs[n].fwd_s for n in _calls(gm)} == {"lin": 1.0, "relu": 2.0, "size": 0.5, "mul": 3.0}
    assert sum(costs[n].bwd_s for n in _calls(gm)) == pytest.approx(12.0)
    assert costs["size"].bwd_s == 0.0                                 # nothing to backpropagate: no share
    assert costs["x"].fwd_s == costs["output"].fwd_s == 0.0 and costs["lin"].param_bytes == (8 * 8 + 8) * 4


@pytest.mark.parametrize("requires_grad", [False, True])
def test_on_cpu_every_node_is_timed_and_the_nodes_sum_to_what_the_clock_measured(requires_grad):
    gm = trace(Sized())
    x = torch.randn(4, 8, requires_grad=requires_grad)
    clock = RecordingClock()
    costs = profile_graph(gm, (x,), torch.device("cpu"), timing="graph", clock=clock, warmup=0, repeats=1)
    calls = _calls(gm)
    assert all(costs[n].fwd_s > 0 and costs[n].bwd_s >= 0 for n in calls)
    assert len(clock.marks) == len(calls) + 3
    fwd_total, bwd_total = clock.marks[len(calls)] - clock.marks[0], clock.marks[-1] - clock.marks[-2]
    assert sum(costs[n].fwd_s for n in calls) == pytest.approx(fwd_total, rel=1e-9, abs=1e-12)
    assert sum(costs[n].bwd_s for n in calls) == pytest.approx(bwd_total, rel=1e-9, abs=1e-12)
    assert bwd_total > 0 and costs["size"].bwd_s == 0.0
    assert x.grad is None


def test_time_graph_totals_are_the_medians_of_the_runs_and_the_nodes_sum_to_them():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    gm = trace(model)
    alone = {n: (1.0, 2.0) for n in _calls(gm)}
    clock = RecordingClock()
    timed = time_graph(gm, (torch.randn(8, 16),), alone, clock, warmup=1, repeats=3)
    per_run = len(_calls(gm)) + 3
    runs = [clock.marks[i * per_run:(i + 1) * per_run] for i in range(4)][1:]
    assert timed.fwd_total_s == statistics.median(r[-3] - r[0] for r in runs)
    assert timed.bwd_total_s == statistics.median(r[-1] - r[-2] for r in runs)
    assert sum(timed.fwd_s.values()) == pytest.approx(timed.fwd_total_s, rel=1e-9)
    assert sum(timed.bwd_s.values()) == pytest.approx(timed.bwd_total_s, rel=1e-9)
    assert all(v > 0 for v in timed.fwd_s.values()) and all(v > 0 for v in timed.bwd_s.values())


def test_the_clock_and_the_timing_are_chosen_by_device_without_touching_cuda():
    assert isinstance(clock_for(torch.device("cuda")), CudaEventClock)
    assert isinstance(clock_for(torch.device("cuda", 1)), CudaEventClock)
    assert isinstance(clock_for(torch.device("cpu")), PerfCounterClock)
    assert default_timing(torch.device("cuda")) == "graph" and default_timing(torch.device("cpu")) == "node"


def test_cpu_defaults_to_node_timing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("graph timing on CPU by default")
    monkeypatch.setattr(fxpipe.cost.profile, "time_graph", refuse)
    costs = profile_graph(trace(Sized()), (torch.randn(4, 8),), torch.device("cpu"), warmup=0, repeats=1)
    assert costs["lin"].fwd_s > 0
    with pytest.raises(AssertionError, match="graph timing"):
        profile_graph(trace(Sized()), (torch.randn(4, 8),), torch.device("cpu"), timing="graph",
                      warmup=0, repeats=1)
    with pytest.raises(ValueError, match="unknown timing"):
        profile_graph(trace(Sized()), (torch.randn(4, 8),), torch.device("cpu"), timing="stage")


def test_profile_options_carry_the_timing_to_the_profiler(monkeypatch):
    with pytest.raises(ValueError, match="timing must be one of"):
        fxpipe.ProfileOptions(timing="whole")
    seen = []
    real = fxpipe.cost.node_costs.profile_graph

    def spy(*args, **kwargs):
        seen.append(kwargs["timing"])
        return real(*args, **kwargs)
    monkeypatch.setattr(fxpipe.cost.node_costs, "profile_graph", spy)
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), torch.randn(8, 8)
    for timing in (None, "graph"):
        pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=2,
                              profile=fxpipe.ProfileOptions(mode="measure", timing=timing, cache=False))
        assert pipe.plan.stages and pipe.plan.profile["from_cache"] is False
    assert seen == ["node", "graph"]
    assert graph_timing.TIMINGS == ("graph", "node")


def test_the_cuda_clock_records_events_on_the_current_stream_and_reads_milliseconds(monkeypatch):
    """Without a GPU: torch.cuda's Event and current_stream replaced, the clock's use of them is checked."""
    recorded, synchronised = [], []

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing
            self.at = len(recorded)

        def record(self, stream) -> None:
            recorded.append((self, stream))

        def synchronize(self) -> None:
            synchronised.append(self)

        def elapsed_time(self, end) -> float:
            return 250.0 * (end.at - self.at)   # milliseconds

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: ("stream of", device))
    device = torch.device("cuda", 0)
    clock = clock_for(device)
    clock.wait()                                 # nothing marked: nothing to wait for
    first, second = clock.mark(), clock.mark()
    clock.wait()
    assert [stream for _, stream in recorded] == [("stream of", device)] * 2
    assert synchronised == [second] and clock.seconds(first, second) == 0.25
