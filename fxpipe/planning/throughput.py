"""Tokens per second per device and model FLOPs utilisation of a plan: the figures LLM runs are compared by.

A step's model FLOPs are three times its forward's as the planner costed it (``FlopCounterMode``'s count of
every matmul and attention of the traced graph; the backward twice the forward), recorded by ``fxpipe.plan`` as
``plan.predicted["model_flops"]``. Recomputation is not counted: this is model FLOPs utilisation as PaLM
defines it and torchtitan reports it, not the hardware's. A step's tokens are its samples times the tokens of
one sample of the first input when that is an integer tensor of two dimensions (token ids), read from the
example inputs the plan records. MFU divides the model FLOPs per second per device by the device's dense peak
for the training dtype (``plan.profile["peak_flops"]``: a preset's datasheet figure, so only plans made for a
preset have it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["record", "tokens_per_step", "devices_of", "throughput_line"]

_INTEGER = ("int64", "int32", "int16", "int8", "uint8")


def record(plan: Any, forward_flops_per_step: float, peak_flops: float | None) -> None:
    """Write a step's model FLOPs (from its forward's) and the devices' dense peak into ``plan``."""
    plan.predicted["model_flops"] = 3.0 * forward_flops_per_step
    if peak_flops:
        plan.profile["peak_flops"] = peak_flops


def tokens_per_step(plan: Any) -> int | None:
    """The tokens of one step (module doc), or ``None`` when the first input is not token ids."""
    inputs = (plan.frontend or {}).get("inputs") or {}
    leaves = inputs.get("leaves") or []
    first = leaves[0] if leaves else None
    if not isinstance(first, dict) or first.get("dtype") not in _INTEGER or len(first.get("shape", ())) != 2:
        return None
    dim = inputs.get("batch_dim", 0)
    dim = dim if dim in (0, 1) else 0
    return plan.batch_size * first["shape"][1 - dim]


def devices_of(plan: Any) -> int:
    """The devices one step runs on: the mesh's, else the pipeline's workers."""
    return plan.layout.world


def throughput_line(plan: Any) -> str | None:
    """``tokens/s ... per device, MFU ...`` for a plan of a token model with a predicted step, else ``None``: of
    the step with CPU workers sharing the processors where the plan predicts that one (``fxpipe.compile`` on CPU
    workers), else of its iteration."""
    p = plan.predicted
    tokens, step = tokens_per_step(plan), p.get("iteration_shared_s") or p.get("iteration_s")
    if not tokens or not step:
        return None
    world = devices_of(plan)
    line = f"tokens: {tokens:,} a step, {tokens / step:,.0f}/s, {tokens / step / world:,.0f}/s per device"
    flops, peak = p.get("model_flops"), plan.profile.get("peak_flops")
    layout = getattr(plan, "layout", None)
    dtype = "bfloat16" if layout is not None and layout.precision == "bf16-mixed" else plan.profile.get("dtype", "")
    if flops and peak:
        line += (f"; MFU {flops / (step * world * peak):.1%} (model FLOPs {flops:.3g} a step, 3x the forward's, "
                 f"against {peak / 1e12:,.0f} TFLOP/s dense {dtype} per device)")
    return line
