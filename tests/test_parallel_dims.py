"""ParallelDims: the degrees of pp × dp (replicate, shard) × tp, the mesh dims they make, the data parallelism a
mesh's names say, and degrees that do not fit the world or the plan refused with the fix (no processes)."""

from __future__ import annotations

import pytest

import fxpipe
from fxpipe.distributed.parallel import ParallelDims


class _Mesh:
    """What ParallelDims.from_mesh reads of a DeviceMesh: its dim names and sizes."""

    def __init__(self, **dims: int) -> None:
        self.mesh_dim_names, self.shape = tuple(dims), tuple(dims.values())
        self.ndim = len(dims)

    def size(self, dim: int) -> int:
        return self.shape[dim]


def test_mesh_dims_keep_pp_and_dp_shard_and_drop_the_other_dims_of_size_one():
    assert ParallelDims(pp=2, dp_shard=2).dims() == (("pp", 2), ("dp_shard", 2))
    assert ParallelDims(pp=2).dims() == (("pp", 2), ("dp_shard", 1))
    assert ParallelDims(pp=2, dp_replicate=2, dp_shard=2, tp=2).dims() == (
        ("pp", 2), ("dp_replicate", 2), ("dp_shard", 2), ("tp", 2))
    assert ParallelDims(pp=2, dp_replicate=3, dp_mode="replicate").dims() == (("pp", 2), ("dp", 3))
    assert [ParallelDims(pp=2, dp_shard=2).data_parallel, ParallelDims(dp_replicate=2, dp_shard=2).data_parallel,
            ParallelDims(dp_replicate=2, dp_mode="replicate").data_parallel] == ["shard", "hsdp", "replicate"]
    assert ParallelDims(pp=2, dp_replicate=2, dp_shard=3, tp=2).world_size == 24


@pytest.mark.parametrize("dims", [dict(pp=2, dp_shard=2), dict(pp=2, dp_replicate=2, dp_shard=2),
                                  dict(pp=2, dp_replicate=2, dp_mode="replicate"), dict(pp=4, dp_shard=1)])
def test_a_mesh_built_from_the_dims_reads_back_as_them(dims):
    want = ParallelDims(**dims)
    assert ParallelDims.from_mesh(_Mesh(**dict(want.dims()))) == want


def test_degrees_that_do_not_fit_the_world_or_the_plan_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"multiply to 8 but there are 4 devices.*torchrun --nproc-per-node 8"):
        ParallelDims(pp=2, dp_shard=4).validate(4)
    with pytest.raises(fxpipe.PlanMismatchError, match=r"plan runs on 4 workers but pp=2: use pp=4, dp=2"):
        ParallelDims(pp=2, dp_shard=4).validate(8, workers=4)
    with pytest.raises(ValueError, match="must be a positive int"):
        ParallelDims(pp=0)
    with pytest.raises(ValueError, match="replicas .DDP. do not shard"):
        ParallelDims(dp_shard=2, dp_mode="replicate")


@pytest.mark.parametrize("names", [dict(dp=2), dict(tp=2), dict(pp=2, dp=2, dp_shard=2),
                                   dict(pp=2, data=2)])
def test_a_mesh_whose_names_say_no_pipeline_or_no_data_parallelism_is_refused(names):
    with pytest.raises(ValueError, match=r"mesh_dim_names=\('pp', 'dp'\).*ParallelDims"):
        ParallelDims.from_mesh(_Mesh(**names))


def test_a_pp_by_tp_mesh_is_read_as_tensor_parallelism_without_data_parallelism():
    dims = ParallelDims.from_mesh(_Mesh(pp=2, tp=2))
    assert (dims.pp, dims.tp, dims.dp, dims.world_size) == (2, 2, 1, 4)


@pytest.mark.parametrize("spec, want", [
    ("dp_shard=2,tp=2", ParallelDims(pp=2, dp_shard=2, tp=2)),
    ("dp=2", ParallelDims(pp=2, dp_shard=2)),                                # fxpipe plan's spelling: FSDP2 by default
    ("pp=2,dp=4,tp=1,dp_mode=replicate", ParallelDims(pp=2, dp_replicate=4, dp_mode="replicate")),
    ("dp_replicate=2,dp_shard=2", ParallelDims(pp=2, dp_replicate=2, dp_shard=2)),   # HSDP
    ("dp_replicate=3", ParallelDims(pp=2, dp_replicate=3, dp_mode="replicate")),  # as from_mesh reads it: DDP
    ({"pp": 2, "dp": 2, "tp": 2, "dp_mode": "shard", "order": "pp-dp-tp"}, ParallelDims(pp=2, dp_shard=2, tp=2)),
    ("tp=2", ParallelDims(pp=2, tp=2)),
])
def test_a_mesh_spec_in_either_spelling_gives_the_degrees_around_the_plans_pipeline(spec, want):
    assert ParallelDims.from_spec(spec, pp=2) == want


@pytest.mark.parametrize("spec, match", [
    ("dp_shard=2,cp=2", r"unknown key\(s\) \['cp'\]; the keys are pp, dp, tp"),
    ("dp=2,dp_shard=2", "give dp .with dp_mode. or dp_shard/dp_replicate, not both"),
    ("dp=2,dp_mode=fsdp", "dp_mode is shard .FSDP2. or replicate"),
    ("dp=two", "must be integers"),
    ("dp_shard", "is not KEY=VALUE"),
    ("dp=2,order=dp-pp-tp", "runs the pipeline outermost .pp-dp-tp"),
])
def test_a_bad_mesh_spec_is_refused_naming_the_key_and_the_fix(spec, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims.from_spec(spec, pp=2)
    with pytest.raises(fxpipe.PlanMismatchError, match="the plan runs on 2 workers but pp=4: leave pp out"):
        ParallelDims.from_spec("pp=4,dp=2", pp=2)
