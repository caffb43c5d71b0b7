"""Schedules: every operation once, on its own worker, in dependency order; bubbles match the papers' formulas."""

import random

import pytest

from solvers.schedules import SCHEDULES, check_schedule, stage_worker, worker_orders
from solvers.simulate import simulate

SHAPES = [  # (schedule, stages, workers, micro-batches)
    *[(s, p, p, m) for s in ("gpipe", "1f1b", "zb-h1") for p in (1, 2, 3, 5) for m in (1, 2, 4, 7)],
    *[("interleaved-1f1b", p * v, p, m) for p in (1, 2, 3, 4) for v in (1, 2, 3) for m in (p, 2 * p, 4 * p)],
    *[("zb-v", 2 * p, p, m) for p in (1, 2, 3, 5) for m in (1, 2, 4, 7, 12)],
    *[("dualpipev", 2 * p, p, m) for p in (1, 2, 3, 5) for m in (2 * p, 2 * p + 1, 4 * p, 12)],
]


@pytest.mark.parametrize("schedule,stages,workers,m", SHAPES)
def test_every_operation_runs_once_on_its_worker_after_what_it_needs(schedule, stages, workers, m):
    orders = worker_orders(schedule, stages, m, workers)
    assert len(orders) == workers
    ops = [op for order in orders for op in order]
    for s in range(stages):   # each micro-batch once forward, and once backward: whole, or input then weight pass
        for i in range(m):
            ran = sorted(kind for kind, k, j in ops if (k, j) == (s, i))
            assert ran in (["B", "F"], ["F", "I", "W"]), (s, i, ran)
    assert len(set(ops)) == len(ops)
    for w, order in enumerate(orders):
        assert all(stage_worker(schedule, s, workers) == w for _, s, _ in order)
        position = {op: n for n, op in enumerate(order)}
        for kind, s, i in order:   # on one worker: F before B before W of the same micro-batch
            if kind != "F":
                assert position[("F", s, i)] < position[(kind, s, i)]
            if kind == "W":
                assert position[("I", s, i)] < position[(kind, s, i)]
    if schedule == "dualpipev":   # torch's own order of it, its overlapped forward-backward pairs in turn
        assert orders == _torch_dualpipev(workers, m)
    # the simulator runs it to the end (raises on a deadlock), also with a skip from stage 0 to the last
    sends = {(0, stages - 1): 0.25} if stages > 2 else None
    sim = simulate([1.0] * stages, [2.0] * stages, m, schedule, sends=sends, workers=workers)
    assert len([e for e in sim.timeline if e.kind in ("F", "B", "I", "W")]) == len(ops)


