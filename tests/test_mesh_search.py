"""The mesh search (solvers.mesh_search) against brute force over every mesh shape, candidate and cut."""

from __future__ import annotations

import math
import dataclasses
import random

import pytest

from solvers import InfeasibleError
from solvers.brute import brute_force_mesh
from solvers.activation_memory import StageBytes, worker_peak_bytes
from solvers.layout import Layout
from solvers.mesh import Level, MeshProblem, Piece, mesh_shapes, stage_figures, stage_held
from solvers.mesh_search import least_simulated_s, search_mesh, simulate_choice
from solvers.schedules import get_schedule, worker_orders


def chain(rng: random.Random, pieces: int, levels: list[Level], memory: float, batch: int,
          act: float = 1.0, blocks: bool = False) -> MeshProblem:
    """A random chain: pieces of uneven compute, parameters and activations, some with TP collectives; with
    ``blocks`` the pieces between the first and the last are repeated blocks (per-block recomputation)."""
    out = []
    for i in range(pieces):
        f = rng.uniform(0.5, 3.0) * 1e-3
        out.append(Piece(f"p{i}", f, f * rng.uniform(1.5, 2.5), rng.uniform(1, 8) * 2**20, rng.uniform(1, 6) * act * 2**20,
                         fixed_s=1e-5, tp_collectives=rng.choice([0, 1, 2]), tp_bytes=rng.uniform(0.5, 2) * 2**20,
                         replicated_act_bytes=rng.uniform(0, 1) * 2**20, block=blocks and 0 < i < pieces - 1,
                         selective_share=rng.uniform(0.2, 0.5)))
    cuts = [rng.uniform(0.2, 2) * 2**20 for _ in range(pieces - 1)]
    return MeshProblem(out, cuts, levels, memory, batch, grad_factor=1.0, optimizer_factor=6.0,
                       broadcast_bytes=rng.choice([0.0, rng.uniform(0.1, 1) * 2**20]))


@pytest.mark.parametrize("seed", range(6))   # 3-5: chains of repeated blocks, recomputed per block at pp=1
def test_search_matches_brute_force_on_every_shape(seed: int) -> None:
    rng = random.Random(seed)
    levels = [Level(2, 100e9, 2e-6, "NV4"), Level(2, 10e9, 5e-6, "NET")] if seed % 2 else \
        [Level(4, 200e9, 2e-6, "NV8"), Level(2, 12e9, 5e-6, "NET")]
    problem = chain(rng, 6, levels, memory=rng.choice([90, 150, 300]) * 2**20, batch=8, act=rng.choice([1, 8]),
                    blocks=seed >= 3)
    brute = brute_force_mesh(problem)
    try:
        found = search_mesh(problem)
    except InfeasibleError:
        assert not brute
        return
    mine = {c.mesh: c for c in found.shapes}
    assert set(mine) == set(brute)
    for mesh, best in brute.items():
        assert mine[mesh].screened_s == pytest.approx(best.screened_s, rel=1e-9), mesh
    # the choice is the fastest simulated shape; every shape's simulated step is at least its pipeline's work
    assert found.best.iteration_s == min(c.iteration_s for c in found.shapes)
    assert set(found.infeasible).isdisjoint(mine)
    assert set(found.infeasible) | set(mine) == set(mesh_shapes(problem))


@pytest.mark.parametrize("seed", range(12))
def test_the_simulation_s_bound_is_at_most_the_simulated_step(seed: int) -> None:
    """least_simulated_s, which leaves shapes unsimulated that cannot beat a step in hand, is a lower bound on every
    shape's simulated step: every schedule, uneven stages, transfers and data parallel's sync."""
    rng = random.Random(seed)
    levels = [Level(2, 100e9, 2e-6, "NV4"), Level(2, 10e9, 5e-6, "NET")]
    problem = chain(rng, rng.choice([6, 9]), levels, memory=rng.choice([90, 300]) * 2**20, batch=8,
                    act=rng.choice([1, 8]), blocks=seed % 3 == 0)
    try:
        shapes = search_mesh(problem).shapes
    except InfeasibleError:
        return
    for c in shapes:
        assert least_simulated_s(problem, c) <= simulate_choice(problem, c).iteration_s * (1 + 1e-12), c.mesh


def test_recomputation_and_memory_bounds() -> None:
    """Tight memory: some shapes need recomputation, none of the chosen devices is over its memory."""
    rng = random.Random(11)
    problem = chain(rng, 6, [Level(2, 100e9), Level(2, 10e9)], memory=150 * 2**20, batch=8, act=8)
    brute = brute_force_mesh(problem)
    found = search_mesh(problem)
    assert {c.mesh for c in found.shapes} == set(brute)
    assert any(c.candidate.recompute for c in found.shapes)
    assert any(not c.candidate.recompute for c in found.shapes)
    for c in found.shapes:
        assert c.screened_s == pytest.approx(brute[c.mesh].screened_s, rel=1e-9)
    assert all(max(c.peak_bytes) <= problem.memory_bytes * (1 + 1e-9) for c in found.shapes)


