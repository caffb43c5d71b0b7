"""The LLM journey end to end, as a user runs it: plan a small Hugging Face model, write the plan, train it with
``torchrun --nproc-per-node N -m fxpipe.launch`` on gloo CPU ranks with padded labels and the model's own loss,
checkpoint, resume; the losses and every parameter equal one process training the whole batches."""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fxpipe

transformers = pytest.importorskip("transformers")
from hf_models import build  # noqa: E402
from journey_target import STEPS, batches  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
LR = 0.1


# float32 as built, for the journeys exact against one process (an H100 plan of a float32 model is bf16-mixed
# by default)
FP32 = fxpipe.CompileOptions(precision="fp32")

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


@functools.cache   # per family: the 4-rank run checks Qwen2's journey and its mesh journey against the same run
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


def _preset(family: str, world: int) -> bool:
    """Whether the journey of ``family`` on ``world`` ranks starts from a plan made for H100s from shapes on meta
    (``fxpipe.plan``), as the LLM team plans on a laptop for the cluster, or from one compiled on this machine's
    CPUs (``fxpipe.compile``, estimated costs): the families of each rank count take turns."""
    return [f for f, _ in _journeys(world)].index(family) % 2 == 1


def _plan(family: str, world: int, schedule: str, path: Path) -> None:
    first = batches(family)[0]
    if _preset(family, world):   # the plan names cuda devices: the ranks run them on their CPUs (gloo)
        with torch.device("meta"):
            model = build(family)
        plan = fxpipe.plan(model, fxpipe.Devices.preset("h100", world), (first["input_ids"].to("meta"),),
                           example_kwargs={"labels": first["labels"].to("meta")}, chunks=4, schedule=schedule,
                           stages=world, options=FP32)
        assert plan.profile["mode"] == "analytic" and plan.stages[0].device.startswith("cuda"), plan.profile
    else:
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
    """Each family once, on 2 ranks (Llama, GPT-2, BERT) or on 4 (Llama tied, Qwen2, T5), each rank count's under
    GPipe, 1F1B and ZB-H1 in turn (every schedule on each rank count), unless ``FXPIPE_FULL_JOURNEYS=1`` asks for
    all 18 pairs on each (about 15 min on this 2-core machine). The README's journey adds Llama on 2 ranks and on a
    4-rank mesh."""
    every = [(f, s) for f in JOURNEY_FAMILIES for s in JOURNEY_SCHEDULES]
    if os.environ.get("FXPIPE_FULL_JOURNEYS") == "1":
        return every
    mine = JOURNEY_FAMILIES[0 if world == 2 else 1::2]
    return [(f, JOURNEY_SCHEDULES[i % len(JOURNEY_SCHEDULES)]) for i, f in enumerate(mine)]


QWEN2 = ("num_hidden_layers=4,hidden_size=32,intermediate_size=64,num_attention_heads=4,num_key_value_heads=2,"
         "vocab_size=96,max_position_embeddings=64")   # hf_models' Qwen2, as `fxpipe plan hf:qwen2 --config` takes it
LLAMA = QWEN2   # the same shape of Llama (hf:llama)


def _from_config(kind: str, config: str, dtype: torch.dtype) -> torch.nn.Module:
    """What a Hugging Face user builds for ``hf:KIND --config CONFIG`` in ``dtype`` (transformers' own
    ``from_config(dtype=...)``, its rotary frequencies kept in float32), seeded as ``fxpipe.launch --seed 0``."""
    import transformers
    torch.manual_seed(0)
    settings = {k: int(v) for k, v in (kv.split("=") for kv in config.split(","))}
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(kind, **settings),
                                                         dtype=dtype).train()


