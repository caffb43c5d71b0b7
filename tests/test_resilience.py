"""A rank that dies loses nothing: a process SIGKILLed in the middle of a step makes the other ranks end with an
error naming it, within the wait deadline; under ``torchrun --max-restarts 1`` the group restarts and
``fxpipe.launch --checkpoint DIR --resume`` continues from the last complete checkpoint, to the parameters and
optimizer state of a run nobody killed. A checkpoint a kill interrupts (while its ranks write it, or between
its rename and the ``latest`` pointer) is never the one resumed from (:mod:`fxpipe.distributed.snapshots`)."""

from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from distributed_run import _entry, rank_context
from forced_cuts import compile_with_cuts
from launch_target import batches, make_model
from test_launch import _env, _losses

ROOT = Path(__file__).resolve().parent.parent
CUTS = {2: ["blocks_3_0"], 4: ["blocks_1_0", "blocks_3_0", "blocks_5_0"]}


def _plan(tmp_path: Path, world: int) -> str:
    plan = copy.deepcopy(compile_with_cuts(make_model(), (batches()[0][0],), CUTS[world], chunks=3).plan)
    plan.save(tmp_path / "p.json")
    return str(tmp_path / "p.json")


def _launch(world: int, args: list[str], kill: dict[str, str] | None = None) -> tuple[str, str, int, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "--max-restarts", "1", "-m", "fxpipe.launch", *args]
    started = time.monotonic()
    proc = subprocess.run(cmd, env={**_env(), **(kill or {})}, cwd=ROOT, capture_output=True, text=True, timeout=400)
    return proc.stdout, proc.stderr, proc.returncode, time.monotonic() - started


def _final(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    latest = __import__("json").loads((ckpt / "latest").read_text())
    assert latest["step"] == 6, latest
    dcp_to_torch_save(str(ckpt / latest["path"]), str(out))
    return torch.load(out, weights_only=False)


@pytest.mark.slow   # measured 38-87 s (2 processes), 63-172 s (4) on the shared 2-core machine: 3 torchrun groups
@pytest.mark.parametrize("world, victim", [(2, 1), (4, 2)])
def test_a_rank_killed_mid_step_is_named_and_torchrun_resumes_to_an_uninterrupted_runs_parameters(tmp_path, world,
                                                                                                 victim):
    plan = _plan(tmp_path, world)
    common = ["--plan", plan, "--model", "dying_target:make_model", "--data", "dying_target:batches", "--lr", "0.1",
              "--optimizer", "adam", "--total-steps", "6", "--checkpoint-every", "2", "--resume", "--timeout", "30"]
    out, err, rc, _ = _launch(world, [*common, "--checkpoint", str(tmp_path / "whole")])
    assert rc == 0, err[-3000:]
    want = _losses(out)
    assert len(want) == 6 and "no complete checkpoint" in out, out
    kill = {"FXPIPE_TEST_KILL_RANK": str(victim), "FXPIPE_TEST_KILL_STEP": "3"}
    out, err, rc, wall = _launch(world, [*common, "--checkpoint", str(tmp_path / "killed")], kill)
    assert rc == 0, err[-3000:]
    # the first attempt: steps 0-2 trained, rank `victim` killed in step 3; every survivor names it (torchrun's
    # SIGTERM, within its 0.1 s monitor interval, gives each up to 5 s to say why: fxpipe.launch)
    named = re.findall(rf"^error: rank (\d+): StageError: PeerFailed: rank {victim} is gone: its connection closed",
                       err, re.M)
    assert sorted(map(int, named)) == [r for r in range(world) if r != victim], err[-3000:]
    assert re.search(r"exitcode\s*: -9", err), err[-3000:]   # torchrun saw the SIGKILL
    # the second attempt resumed from step 2's checkpoint (step 4's was never written) and trained 2..5
    assert re.search(rf"^resumed from {re.escape(str(tmp_path / 'killed'))}/step-00000002 after step 2$", out, re.M), out
    steps = [int(s) for s in re.findall(r"^step (\d+):", out, re.M)]
    assert steps == [0, 1, 2, 2, 3, 4, 5], steps
    assert _losses(out)[3:] == want[2:], (_losses(out), want)
    whole, killed = _final(tmp_path / "whole", tmp_path / "a.pt"), _final(tmp_path / "killed", tmp_path / "b.pt")
    assert sorted(whole) == sorted(killed) and any(k.startswith("optim.") for k in whole), sorted(whole)
    for key in whole:
        assert torch.equal(whole[key], killed[key]), key
    print(f"world {world}: the killed run took {wall:.1f} s")


def _train_until_killed(rank: int, world: int, plan_json: str, victim: int, out: str) -> dict:
    """Train 3 steps; ``victim`` SIGKILLs itself at its second linear call of step 1 (the time written first)."""
    import fxpipe
    from fxpipe.distributed import PipelineRank
    from fxpipe.launch import LOSSES
    step = [0]
    stage = PipelineRank(fxpipe.Plan.from_dict(__import__("json").loads(plan_json)), make_model,
                         LOSSES["cross_entropy"], timeout_s=20)
    if rank == victim:
        seen = [0]

        def die(module: torch.nn.Module, args: tuple) -> None:
            seen[0] += step[0] == 1
            if seen[0] == 2:
                Path(out, "killed_at").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        for spec in (stage.specs[k] for k in stage.own):
            for sub in spec.module.modules():
                if isinstance(sub, torch.nn.Linear):
                    sub.register_forward_pre_hook(die)
    try:
        for step[0], (x, y) in enumerate(batches()[:3]):
            stage.step(x, y)
    except Exception as exc:   # noqa: BLE001 - the error is what the test checks
        return {"text": f"{type(exc).__name__}: {exc}", "at": time.time()}
    return {"text": None, "at": time.time()}


@pytest.mark.slow   # measured 15-25 s (2 processes), 25-47 s (4)
@pytest.mark.parametrize("world, victim", [(2, 0), (4, 1)])
def test_every_survivor_names_the_killed_rank_well_within_the_deadline(tmp_path, world, victim):
    plan = copy.deepcopy(compile_with_cuts(make_model(), (batches()[0][0],), CUTS[world], chunks=3).plan)
    with tempfile.TemporaryDirectory(prefix="fxpipe-dies-") as out:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_entry, args=(r, world, out, rank_context(), _train_until_killed,
                                                  (plan.to_json(), victim, out))) for r in range(world)]
        for p in procs:
            p.start()
        end = time.monotonic() + 200
        for p in procs:
            p.join(max(0.1, end - time.monotonic()))
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in alive:
            procs[r].kill()
        assert not alive, f"ranks {alive} still ran after 200 s: a hang"
        assert procs[victim].exitcode == -signal.SIGKILL
        killed_at = float(Path(out, "killed_at").read_text())
        for r in (r for r in range(world) if r != victim):
            got = torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False)
            assert "ok" in got, got
            text, after = got["ok"]["text"], got["ok"]["at"] - killed_at
            assert text is not None and f"PeerFailed: rank {victim} is gone: its connection closed" in text, (r, text)
            assert after < 20, f"rank {r} heard of rank {victim}'s death after {after:.1f} s (deadline 20 s)"
            print(f"world {world}: rank {r} named rank {victim} {after:.3f} s after the kill")


