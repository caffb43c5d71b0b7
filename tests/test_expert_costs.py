"""Expert parallelism costed and planned (issue 60 part 3): the active experts' FLOPs, the all-to-all formula, the
experts' memory over ``ep``, a fixed ``pp=2,ep=2`` plan, a refused ``ep`` and the search choosing ``ep``."""

from __future__ import annotations

import dataclasses

import pytest

import fxpipe
from fxpipe import analytic
from fxpipe.analytic_model import cost_model
from solvers import InfeasibleError
from solvers.experts import A2A_PER_LAYER, EXPERT_IMBALANCE, Experts, a2a_bytes, a2a_s, expert_extra_s
from solvers.layout import Layout
from solvers.mesh import Level, MeshProblem, Piece, mesh_shapes, state_bytes
from solvers.mesh_search import search_mesh
from hf_models import SEQ, WIDTH, build, padded_batch

GiB = 2.0 ** 30


@pytest.fixture(scope="module")
def moe():
    model = build("qwen3_moe")
    batch = padded_batch("qwen3_moe")
    inputs, kwargs = (batch["input_ids"],), {"labels": batch["labels"]}
    costed = cost_model(model, inputs, fxpipe.Devices.preset("h100", 4).specs[0], example_kwargs=kwargs)
    return model, inputs, kwargs, costed


def test_the_experts_region_is_charged_its_active_experts_only(moe):
    _, _, _, costed = moe
    assert [r.path for r in costed.experts] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    tokens = costed.batch // costed.profiled * SEQ   # the costed micro-batch's tokens
    one_expert = 2 * WIDTH * 16 + 16 * WIDTH          # gate_up (2I x H) and down (H x I), I = 16
    for region in costed.experts:
        assert (region.tokens, region.top_k, region.hidden) == (tokens, 2, WIDTH)
        hand = 2 * tokens * 2 * one_expert             # 2 FLOPs a multiply-add, top 2 of 8 experts
        assert sum(costed.costs[n].flops for n in region.nodes) == hand
        assert region.param_bytes == 8 * one_expert * 4


def test_the_all_to_all_formula():
    # Qwen3-30B-A3B's shape: 4096 tokens to 8 experts each, hidden 2048 in bfloat16, over 8 ranks
    sent = a2a_bytes(4096, 8, 2048, 2, 8)
    assert sent == 4096 * 8 * 2048 * 2 * 7 / 8
    assert a2a_bytes(4096, 8, 2048, 2, 1) == 0.0
    assert a2a_s(sent, 8, 400e9, 1e-6) == pytest.approx(sent / 400e9 + 7e-6)
    layer = Experts((128,), 0.0, fwd_s=1e-6, bwd_s=2e-6, token_bytes=8 * 2048 * 2)   # per sample (one token)
    fwd, bwd = expert_extra_s(layer, 4096, 8, 400e9)
    one = sent / 400e9
    assert fwd == pytest.approx((EXPERT_IMBALANCE - 1) * 1e-6 * 4096 + A2A_PER_LAYER // 2 * one)
    assert bwd == pytest.approx((EXPERT_IMBALANCE - 1) * 2e-6 * 4096 + A2A_PER_LAYER // 2 * one)
    assert expert_extra_s(layer, 4096, 1, 400e9) == (0.0, 0.0)


def _problem(memory: float, experts: bool = True) -> MeshProblem:
    """Four blocks of 10 GiB of parameters, 9 of them experts (64 per layer), on one node of 8."""
    pieces = [Piece(f"b{i}", 1e-3, 2e-3, 10 * GiB, 1e6, block=True,
                    experts=Experts((64,), 9 * GiB, 5e-4, 1e-3, 8 * 4096 * 2) if experts else None) for i in range(4)]
    return MeshProblem(pieces, [1e5] * 3, [Level(8, 400e9, 1e-6, "NV18")], memory, batch=64, grad_factor=1.0,
                       optimizer_factor=6.0, tp_refused=(2, 4, 8))


def test_the_experts_memory_is_divided_by_ep():
    problem = _problem(80 * GiB)
    for ep in (1, 2, 8):
        replicated = state_bytes(problem, Layout.of(2, 8, 1, "replicate", ep=ep), 4)
        assert replicated[0] == pytest.approx((1 * GiB + 9 * GiB / ep) * 8.0)   # parameters, gradients, state
        # FSDP2: the experts' state over ep x the dp / ep ranks left, the dense state over dp
        sharded = state_bytes(problem, Layout.of(2, 8, 1, "shard", ep=ep), 4)
        assert sharded[0] == pytest.approx((1 * GiB + 9 * GiB / ep) * 2.0 + 6.0 * 10 * GiB / 8)


def test_a_fixed_ep_mesh_is_planned_and_shown(moe):
    model, inputs, kwargs, costed = moe
    plan = fxpipe.plan(model, fxpipe.Devices.preset("h100", 4), inputs, example_kwargs=kwargs, mesh="pp=2,ep=2")
    assert plan.to_dict()["layout"]["ep"] == 2 and plan.layout.ep == 2
    assert "ep=2" in plan.summary().splitlines()[0]
    plain = analytic.plan_costed_mesh(costed, fxpipe.Devices.preset("h100", 4), "pp=2,dp=2")
    assert plain.layout.ep == 1
    # the experts' parameters halved on each rank; the all-to-alls and the imbalance make the stages slower
    assert sum(s.param_bytes for s in plan.stages) < sum(s.param_bytes for s in plain.stages)
    assert sum(s.fwd_s for s in plan.stages) > sum(s.fwd_s for s in plain.stages)


def test_an_ep_that_does_not_divide_the_experts_is_refused_with_the_degrees_that_would(moe):
    _, _, _, costed = moe
    with pytest.raises(ValueError, match=r"ep=3 does not divide the 8 experts of model.layers.0.mlp.experts.*\(2\)"):
        analytic.plan_costed_mesh(costed, fxpipe.Devices.preset("h100", 6), "pp=1,dp=6,ep=3")


def test_the_search_enumerates_ep_and_picks_it_where_it_pays():
    assert {m.ep for m in mesh_shapes(_problem(80 * GiB, experts=False))} == {1}
    problem = _problem(48 * GiB)
    assert {m.ep for m in mesh_shapes(problem) if m.dp == 8} == {1, 2, 4, 8}
    best = search_mesh(problem).best.mesh
    assert best.ep > 1, best
    with pytest.raises(InfeasibleError):   # without ep no shape holds the experts' parameters and state
        search_mesh(dataclasses.replace(problem, fixed=[m for m in mesh_shapes(problem) if m.ep == 1]))