@pytest.mark.parametrize("seed", [5, 7])
def test_stages_recompute_per_block_where_whole_stages_keep_as_much(seed):
    """A stage recomputing the whole of a micro-batch rebuilds all its activations in the backward; a chain of
    blocks recomputed one block at a time (every block, every other, or selectively) keeps less, so each stage
    takes the fastest mode that fits (as the node-level costing chooses), the search against brute force over
    the cuts. With the blocks the search is faster on some shapes than on the same chain without them (whole
    stages only), never slower, and never runs selective recomputation under a split backward."""
    rng = random.Random(seed)
    problem = chain(rng, 8, [Level(4, 100e9)], memory=150 * 2**20, batch=8, act=8, blocks=True)
    brute = brute_force_mesh(problem)
    found = search_mesh(problem)
    per = {c.mesh: c for c in found.shapes if set(c.stage_modes) & {"blocks", "blocks:2", "selective"}}
    assert per
    for c in found.shapes:
        assert c.screened_s == pytest.approx(brute[c.mesh].screened_s, rel=1e-9)
        assert max(c.peak_bytes) <= problem.memory_bytes * (1 + 1e-9)
        assert len(c.stage_modes) == len(c.cuts) - 1
        if c.mesh.pp > 1 and get_schedule(c.candidate.schedule).split_backward:
            assert "selective" not in c.stage_modes
    flat = dataclasses.replace(problem, pieces=[dataclasses.replace(p, block=False) for p in problem.pieces])
    without = {c.mesh: c for c in search_mesh(flat).shapes}
    assert all(without[m].screened_s >= c.screened_s * (1 - 1e-12) for m, c in per.items() if m in without)
    assert any(m not in without or without[m].screened_s > c.screened_s for m, c in per.items())


def test_the_first_stage_sends_what_every_block_reads_to_each_later_stage() -> None:
    """What the first piece makes for every later one (a mask, rotary tables: ``broadcast_bytes``) goes from the
    first stage to each later stage, forward and gradient, as the node-level costing charges it
    (:func:`solvers.score.score_assignment`: one transfer per receiving stage); each later stage receives it once."""
    piece = Piece("block", 1e-3, 2e-3, param_bytes=1e6, act_bytes=1e6, block=True)
    problem = MeshProblem([dataclasses.replace(piece, block=False)] + [piece] * 4, [1e6] * 4, [Level(4, 10e9)], 1e12,
                          batch=4, broadcast_bytes=2e6)
    found = search_mesh(dataclasses.replace(problem, fixed=[Layout.of(4, 1, 1)], schedules=("1f1b",)))
    choice = found.best
    sent = 2e6 * choice.samples / 10e9
    hidden = 1e6 * choice.samples / 10e9
    work = choice.samples * 3e-3   # a piece's forward and backward for the micro-batch
    for j, (a, i) in enumerate(zip(choice.cuts, choice.cuts[1:])):
        hops = (a > 0) + (i < 5)   # the hidden state in and out
        assert choice.stage_s[j] == pytest.approx((i - a) * work + 2 * hops * hidden + 2 * (3 if j == 0 else 1) * sent)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_what_a_split_backward_holds_is_the_memory_walk_s_peak(schedule) -> None:
    """A stage's (forward, pending) pairs (:func:`solvers.mesh.stage_held`) give the node-level memory walk's
    peak (:func:`solvers.activation_memory.worker_peak_bytes`) for a stage keeping ``full`` bytes from its forward
    to its backward and ``pending`` from its backward to its weight pass: equal where a worker runs one stage
    (ZB-H1), at least the worker's where it runs two (ZB-V: the search charges each stage its own peak)."""
    rng = random.Random(schedule)
    for p in (2, 3, 4):
        for m in (1, 2, 3, 5, 8):
            stages = 2 * p if schedule == "zb-v" else p
            workers = worker_orders(schedule, stages, m, p)
            for _ in range(3):
                full, pending = rng.uniform(0.1, 2), rng.uniform(0.1, 3)
                sizes = StageBytes(full=full, checkpointed=0.0, forward_peak=full, forward_peak_checkpointed=0.0,
                                   backward_peak=0.0, backward_peak_checkpointed=0.0, backward_peak_split=0.0,
                                   weight_pending=pending)
                for w, order in enumerate(workers):
                    walked = worker_peak_bytes(order, lambda s: sizes, lambda s, i: False)
                    mine = {s for _, s, _ in order}
                    charged = sum(max(f * full + b * pending for f, b in stage_held(schedule, s, stages, m))
                                  for s in mine)
                    if len(mine) == 1:
                        assert charged == pytest.approx(walked), (p, m, w)
                    else:
                        assert charged >= walked * (1 - 1e-12), (p, m, w)


