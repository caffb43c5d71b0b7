"""The LLM journey end to end, as a user runs it: plan a small Hugging Face model, write the plan, train it with
``torchrun --nproc-per-node N -m fxpipe.launch`` on gloo CPU ranks with padded labels and the model's own loss,
checkpoint, resume; the losses and every parameter equal one process training the whole batches."""

from __future__ import annotations

import copy
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


def _launch(world: int, args: list[str]) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "-m", "fxpipe.launch", *args]
    done = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
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


@pytest.mark.slow   # two torchrun runs of `world` processes each: ~1-2 min on the shared machine
@pytest.mark.parametrize("family,world,schedule", [
    ("llama", 2, "1f1b"), ("llama-tied", 4, "gpipe"), ("gpt2", 4, "zb-h1"), ("qwen2", 2, "zb-h1"),
    ("bert-mlm", 2, "gpipe"), ("t5", 2, "1f1b")])
def test_the_journey_trains_as_one_process(tmp_path, family, world, schedule):
    plan = tmp_path / "plan.json"
    _plan(family, world, schedule, plan)
    name = family.replace("-", "_")
    common = ["--plan", str(plan), "--model", f"journey_target:{name}", "--data", f"journey_target:data_{name}",
              "--lr", str(LR), "--checkpoint", str(tmp_path / "ckpt")]
    first = _launch(world, [*common, "--steps", "3"])
    second = _launch(world, [*common, "--resume", "--steps", str(STEPS - 3)])
    want, params = _reference(family)
    assert _losses(first) + _losses(second) == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert re.findall(r"^step (\d+):", second, re.M) == [str(i) for i in range(3, STEPS)]
    found = _checkpointed_parameters(tmp_path / "ckpt")
    assert set(params) <= set(found), sorted(set(params) - set(found))
    for n, p in params.items():
        torch.testing.assert_close(found[n], p, rtol=1e-5, atol=1e-5, msg=n)