def _one_process(model: torch.nn.Module, data: list, loss_fn: Any = None) -> list[float]:
    """The losses of ``model`` trained by one process on the whole batches (SGD, ``LR``)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in data:
        loss = model(**batch).loss if isinstance(batch, dict) else loss_fn(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _preset_cases(world: int, tmp_path: Path) -> list[dict[str, Any]]:
    """Plans made for H100s from shapes (nothing allocated, as on a laptop) that the journeys do not make, each
    launched as written beside them (one command, ``steps`` steps) and checked against one process: on 2 ranks a
    torch.fx-traced model (``fxpipe.plan``, and ``fxpipe.compile``'s measured plan of it) and ``fxpipe plan
    hf:qwen2``'s bfloat16 plan launched with the same ``--model hf:qwen2 --config`` (the model in float32 refused,
    naming both fixes); on 4, ``fxpipe plan hf:llama --mesh pp=2,tp=2``'s plan launched the same way, and a pp x
    FSDP2 mesh (``fxpipe.plan(mesh=...)``; the journeys on meshes are :data:`MESH_JOURNEYS`')."""
    from fxpipe.__main__ import main as cli
    from launch_target import batches as pairs, make_model
    cases: list[dict[str, Any]] = []

    def case(name: str, plan: Any, model: str, data: str, steps: int, want: list[float], rel: float = 1e-5,
             loss: str | None = None, more: list[str] = ()) -> None:
        path = tmp_path / f"{name}.json"
        if plan is not None:
            plan.save(path)
        argv = ["--plan", str(path), "--model", model, "--data", data, "--lr", str(LR), "--steps", str(steps),
                "--timeout", "120", *(["--loss", loss] if loss else []), *more]
        cases.append({"name": name, "plan": str(path), "argv": argv, "out": str(tmp_path / name), "want": want,
                      "rel": rel})
    with torch.device("meta"):
        tied = make_model()
    x_cpu = torch.cat([pairs()[0][0], pairs()[1][0][:1]])   # 8 samples: the dp replicas' even shares
    x = x_cpu.to("meta")
    ce = lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())   # noqa: E731
    h100 = fxpipe.Devices.preset("h100", world)
    if world == 2:
        plan = fxpipe.plan(tied, h100, (x,), schedule="1f1b", chunks=2, options=FP32)
        assert plan.frontend["name"] == "fx", plan.frontend
        case("fx-preset", plan, "launch_target:make_model", "launch_target:batches", 4,
             _one_process(make_model(), pairs()[:4], ce))
        # stages=2: the ranks need two stages, which costs measured on a loaded machine need not give
        measured = fxpipe.compile(make_model(), ["cpu", "cpu"], (x_cpu,), schedule="1f1b", chunks=2, stages=2).plan
        assert measured.profile["mode"] == "measure", measured.profile   # timed on this machine, the other mode
        assert len(measured.stages) == 2, measured.stages
        case("fx-measured", measured, "launch_target:make_model", "launch_target:batches", 4,
             _one_process(make_model(), pairs()[:4], ce))
        assert cli(["plan", "hf:qwen2", "--config", QWEN2, "--seq-len", "12", "--batch", "8", "--devices", "h100x2",
                    "--dtype", "bfloat16",   # pure bfloat16 (the default is bf16-mixed of the float32 model)
                    "--schedule", "1f1b", "--chunks", "2", "-q", "-o", str(tmp_path / "bf16-cli.json")]) == 0
        case("bf16-cli", None, "hf:qwen2", "journey_target:data_qwen2", STEPS,   # launched as planned: hf:, --config
             _one_process(_from_config("qwen2", QWEN2, torch.bfloat16), batches("qwen2")), rel=1e-3,
             more=["--config", QWEN2])   # rel: bfloat16's own rounding, not the pipeline's
        # the same model in float32 traces to another graph (its float32 casts are no-ops): refused, with both fixes
        first = batches("qwen2")[0]
        with pytest.raises(fxpipe.PlanMismatchError, match=r"the plan was made for training in bfloat16 and the "
                           r"model's parameters are float32: build the model in bfloat16 .* or plan it in float32 "
                           r"\(fxpipe plan --dtype float32"):
            fxpipe.compile(build("qwen2"), ["cpu", "cpu"], (first["input_ids"],),
                           example_kwargs={"labels": first["labels"]}, plan=fxpipe.load_plan(tmp_path / "bf16-cli.json"))
    else:   # the shell's preset plan of a mesh (pp x tp), launched with the same hf: and --config
        assert cli(["plan", "hf:llama", "--config", LLAMA, "--seq-len", "12", "--batch", "8", "--devices", "h100x4",
                    "--mesh", "pp=2,tp=2", "--schedule", "1f1b", "--chunks", "2", "-q", "--dtype", "bfloat16",
                    "-o", str(tmp_path / "bf16-mesh-cli.json")]) == 0
        case("bf16-mesh-cli", None, "hf:llama", "journey_target:data_llama", 3,
             _one_process(_from_config("llama", LLAMA, torch.bfloat16), batches("llama")[:3]), rel=1e-3,
             more=["--config", LLAMA])
        case("fx-fsdp-preset", fxpipe.plan(tied, h100, (x,), mesh="pp=2,dp=2,dp_mode=shard", schedule="1f1b",
                                           options=FP32),
             "launch_target:make_model", "launch_target:batches", 4, _one_process(make_model(), pairs()[:4], ce))
    return cases


