"""CPU workers beyond the processors take turns (fxpipe.cost.cpu.turns), and the simulator follows the same rule."""

import threading
import time

import pytest
import torch
from torch import nn

import fxpipe
import fxpipe.cost.cpu.turns
from equivalence import max_relative_error
from fxpipe.cost.cpu.turns import CoreTurns
from solvers.simulate import simulate

CPU = torch.device("cpu")


def _most_at_once(intervals):
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    live = most = 0
    for _, d in edges:
        live += d
        most = max(most, live)
    return most


def test_at_most_cores_operations_run_and_turns_go_first_come_first_served():
    turns = CoreTurns(workers=4, slots=2)
    assert turns.active and turns.slots == 2
    intervals, granted, lock = [], [], threading.Lock()
    inside = threading.Semaphore(0)

    def hold(name, wait_s):
        with turns.turn(CPU):
            with lock:
                granted.append(name)
            start = time.perf_counter()
            inside.release()
            time.sleep(wait_s)
            with lock:
                intervals.append((start, time.perf_counter()))
    # h1 keeps its core throughout; the waiters pass the other one on, 0.1 s each, in the order they came
    holders = [threading.Thread(target=hold, args=(f"h{j}", wait)) for j, wait in enumerate((0.15, 0.7))]
    for t in holders:
        t.start()
    inside.acquire()
    inside.acquire()                       # both holders have their cores
    waiters = []
    for j in range(4):                     # queue up one after another while both cores are held
        t = threading.Thread(target=hold, args=(f"w{j}", 0.1))
        t.start()
        waiters.append(t)
        time.sleep(0.02)
    for _ in range(4):
        inside.acquire()
    for t in holders + waiters:
        t.join()
    assert _most_at_once(intervals) == 2
    assert granted[2:] == ["w0", "w1", "w2", "w3"]


def test_no_turns_when_the_cores_are_enough_or_the_device_is_a_gpu():
    assert not CoreTurns(workers=2, slots=2).active
    turns = CoreTurns(workers=3, slots=1)
    with turns.turn(torch.device("cuda", 0)), turns.turn(torch.device("cuda", 0)):
        pass                               # GPU work never waits for a CPU core
    assert CoreTurns.for_devices([CPU, torch.device("cuda", 0), CPU], 3).slots >= 1


def test_a_failing_operation_gives_its_turn_back():
    turns = CoreTurns(workers=2, slots=1)
    with pytest.raises(RuntimeError):
        with turns.turn(CPU):
            raise RuntimeError("boom")
    done = threading.Event()
    t = threading.Thread(target=lambda: (turns.turn(CPU).__enter__(), done.set()))
    t.start()
    assert done.wait(5), "the turn was not given back"


class Sleepy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        time.sleep(0.01)
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_four_cpu_workers_on_two_cores_take_turns_and_compute_the_same(monkeypatch, schedule):
    monkeypatch.setattr(fxpipe.cost.cpu.turns, "processors", lambda: 2)
    torch.manual_seed(0)
    model = nn.Sequential(*[Sleepy() for _ in range(4)])
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    pipe = fxpipe.compile(model, ["cpu"] * 4, (x,), chunks=4, stages=4, schedule=schedule, checkpoint="never",
                          profile="estimate", options=fxpipe.CompileOptions(leaf_modules=[Sleepy]))
    loss = pipe.step(x, y, nn.functional.mse_loss)
    intervals = [(t.start_s, t.end_s) for t in pipe.last_step["timings"]]
    assert len(intervals) == 4 * 4 * (3 if schedule == "zb-h1" else 2)     # every F, B (and W) timed
    assert _most_at_once(intervals) <= 2
    grads = [p.grad.clone() for p in pipe.parameters()]
    for p in model.parameters():
        p.grad = None
    expected = nn.functional.mse_loss(model(x), y)
    expected.backward()
    assert torch.allclose(loss, expected, rtol=1e-5)
    assert all(max_relative_error(g, p.grad) < 1e-4 for g, p in zip(grads, model.parameters()))
    with torch.no_grad():
        assert torch.allclose(pipe(x), model(x), rtol=1e-5)


def test_the_simulator_gives_each_operation_its_own_time_and_at_most_slots_at_once():
    f, b, p, m = 1.0, 2.0, 4, 6
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        sim = simulate([f] * p, [b] * p, m, schedule, cores=2, slots=2)
        ops = [e for e in sim.timeline if e.kind in ("F", "B", "I", "W")]
        assert _most_at_once([(e.start, e.end) for e in ops]) <= 2
        lengths = {"F": f, "B": b, "I": b / 2, "W": b / 2}
        assert all(e.end - e.start == pytest.approx(lengths[e.kind]) for e in ops)
        assert sim.iteration_s >= p * m * (f + b) / 2


def test_workers_of_several_threads_share_the_processors_without_turns(monkeypatch):
    """Two workers of two threads on two processors: the OS shares them (faster for small operations), and the
    simulator stretches both operations instead of queueing one."""
    monkeypatch.setattr(fxpipe.cost.cpu.turns, "processors", lambda: 2)
    assert not CoreTurns(workers=2).active and CoreTurns(workers=3).active
    sim = simulate([1.0, 1.0], [1.0, 1.0], 4, "gpipe", cores=1.0, slots=2)
    assert _most_at_once([(e.start, e.end) for e in sim.timeline if e.kind in ("F", "B")]) == 2
    assert sim.iteration_s == pytest.approx(2 * 4 * 2.0)   # one processor's worth of work, never idle
