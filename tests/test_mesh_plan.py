"""fxpipe.plan(mesh=...): a Hugging Face model on meta planned as a pp x dp x tp mesh, the plan records it, and
plans of the format before the mesh still load."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import fxpipe
import fxpipe.analytic as analytic
from fxpipe.cost.devices import PRESETS, Devices
from hf_models import on_meta
from solvers.schedules import SCHEDULES


@pytest.fixture(scope="module")
def costed():
    model = on_meta("llama", num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=4, vocab_size=512, max_position_embeddings=256)   # tp up to 4 runs
    ids = torch.zeros(16, 256, dtype=torch.long, device="meta")
    devices = Devices.preset("h100", "0:0-3,1:0-3")
    return model, ids, devices, analytic.cost_model(model, (ids,), devices.specs[0], workers=8)


def test_auto_mesh_plan_records_the_mesh_and_every_shape(costed, tmp_path):
    model, ids, devices, c = costed
    plan = fxpipe.plan(model, devices, (ids,), mesh="auto")
    mesh = plan.layout
    assert mesh.world == 8 and mesh.tp <= 4   # tp inside a node's NVLink island
    rows = plan.solver["mesh_search"]
    chosen = [r for r in rows if r["chosen"]]
    assert len(chosen) == 1 and (chosen[0]["pp"], chosen[0]["dp"], chosen[0]["tp"]) == (mesh.pp, mesh.dp, mesh.tp)
    assert len({(r["pp"], r["dp"], r["tp"]) for r in rows}) >= 8   # the shapes of 8 = pp x dp x tp with tp <= 4
    assert plan.workers == mesh.pp and plan.devices[0] == "cuda:0"
    assert sorted(n for s in plan.stages for n in s.nodes) == sorted(n.name for n in c.captured.graph.graph.nodes
                                                                    if n.op != "output")
    text = plan.summary()
    assert text.startswith(f"mesh pp={mesh.pp}") and "mesh search (" in text and "* pp=" in text
    # every choice costed node by node is recorded beside the search's figures; the plan is the fastest of them
    costed = plan.solver["mesh_costed"]
    fitted = [r for r in costed if "iteration_s" in r]
    assert fitted and all("refused" in r for r in costed if r not in fitted)
    assert plan.predicted["iteration_s"] == min(r["iteration_s"] for r in fitted)
    assert all(r["searched_s"] > 0 and r["searched_peak_bytes"] > 0 for r in costed)
    assert f"{len(costed)} choices of the search costed node by node" in text
    path = tmp_path / "mesh.plan.json"
    plan.save(path)
    again = fxpipe.load_plan(path)
    assert again.mesh == plan.mesh and again.to_dict() == plan.to_dict()


def test_fixed_mesh_divides_the_blocks_parameters_by_tp_and_shards_the_optimizer(costed):
    """tp divides what the runtime shards, the blocks' parameters; the embedding and the head (replicated over tp
    by the default tensor-parallel plan) are charged whole on every tp rank."""
    from fxpipe.planning.blocks import repeated_blocks
    _, _, devices, c = costed
    params = sum(x.param_bytes for x in c.costs.values())
    inside = {n for names in repeated_blocks(c.captured.graph).values() for n in names}
    blocks = sum(x.param_bytes for n, x in c.costs.items() if n in inside)
    assert params - blocks > 0.05 * params   # the embedding and head of a 512-token vocabulary
    tp = analytic.plan_costed_mesh(c, devices, "pp=2,dp=1,tp=4", schedule="1f1b")
    assert (tp.layout.pp, tp.layout.dp, tp.layout.tp, tp.schedule, len(tp.stages)) == (2, 1, 4, "1f1b", 2)
    assert sum(s.param_bytes for s in tp.stages) == pytest.approx(blocks / 4 + (params - blocks), rel=1e-3)
    assert tp.mesh["links"] == {"tp": "NV18", "dp": None, "pp": "NET"}
    one = analytic.plan_costed_mesh(c, devices, "pp=2,dp=4,tp=1,dp_mode=replicate", schedule="1f1b", chunks=2)
    fsdp = analytic.plan_costed_mesh(c, devices, "pp=2,dp=4,tp=1,dp_mode=shard", schedule="1f1b", chunks=2)
    assert one.layout.dp_mode == "replicate" and fsdp.layout.dp_mode == "shard"
    # Adam on a bfloat16 model as it runs: 2 + 2 bytes a parameter kept whole, 4 of moments sharded by dp = 4
    assert fsdp.problem["optimizer_state_factor"] == pytest.approx(1 + 2 / 4)
    assert one.problem["optimizer_state_factor"] == pytest.approx(3)
    # tensor parallelism pays its collectives: a tp=4 stage's compute is more than a quarter of tp=1's
    base = analytic.plan_costed_mesh(c, devices, "pp=2,dp=4,tp=1,dp_mode=replicate", schedule="1f1b", chunks=4)
    four = analytic.plan_costed_mesh(c, devices, "pp=2,dp=1,tp=4", schedule="1f1b", chunks=16)
    assert sum(s.fwd_s for s in four.stages) > sum(s.fwd_s for s in base.stages) / 4


def test_default_plan_has_no_mesh_and_older_plans_load(costed, tmp_path):
    model, ids, devices, _ = costed
    plan = fxpipe.plan(model, Devices.preset("h100", 2), (ids,), schedule="1f1b", chunks=4)
    assert plan.mesh is None
    doc = plan.to_dict()
    doc["format"] = "fxpipe-plan/1"
    doc.pop("mesh"), doc.pop("layout")
    path = tmp_path / "old.plan.json"
    path.write_text(json.dumps(doc))
    old = fxpipe.load_plan(path)
    assert old.mesh is None and [s.nodes for s in old.stages] == [s.nodes for s in plan.stages]
    assert old.layout == plan.layout and (old.layout.pp, old.layout.dp, old.layout.tp) == (2, 1, 1)


@pytest.mark.parametrize("mesh", ["pp=2,dp=4,tp=1,dp_mode=shard", "pp=2,dp=2,tp=2"])
def test_a_plan_stores_its_layout_whole_and_plans_of_format_2_migrate(costed, tmp_path, mesh):
    """The plan's JSON holds one ``layout`` (the degrees, mode, order, sequence parallelism, schedule and each
    stage's recomputation; ``mesh`` only where it runs); a ``fxpipe-plan/2`` plan, whose ``mesh`` held the
    degrees, loads to the same layout; a stored layout that disagrees with the plan's stages is refused."""
    _, _, devices, c = costed
    plan = analytic.plan_costed_mesh(c, devices, mesh, schedule="1f1b", chunks=2)
    doc = plan.to_dict()
    assert doc["format"] == "fxpipe-plan/4" and doc["layout"] == plan.layout.to_dict()
    assert not {"pp", "dp", "tp", "dp_mode"} & set(doc["mesh"])
    assert fxpipe.Plan.from_dict(json.loads(json.dumps(doc))).layout == plan.layout
    layout = plan.layout
    old = {**doc, "format": "fxpipe-plan/2"}
    old.pop("layout")
    old["mesh"] = {**doc["mesh"], "pp": layout.pp, "dp": layout.dp, "tp": layout.tp, "dp_mode": layout.dp_mode,
                   "order": layout.order, "sequence_parallel": bool(layout.sequence_parallel)}
    path = tmp_path / "v2.plan.json"
    path.write_text(json.dumps(old))
    again = fxpipe.load_plan(path)
    assert again.layout == layout and again.mesh == plan.mesh, (again.layout, layout)
    # a /2 mesh that left dp_mode out: unsaid, which the ranks run as FSDP2 (as /2 plans ran)
    from fxpipe.distributed.parallel import ParallelDims
    unsaid = {k: v for k, v in old["mesh"].items() if k != "dp_mode"}
    path.write_text(json.dumps({**old, "mesh": unsaid}))
    read = fxpipe.load_plan(path).layout
    assert read.dp_mode is None and read.dp_shard == layout.dp, read
    assert ParallelDims.of(read, plan.workers) == ParallelDims.of(layout, plan.workers)
    wrong = {**doc, "layout": {**doc["layout"], "schedule": "gpipe"}}
    with pytest.raises(fxpipe.PlanFormatError, match="layout/schedule is 'gpipe' but the plan runs '1f1b'"):
        fxpipe.Plan.from_dict(wrong)
    with pytest.raises(fxpipe.PlanFormatError, match="plan field layout: dp_shard=4 with dp_mode='replicate'"):
        fxpipe.Plan.from_dict({**doc, "layout": {**doc["layout"], "dp_mode": "replicate", "dp_shard": 4}})


