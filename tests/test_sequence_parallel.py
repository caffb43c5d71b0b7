"""Sequence parallelism's analysis of the stage graphs, in one process (the runs on ranks, exact against one process,
are ``tests/test_mesh_tp.py``): which nodes run on sequence shards in Llama, GPT-2 and Qwen3 split in two stages,
which parameters' gradients are then summed over tp, and the refusal of a sequence tp does not divide."""

from __future__ import annotations

import functools
import json
import re

import pytest

import fxpipe

transformers = pytest.importorskip("transformers")
from test_mesh_fsdp import _builder, _plan  # noqa: E402

NORMS = re.compile(r"(input_layernorm|post_attention_layernorm|model\.norm|ln_1|ln_2|ln_f)\.(weight|bias)$")


@functools.lru_cache(maxsize=None)
def _stages(family: str):
    """Every stage graph of ``family``'s two-stage plan, its tensor-parallel layers called as modules, as each rank
    reads them; the plan's row-wise layers."""
    from fxpipe.distributed.parallel.module_calls import restore_module_calls
    from fxpipe.distributed.parallel.tp import _kinds
    from fxpipe.distributed.parallel.tp_plans import default_tp_plan
    from fxpipe.frontend.capture import capture_as_planned
    from fxpipe.runtime.execute.codegen import split_graph
    plan = fxpipe.Plan.from_dict(json.loads(_plan(family)))
    model = _builder(family)()
    captured = capture_as_planned(model, plan.frontend, ())
    graphs = [s.module for s in split_graph(captured.graph, plan.stage_of(), len(plan.stages), copies=True)]
    styles = default_tp_plan(model, 2)
    for gm in graphs:
        restore_module_calls(gm, model, styles.styles)
    return graphs, _kinds(styles)[1], model


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])
def test_the_norms_and_residual_adds_run_on_sequence_shards_and_nothing_inside_a_block(family):
    """Every block's norms, its residual adds and the final norm run sharded (their parameters are the ones summed
    over tp); attention, the tensor-parallel layers, Qwen3's per-head q/k norms and the LM head do not; what crosses
    the stage boundary is sharded, what the last stage returns is not."""
    from fxpipe.distributed.parallel.sequence import read_parameters, sequence_sharded
    graphs, rowwise, model = _stages(family)
    found = sequence_sharded(graphs, rowwise, 2)
    assert found.length == 12 and found.active
    for k, gm in enumerate(graphs):
        sharded = {n for n in gm.graph.nodes if n.name in found.sharded[k]}
        read = {_param(gm, model, t) for t in read_parameters(gm, found.sharded[k])} - {None}
        norms = {_param(gm, model, n.target) for n in gm.graph.nodes if n.op == "get_attr"} - {None}
        assert read == {n for n in norms if n and NORMS.search(n)}, (family, k, read)
        for node in sharded:
            assert "attention" not in str(node.target) and node.op != "call_module", (family, node.format_node())
        output = next(n for n in gm.graph.nodes if n.op == "output")
        crossing = {n.name for n in output.all_input_nodes if n in sharded}
        if k == 0:   # the hidden state after stage 0's last block, sent on its sequence shard
            assert len(crossing) == 1 and _shape(next(n for n in sharded if n.name in crossing))[1:] == (12, 32)
        else:
            assert not crossing
    adds = [n for k, gm in enumerate(graphs) for n in gm.graph.nodes
            if n.name in found.sharded[k] and "aten.add.Tensor" in str(n.target)]
    assert len(adds) >= 2 * 4, adds   # each of the four blocks' two residual adds


def _param(gm, model, target):
    """The model's name of the parameter at ``target`` of ``gm`` (``None`` for a buffer)."""
    owner, _, attr = target.rpartition(".")
    param = gm.get_submodule(owner)._parameters.get(attr)
    return next((n for n, p in model.named_parameters() if p is param), None) if param is not None else None


def _shape(node):
    return tuple(node.meta["val"].shape)


def test_a_sequence_that_tp_does_not_divide_is_refused_naming_the_fix():
    from fxpipe.distributed.parallel.sequence import sequence_sharded
    from fxpipe.distributed.parallel.tp_plans import TPPlanError
    graphs, rowwise, _ = _stages("llama")
    with pytest.raises(TPPlanError, match=r"sequence \(12 tokens\) over tp=5 ranks, which does not divide it: pad "
                                          r"the sequences to a multiple of 5, or turn sequence parallelism off "
                                          r"\(mesh '...,sp=0'\)"):
        sequence_sharded(graphs, rowwise, 5)


def test_without_row_wise_layers_nothing_is_sharded():
    from fxpipe.distributed.parallel.sequence import sequence_sharded
    graphs, _, _ = _stages("llama")
    found = sequence_sharded(graphs, set(), 2)
    assert not found.active and found.sharded == [set(), set()]