_SNAPSHOT = textwrap.dedent('''
    import os, signal, sys, torch
    import torch.distributed.checkpoint as dcp
    from fxpipe.distributed import snapshots
    root, where = sys.argv[1], sys.argv[2]
    def write(step):
        def go(path):
            dcp.save({"w": torch.full((4,), float(step))}, checkpoint_id=path)
            if where == "write" and step == 4:   # the ranks' files are on disk, the checkpoint is not published
                os.kill(os.getpid(), signal.SIGKILL)
        return go
    if where == "pointer":   # renamed, but killed before `latest` names it
        real = os.replace
        os.replace = lambda a, b: os.kill(os.getpid(), signal.SIGKILL) if b.endswith("latest") and "4" in open(a).read() else real(a, b)
    for step in (2, 4):
        snapshots.publish(root, step, write(step), {"note": step})
''')


@pytest.mark.parametrize("where", ["write", "pointer"])
def test_a_checkpoint_a_kill_interrupts_is_never_the_one_resumed_from(tmp_path, where):
    import torch.distributed.checkpoint as dcp
    from fxpipe.distributed import snapshots
    root = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-c", _SNAPSHOT, str(root), where], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    path, meta = snapshots.latest(str(root))
    assert meta == {"step": 2, "note": 2} and path.endswith("step-00000002")
    state = {"w": torch.empty(4)}
    dcp.load(state, checkpoint_id=path)
    assert torch.equal(state["w"], torch.full((4,), 2.0))
    left = sorted(os.listdir(root))
    assert left == sorted(["latest", "step-00000002", *([".partial-step-00000004"] if where == "write" else
                                                        [".latest.tmp", "step-00000004"])]), left
    # the next publish of step 4 (the restarted run reaching it again) cleans up and becomes the latest
    snapshots.publish(str(root), 4, lambda p: dcp.save({"w": torch.full((4,), 4.0)}, checkpoint_id=p))
    path, meta = snapshots.latest(str(root))
    assert meta == {"step": 4} and path.endswith("step-00000004")
    assert sorted(os.listdir(root)) == ["latest", "step-00000002", "step-00000004"]
    dcp.load(state, checkpoint_id=path)
    assert torch.equal(state["w"], torch.full((4,), 4.0))