def test_bad_meshes_are_refused_with_the_fix(costed):
    model, ids, devices, c = costed
    with pytest.raises(ValueError, match="multiply to .* but there are 8 devices"):
        analytic.plan_costed_mesh(c, devices, "pp=3,dp=1,tp=1")
    with pytest.raises(ValueError, match="does not split evenly over dp=8"):
        analytic.plan_costed_mesh(dataclasses.replace(c, batch=12), devices, "pp=1,dp=8,tp=1")
    with pytest.raises(ValueError, match="unknown key"):
        analytic.plan_costed_mesh(c, devices, {"pp": 8, "cp": 1})
    # a tp the runtime's tensor-parallel plan refuses (4 heads over 8, past a node): the planner's own fix, not a rank's
    with pytest.raises(ValueError, match=r"^mesh pp=1 dp=1 tp=8: the runtime cannot run tp=8 on this model: "
                       r"model.layers.0.self_attn has 4 attention heads, which tp=8 does not divide; plan a tp of "
                       r"1, 2, 4 \(the default tensor-parallel plan shards whole heads and features\), or let the "
                       r"planner choose \(mesh='auto', fxpipe plan --mesh auto\)$"):
        analytic.plan_costed_mesh(c, devices, "pp=1,dp=1,tp=8")
    with pytest.raises(ValueError, match="leave stages and virtual_stages unset"):
        fxpipe.plan(model, devices, (ids,), mesh="auto", stages=4)
    mixed = Devices([PRESETS["h100"][0], PRESETS["a100"][0]], [["X", "NV12"], ["NV12", "X"]])
    with pytest.raises(ValueError, match="identical devices"):
        analytic.plan_costed_mesh(c, mixed, "auto")
    with pytest.raises(fxpipe.InfeasiblePlanError, match="optimizer state alone need"):
        analytic.plan_costed_mesh(c, Devices.preset("h100", "0:0-1"), "auto",
                                  options=fxpipe.CompileOptions(memory_bytes=[1e6, 1e6]))


