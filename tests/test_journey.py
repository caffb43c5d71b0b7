"""The LLM journey end to end, as a user runs it: plan a small Hugging Face model, write the plan, train it with
``torchrun --nproc-per-node N -m fxpipe.launch`` on gloo CPU ranks with padded labels and the model's own loss,
checkpoint, resume; the losses and every parameter equal one process training the whole batches."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxpipe

transformers = pytest.importorskip("transformers")
from hf_models import build  # noqa: E402
from journey_target import STEPS, batches  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
LR = 0.1


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{TESTS}", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    for key in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "FXPIPE_NODE"):
        env.pop(key, None)
    return env


def _launch(world: int, args: list[str], module: str = "fxpipe.launch", timeout_s: float = 600) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "-m", module, *args]
    done = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def _losses(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"^step \d+: loss ([0-9.]+)$", out, re.M)]


def _reference(family: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build(family)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in batches(family):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _checkpointed_parameters(path: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from fxpipe.distributed import snapshots
    path = Path(snapshots.latest(str(path))[0])   # the last checkpoint fxpipe.launch published
    dcp_to_torch_save(str(path), str(path) + ".pt")
    return {k.removeprefix("model."): v for k, v in torch.load(str(path) + ".pt").items() if k.startswith("model.")}


def _plan(family: str, world: int, schedule: str, path: Path) -> None:
    first = batches(family)[0]
    plan = fxpipe.compile(copy.deepcopy(build(family)), ["cpu"] * world, (first["input_ids"],),
                          example_kwargs={"labels": first["labels"]}, chunks=4, schedule=schedule, stages=world,
                          profile=fxpipe.ProfileOptions(mode="estimate")).plan
    plan.save(path)


def _check(family: str, first: str, second: str, checkpoint: Path) -> None:
    """Losses printed by the two runs and the parameters checkpointed at the end equal one process's."""
    want, params = _reference(family)
    assert _losses(first) + _losses(second) == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert re.findall(r"^step (\d+):", second, re.M) == [str(i) for i in range(3, STEPS)]
    found = _checkpointed_parameters(checkpoint)
    assert set(params) <= set(found), sorted(set(params) - set(found))
    for n, p in params.items():
        torch.testing.assert_close(found[n], p, rtol=1e-5, atol=1e-5, msg=n)


JOURNEY_FAMILIES = ("llama", "llama-tied", "gpt2", "qwen2", "bert-mlm", "t5")
JOURNEY_SCHEDULES = ("gpipe", "1f1b", "zb-h1")


def _journeys(world: int) -> list[tuple[str, str]]:
    """Each family on 2 ranks under two schedules and on 4 ranks under the third, the schedules in turn (every
    schedule on each rank count; 12 of the 18 pairs on 2 ranks, and each family under every schedule over both),
    unless ``FXPIPE_FULL_JOURNEYS=1`` asks for all 18 on each (about 15 min on this 2-core machine)."""
    every = [(f, s) for f in JOURNEY_FAMILIES for s in JOURNEY_SCHEDULES]
    if os.environ.get("FXPIPE_FULL_JOURNEYS") == "1":
        return every
    on_4 = {(f, JOURNEY_SCHEDULES[i % len(JOURNEY_SCHEDULES)]) for i, f in enumerate(JOURNEY_FAMILIES)}
    return [pair for pair in every if (pair in on_4) == (world == 4)]


@pytest.mark.slow   # 6 plans, then one torchrun of `world` processes running the journeys (two launches each)
@pytest.mark.parametrize("world", [2, 4])
def test_every_family_and_schedule_trains_as_one_process(tmp_path, world):
    """Model families × schedules on ``world`` ranks (:func:`_journeys`): plan, train 3 steps with a checkpoint,
    resume for the rest (the last batch smaller), through :func:`fxpipe.launch.main` with the command's own
    arguments (``tests/journey_matrix.py`` runs them all in one torchrun; the README's console block runs the
    same two commands as typed). One plan per family (1F1B's cuts), run under each schedule with ``--schedule``."""
    cases = []
    journeys = _journeys(world)
    for family in JOURNEY_FAMILIES:
        _plan(family, world, "1f1b", tmp_path / f"{family}.json")
        for schedule in [s for f, s in journeys if f == family]:
            here = tmp_path / f"{family}-{schedule}"
            cases.append({"family": family, "schedule": schedule, "plan": str(tmp_path / f"{family}.json"),
                          "lr": LR, "checkpoint": str(here / "ckpt"), "out": str(here / "out")})
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    _launch(world, [str(tmp_path / "cases.json")], module="journey_matrix", timeout_s=1500)
    for case in cases:
        out = "".join(p.read_text() for p in sorted(Path(case["out"]).glob("rank*.txt")))
        first, _, second = out.partition("step 3:")   # the resumed run's first line starts its part
        try:
            _check(case["family"], first, "step 3:" + second, Path(case["checkpoint"]))
        except AssertionError as exc:
            raise AssertionError(f"{case['family']} / {case['schedule']} on {world} ranks: {exc}") from exc
