"""Plans: summary table, JSON round trip, fingerprint checks, loading never runs code."""

import json
import pickle

import pytest
import torch
import torchvision

import fxpipe
from fxpipe.planning.plan import PLAN_FORMAT


@pytest.fixture(scope="module")
def resnet_pipe():
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(6, 3, 32, 32)
    return model, x, fxpipe.compile(model, ["cpu", "cpu"], (x,), chunks=3, schedule="gpipe",
                                     profile="estimate")


def test_summary_table_has_every_column(resnet_pipe):
    _, _, pipe = resnet_pipe
    text = pipe.plan.summary()
    for column in ("stage", "device", "nodes", "param MiB", "fwd ms", "bwd ms", "act MiB", "peak MiB", "stage ms"):
        assert column in text
    assert "bottleneck: stage" in text and "samples/s" in text
    # ResNet's residual branches admit convex, non-contiguous stages the DP does not search: not "optimal",
    # but exact over its own space, and the summary says which.
    assert "optimal=False" in text and "exact over: contiguous stages of a topological order" in text
    assert len(pipe.plan.stages) == 2
    n_nodes = sum(len(s.nodes) for s in pipe.plan.stages)
    traced = fxpipe.trace(resnet_pipe[0])
    assert n_nodes == len([n for n in traced.graph.nodes if n.op != "output"])


def test_save_load_round_trip_and_reuse(resnet_pipe, tmp_path):
    model, x, pipe = resnet_pipe
    path = tmp_path / "r18.plan.json"
    pipe.plan.save(path)
    doc = json.loads(path.read_text())
    assert doc["format"] == PLAN_FORMAT and len(doc["fingerprint"]) == 64
    plan = fxpipe.load_plan(path)
    assert plan.to_dict() == pipe.plan.to_dict()
    again = fxpipe.compile(model, ["cpu", "cpu"], plan=plan)
    assert [s.nodes for s in again.plan.stages] == [s.nodes for s in pipe.plan.stages]
    with torch.no_grad():
        assert torch.equal(again(x), pipe(x))


def test_plan_for_another_model_is_refused(resnet_pipe, tmp_path):
    _, _, pipe = resnet_pipe
    with pytest.raises(fxpipe.PlanMismatchError, match="made for another model"):
        fxpipe.compile(torchvision.models.resnet34(), ["cpu", "cpu"], plan=pipe.plan)


def test_plan_for_other_devices_or_chunks_is_refused(resnet_pipe):
    model, _, pipe = resnet_pipe
    with pytest.raises(fxpipe.PlanMismatchError, match="made for devices"):
        fxpipe.compile(model, ["cpu", "cpu", "cpu"], plan=pipe.plan)
    with pytest.raises(fxpipe.PlanMismatchError, match="chunks=3"):
        fxpipe.compile(model, ["cpu", "cpu"], plan=pipe.plan, chunks=2)


def test_same_architecture_other_weights_shares_the_fingerprint(resnet_pipe):
    _, _, pipe = resnet_pipe
    other = torchvision.models.resnet18().eval()
    assert fxpipe.compile(other, ["cpu", "cpu"], plan=pipe.plan).plan is pipe.plan


def test_loading_is_json_only(tmp_path):
    evil = tmp_path / "evil.plan.json"
    evil.write_bytes(pickle.dumps({"format": PLAN_FORMAT}))
    with pytest.raises(fxpipe.PlanFormatError, match="is not JSON"):
        fxpipe.load_plan(evil)


@pytest.mark.parametrize("doc,message", [
    ({"format": "fxpipe-plan/0"}, "this fxpipe reads 'fxpipe-plan/4'"),
    ({"format": PLAN_FORMAT, "fingerprint": "x"}, "'model' is a required property"),
    ([], "must be a JSON object"),
])
def test_malformed_plans_are_named(tmp_path, doc, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(fxpipe.PlanFormatError, match=message):
        fxpipe.load_plan(path)