def _torch_dualpipev(p: int, m: int) -> list[list[tuple[str, int, int]]]:
    """torch.distributed.pipelining's ``ScheduleDualPipeV`` order of every rank (its order generator, called
    without the process group it otherwise builds from)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as tds
    kinds = {tds.FORWARD: "F", tds.FULL_BACKWARD: "B", tds.BACKWARD_INPUT: "I", tds.BACKWARD_WEIGHT: "W"}
    shape = SimpleNamespace(pp_group_size=p, _n_microbatches=m)
    out = []
    for rank in range(p):
        actions = tds.ScheduleDualPipeV._calculate_single_rank_operations(shape, rank)
        flat = [sub for a in actions for sub in (a.sub_actions if a.computation_type == tds.OVERLAP_F_B else (a,))]
        out.append([(kinds[a.computation_type], a.stage_index, a.microbatch_index) for a in flat])
    return out


def _peak_in_flight(sim, stage, release):
    events = sorted((e.start if e.kind == "F" else e.end, e.kind == "F")
                    for e in sim.timeline if e.stage == stage and e.kind in ("F", release))
    live = peak = 0
    for _, forward in sorted(events, key=lambda t: (t[0], t[1])):
        live += 1 if forward else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (5, 5)])
def test_1f1b_keeps_p_minus_s_and_zb_h1_p_in_flight(p, m):
    one = simulate([1.0] * p, [2.0] * p, m, "1f1b")
    zb = simulate([1.0] * p, [2.0] * p, m, "zb-h1")
    for s in range(p):
        assert _peak_in_flight(one, s, "B") == min(m, p - s)
        assert _peak_in_flight(zb, s, "W") == min(m, p)


@pytest.mark.parametrize("p,m", [(2, 2), (3, 3), (4, 8), (5, 9)])
def test_zb_h1_bubble_is_p_minus_1_times_f_plus_b_minus_w(p, m):
    f, b = 1.0, 2.0       # B and W get half of the backward each
    assert simulate([f] * p, [b] * p, m, "zb-h1").iteration_s == pytest.approx(m * (f + b) + (p - 1) * f)
    assert simulate([f] * p, [b] * p, m, "1f1b").iteration_s == pytest.approx(m * (f + b) + (p - 1) * (f + b))


@pytest.mark.parametrize("p,m", [(2, 2), (3, 3), (4, 8), (5, 9)])
@pytest.mark.parametrize("w", [0.25, 0.4])
def test_zb_h1_bubble_follows_a_per_stage_weight_share(p, m, w):
    """A checkpointed micro-batch's B also recomputes its forward, so W's share of the backward is smaller:
    the bubble (p - 1)(F + B - W) grows to (p - 1)(f + b - 2bw)."""
    f, b = 1.0, 2.0
    sim = simulate([f] * p, [b] * p, m, "zb-h1", weight_share=[w] * p)
    assert sim.iteration_s == pytest.approx(m * (f + b) + (p - 1) * (f + b - 2 * b * w))
    with pytest.raises(ValueError, match="one per stage"):
        simulate([f] * p, [b] * p, m, "zb-h1", weight_share=[w] * (p + 1))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (3, 2, 6), (4, 3, 8), (4, 2, 12)])
def test_interleaving_divides_the_bubble_by_v(p, v, m):
    f, b = 1.0, 2.0       # the model's time per micro-batch per worker; each of the v chunks has 1/v of it
    sim = simulate([f / v] * (p * v), [b / v] * (p * v), m, "interleaved-1f1b", workers=p)
    assert sim.iteration_s == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v)
    assert len(sim.busy_s) == p


def test_orders_on_small_cases():
    assert worker_orders("gpipe", 2, 2) == [[("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)],
                                            [("F", 1, 0), ("F", 1, 1), ("B", 1, 1), ("B", 1, 0)]]
    assert worker_orders("1f1b", 3, 4)[0] == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("B", 0, 0), ("F", 0, 3),
                                              ("B", 0, 1), ("B", 0, 2), ("B", 0, 3)]
    # the last stage of ZB-H1 defers its weight passes by p - 1 = 1 micro-batch
    assert worker_orders("zb-h1", 2, 3)[1] == [("F", 1, 0), ("I", 1, 0), ("F", 1, 1), ("I", 1, 1), ("W", 1, 0),
                                               ("F", 1, 2), ("I", 1, 2), ("W", 1, 1), ("W", 1, 2)]
    # worker 1 of 2 with 2 chunks: stages 1 and 3
    assert {s for _, s, _ in worker_orders("interleaved-1f1b", 4, 2, 2)[1]} == {1, 3}


@pytest.mark.parametrize("schedule,stages,workers,m,message", [
    ("pipedream", 2, 2, 2, "unknown schedule 'pipedream'"),
    ("interleaved-1f1b", 6, 4, 4, "multiple of 4 stages"),
    ("interleaved-1f1b", 4, 2, 3, "use chunks=4"),
    ("1f1b", 4, 2, 4, "one stage per worker"),
    ("gpipe", 2, 2, 0, "must be positive"),
])
def test_bad_shapes_say_what_is_wrong(schedule, stages, workers, m, message):
    with pytest.raises(ValueError, match=message):
        check_schedule(schedule, stages, workers, m)


def test_all_schedules_are_listed():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipev"}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_workers_sharing_cores_by_hand(schedule):
    f, b, p, m = 1.0, 2.0, 4, 6
    alone = simulate([f] * p, [b] * p, m, schedule)
    # as many cores as workers and no slowdown: the same as devices of their own
    assert simulate([f] * p, [b] * p, m, schedule, cores=p).iteration_s == pytest.approx(alone.iteration_s)
    # one core: the work is done one operation's worth at a time, never idle
    one = simulate([f] * p, [b] * p, m, schedule, cores=1)
    assert one.iteration_s == pytest.approx(p * m * (f + b))
    # two cores: between the two
    two = simulate([f] * p, [b] * p, m, schedule, cores=2)
    assert p * m * (f + b) / 2 <= two.iteration_s <= one.iteration_s
    assert two.iteration_s >= alone.iteration_s
    # two operations at once each at 80%: a two-stage pipeline's overlap is stretched
    slow = simulate([f] * 2, [b] * 2, m, schedule, cores=2, parallel_efficiency=0.8)
    assert simulate([f] * 2, [b] * 2, m, schedule).iteration_s < slow.iteration_s <= 2 * m * (f + b) / 0.8


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_devices_of_their_own_simulate_as_the_shared_stepping_does(schedule):
    """The event-ordered path for workers on devices of their own (no ``cores``, no ``slots``) gives every
    operation and transfer the start and end the stepping path gives (``slots`` as many as the workers: it never
    binds), on uneven stages, transfers, weight shares and gradient syncs."""
    rng = random.Random(schedule)
    checked = 0
    for _ in range(40):
        p = rng.randint(2, 5)
        v = 2 if schedule in ("interleaved-1f1b", "zb-v", "dualpipev") else 1
        m = rng.randint(1, 6) * (p if schedule == "interleaved-1f1b" else 1) + (2 * p if schedule == "dualpipev" else 0)
        k = p * v
        try:
            check_schedule(schedule, k, p, m)
        except ValueError:
            continue
        args = ([rng.uniform(0.5, 2) for _ in range(k)], [rng.uniform(0.5, 4) for _ in range(k)], m, schedule)
        kwargs = dict(sends={(s, s + 1): rng.choice([0.0, rng.uniform(0, 1)]) for s in range(k - 1)},
                      allreduce_s=[rng.uniform(0, 1) for _ in range(k)], workers=p,
                      weight_share=[rng.uniform(0, 1) for _ in range(k)])
        own, stepped = simulate(*args, **kwargs), simulate(*args, **kwargs, slots=p)
        assert own.iteration_s == pytest.approx(stepped.iteration_s, rel=1e-12)
        assert own.busy_s == pytest.approx(stepped.busy_s, rel=1e-12)
        events = [sorted((e.stage, e.kind, e.micro_batch, e.peer, e.start, e.end) for e in s.timeline)
                  for s in (own, stepped)]
        assert len(events[0]) == len(events[1])
        for a, b in zip(*events):
            assert a[:4] == b[:4] and a[4:] == pytest.approx(b[4:], rel=1e-12, abs=1e-12)
        checked += 1
    assert checked >= 20
