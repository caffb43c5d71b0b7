"""One spelling of a mesh (solvers.layout): fxpipe.plan's parser (parse_mesh) and fxpipe.launch's
(ParallelDims.from_spec) read the same spellings as the same layout, and refuse the same mistakes alike."""

import json

import pytest

from fxpipe.distributed.parallel import ParallelDims
from fxpipe.planning.mesh_plan import parse_mesh
from solvers.layout import Layout, parse_layout


def _planned(spec, world):
    """(pp, dp, tp, data parallelism) of the planner's reading, one dp mode given."""
    meshes = parse_mesh(spec, world)
    assert len(meshes) == 1, meshes
    m = meshes[0]
    return m.pp, m.dp, m.tp, m.dp_mode if m.dp > 1 else "none"


def _launched(spec, pp):
    d = ParallelDims.from_spec(spec, pp)
    return d.pp, d.dp, d.tp, d.data_parallel if d.dp > 1 else "none"


@pytest.mark.parametrize("spellings, want", [
    (["dp_shard=4", "dp=4,dp_mode=shard", "pp=2,dp_shard=4", {"dp_shard": 4}, {"dp": "4", "dp_mode": "shard"}],
     (2, 4, 1, "shard")),
    (["dp_replicate=4", "dp=4,dp_mode=replicate", {"dp_replicate": 4, "tp": 1}], (2, 4, 1, "replicate")),
    (["dp_shard=2,tp=2", "pp=2,dp=2,tp=2,dp_mode=shard", {"pp": 2, "dp": 2, "tp": 2, "dp_mode": "shard",
                                                           "order": "pp-dp-tp"}], (2, 2, 2, "shard")),
    (["tp=4", "pp=2,dp=1,tp=4", {"tp": "4"}], (2, 1, 4, "none")),
])
def test_either_spelling_gives_the_same_layout_to_the_planner_and_to_launch(spellings, want):
    for spec in spellings:
        assert _planned(spec, world=8) == want, spec
        assert _launched(spec, pp=2) == want, spec


def test_dp_without_a_mode_is_both_modes_to_the_planner_and_fsdp_to_launch():
    assert [m.dp_mode for m in parse_mesh("pp=2,dp=4", 8)] == ["replicate", "shard"]
    assert ParallelDims.from_spec("dp=4", 2) == ParallelDims(pp=2, dp_shard=4)
    assert parse_layout("dp=4") == Layout(dp_shard=4, dp_mode=None)


@pytest.mark.parametrize("spec, want", [("tp=2", True), ("tp=2,sp=1", True), ("tp=2,sp=off", False),
                                        ({"tp": 2, "sp": False}, False), ("tp=2,sp=TRUE", True)])
def test_sequence_parallelism_is_on_unless_the_spelling_says_sp_0_for_the_planner_and_launch(spec, want):
    from fxpipe.planning.mesh_plan import ask_mesh
    assert ParallelDims.from_spec(spec, 2).sequence_parallel is want
    asked = ask_mesh(spec, 8)   # fxpipe.plan reads its mesh= once, here
    assert asked.sequence_parallel is want and [m.tp for m in asked.shapes] == [2] * len(asked.shapes)
    assert ask_mesh(asked, 8) is asked
    assert ask_mesh("auto", 8).sequence_parallel is True and ask_mesh("auto", 8).shapes == ()
    assert ask_mesh("auto,sp=0", 8).sequence_parallel is False and ask_mesh("auto, sp=on", 8).sequence_parallel
    with pytest.raises(ValueError, match=r"'auto' searches every shape and takes only sp= beside it"):
        ask_mesh("auto,tp=2", 8)
    with pytest.raises(ValueError, match=r"sp is 1 or 0 \(on/off, true/false: sequence parallelism\), got 'yes'"):
        parse_layout("tp=2,sp=yes")


def test_hsdp_is_parsed_run_by_launch_and_refused_by_the_planner_naming_the_fix():
    spec = "dp_replicate=2,dp_shard=2"
    assert parse_layout(spec).hsdp and parse_layout(spec).dp == 4
    assert ParallelDims.from_spec(spec, 2).data_parallel == "hsdp"
    with pytest.raises(ValueError) as caught:
        parse_mesh(spec, 8)
    text = str(caught.value)
    assert "\n" not in text and "is HSDP, which the planner cannot cost yet: plan dp_shard=4" in text
    assert "python -m fxpipe.launch --mesh dp_replicate=2,dp_shard=2" in text