def test_costs_charged_where_the_dimensions_run() -> None:
    """TP collectives at the island's link, FSDP shards the optimizer by dp, the pipeline's cut by tp."""
    piece = Piece("block", 1e-3, 2e-3, param_bytes=8e6, act_bytes=4e6, tp_collectives=2, tp_bytes=1e6)
    problem = MeshProblem([piece, piece], [1e6], [Level(2, 100e9), Level(2, 10e9)], 1e12, batch=4)
    one = stage_figures(problem, Layout.of(1, 4, 1), 1)
    tp = stage_figures(problem, Layout.of(2, 1, 2), 1)
    # tp=2 inside the island: compute halves, 2 all-reduces of 1 MB each way at 100 GB/s (2 (t-1)/t = 1)
    assert tp.fwd_s[0] == pytest.approx(0.5e-3 + 2 * 1e6 / 100e9)
    assert tp.cut_bytes == [0.5e6] and tp.cut_s == [pytest.approx(0.5e6 / 10e9)]   # pp=2 crosses the network
    assert one.state_bytes[0] == pytest.approx(8e6 * (1 + 1 + 6))
    shard = stage_figures(problem, Layout.of(1, 4, 1, "shard"), 1)
    assert shard.state_bytes[0] == pytest.approx(8e6 * (1 + 1 + 6 / 4))
    assert problem.links(Layout.of(1, 4, 1))["dp"].bandwidth_Bps == 10e9       # dp=4 spans both nodes
    assert problem.links(Layout.of(2, 2, 1))["dp"].bandwidth_Bps == 100e9      # dp inside the island, pp outside
    assert problem.links(Layout.of(2, 2, 1, order="dp-pp-tp"))["pp"].bandwidth_Bps == 100e9
    assert all(m.tp <= 2 for m in mesh_shapes(problem))                    # tp never leaves the island


def test_nothing_fits_says_so() -> None:
    problem = chain(random.Random(3), 4, [Level(2, 100e9)], memory=1e6, batch=4)
    with pytest.raises(InfeasibleError, match="no mesh of 2 devices fits"):
        search_mesh(problem)


def test_the_search_enumerates_only_layouts_the_runtime_runs() -> None:
    """By default no shape puts dp outside pp or replicates tensor-parallel stages with DDP (the runtime refuses
    both: ``ParallelDims.from_spec`` reads every enumerated shape); off, the cost model's other layouts are there."""
    from fxpipe.distributed.parallel import ParallelDims
    problem = chain(random.Random(0), 6, [Level(4, 200e9, 2e-6, "NV8"), Level(4, 12e9, 5e-6, "NET")], 1e12, batch=8)
    shapes = mesh_shapes(problem)
    every = mesh_shapes(MeshProblem(**{**problem.__dict__, "runnable_only": False}))
    left_out = set(every) - set(shapes)
    assert {m.order for m in left_out} == {"pp-dp-tp", "dp-pp-tp"}, left_out
    assert all(m.order == "dp-pp-tp" or (m.dp_mode == "replicate" and m.tp > 1) for m in left_out), left_out
    assert any(m.tp > 1 and m.dp > 1 for m in shapes) and any(m.dp_mode == "replicate" for m in shapes)
    for m in shapes:
        dims = ParallelDims.from_spec({"pp": m.pp, "dp": m.dp, "tp": m.tp, "dp_mode": m.dp_mode, "order": m.order},
                                      m.pp)
        assert (dims.dp, dims.tp, dims.dp_mode == "shard" or m.dp == 1) == (m.dp, m.tp, m.dp_mode == "shard" or m.dp == 1)
        assert not (dims.tp > 1 and dims.dp > 1 and dims.dp_mode == "replicate"), m


def test_a_schedule_that_cannot_run_the_shape_is_named_not_memory() -> None:
    """Where no schedule and micro-batch count runs on the shape at all (ZB-V's two stages a device from a chain of
    too few pieces; one micro-batch under 1F1B), the error says so rather than blaming memory."""
    problem = chain(random.Random(1), 6, [Level(4, 200e9, 2e-6, "NV8")], 1e12, batch=8)
    pp4 = Layout.of(4, 1, 1, "replicate", "pp-dp-tp")
    with pytest.raises(InfeasibleError, match=r"no schedule runs on pp=4 dp=1 tp=1 \(zb-v needs 8 stages of the "
                                              r"model's 6 pieces"):
        search_mesh(dataclasses.replace(problem, fixed=[pp4], schedules=("zb-v",)))
    with pytest.raises(InfeasibleError, match=r"1f1b: one micro-batch \(only gpipe"):
        search_mesh(dataclasses.replace(problem, fixed=[pp4], schedules=("1f1b",), micro_batch_counts=(1,)))
