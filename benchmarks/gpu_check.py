"""One command for the first GPU: every check fxpipe needs a GPU for, as one table.

    PYTHONPATH=. python benchmarks/gpu_check.py [--out DIR] [--budget-s 420] [--only ROW ...] [--small]

Rows (each in its own ``try``, with its own time limit; a failing row prints ``FAIL`` and the first line of
its exception, a row past the global ``--budget-s`` prints ``SKIPPED (budget)``, and the table still prints):

- ``tests:<file>``: the suite's CUDA tests (the test files that skip without a GPU), run by
  ``python -m pytest``; passed / failed / skipped per file.
- ``exec:<p>st:<schedule>``: the embedded executor, ``p`` = 2 and 4 stages on ``cuda:0`` (all on one GPU),
  GPipe, 1F1B and ZB-V: ``pipe.step``'s loss, outputs and every parameter's gradient against the model
  run on the same micro-batches (the largest relative error of each).
- ``bf16``: ``pipe.step`` under ``torch.autocast(bfloat16)`` against the model under the same autocast
  (loss and gradients within a bf16 tolerance), and what bf16 gains: the pipeline's fp32/bf16 step time over
  the model's (target 1 +- 0.05).
- ``bf16-mixed``: ``precision="bf16-mixed"`` (float32 parameters, bfloat16 compute): ``pipe.step``'s gradients
  against the plain model under the same policy (float32, within a bf16 tolerance) and its step time against
  that model's (target <= 1.05x, median of interleaved ratios).
- ``overhead:gpt``: the executor's own cost, one stage, one micro-batch, no recomputation, ``pipe.step``
  against the model's step (target >= 0.98x).
- ``speed:resnet101``: torchgpipe's ResNet-101 speed experiment as far as one GPU goes: naive-1 (the plain
  model, batch 118) against pipeline-1 (fxpipe, one stage, batch 220, 2 micro-batches, checkpointing all
  but the last, torchgpipe's settings), training steps with SGD, samples/s and their ratio (torchgpipe's
  own table: pipeline-1 at 0.756x naive-1 on a Tesla P40).
- ``fidelity:<model>``: ResNet-101, GPT-2 and a Llama config, two stages on ``cuda:0``: each stage's
  predicted forward + backward time per micro-batch (the plan: ``profile="measure"``) against the stage
  timed alone (:func:`fxpipe.refine.stage_profile.stage_factors`, synchronised), each worker's predicted
  peak activation memory (:mod:`fxpipe.planning.memory_model`) against its step replayed alone under
  ``torch.cuda.max_memory_allocated`` (:mod:`fxpipe.runtime.execute.memory_probe`), the error in %, and the
  compile time (profiling included).
- ``compiled``: ``fxpipe.compile(torch.compile(model), ...)``: outputs and gradients against the eager
  model, step time against the eager pipeline, and whether the stages were compiled.

Without a GPU (or with ``--small``) it says so and runs the same rows on CPU with tiny models and
``["cpu", "cpu"]``-style devices (``tests/test_gpu_check.py`` runs that mode, so the script cannot rot
between GPUs). Each row is printed when measured; with ``--out DIR`` (default ``$OUT`` when set) the table
(``gpu_check.txt``) and every figure (``gpu_check.json``) are rewritten after each row.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import fxpipe  # noqa: E402

# ------------------------------------------------------------------------------------------------ sizes

FULL = dict(
    exec_gpt=dict(vocab=8192, width=512, depth=8, heads=8, seq=256), exec_batch=16, exec_chunks=4,
    resnet=dict(name="resnet101", batch=64, image=224, chunks=4),
    gpt2=dict(layers=12, width=768, heads=12, seq=512, batch=8, vocab=50257, chunks=4),
    llama=dict(layers=8, width=1024, heads=16, kv_heads=8, inner=2816, seq=512, batch=8, vocab=32000, chunks=4),
    speed=dict(name="resnet101", image=224, naive_batch=118, pipe_batch=220, chunks=2, steps=4, rounds=3),
    timing_steps=5,
)
SMALL = dict(
    exec_gpt=dict(vocab=64, width=32, depth=4, heads=4, seq=8), exec_batch=8, exec_chunks=4,
    resnet=dict(name="resnet18", batch=4, image=16, chunks=2),
    gpt2=dict(layers=2, width=32, heads=4, seq=16, batch=4, vocab=128, chunks=2),
    llama=dict(layers=2, width=32, heads=4, kv_heads=2, inner=64, seq=16, batch=4, vocab=128, chunks=2),
    speed=dict(name="resnet18", image=16, naive_batch=4, pipe_batch=4, chunks=2, steps=2, rounds=1),
    timing_steps=2,
)
# seconds each row may take before it is stopped (a soft limit: checked between Python operations)
ROW_LIMIT_S = {"tests": 180, "exec": 60, "bf16": 60, "speed": 120, "fidelity": 120, "compiled": 180}
GRACE_S = 30   # a row started before --budget-s may run this long past it
REFERENCE_PIPELINE_1 = 0.756   # torchgpipe's pipeline-1 / naive-1, ResNet-101, Tesla P40 (docs, v0.0.3)


# ------------------------------------------------------------------------------------------------ table

@dataclass
class Row:
    name: str
    status: str = "PASS"          # PASS, FAIL, INFO (measured, nothing to pass), SKIPPED (...)
    detail: str = ""
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)


class RowTimeout(Exception):
    pass


class Table:
    """Rows printed as they come, and the whole table and its figures rewritten to ``out`` after each."""

    def __init__(self, header: dict[str, Any], out: Path | None) -> None:
        self.header, self.out, self.rows = header, out, []
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
        for line in self.head_lines():
            print(line, flush=True)
        self.save()

    def head_lines(self) -> list[str]:
        lines = [f"{k}: {v}" for k, v in self.header.items()]
        lines += ["", f"{'row':<24} {'status':<8} {'s':>6}  detail", "-" * 100]
        return lines

    @staticmethod
    def line(row: Row) -> str:
        return f"{row.name:<24} {row.status:<8} {row.seconds:6.1f}  {row.detail}"

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(self.line(row), flush=True)
        self.save()

    def text(self) -> str:
        counts = {s: sum(r.status.startswith(s) for r in self.rows) for s in ("PASS", "FAIL", "INFO", "SKIPPED")}
        return "\n".join(self.head_lines() + [self.line(r) for r in self.rows] + [
            "-" * 100, ", ".join(f"{v} {k}" for k, v in counts.items())]) + "\n"

    def save(self) -> None:
        if self.out is None:
            return
        (self.out / "gpu_check.txt").write_text(self.text())
        doc = {"header": self.header, "rows": [r.__dict__ for r in self.rows]}
        (self.out / "gpu_check.json").write_text(json.dumps(doc, indent=1, default=str))


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`RowTimeout` in the main thread after ``seconds`` (SIGALRM; nothing where there is none).

    An alarm already pending (pytest-timeout's, when the test suite runs this) is kept: the earlier of the two
    fires first, the other's handler is put back afterwards with its time left."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return
    started = time.monotonic()
    theirs, _ = signal.getitimer(signal.ITIMER_REAL)

    fired = []

    def fire(signum, frame):
        elapsed = time.monotonic() - started
        if elapsed >= seconds - 0.01:
            raise RowTimeout(f"row over its limit of {seconds:g} s")
        fired.append(True)   # the other alarm came first: its handler, then ours for the time left
        signal.setitimer(signal.ITIMER_REAL, seconds - elapsed)
        if callable(old):
            old(signum, frame)
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, min(seconds, theirs) if theirs > 0 else seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if theirs > 0 and not fired:
            signal.setitimer(signal.ITIMER_REAL, max(theirs - (time.monotonic() - started), 0.001))


# ------------------------------------------------------------------------------------------------ helpers

class Context:
    def __init__(self, small: bool) -> None:
        self.small = small
        self.gpu = not small
        self.sizes = SMALL if small else FULL
        self.device = torch.device("cuda:0" if self.gpu else "cpu")
        # rows that check the executor need no measured costs: the small mode plans them from FLOPs (seconds
        # less on a busy CPU); the fidelity rows measure in both modes, as their predictions are the point
        self.profile = "estimate" if small else "measure"

    def devices(self, n: int) -> list[str]:
        return [str(self.device)] * n

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize(self.device)

    def clean(self) -> None:
        gc.collect()
        if self.gpu:
            torch.cuda.empty_cache()


def rel_err(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    """Largest absolute difference over the largest magnitude of ``want`` (or ``floor``, if larger)."""
    got, want = got.detach().float().to(want.device), want.detach().float()
    scale = max(want.abs().max().item() if want.numel() else 0.0, floor)
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    return diff / scale if scale > 0 else diff


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def reference_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable, chunks: int,
                   autocast: Any = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The model on the pipeline's micro-batches (``torch.tensor_split`` of the batch), each loss weighted by
    its share of the batch as ``pipe.step``'s ``reduction="mean"``: loss, outputs and gradients."""
    model.zero_grad(set_to_none=True)
    total, outs, n = 0.0, [], x.shape[0]
    for xi, yi in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks)):
        with autocast or contextlib.nullcontext():
            out = model(xi)
            loss = loss_fn(out, yi) * (xi.shape[0] / n)
        loss.backward()
        total = total + loss.detach()
        outs.append(logits_of(out).detach())
    grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    return total, torch.cat(outs), grads


