"""``parallelize`` applies each parallelism by its own function in one fixed order (tensor parallelism,
recomputation, data parallelism, then the gradient-norm marks), as torchtitan's ``parallelize_llama``; without a
mesh only recomputation. The functions themselves are tested on gloo ranks (test_mesh_tp, test_mesh_fsdp)."""

from __future__ import annotations

from types import SimpleNamespace

import fxpipe.distributed.parallel.apply as apply
from fxpipe.distributed.parallel import ParallelDims


def _recorded(monkeypatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(apply, "apply_tensor_parallel", lambda *a: calls.append("tp") or apply.TensorParallel())
    monkeypatch.setattr(apply, "apply_recomputation", lambda stages, units: calls.append(f"recompute units={units}"))
    monkeypatch.setattr(apply, "apply_data_parallel", lambda *a: calls.append("data") or "reducer")
    monkeypatch.setattr(apply, "count_once", lambda stages, elsewhere, copies, tp: calls.append(f"count {copies}"))
    monkeypatch.setattr(ParallelDims, "dp_ranks", staticmethod(lambda mesh: [[0, 1]]))
    monkeypatch.setattr(apply.DataParallelStep, "group_of", staticmethod(lambda grid, timeout_s: "group"))
    return calls


def test_parallelize_applies_each_parallelism_in_one_fixed_order(monkeypatch):
    calls = _recorded(monkeypatch)
    stages = SimpleNamespace(named_parameters=lambda: iter(()), pipe=SimpleNamespace(compiled=None))
    done = apply.parallelize(stages, ParallelDims(pp=2, dp_shard=2, tp=2), mesh=object(), tp_plan=None,
                             timeout_s=1.0)
    assert calls == ["tp", "recompute units=True", "data", "count 4"]
    assert (done.grid, done.group, done.data) == ([[0, 1]], "group", "reducer")
    calls.clear()
    apply.parallelize(stages, ParallelDims(pp=2, dp_replicate=2, dp_mode="replicate"), object(), None, 1.0)
    assert calls == ["tp", "recompute units=False", "data", "count 2"]   # DDP: blocks recompute in place
    calls.clear()
    # expert parallelism after tensor parallelism; on a sharded mesh its shards FSDP2-sharded just before the rest
    from solvers.layout import Layout
    shard = object()
    monkeypatch.setattr(apply, "apply_expert_parallel", lambda *a: calls.append("ep") or apply.ExpertParallel(
        ep=2, modules=[shard], params=[]))
    monkeypatch.setattr(apply, "apply_expert_fsdp", lambda stages, experts, *a: calls.append("expert fsdp") or True)
    monkeypatch.setattr(apply, "mark_copies", lambda params, copies: None)
    planned = SimpleNamespace(named_parameters=lambda: iter(()), pipe=SimpleNamespace(compiled=None),
                              plan=SimpleNamespace(layout=SimpleNamespace(precision="fp32")))
    done = apply.parallelize(planned, ParallelDims(Layout(pp=1, dp_shard=4, ep=2)), object(), None, 1.0)
    assert calls == ["tp", "ep", "recompute units=True", "expert fsdp", "data", "count 4"]
    assert done.data == "reducer"   # FSDP2 reduces the shards: no ExpertGrads around the reducer
    calls.clear()
    alone = apply.parallelize(stages, None, None, None, 1.0)
    assert calls == ["recompute units=False"] and alone.data is None
