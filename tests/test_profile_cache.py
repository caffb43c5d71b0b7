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


def test_compiled_stages_are_another_key(tmp_path, monkeypatch):
    """Costs recorded for eager stages are not read for compiled ones, nor across compile options; the same
    options (a backend given as a function included) read the same entry again."""
    x = torch.randn(8, 8)
    gm = fxpipe.trace(_model())
    fp = fxpipe.frontend.fingerprint.graph_fingerprint(gm)
    eager = profile_key(fp, torch.device("cpu"), (x[:4],), "estimate", 1, 1)
    inductor = profile_key(fp, torch.device("cpu"), (x[:4],), "estimate", 1, 1, compiled={})
    reduced = profile_key(fp, torch.device("cpu"), (x[:4],), "estimate", 1, 1, compiled={"mode": "reduce-overhead"})

    def my_backend(gm, example_inputs):
        return gm
    custom = profile_key(fp, torch.device("cpu"), (x[:4],), "estimate", 1, 1, compiled={"backend": my_backend})
    assert eager["compiled"] is None and inductor["compiled"] == {}
    assert len({json.dumps(k, sort_keys=True) for k in (eager, inductor, reduced, custom)}) == 4
    assert custom == profile_key(fp, torch.device("cpu"), (x[:4],), "estimate", 1, 1, compiled={"backend": my_backend})
    assert "my_backend" in custom["compiled"]["backend"] and "0x" not in custom["compiled"]["backend"]
    cache = ProfileCache(tmp_path)
    cache.store(eager, fxpipe.cost.profile.profile_graph(gm, (x[:4],), torch.device("cpu"), mode="estimate"))
    assert cache.load(eager, gm) is not None
    assert cache.load(inductor, gm) is None and cache.load(reduced, gm) is None
    # through compile: the eager entry above is read by an eager compile and missed by compiled stages, which
    # profile and store their own, read by the next compile with the same options
    options = fxpipe.ProfileOptions(mode="estimate", cache=str(tmp_path), stage_timing=False)
    first = fxpipe.compile(_model(), ["cpu", "cpu"], (x,), chunks=2, profile=options)
    compiled = fxpipe.compile(_model(), ["cpu", "cpu"], (x,), chunks=2, profile=options,
                              options=fxpipe.CompileOptions(compile_stages={"backend": "eager"}))
    again = fxpipe.compile(_model(), ["cpu", "cpu"], (x,), chunks=2, profile=options,
                           options=fxpipe.CompileOptions(compile_stages={"backend": "eager"}))
    assert first.plan.profile["from_cache"] is True and compiled.plan.profile["from_cache"] is False
    assert again.plan.profile["from_cache"] is True


def test_the_timing_is_part_of_a_measured_key(tmp_path):
    """Node costs timed alone are never read for whole-graph timing (the CUDA default), nor the other way;
    the CPU default is node timing, and the modes that time nothing have no timing in their key."""
    x = torch.randn(8, 8)
    gm = fxpipe.trace(_model())
    fp = fxpipe.frontend.fingerprint.graph_fingerprint(gm)
    cpu = torch.device("cpu")
    node = profile_key(fp, cpu, (x[:4],), "measure", 1, 1, timing="node")
    graph = profile_key(fp, cpu, (x[:4],), "measure", 1, 1, timing="graph")
    assert node["timing"] == "node" and graph["timing"] == "graph" and node != graph
    assert profile_key(fp, cpu, (x[:4],), "measure", 1, 1) == node                  # the CPU default
    assert profile_key(fp, cpu, (x[:4],), "estimate", 1, 1, timing="graph")["timing"] is None
    cache = ProfileCache(tmp_path)
    assert cache.path(node) != cache.path(graph)
    cache.store(node, fxpipe.cost.profile.profile_graph(gm, (x[:4],), cpu, warmup=0, repeats=1))
    assert cache.load(node, gm) is not None and cache.load(graph, gm) is None
    # through compile: a graph-timed compile misses the node-timed entry, profiles, and stores its own
    options = fxpipe.ProfileOptions(mode="measure", cache=str(tmp_path), stage_timing=False)
    first = fxpipe.compile(_model(), ["cpu", "cpu"], (x,), chunks=2, profile=options)
    timed = fxpipe.compile(_model(), ["cpu", "cpu"], (x,), chunks=2,
                           profile=fxpipe.ProfileOptions(mode="measure", cache=str(tmp_path), stage_timing=False,
                                                         timing="graph"))
    assert first.plan.profile["from_cache"] is True and timed.plan.profile["from_cache"] is False
    assert cache.load(graph, gm) is not None