def logits_of(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def compare(pipe: fxpipe.Pipeline, model: nn.Module, x, y, loss_fn, autocast: Any = None) -> dict[str, Any]:
    """One ``pipe.step`` against :func:`reference_step`: the largest relative errors of loss, outputs, grads."""
    ref_loss, ref_out, ref_grads = reference_step(model, x, y, loss_fn, pipe.chunks, autocast)
    model.zero_grad(set_to_none=True)
    with autocast or contextlib.nullcontext():
        loss, out = pipe.step(x, y, loss_fn, return_outputs=True)
    grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    missing = sorted(set(ref_grads) ^ set(grads))
    if missing:
        raise AssertionError(f"parameters with gradients differ from the model's: {missing[:3]}")
    # each gradient relative to its own largest magnitude, or to a thousandth of the model's largest gradient
    # where it is smaller: a gradient that is zero in exact arithmetic (a key bias under softmax) is rounding
    # noise, which a GPU's atomics sum in another order each run
    floor = 1e-3 * max(g.abs().max().item() for g in ref_grads.values())
    errors = {k: rel_err(grads[k], ref_grads[k], floor) for k in ref_grads}
    worst = max(errors, key=errors.__getitem__)
    return {"loss_err": rel_err(torch.as_tensor(loss), torch.as_tensor(ref_loss)),
            "out_err": rel_err(logits_of(out), ref_out), "grad_err": errors[worst],
            "worst_grad": worst, "params": len(ref_grads)}


def judged(row: Row, errs: dict[str, Any], tol: dict[str, float]) -> None:
    """PASS when every error is within its tolerance, FAIL naming the first that is not."""
    row.figures.update(errs, tolerance=tol)
    over = [k for k in tol if not errs[k] <= tol[k]]
    row.status = "FAIL" if over else "PASS"
    row.detail = (f"loss {errs['loss_err']:.1e} out {errs['out_err']:.1e} grads {errs['grad_err']:.1e} "
                  f"({errs['params']} params)" + (f"  over tolerance: {', '.join(over)} (tol {tol}; worst gradient "
                                                  f"{errs['worst_grad']})" if over else ""))


def timed(ctx: Context, step: Callable[[], Any], steps: int, warmup: int = 1) -> float:
    """Median seconds of ``step`` over ``steps`` runs after ``warmup``, synchronised."""
    for _ in range(warmup):
        step()
    seconds = []
    for _ in range(steps):
        ctx.sync()
        t = time.perf_counter()
        step()
        ctx.sync()
        seconds.append(time.perf_counter() - t)
    return statistics.median(seconds)


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = logits_of(out)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def gpt(ctx: Context) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The executor rows' model: a GPT-style decoder with its head tied to the embedding, no dropout."""
    from make_problems import GPT
    s = ctx.sizes["exec_gpt"]
    torch.manual_seed(0)
    model = GPT(**s).to(ctx.device).train()
    b = ctx.sizes["exec_batch"]
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, s["vocab"], (b, s["seq"]), generator=g).to(ctx.device)
    y = torch.randint(0, s["vocab"], (b, s["seq"]), generator=g).to(ctx.device)
    return model, x, y


