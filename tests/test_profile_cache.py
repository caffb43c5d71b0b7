"""The profile cache: a second compile reuses costs; any mismatch re-profiles, never a stale cost."""

import json
import sys

import torch
from torch import nn

import fxpipe
from fxpipe.cost import profile_cache
from fxpipe.cost.profile_cache import ProfileCache, profile_key


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def test_second_compile_reads_the_cache_and_plans_the_same(tmp_path, monkeypatch):
    x = torch.randn(8, 8)
    # node costs are what is cached; stage timing (effort="thorough") scales them afresh on every compile
    first = fxpipe.compile(_model(), ["cpu", "cpu"], (x,), chunks=2,
                           profile=fxpipe.ProfileOptions(mode="measure", cache=str(tmp_path), stage_timing=False))
    assert first.plan.profile["from_cache"] is False and len(list(tmp_path.glob("*.json"))) == 1
    calls = []
    compile_module = sys.modules["fxpipe.cost.node_costs"]   # where compile reads the cache or profiles
    monkeypatch.setattr(compile_module, "profile_graph", lambda *a, **k: calls.append(1))
    second = fxpipe.compile(_model(), ["cpu", "cpu"], (x,), chunks=2,
                            profile=fxpipe.ProfileOptions(mode="measure", cache=str(tmp_path), stage_timing=False))
    assert calls == [] and second.plan.profile["from_cache"] is True
    assert second.plan.stage_of() == first.plan.stage_of()
    assert second.plan.problem == first.plan.problem                       # identical costs
    staged = fxpipe.compile(_model(), ["cpu", "cpu"], (x,), chunks=2,
                            profile=fxpipe.ProfileOptions(mode="measure", cache=str(tmp_path), stage_timing=True))
    assert calls == [] and staged.plan.profile["from_cache"] is True and "stage_profile" in staged.plan.profile
    assert first.plan.profile["threads"] == torch.get_num_threads()


def test_anything_different_is_a_miss_and_a_broken_file_is_reprofiled(tmp_path):
    x = torch.randn(8, 8)
    fxpipe.compile(_model(), ["cpu", "cpu"], (x,), chunks=2,
                   profile=fxpipe.ProfileOptions(mode="estimate", cache=str(tmp_path)))
    gm = fxpipe.trace(_model())
    fp = fxpipe.frontend.fingerprint.graph_fingerprint(gm)
    cache = ProfileCache(tmp_path)
    key = profile_key(fp, torch.device("cpu"), (x[:4],), "estimate", 1, 1)
    assert cache.load(key, gm) is not None
    # (1, 1: the default effort's warm-up and repeats) another micro-batch shape, mode, thread count, version: other keys
    for other in (profile_key(fp, torch.device("cpu"), (x[:2],), "estimate", 1, 1),
                  profile_key(fp, torch.device("cpu"), (x[:4],), "measure", 1, 1),
                  {**key, "threads": key["threads"] + 1}, {**key, "fxpipe": "0.0.0"}):
        assert cache.load(other, gm) is None
    # an entry whose stored key differs (a hash collision or an edited file) is not trusted
    path = cache.path(key)
    doc = json.loads(path.read_text())
    doc["key"]["torch"] = "1.0"
    path.write_text(json.dumps(doc))
    assert cache.load(key, gm) is None
    # an entry for another graph with the same key is not trusted either
    doc["key"] = key
    doc["costs"].pop(next(iter(doc["costs"])))
    path.write_text(json.dumps(doc))
    assert cache.load(key, gm) is None
    path.write_text("{ not json")
    assert cache.load(key, gm) is None
    pipe = fxpipe.compile(_model(), ["cpu", "cpu"], (x,), chunks=2,
                          profile=fxpipe.ProfileOptions(mode="estimate", cache=str(tmp_path)))
    assert pipe.plan.profile["from_cache"] is False and cache.load(key, gm) is not None   # rewritten


def test_cache_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    assert profile_cache.default_cache_dir() == tmp_path
    fxpipe.compile(_model(), ["cpu"], (torch.randn(4, 8),), chunks=2,
                   profile=fxpipe.ProfileOptions(mode="estimate", cache=False))
    assert list(tmp_path.glob("*.json")) == []