# the LLM journey on a mesh, on the model's own loss (dict batches with padded labels, the last batch of 6 shared
# 3 + 3 by the replicas, each then in 3 micro-batches of the plan's 4): (family, mesh) planned for H100s from shapes
MESH_JOURNEYS = (("qwen2", "pp=2,dp=2,dp_mode=shard"), ("llama", "pp=1,dp=2,tp=2,dp_mode=shard"))


def _mesh_journeys(world: int, tmp_path: Path) -> list[dict[str, Any]]:
    """Journeys (plan, launch 3 steps with a checkpoint, resume for the rest) of :data:`MESH_JOURNEYS` on 4 ranks:
    pp × FSDP2 and FSDP2 × tp, each ``fxpipe.launch`` running the plan's own mesh."""
    if world != 4:
        return []
    cases = []
    for family, mesh in MESH_JOURNEYS:
        first = batches(family)[0]
        with torch.device("meta"):
            model = build(family)
        plan = fxpipe.plan(model, fxpipe.Devices.preset("h100", world), (first["input_ids"].to("meta"),),
                           example_kwargs={"labels": first["labels"].to("meta")}, chunks=4, schedule="1f1b",
                           mesh=mesh, options=FP32)
        name = f"{family}-mesh"
        plan.save(tmp_path / f"{name}.json")
        cases.append({"family": family, "schedule": "1f1b", "plan": str(tmp_path / f"{name}.json"), "lr": LR,
                      "checkpoint": str(tmp_path / name / "ckpt"), "out": str(tmp_path / name / "out")})
    return cases


@pytest.mark.slow   # 6 plans, then one torchrun of `world` processes running the journeys (two launches each)
@pytest.mark.parametrize("world", [2, 4])
def test_every_family_and_schedule_trains_as_one_process(tmp_path, world):
    """Model families and schedules on ``world`` ranks (:func:`_journeys`): plan, train 3 steps with a checkpoint,
    resume for the rest (the last batch smaller), through :func:`fxpipe.launch.main` with the command's own
    arguments (``tests/journey_matrix.py`` runs them all in one torchrun; the README's console block runs the
    same two commands as typed). One plan per family (1F1B's cuts), run under each schedule with ``--schedule``;
    on 4 ranks also the journeys of :data:`MESH_JOURNEYS` on the mesh each plan was made for."""
    cases = []
    journeys = _journeys(world)
    for family in dict.fromkeys(f for f, _ in journeys):
        _plan(family, world, "1f1b", tmp_path / f"{family}.json")
        for schedule in [s for f, s in journeys if f == family]:
            here = tmp_path / f"{family}-{schedule}"
            cases.append({"family": family, "schedule": schedule, "plan": str(tmp_path / f"{family}.json"),
                          "lr": LR, "checkpoint": str(here / "ckpt"), "out": str(here / "out")})
    presets = _preset_cases(world, tmp_path)
    cases += _mesh_journeys(world, tmp_path)
    (tmp_path / "cases.json").write_text(json.dumps(cases + presets))
    _launch(world, [str(tmp_path / "cases.json")], module="journey_matrix", timeout_s=1500)
    for case in presets:
        got = _losses("".join(p.read_text() for p in sorted(Path(case["out"]).glob("rank*.txt"))))
        assert got == pytest.approx(case["want"], rel=case["rel"], abs=1e-6), (case["name"], got, case["want"])
    for case in cases:
        out = "".join(p.read_text() for p in sorted(Path(case["out"]).glob("rank*.txt")))
        first, _, second = out.partition("step 3:")   # the resumed run's first line starts its part
        try:
            _check(case["family"], first, "step 3:" + second, Path(case["checkpoint"]))
        except AssertionError as exc:
            raise AssertionError(f"{case['family']} / {case['schedule']} on {world} ranks: {exc}") from exc