# ------------------------------------------------------------------------------------------------ rows

def cuda_test_files() -> list[str]:
    """The test files that skip their tests without a GPU: a ``skipif`` on CUDA, a ``requires_cuda`` mark, or
    a ``pytest.skip`` right after a ``cuda.is_available()`` test."""
    pattern = re.compile(r"skipif\([^)]*cuda|requires_cuda|cuda\.is_available\(\)[^\n]*\n\s*pytest\.skip"
                         r"|importorskip\([^)]*cuda")
    return sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")
                  if p.name != "test_gpu_check.py" and pattern.search(p.read_text()))


def row_tests(ctx: Context, limit_s: float) -> list[Row]:
    files = cuda_test_files()
    if not files:
        return [Row("tests", "FAIL", "no test file skips without CUDA: the pattern in cuda_test_files() is stale")]
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        # the GPU tests only: a file that skips some tests without CUDA holds CPU tests too (the second H200 run
        # spent its 180 s on test_tied_weights' CPU tests); their names say gpu, cuda, device or stream
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
               "-k", "gpu or cuda or device or stream", *files]
        started = time.perf_counter()
        try:
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s)
        except subprocess.TimeoutExpired:
            return [Row("tests", "FAIL", f"pytest over its limit of {limit_s:.0f} s: {' '.join(files)}")]
        took = time.perf_counter() - started
        if not xml.exists():
            tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
            return [Row("tests", "FAIL", f"pytest rc {done.returncode}: {tail[0][:150]}")]
        per: dict[str, dict[str, Any]] = {f: {"passed": 0, "failed": 0, "skipped": 0, "first_failure": ""}
                                          for f in files}
        for case in ET.parse(xml).getroot().iter("testcase"):
            parts = case.get("classname", "").split(".")   # tests.test_streams[.Class]
            name = next((f for f in files if Path(f).stem in parts), None)
            if name is None:
                continue
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                per[name]["failed"] += 1
                message = ((bad.get("message") or "").strip().splitlines() or [""])[0][:120]
                per[name]["first_failure"] = per[name]["first_failure"] or f"{case.get('name')}: {message}"
            elif case.find("skipped") is not None:
                per[name]["skipped"] += 1
            else:
                per[name]["passed"] += 1
    rows = []
    for f, c in per.items():
        # a GPU file whose tests all skip (two GPUs wanted, say) checked nothing: INFO, not PASS
        status = "FAIL" if c["failed"] else "PASS" if c["passed"] or not ctx.gpu else "INFO"
        rows.append(Row(f"tests:{Path(f).stem.removeprefix('test_')}", status,
                        f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
                        + (f"; {c['first_failure']}" if c["first_failure"] else "")
                        + ("" if ctx.gpu or not c["skipped"] else " (no GPU: skips expected)"),
                        seconds=took / len(per), figures=c))
    return rows