@pytest.mark.parametrize("spec, match", [
    ("dp_shard=2,cp=2", r"unknown key\(s\) \['cp'\]; the keys are pp, dp, tp, dp_mode, order, dp_shard, "
                        r"dp_replicate, sp, ep \(e\.g\. pp=2,dp=4,dp_mode=shard, or dp_shard=4 \(FSDP\)"),
    ({"pp": 2, "cp": 1}, r"unknown key\(s\) \['cp'\]; the keys are"),
    ("dp=2,dp_shard=2", "give dp .with dp_mode. or dp_shard/dp_replicate, not both"),
    ("dp_shard=2,dp_mode=shard", "dp_mode is shard .FSDP2. or replicate .DDP., and goes with dp only"),
    ("dp=2,dp_mode=fsdp", "dp_mode is shard .FSDP2. or replicate"),
    ("dp=two", "must be integers"),
    ("dp_shard=0", "dp_shard must be at least 1"),
    ("dp_shard", "is not KEY=VALUE"),
    ("dp=2,order=tp-dp-pp", "order must be one of pp-dp-tp, dp-pp-tp"),
])
def test_a_bad_spelling_gets_the_same_one_line_error_from_both(spec, match):
    for read in (lambda: parse_mesh(spec, 8), lambda: ParallelDims.from_spec(spec, 2)):
        with pytest.raises(ValueError, match=match) as caught:
            read()
        assert "\n" not in str(caught.value)


def test_each_reader_refuses_only_what_it_cannot_run():
    assert parse_mesh("dp=2,dp_mode=shard,order=dp-pp-tp", 8)[0].order == "dp-pp-tp"
    with pytest.raises(ValueError, match="runs the pipeline outermost"):
        ParallelDims.from_spec("dp=2,order=dp-pp-tp", 2)
    with pytest.raises(ValueError, match=r"multiply to 6 but there are 8 devices"):
        parse_mesh("pp=3,dp_shard=2", 8)
    with pytest.raises(TypeError, match="a string like 'pp=2,dp=4,tp=1'"):
        parse_layout(8)


def test_the_layout_record_round_trips_and_refuses_what_it_cannot_be():
    from solvers.layout import Layout, LayoutError
    full = Layout(pp=2, dp_replicate=2, dp_shard=2, tp=2, dp_mode="shard", sequence_parallel=False,
                  schedule="zb-v", virtual_stages=2, recomputation=("never", "blocks:3", "selective", "always"))
    assert Layout.from_dict(json.loads(json.dumps(full.to_dict()))) == full and full.data_parallel == "hsdp"
    assert parse_layout(full.spec()) == full.degrees() and full.world == 16
    assert Layout.of(2, 4, 1, "shard") == Layout(pp=2, dp_shard=4, dp_mode="shard")
    for bad, why in [({"dp_shard": 2, "dp_mode": "replicate"}, "replicas .DDP. do not shard"),
                     ({"dp_replicate": 2, "dp_shard": 2, "dp_mode": "replicate"}, "is HSDP"),
                     ({"dp_replicate": 2}, "names its mode"), ({"tp": 0}, "positive int"),
                     ({"recomputation": ("stages",)}, "recomputation 'stages' is not one of"),
                     ({"order": "tp-pp-dp"}, "order must be one of"),
                     ({"dp_shard": 2, "ep": 4}, r"ep=4 borrows 4 data-parallel ranks .* but dp=2: use a dp that ep "
                                                r"divides .dp=4 or a multiple of it")]:
        with pytest.raises(LayoutError, match=why):
            Layout(pp=1, **bad)
    with pytest.raises(LayoutError, match="unknown"):
        Layout.from_dict({"pp": 1, "cp": 2})


def test_the_layout_rules_are_one_function():
    """:func:`solvers.layout.refusal` says each rule's breach with its fix, and nothing for a layout that keeps
    them; the runtime's rules only where asked."""
    from solvers.layout import Layout, refusal
    good = Layout.of(2, 2, 2, "shard")
    assert refusal(good, world=8, workers=2, batch=4) is None
    cases = [(Layout.of(2, 2, 1, "replicate", "dp-pp-tp"), {}, "order", "pass order=pp-dp-tp"),
             (Layout.of(2, 2, 2, "replicate"), {}, "ddp_tp", "shard them with FSDP2"),
             (good, {"workers": 4, "world": 16}, "workers", "use pp=4, dp=2"),
             (good, {"world": 6}, "world", "multiply to 8 but there are 6"),
             (good, {"batch": 3}, "batch", "multiple of 2"),
             (Layout.of(2, 4, 1, "shard", ep=4), {"experts": {"model.layers.1.mlp.experts": 6}}, "experts",
              "ep=4 does not divide the 6 experts of model.layers.1.mlp.experts: use an ep that divides both 6 and "
              "dp=4 (2)"),
             (Layout.of(2, 2, 1, "shard", ep=2), {"experts": {}}, "experts", "has none that fxpipe can shard"),
             (Layout.of(1, 2, 2, "shard", ep=2), {}, "experts", "use tp=1 with ep")]
    for layout, given, rule, text in cases:
        found = refusal(layout, **given)
        assert found is not None and found.rule == rule and text in found.message, (rule, found)
    assert refusal(Layout.of(2, 2, 2, "replicate"), runtime=False) is None
    # ep borrows data-parallel ranks: dp left out is ep's, and the world counts it once
    moe = parse_layout("pp=2,ep=2")
    assert (moe.dp, moe.ep, moe.world) == (2, 2, 4) and parse_layout(moe.spec()) == moe
    assert refusal(moe, world=4, experts={"model.layers.0.mlp.experts": 8}) is None
