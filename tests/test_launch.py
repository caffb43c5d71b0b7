"""``python -m fxpipe.launch`` under real ``torchrun`` commands (gloo on 127.0.0.1): a plan whose stage 0 is on
the second device (or the second node) runs each stage where the plan says, from weights loaded per rank,
with the one-process model's losses; resuming from its checkpoint continues them; bad arguments end every
process with one ``error:`` line and a non-zero exit; ``--help`` shows a real example."""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fxpipe.planning.plan import load_plan
from solvers.layout import Layout

from forced_cuts import compile_with_cuts
from launch_target import batches, make_model

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{TESTS}", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    for key in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "FXPIPE_NODE"):
        env.pop(key, None)
    return env


def _torchrun(args: list[str], torchrun: list[str] | None = None, wait: bool = True, module: str = "fxpipe.launch"):
    cmd = [sys.executable, "-m", "torch.distributed.run", *(torchrun or ["--standalone", "--nproc-per-node", "2"]),
           "-m", module, *args]
    proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc.communicate(timeout=240) + (proc.returncode,) if wait else proc


def _losses(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"^step \d+: loss ([0-9.]+)$", out, re.M)]


def _trained(steps: int, losses: list[float] | None = None) -> torch.nn.Module:
    """The model after ``steps`` SGD steps of one process on the whole batches (their losses into ``losses``)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches()[:steps]:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if losses is not None:
            losses.append(loss.item())
    return model


def _reference(steps: int) -> list[float]:
    losses: list[float] = []
    _trained(steps, losses)
    return losses


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= 2e-6 + 1e-5 * abs(b) for a, b in zip(got, want))


def _swapped_plan(tmp_path: Path, nodes: tuple[int, int] = (0, 0)) -> tuple[str, str]:
    """A two-stage plan whose stage 0 is on device 1 (and stage 1 on device 0), on ``nodes``; and the weights."""
    x = batches()[0][0]
    plan = copy.deepcopy(compile_with_cuts(make_model(), (x,), ["blocks_3_0"], chunks=3).plan)
    plan.stages[0].device_index, plan.stages[1].device_index = 1, 0
    plan.stages[0].node, plan.stages[1].node = nodes
    plan.save(tmp_path / "p.json")
    torch.save(make_model().state_dict(), tmp_path / "w.pt")
    return str(tmp_path / "p.json"), str(tmp_path / "w.pt")


def _final_parameters(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The parameters of the last checkpoint published in ``checkpoint``, whole (``DTensor`` shards joined)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from fxpipe.distributed import snapshots
    path, _ = snapshots.latest(str(checkpoint))
    dcp_to_torch_save(path, checkpoint / "whole.pt")
    whole = torch.load(checkpoint / "whole.pt")   # fxpipe.distributed.checkpoint's keys: model.NAME, optim.NAME.KEY
    return {k.removeprefix("model."): v for k, v in whole.items() if k.startswith("model.")}


@pytest.mark.slow   # ~30 s on the shared machine: a torchrun run of two processes, then one of four
def test_launch_places_stages_by_the_plan_loads_weights_and_resumes_as_one_process(tmp_path):
    """Three steps on 2 processes (pipeline alone), then two more resumed on 4, the plan carrying a mesh of
    pp=2 x dp=2 (FSDP2, as fxpipe.plan(..., mesh=...) records one): the pipeline's checkpoint loads into the
    sharded stages, each replica trains half of every batch (7 samples: shares of 4 and 3), and the losses and the
    final checkpoint's parameters are the one process's."""
    plan, weights = _swapped_plan(tmp_path)
    common = ["--plan", plan, "--model", "launch_target:other_init", "--data", "launch_target:batches",
              "--lr", "0.1", "--checkpoint", str(tmp_path / "ckpt")]
    out, err, rc = _torchrun([*common, "--weights", weights, "--steps", "3"])
    assert rc == 0, err[-3000:]
    # the plan put stage 0 on the second device: LOCAL_RANK 1 runs it, not rank 0
    assert re.search(r"^rank 1 \(node 0, local 1\): stages \[0\] on cpu", out, re.M), out
    assert re.search(r"^rank 0 \(node 0, local 0\): stages \[1\] on cpu", out, re.M), out
    want = _reference(5)
    assert _close(_losses(out), want[:3]), (_losses(out), want)
    meshed = load_plan(plan)
    meshed.layout = Layout.of(2, 2, 1, "shard")   # as fxpipe.plan(mesh=...) records one
    meshed.save(plan)
    out, err, rc = _torchrun([*common, "--resume", "--steps", "2"],   # other_init's weights until loaded
                             ["--standalone", "--nproc-per-node", "4"])
    assert rc == 0, err[-3000:]
    # pp=2 x dp_shard=2: ranks 0, 1 are stage 1's pp position (the plan's device 0), 2, 3 stage 0's; each holds
    # its half of the stage's parameters
    assert re.search(r"^rank 3 \(node 0, local 3 of mesh pp 1, dp_shard 1\): stages \[0\] on cpu", out, re.M), out
    assert re.search(r"^rank 0 \(node 0, local 0 of mesh pp 0, dp_shard 0\): stages \[1\] on cpu", out, re.M), out
    assert _close(_losses(out), want[3:]), (_losses(out), want)   # printed once, by dp rank 0 of the last stage
    assert re.findall(r"^step (\d+):", out, re.M) == ["3", "4"]
    got, model = _final_parameters(tmp_path / "ckpt"), _trained(5)
    assert set(dict(model.named_parameters())) <= set(got), sorted(got)
    for name, p in model.named_parameters():
        assert torch.allclose(got[name], p, rtol=1e-5, atol=1e-6), (name, (got[name] - p).abs().max())


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow   # ~45 s: two torchrun commands joined by a c10d rendezvous
def test_two_node_run_puts_each_stage_on_the_node_the_plan_says(tmp_path):
    plan, weights = _swapped_plan(tmp_path, nodes=(1, 0))   # stage 0 on node 1, stage 1 on node 0
    rdzv = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{_port()}", "--rdzv-id", "fxpipe-test"]
    args = ["--plan", plan, "--model", "launch_target:other_init", "--data", "launch_target:batches",
            "--lr", "0.1", "--weights", weights, "--steps", "3"]
    procs = [_torchrun([*args, "--plan-node", str(node)], rdzv, wait=False) for node in (0, 1)]
    (out0, err0), (out1, err1) = [p.communicate(timeout=240) for p in procs]
    assert procs[0].returncode == 0 and procs[1].returncode == 0, (err0[-2000:], err1[-2000:])
    assert re.search(r"^rank \d \(node 0, local 0\): stages \[1\]", out0, re.M), out0
    assert re.search(r"^rank \d \(node 1, local 0\): stages \[0\]", out1, re.M), out1
    assert _close(_losses(out0), _reference(3)) and not _losses(out1), (out0, out1)


@pytest.mark.slow   # ~35 s: two torchrun runs of two processes
def test_bad_arguments_end_every_process_with_one_error_line(tmp_path):
    """A model that does not import ends each process of a real ``-m fxpipe.launch`` torchrun with one error
    line and a non-zero exit; then three more bad launches (a plan of three stages on two processes, an unknown
    compression, a tp the default tensor-parallel plan refuses), each ``fxpipe.launch.main`` with the command's
    own arguments, in one torchrun (``tests/journey_matrix.py``: the processes start once)."""
    plan, _ = _swapped_plan(tmp_path)
    out, err, rc = _torchrun(["--plan", plan, "--model", "nosuch.models:make", "--data", "launch_target:batches"])
    assert rc != 0
    assert re.search(r"^error: rank [01]: --model nosuch.models:make: cannot import 'nosuch.models'", err, re.M), err
    three = copy.deepcopy(compile_with_cuts(make_model(), (batches()[0][0],), ["blocks_2_0", "blocks_4_0"]).plan)
    three.save(tmp_path / "three.json")
    # a tp the default tensor-parallel plan refuses (3 heads over 2): the launch's own fix (--mesh), not tp_plan=
    config = ("num_hidden_layers=2,hidden_size=48,intermediate_size=64,num_attention_heads=3,num_key_value_heads=3,"
              "vocab_size=64,max_position_embeddings=32")
    from fxpipe.__main__ import main as cli
    assert cli(["plan", "hf:llama", "--config", config, "--seq-len", "8", "--batch", "4", "--devices", "h100x1",
                "-q", "-o", str(tmp_path / "one.json")]) == 0
    target = ["--model", "launch_target:make_model", "--data", "launch_target:batches"]
    bad = {"three": ["--plan", str(tmp_path / "three.json"), *target],
           "zstd": ["--plan", plan, *target, "--compression", "zstd"],
           "heads": ["--plan", str(tmp_path / "one.json"), "--model", "hf:llama", "--config", config, "--data", "mock",
                     "--mesh", "tp=2"]}
    cases = [{"name": name, "plan": argv[1], "argv": argv, "out": str(tmp_path / name), "fails": True}
             for name, argv in bad.items()]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out, err, rc = _torchrun([str(tmp_path / "cases.json")], module="journey_matrix")
    assert rc == 0, err[-3000:]
    errors = {name: [(tmp_path / name / f"rank{r}.txt").read_text() for r in (0, 1)] for name in bad}
    for r in (0, 1):   # each process's own line, naming it
        assert re.search(rf"^error: rank {r}: PlanMismatchError: the plan runs 3 stages on 3 workers but the process "
                         r"group has 2 processes: start one process per worker \(torchrun --nproc-per-node 3",
                         errors["three"][r], re.M), errors["three"][r]
        assert re.search(rf"^error: rank {r}: ValueError: unknown compression 'zstd': use one of 'fp16'",
                         errors["zstd"][r], re.M), errors["zstd"][r]
        assert re.search(rf"^error: rank {r}: model.layers.0.self_attn has 3 attention heads, which tp=2 does not "
                         r"divide; fxpipe.launch runs the default tensor-parallel plan: give --mesh a tp that it "
                         r"divides \(PipelineRank\(tp_plan=...\) takes a plan of your own\)$",
                         errors["heads"][r], re.M), errors["heads"][r]


def test_help_shows_a_real_example():
    out = subprocess.run([sys.executable, "-m", "fxpipe.launch", "--help"], env=_env(), cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0
    assert "torchrun --standalone --nproc-per-node 2 -m fxpipe.launch --plan" in out.stdout
    assert "--weights" in out.stdout and "--resume" in out.stdout and "--plan-node" in out.stdout
    assert "--mesh dp_shard=2,tp=2" in out.stdout and "--nproc-per-node 8" in out.stdout


def test_a_mesh_the_world_does_not_fit_ends_the_process_before_anything_is_built(tmp_path, monkeypatch, capsys):
    """One process (gloo on 127.0.0.1) given --mesh, or a plan carrying a mesh, of 4 processes: one error line
    naming the processes to start; --mesh dp=1 runs the pipeline alone (refused here for its 2 workers)."""
    from fxpipe import launch
    plan, _ = _swapped_plan(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    monkeypatch.syspath_prepend(str(TESTS))
    args = ["--plan", plan, "--model", "launch_target:make_model", "--data", "launch_target:batches"]

    def run(*extra: str) -> str:
        monkeypatch.setenv("MASTER_PORT", str(_port()))
        for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
            monkeypatch.setenv(key, value)
        assert launch.main([*args, *extra]) != 0
        return capsys.readouterr().err
    assert re.search(r"^error: rank 0: --mesh dp_shard=2 is pp=2 x dp_shard=2 \(shard, 4 processes\) but torchrun "
                     r"started 1: start 4 \(torchrun --nproc-per-node 4\)", run("--mesh", "dp_shard=2"), re.M)
    assert "error: rank 0: mesh 'cp=2': unknown key(s) ['cp']" in run("--mesh", "cp=2")
    meshed = load_plan(plan)
    meshed.layout = Layout.of(2, 2, 1, "shard")
    meshed.save(plan)
    # the plan's whole layout is named: degrees, schedule, recomputation
    assert re.search(r"^error: rank 0: the plan's layout \(pp=2 dp=2\(fsdp\) tp=1 zb-h1 recompute except_last; --mesh "
                     r"overrides it\) is pp=2 x dp_shard=2 \(shard, 4 processes\) but torchrun started 1", run(), re.M)
    assert "PlanMismatchError: the plan runs 2 stages on 2 workers but the process group has 1" in run("--mesh", "dp=1")


def test_an_error_line_is_written_whole_so_two_ranks_lines_never_run_together(monkeypatch):
    """Every rank shares torchrun's unbuffered stderr: a line written as text then newline (``print``) ran into
    another rank's line in CI ('... GLHF!error: rank 3: ...'), hiding rank 3's error from a reader."""
    from fxpipe import launch
    writes: list[str] = []
    monkeypatch.setattr(sys, "stderr", type("Recorder", (), {"write": lambda self, s: writes.append(s),
                                                             "flush": lambda self: None})())
    monkeypatch.delenv("RANK", raising=False)
    assert launch.main(["--plan", "p.json", "--model", "m:f", "--data", "m:b"]) == 2
    assert writes == ["error: rank 0: fxpipe.launch runs under torchrun: torchrun --nproc-per-node N -m fxpipe.launch "
                      "...\n"], writes


@pytest.mark.parametrize("given", [None, "3"])
def test_main_called_as_a_function_leaves_the_node_variable_as_it_found_it(monkeypatch, given):
    """``fxpipe.launch.main`` sets ``FXPIPE_NODE`` for the placement; called in a test process it kept it, and a
    later two-node torchrun started from that process put both nodes on node 0 (the two-node console block of
    docs/meshes.md, in CI)."""
    from fxpipe import launch
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "stderr", type("Quiet", (), {"write": lambda self, s: None, "flush": lambda self: None})())
    if given is None:
        monkeypatch.delenv("FXPIPE_NODE", raising=False)
    else:
        monkeypatch.setenv("FXPIPE_NODE", given)
    assert launch.main(["--plan", "p.json", "--model", "m:f", "--data", "m:b", "--plan-node", "1"]) == 2
    assert os.environ.get("FXPIPE_NODE") == given