def row_executor(ctx: Context, stages: int, schedule: str) -> Row:
    from solvers.schedules import get_schedule

    row = Row(f"exec:{stages}st:{schedule}")
    model, x, y = gpt(ctx)
    workers = get_schedule(schedule).workers(stages)
    extra = {} if get_schedule(schedule).multi_stage else {"stages": stages}
    pipe = fxpipe.compile(model, ctx.devices(workers), (x,), chunks=ctx.sizes["exec_chunks"], schedule=schedule,
                          checkpoint="never", **extra, profile=ctx.profile)
    if len(pipe.plan.stages) != stages:
        raise AssertionError(f"the plan has {len(pipe.plan.stages)} stages, asked for {stages}")
    errs = compare(pipe, model, x, y, lm_loss)
    judged(row, errs, {"loss_err": 1e-4, "out_err": 1e-4, "grad_err": 1e-3})
    row.figures.update(stages=stages, workers=workers, chunks=pipe.chunks, devices=ctx.devices(workers))
    return row


def interleaved_medians(ctx: Context, runs: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each run, round by round (each round runs every one once, in turn: drift moves them alike)."""
    for run in runs.values():
        run()   # warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(timed(ctx, run, 1, warmup=0))
    return times


def gpt_steps(ctx: Context, model: nn.Module, pipe: fxpipe.Pipeline, x: torch.Tensor, y: torch.Tensor,
              bf16: bool) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The plain model's step (its micro-batches accumulated as the pipeline splits them) and ``pipe.step``."""
    cast = (lambda: torch.autocast(ctx.device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    m = pipe.chunks

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        with cast():
            for xi, yi in zip(x.tensor_split(m), y.tensor_split(m)):
                (lm_loss(model(xi), yi) * (len(xi) / len(x))).backward()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with cast():
            pipe.step(x, y, lm_loss)
    return plain, step


def row_bf16(ctx: Context) -> Row:
    """Exactness under autocast, and its speed-up: (pipe fp32 / pipe bf16) / (model fp32 / model bf16), target
    within 5 % of 1 (the pipeline gains from bf16 what the model gains)."""
    row = Row("bf16")
    model, x, y = gpt(ctx)
    pipe = fxpipe.compile(model, ctx.devices(2), (x,), chunks=ctx.sizes["exec_chunks"], schedule="1f1b", stages=2,
                          checkpoint="never", profile=ctx.profile)
    autocast = lambda: torch.autocast(ctx.device.type, dtype=torch.bfloat16)  # noqa: E731
    errs = compare(pipe, model, x, y, lm_loss, autocast())
    judged(row, errs, {"loss_err": 2e-2, "out_err": 5e-2, "grad_err": 5e-2})
    runs = {}
    for bf16 in (False, True):
        runs[f"model-{bf16}"], runs[f"pipe-{bf16}"] = gpt_steps(ctx, model, pipe, x, y, bf16)
    t = interleaved_medians(ctx, runs, ctx.sizes["timing_steps"])
    gain = {k: [a / b for a, b in zip(t[f"{k}-False"], t[f"{k}-True"])] for k in ("model", "pipe")}
    ratio = statistics.median(p / m for p, m in zip(gain["pipe"], gain["model"]))
    fp32_s, bf16_s = statistics.median(t["pipe-False"]), statistics.median(t["pipe-True"])
    row.figures.update(fp32_step_s=fp32_s, bf16_step_s=bf16_s, model_fp32_step_s=statistics.median(t["model-False"]),
                       model_bf16_step_s=statistics.median(t["model-True"]), gain_ratio=ratio)
    row.detail += (f"; step {bf16_s * 1e3:.1f} ms bf16 vs {fp32_s * 1e3:.1f} ms fp32 ({fp32_s / bf16_s:.2f}x; "
                   f"model {statistics.median(gain['model']):.2f}x): gain ratio {ratio:.3f} (target 1 +- 0.05)")
    return row


def policy_steps(ctx: Context, model: nn.Module, pipe: fxpipe.Pipeline, x: torch.Tensor,
                 y: torch.Tensor) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """Under ``bf16-mixed``: the plain model's step under the same policy (every float32 parameter read through
    its bfloat16 copy, :func:`fxpipe.frontend.precision.compute_copy`; the micro-batches accumulated as the
    pipeline splits them) and ``pipe.step``."""
    from fxpipe.frontend.precision import compute_copy
    m = pipe.chunks

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        copies = {n: compute_copy(p) for n, p in model.named_parameters()}
        for xi, yi in zip(x.tensor_split(m), y.tensor_split(m)):
            out = torch.func.functional_call(model, copies, (xi,))
            (lm_loss(out, yi) * (len(xi) / len(x))).backward()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        pipe.step(x, y, lm_loss)
    return plain, step


def row_bf16_mixed(ctx: Context) -> Row:
    """``precision="bf16-mixed"`` (float32 parameters, bfloat16 compute, :mod:`fxpipe.frontend.precision`): the
    pipeline's step against the plain model under the same policy, its loss and gradients within bfloat16's
    tolerance, float32 gradients, and its time (target: within 5 % of the plain model's, median of ratios)."""
    row = Row("bf16-mixed")
    model, x, y = gpt(ctx)
    pipe = fxpipe.compile(model, ctx.devices(2), (x,), chunks=ctx.sizes["exec_chunks"], schedule="1f1b", stages=2,
                          checkpoint="never", profile=ctx.profile,
                          options=fxpipe.CompileOptions(precision="bf16-mixed"))
    plain, step = policy_steps(ctx, model, pipe, x, y)
    plain()
    want = grads_of(model)
    step()
    got = grads_of(model)
    floor = 1e-3 * max(g.abs().max().item() for g in want.values())
    errors = {k: rel_err(got[k], want[k], floor) for k in want}
    worst = max(errors, key=errors.__getitem__)
    dtypes = sorted({str(g.dtype) for g in got.values()})
    t = interleaved_medians(ctx, {"model": plain, "pipe": step}, ctx.sizes["timing_steps"])
    ratio = statistics.median(p / m for p, m in zip(t["pipe"], t["model"]))
    row.figures.update(grad_err=errors[worst], worst_grad=worst, grad_dtypes=dtypes, ratio=ratio,
                       tolerance={"grad_err": 5e-2},
                       pipe_step_s=statistics.median(t["pipe"]), model_step_s=statistics.median(t["model"]))
    ok = errors[worst] <= 5e-2 and dtypes == ["torch.float32"]
    row.status = "PASS" if ok else "FAIL"   # the time is a figure against its target, as the bf16 row's
    row.detail = (f"grads {errors[worst]:.1e} (worst {worst}; {', '.join(dtypes)}); pipe.step "
                  f"{statistics.median(t['pipe']) * 1e3:.1f} ms vs the model under the policy "
                  f"{statistics.median(t['model']) * 1e3:.1f} ms: {ratio:.3f}x (target <= 1.05x)")
    return row


def row_overhead(ctx: Context) -> Row:
    """The executor's own cost: one stage, one micro-batch, no recomputation, ``pipe.step`` against the model's
    ``loss.backward()`` (target >= 0.98x), medians of per-round ratios."""
    row = Row("overhead:gpt", "INFO")
    model, x, y = gpt(ctx)
    pipe = fxpipe.compile(model, ctx.devices(1), (x,), chunks=1, stages=1, checkpoint="never", profile="estimate")
    plain, step = gpt_steps(ctx, model, pipe, x, y, False)
    t = interleaved_medians(ctx, {"model": plain, "pipe": step}, 3 * ctx.sizes["timing_steps"])
    ratio = statistics.median(m / p for m, p in zip(t["model"], t["pipe"]))
    row.figures.update(model_step_s=statistics.median(t["model"]), pipe_step_s=statistics.median(t["pipe"]),
                       ratio=ratio)
    row.detail = (f"model {statistics.median(t['model']) * 1e3:.1f} ms, pipe.step {statistics.median(t['pipe']) * 1e3:.1f}"
                  f" ms: {ratio:.3f}x (target >= 0.98x)")
    return row


def row_speed(ctx: Context) -> Row:
    import torchvision
    s = ctx.sizes["speed"]
    row = Row(f"speed:{s['name']}", "INFO")
    torch.manual_seed(0)
    model = torchvision.models.get_model(s["name"], num_classes=1000).to(ctx.device).train()

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.rand(n, 3, s["image"], s["image"], device=ctx.device),
                torch.randint(0, 1000, (n,), device=ctx.device))
    xn, yn = batch(s["naive_batch"])
    xp, yp = batch(s["pipe_batch"])
    started = time.perf_counter()
    pipe = fxpipe.compile(model, ctx.devices(1), (xp,), chunks=s["chunks"], schedule="gpipe",
                          checkpoint="except_last", stages=1, profile=ctx.profile)
    compile_s = time.perf_counter() - started
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.functional.cross_entropy

    def naive() -> None:
        loss_fn(model(xn), yn).backward()
        opt.step()
        opt.zero_grad()

    def pipelined() -> None:
        pipe.step(xp, yp, loss_fn)
        opt.step()
        opt.zero_grad()
    # the executor's own cost beside it: one stage, naive-1's batch whole, nothing recomputed
    plain = fxpipe.compile(model, ctx.devices(1), (xn,), chunks=1, schedule="gpipe", checkpoint="never", stages=1,
                           profile="estimate")

    def plain_step() -> None:
        plain.step(xn, yn, loss_fn)
        opt.step()
        opt.zero_grad()
    rates: dict[str, list[float]] = {"naive-1": [], "pipeline-1": [], "pipeline-1-plain": []}
    naive(), pipelined(), plain_step()   # warm-up
    for _ in range(s["rounds"]):   # interleaved, so drift moves all alike
        rates["naive-1"].append(s["naive_batch"] / timed(ctx, naive, s["steps"], warmup=0))
        rates["pipeline-1"].append(s["pipe_batch"] / timed(ctx, pipelined, s["steps"], warmup=0))
        rates["pipeline-1-plain"].append(s["naive_batch"] / timed(ctx, plain_step, s["steps"], warmup=0))
    naive_rate, pipe_rate, plain_rate = (statistics.median(v) for v in rates.values())
    ratio = pipe_rate / naive_rate
    row.figures.update(naive_samples_s=naive_rate, pipeline_samples_s=pipe_rate, ratio=ratio,
                       plain_samples_s=plain_rate, plain_ratio=plain_rate / naive_rate,
                       torchgpipe_p40_ratio=REFERENCE_PIPELINE_1, compile_s=compile_s, settings=s, rounds=rates)
    row.detail = (f"naive-1 {naive_rate:.1f}/s (batch {s['naive_batch']}), pipeline-1 {pipe_rate:.1f}/s (batch "
                  f"{s['pipe_batch']}, {s['chunks']} chunks, except_last): {ratio:.3f}x "
                  f"(torchgpipe P40: {REFERENCE_PIPELINE_1}x); 1 stage, batch {s['naive_batch']} whole, no "
                  f"checkpoint: {plain_rate / naive_rate:.3f}x; compile {compile_s:.1f} s")
    return row


def fidelity_model(ctx: Context, which: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Callable, int]:
    s = ctx.sizes[which]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    if which == "resnet":
        import torchvision
        model = torchvision.models.get_model(s["name"], num_classes=1000)
        x = torch.randn(s["batch"], 3, s["image"], s["image"], generator=g)
        y = torch.randint(0, 1000, (s["batch"],), generator=g)
        loss_fn = nn.functional.cross_entropy
    else:
        import transformers
        if which == "gpt2":
            config = transformers.GPT2Config(n_layer=s["layers"], n_embd=s["width"], n_head=s["heads"],
                                             n_positions=s["seq"], vocab_size=s["vocab"], resid_pdrop=0.0,
                                             embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
            model = transformers.GPT2LMHeadModel(config)
        else:
            config = transformers.LlamaConfig(num_hidden_layers=s["layers"], hidden_size=s["width"],
                                              num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                                              intermediate_size=s["inner"], max_position_embeddings=s["seq"],
                                              vocab_size=s["vocab"], use_cache=False)
            model = transformers.LlamaForCausalLM(config)
        x = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g)
        y = x.roll(-1, dims=1)
        loss_fn = lm_loss
    return model.to(ctx.device).train(), x.to(ctx.device), y.to(ctx.device), loss_fn, s["chunks"]


def worker_peaks(pipe: fxpipe.Pipeline, inputs: tuple, target: Any, loss: Callable, schedule: str,
                 device: torch.device) -> list[int]:
    """Each worker's step replayed alone (:mod:`fxpipe.runtime.execute.memory_probe`'s replay), its peak measured on
    ``device``: ``torch.cuda.max_memory_allocated`` above what the GPU held before, on a GPU. (fxpipe's own
    ``measure_worker_memory`` counts the replay's allocations with the profiler, as on CPU workers.)"""
    from fxpipe.runtime.execute.memory_probe import Replay, allocations, replaying
    from solvers.schedules import get_schedule, worker_orders

    micro = pipe.inputs.micro_batches(inputs, {})
    targets, m = pipe.inputs.micro_targets(target), len(micro)
    orders = worker_orders(schedule, len(pipe.specs), m, pipe._workers(schedule))
    peaks = []
    with replaying(pipe, micro) as seen:
        for order in orders:
            replay = Replay(pipe, seen, targets, loss, lambda k, i: pipe._checkpointed(k, i, m),
                            split_backward=get_schedule(schedule).split_backward)
            with allocations(device) as found:
                for op in order:
                    replay.run(*op)
            peaks.append(found.peak_bytes)
    return peaks


def row_fidelity(ctx: Context, which: str) -> Row:
    from fxpipe.planning.memory_model import predict_worker_memory
    from fxpipe.refine.stage_profile import stage_factors
    from fxpipe.runtime.execute.memory_probe import measure_worker_memory
    from fxpipe.runtime.execute.structure import FlatInputs, flat_inputs

    model, x, y, loss_fn, chunks = fidelity_model(ctx, which)
    name = {"resnet": ctx.sizes["resnet"]["name"], "gpt2": "gpt2", "llama": "llama"}[which]
    row = Row(f"fidelity:{name}", "INFO")
    started = time.perf_counter()
    pipe = fxpipe.compile(model, ctx.devices(2), (x,), chunks=chunks, stages=2, schedule="gpipe",
                          checkpoint="never", profile=fxpipe.ProfileOptions(cache=False, loss_fn=loss_fn,
                          example_target=y))   # measured now, not read from a cache
    compile_s = time.perf_counter() - started
    loss = pipe.structured_loss(loss_fn)
    inputs: tuple = (x,)
    if pipe.inputs.in_spec is not None:   # the graph's flat leaves (torch.export), as pipe.step passes them on
        inputs = FlatInputs(flat_inputs(inputs, {}, pipe.inputs.in_spec)[0])
    factors = stage_factors(pipe, inputs, target=y, loss_fn=loss)
    stages = []
    for st, (ff, fb) in zip(pipe.plan.stages, factors):
        pred = st.fwd_s + st.bwd_s
        meas = st.fwd_s * ff + st.bwd_s * fb
        stages.append({"stage": st.index, "pred_ms": pred * 1e3, "meas_ms": meas * 1e3,
                       "fwd_ms": [st.fwd_s * 1e3, st.fwd_s * ff * 1e3], "bwd_ms": [st.bwd_s * 1e3, st.bwd_s * fb * 1e3],
                       "err": (pred - meas) / meas})
    predicted = predict_worker_memory(pipe.plan, "gpipe")
    measured = worker_peaks(pipe, inputs, y, loss, "gpipe", ctx.device)
    probed = measure_worker_memory(pipe, inputs, y, loss, schedule="gpipe")   # fxpipe's own, for comparison
    memory = [{"worker": p.worker, "pred_MiB": p.activation_bytes / 2**20, "meas_MiB": m / 2**20,
               "err": (p.activation_bytes - m) / m if m else float("nan"), "probe_MiB": q.peak_bytes / 2**20}
              for p, m, q in zip(predicted, measured, probed)]
    # the whole step on the one device: its time against the stages run one after another (they share it)
    step_s = timed(ctx, lambda: (model.zero_grad(set_to_none=True), pipe.step(x, y, loss_fn)), 3)
    step_peak = None
    if ctx.gpu:   # the step's peak on the GPU above what it held before, both workers on it at once
        pipe.step(x, y, loss_fn, measure_memory=True)
        step_peak = pipe.last_step["memory"][0] / 2**20
    serial_s = pipe.chunks * sum(st.fwd_s + st.bwd_s for st in pipe.plan.stages)
    serial_meas_s = pipe.chunks * sum(s["meas_ms"] for s in stages) / 1e3
    model.zero_grad(set_to_none=True)
    row.figures.update(compile_s=compile_s, stages=stages, memory=memory, step_s=step_s,
                       predicted_serial_step_s=serial_s, measured_serial_step_s=serial_meas_s, chunks=pipe.chunks,
                       profile=pipe.plan.profile.get("mode"),
                       step_peak_MiB=step_peak, predicted_sum_MiB=sum(m["pred_MiB"] for m in memory))
    row.detail = ("time/mb " + ", ".join(f"s{s['stage']} {s['pred_ms']:.1f}|{s['meas_ms']:.1f}ms {s['err']:+.0%}"
                                          for s in stages)
                  + "; act mem " + ", ".join(f"w{m['worker']} {mib(m['pred_MiB'])}|{mib(m['meas_MiB'])}MiB "
                                             f"{m['err']:+.0%}" for m in memory)
                  + ("" if all(abs(m["probe_MiB"] - m["meas_MiB"]) <= 0.05 * m["meas_MiB"] for m in memory) else
                     " (fxpipe's profiler probe: " + ", ".join(mib(m["probe_MiB"]) for m in memory) + " MiB)")
                  + f"; step {step_s * 1e3:.0f}ms, stages in series pred {serial_s * 1e3:.0f}|meas "
                  f"{serial_meas_s * 1e3:.0f}ms"
                  + (f"; step peak {step_peak:.0f}MiB (workers' pred sum {row.figures['predicted_sum_MiB']:.0f})"
                     if step_peak is not None else "")
                  + f"; compile {compile_s:.1f}s")
    return row


def mib(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def stage_modules_compiled(pipe: fxpipe.Pipeline) -> tuple[int, int, str]:
    """How many stages run compiled, of how many, and how that was seen."""
    flag = getattr(pipe, "compiled", None)
    mods = [spec.module for spec in pipe.specs]
    wrapped = sum(type(m).__name__ == "OptimizedModule" or hasattr(m, "_orig_mod")
                  or getattr(getattr(m, "forward", None), "_torchdynamo_orig_callable", None) is not None
                  or "_torchdynamo" in repr(getattr(m, "forward", ""))
                  for m in mods)
    if isinstance(flag, (list, tuple)):
        return sum(bool(f) for f in flag), len(mods), "pipe.compiled"
    if isinstance(flag, bool):
        return (len(mods) if flag else 0), len(mods), "pipe.compiled"
    # the torch.compile options every stage was compiled with (fxpipe.runtime.execute.compiled)
    if isinstance(flag, dict):
        return len(mods), len(mods), f"pipe.compiled={flag!r}"
    return wrapped, len(mods), "stage module types" if flag is None else f"pipe.compiled={flag!r}"


def row_compiled(ctx: Context) -> Row:
    row = Row("compiled")
    model, x, y = gpt(ctx)
    eager = fxpipe.compile(model, ctx.devices(2), (x,), chunks=ctx.sizes["exec_chunks"], schedule="1f1b", stages=2,
                           checkpoint="never", profile=ctx.profile)
    backend = "inductor" if ctx.gpu else "eager"   # CPU: no C++ toolchain needed, the path through fxpipe the same
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = fxpipe.compile(torch.compile(model, backend=backend), ctx.devices(2), (x,),
                              chunks=ctx.sizes["exec_chunks"], schedule="1f1b", stages=2, checkpoint="never",
                              profile=ctx.profile)
    compile_s = time.perf_counter() - started
    errs = compare(pipe, model, x, y, lm_loss)   # the first step also compiles the stages, where they are
    judged(row, errs, {"loss_err": 1e-3, "out_err": 1e-3, "grad_err": 5e-3})
    n = ctx.sizes["timing_steps"]

    def step(p: fxpipe.Pipeline) -> Callable[[], Any]:
        return lambda: (model.zero_grad(set_to_none=True), p.step(x, y, lm_loss))
    eager_s, compiled_s = timed(ctx, step(eager), n), timed(ctx, step(pipe), n)
    done, total, how = stage_modules_compiled(pipe)   # after steps: stages may be compiled at their first call
    model.zero_grad(set_to_none=True)
    warned = [str(w.message).split(":")[0] for w in caught
              if "torch.compile" in str(w.message) and "eager" in str(w.message)]
    row.figures.update(stages_compiled=done, stages=total, detected_by=how, backend=backend, compile_s=compile_s,
                       eager_step_s=eager_s, compiled_step_s=compiled_s, warnings=warned)
    row.detail += (f"; stages compiled: {done}/{total} ({how}); step {compiled_s * 1e3:.1f} ms vs eager pipeline "
                   f"{eager_s * 1e3:.1f} ms ({eager_s / compiled_s:.2f}x); fxpipe.compile {compile_s:.1f} s"
                   + ("; warned: stages run eagerly" if warned and not done else ""))
    return row


# ------------------------------------------------------------------------------------------------ main

def plan_rows(ctx: Context) -> list[tuple[str, str, Callable[[], Row | list[Row]]]]:
    """(name, limit key, run) for every row, in the order they run."""
    rows: list[tuple[str, str, Callable[[], Any]]] = [("tests", "tests", lambda: row_tests(ctx, ROW_LIMIT_S["tests"]))]
    for stages in (2, 4):
        for schedule in ("gpipe", "1f1b", "zb-v"):
            rows.append((f"exec:{stages}st:{schedule}", "exec",
                         lambda s=stages, k=schedule: row_executor(ctx, s, k)))
    rows.append(("bf16", "bf16", lambda: row_bf16(ctx)))
    rows.append(("bf16-mixed", "bf16", lambda: row_bf16_mixed(ctx)))
    rows.append(("overhead:gpt", "exec", lambda: row_overhead(ctx)))
    rows.append((f"speed:{ctx.sizes['speed']['name']}", "speed", lambda: row_speed(ctx)))
    for which in ("resnet", "gpt2", "llama"):
        label = ctx.sizes["resnet"]["name"] if which == "resnet" else which
        rows.append((f"fidelity:{label}", "fidelity", lambda w=which: row_fidelity(ctx, w)))
    rows.append(("compiled", "compiled", lambda: row_compiled(ctx)))
    return rows


def header(ctx: Context, reason: str) -> dict[str, Any]:
    h = {"gpu_check": "fxpipe benchmarks/gpu_check.py",
         "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
         "mode": "GPU (cuda:0)" if ctx.gpu else f"small, on CPU ({reason})",
         "device": torch.cuda.get_device_name(0) if ctx.gpu else platform.processor() or platform.machine(),
         "torch": torch.__version__, "cuda": torch.version.cuda, "fxpipe": fxpipe.__version__,
         "python": platform.python_version()}
    if ctx.gpu:
        h["memory"] = f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB"
        h["fp32"] = (f"matmul precision {torch.get_float32_matmul_precision()!r}, cuDNN TF32 "
                     f"{torch.backends.cudnn.allow_tf32}, cuDNN {torch.backends.cudnn.version()}")
    return h


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or None,
                        help="folder for gpu_check.txt and gpu_check.json (default: $OUT if set, else none)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="rows that would start after this many seconds are skipped (default 420)")
    parser.add_argument("--small", action="store_true", help="tiny models on CPU (automatic without a GPU)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="run only the rows whose name starts with one of these (tests, exec, exec:2st, "
                             "bf16, speed, fidelity, fidelity:gpt2, compiled)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    reason = "--small" if args.small else "torch.cuda.is_available() is False"
    ctx = Context(small=args.small or not torch.cuda.is_available())
    if ctx.small and not args.small:
        print("No GPU here (torch.cuda.is_available() is False): running the small mode on CPU.", flush=True)
    table = Table(header(ctx, reason), Path(args.out) if args.out else None)
    threads = torch.get_num_threads()
    if ctx.small:   # one intra-op thread: a shared CPU's other load then does not stall every operation
        torch.set_num_threads(1)
    try:
        run_rows(ctx, table, args, started)
    finally:
        torch.set_num_threads(threads)
    print("\n" + table.text().rstrip() + f"; {time.perf_counter() - started:.0f} s in all", flush=True)
    if args.out:
        print(f"table and figures: {Path(args.out) / 'gpu_check.txt'}, {Path(args.out) / 'gpu_check.json'}")
    return 1 if any(r.status == "FAIL" for r in table.rows) else 0


def run_rows(ctx: Context, table: Table, args: argparse.Namespace, started: float) -> None:
    """Every row in turn, each in its own ``try`` and time limit, skipped once ``--budget-s`` is spent."""
    for name, kind, run in plan_rows(ctx):
        if args.only is not None and not any(name.startswith(p) for p in args.only):
            continue
        left = args.budget_s - (time.perf_counter() - started)
        if left <= 0:
            table.add(Row(name, "SKIPPED (budget)", f"--budget-s {args.budget_s:.0f} spent"))
            continue
        limit = min(ROW_LIMIT_S[kind], left + GRACE_S)   # the last row may run a little past the budget
        print(f"  ... {name} (limit {limit:.0f} s)", flush=True)
        t0 = time.perf_counter()
        try:
            with time_limit(limit), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = run()
            for r in result if isinstance(result, list) else [result]:   # fxpipe's warnings, first line each
                r.figures.setdefault("warnings", sorted({str(w.message).split(":")[0][:160] for w in caught}))
        except BaseException as exc:   # noqa: BLE001 - a row's failure is reported, the table goes on
            if isinstance(exc, KeyboardInterrupt):
                raise
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            result = Row(name, "FAIL", f"{type(exc).__name__}: {first}",
                         figures={"traceback": traceback.format_exc(limit=-8)})
        for r in result if isinstance(result, list) else [result]:
            if not r.seconds:
                r.seconds = time.perf_counter() - t0
            table.add(r)
        ctx.clean()


if __name__ == "__main__":
    sys.exit(main())