def test_link_levels_from_the_topology():
    """tp's islands are the fastest class's blocks; each slower class inside a node, then the network, a level."""
    from pathlib import Path

    from fxpipe.planning.mesh_chain import levels_of
    from fxpipe.planning.topology import parse_nvidia_smi_topo

    classes = parse_nvidia_smi_topo((Path(__file__).parent / "data" / "titan-v-8gpu-2socket.txt").read_text())
    box = dataclasses.replace(Devices.preset("v100", 8), link_classes=classes)
    assert [(lv.size, lv.name) for lv in levels_of(box)] == [(2, "PIX"), (2, "PHB"), (2, "SYS")]
    two = Devices.preset("h100", "0:0-7,1:0-7", bandwidth_Bps={"NET": 50e9})
    assert [(lv.size, lv.name, lv.bandwidth_Bps) for lv in levels_of(two)] == [(8, "NV18", 450e9), (2, "NET", 50e9)]
    classes[0][1] = classes[1][0] = "SYS"   # GPU 1 no longer in GPU 0's PIX pair
    with pytest.raises(ValueError, match="ordered island by island"):
        levels_of(dataclasses.replace(box, link_classes=classes))


def test_cli_plans_a_mesh_for_a_preset_and_refuses_one_for_local_devices(tmp_path, capsys):
    from fxpipe.__main__ import main

    out = tmp_path / "mesh.plan.json"
    code = main(["plan", "hf:llama", "--config", "num_hidden_layers=2,hidden_size=64,intermediate_size=128,"
                 "num_attention_heads=4,num_key_value_heads=2,vocab_size=256", "--seq-len", "64", "--batch", "8",
                 "--devices", "h100@0:0-1,1:0-1", "--mesh", "pp=2,dp=1,tp=2", "--schedule", "1f1b", "-o", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and text.startswith("mesh pp=2 dp=1 tp=2 on 4 devices")
    planned = fxpipe.load_plan(out)
    assert planned.mesh["links"] == {"tp": "NV18", "dp": None, "pp": "NET"}
    # sequence parallelism by default (as PipelineRank runs it); sp=0 plans the activations whole on each tp rank:
    # more memory, and the whole hidden state over the pipeline's link
    assert planned.layout.sequence_parallel is True
    off = tmp_path / "off.plan.json"
    assert main(["plan", "hf:llama", "--config", "num_hidden_layers=2,hidden_size=64,intermediate_size=128,"
                 "num_attention_heads=4,num_key_value_heads=2,vocab_size=256", "--seq-len", "64", "--batch", "8",
                 "--devices", "h100@0:0-1,1:0-1", "--mesh", "pp=2,dp=1,tp=2,sp=0", "--schedule", "1f1b", "-o",
                 str(off)]) == 0
    capsys.readouterr()
    whole = fxpipe.load_plan(off)
    assert whole.layout.sequence_parallel is False
    assert max(whole.worker_peaks()) > max(planned.worker_peaks())
    # stage 0 sends on the hidden state (bf16, 64 tokens x 64 wide a sample) on its sequence shard, the masks and
    # rotary tables (made outside the blocks) whole, as the ranks run it
    hidden = 8 // planned.chunks * 64 * 64 * 2
    assert whole.stages[0].output_bytes - planned.stages[0].output_bytes == hidden / 2
    code = main(["plan", "resnet18", "--mesh", "auto", "--devices", "cpu,cpu", "--batch", "4", "--image-size", "32"])
    err = capsys.readouterr().err
    assert code != 0 and err.startswith("error: --mesh plans a preset's devices")


def test_meshes_are_searched_by_default_where_one_pipeline_cannot_hold_the_model_or_the_devices_span_nodes():
    """``fxpipe.plan``'s default (``mesh="if_needed"``): a Llama of two blocks whose MLP layers are 134M parameters
    each, 1.0 GiB each with Adam on bfloat16 parameters (8 bytes a parameter), so 8 devices of 0.98 GiB hold no pipeline of them (a layer
    cannot be cut) but hold them split by tensor parallelism (which divides the blocks: the small embedding and
    head stay whole on each rank, as the runtime runs them); ``mesh=None`` keeps one pipeline and refuses, naming ``mesh='auto'``; a fixed
    ``stages`` keeps the pipeline's refusal too. Devices on two nodes are searched as a mesh whatever the memory;
    the summary says why. (A stack of plain ``nn.Linear`` layers has no block tensor parallelism shards: no mesh
    would hold it either.)"""
    wide = on_meta("llama", num_hidden_layers=2, hidden_size=2048, intermediate_size=65536, num_attention_heads=16,
                   num_key_value_heads=4, vocab_size=256, max_position_embeddings=64)
    x = torch.zeros(4, 64, dtype=torch.long, device="meta")
    small = fxpipe.CompileOptions(memory_bytes=[int(0.98 * 2**30)] * 8)
    plan = fxpipe.plan(wide, Devices.preset("h100", 8), (x,), options=small)
    assert plan.layout.tp > 1 and max(plan.worker_peaks()) <= 0.98 * 2**30, plan.layout
    assert plan.solver["mesh_because"].startswith("no single pipeline holds the model")
    assert plan.summary().splitlines()[0].startswith("meshes searched by default: no single pipeline holds the model")
    for pipeline_only in ({"mesh": None}, {"stages": 2}):
        with pytest.raises(fxpipe.InfeasiblePlanError, match="mesh='auto'"):
            fxpipe.plan(wide, Devices.preset("h100", 8), (x,), options=small, **pipeline_only)
    two_nodes = fxpipe.plan(wide, Devices.preset("h100", "0:0-1,1:0-1"), (x,))
    assert two_nodes.mesh is not None and two_nodes.solver["mesh_because"] == "the devices are on 2 nodes"
    one_node = fxpipe.plan(wide, Devices.preset("h100", 4), (x,))
    assert one_node.mesh is None and "mesh_because" not in one_node.solver


@pytest.mark.parametrize("memory", [None, 12e6, 30e6])
def test_the_automatic_mesh_is_no_slower_by_its_own_costing_than_any_layout_the_user_could_fix(costed, memory):
    """Every shape the search ranked, planned with its mesh, order, schedule and micro-batches fixed, is
    costed node by node no faster than the automatic choice (issue 47 part 6). With 12 MB a device the
    search's best schedule of the fastest shapes does not fit under the node-level memory model: the first
    shape that fitted was returned (45.1 ms a step) though pp=4 dp=2 tp=1 fits under another (25.9 ms). With
    30 MB the layout whose search estimate ranked its schedules otherwise than the node-level costing (pp=2
    dp=2(fsdp) tp=2 with dp outside pp) is one the runtime does not run, and is no longer searched; the two step
    models still differ (docs/benchmarks.md: Llama-3-405B on 64 nodes). With every tp the runtime runs (4 key/value heads) and
    no memory bound, the automatic choice was pp=1 dp=4(fsdp) tp=2 at 5.10 ms though pp=4 dp=2 under ZB-H1 costs
    4.70 ms: the search gave the weight pass half of a backward's compute but none of its kernel launches, which
    dominate this small model on an H100, and put that ZB-H1 choice at 6.11 ms (now 4.74 ms, as the node level)."""
    model, ids, devices, c = costed
    options = None if memory is None else fxpipe.CompileOptions(memory_bytes=[memory] * len(devices))
    auto = analytic.plan_costed_mesh(c, devices, "auto", options=options)
    # the search's step and peak for each choice it had costed node by node agree with that costing within the
    # tolerance docs/benchmarks.md states, 15 % and 20 % (seen: step 0.99-1.06x, memory 1.00-1.04x)
    costed_rows = [r for r in auto.solver["mesh_costed"] if "iteration_s" in r]
    assert costed_rows
    for r in costed_rows:
        assert abs(r["iteration_s"] / r["searched_s"] - 1) <= 0.15, r
        assert abs(r["peak_bytes"] / r["searched_peak_bytes"] - 1) <= 0.20, r
    compared = 0
    for row in auto.solver["mesh_search"]:
        if not row["feasible"]:
            continue
        spec = {k: row[k] for k in ("pp", "dp", "tp", "dp_mode", "order")}
        for schedule in ([row["schedule"]] if row["pp"] == 1 else SCHEDULES):
            try:
                fixed = analytic.plan_costed_mesh(c, devices, spec, schedule=schedule, options=options)
            except (MemoryError, fxpipe.InfeasiblePlanError):
                continue
            compared += 1
            assert auto.predicted["iteration_s"] <= fixed.predicted["iteration_s"] * (1 + 1e-9), (row, fixed.mesh)
    # the shapes of the layouts the runtime runs, each under every schedule that fits (12 MB: 2, since the search
    # charges a backward's transient as the node level does)
    assert compared >= 2
