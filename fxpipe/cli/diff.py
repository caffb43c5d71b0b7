"""``fxpipe diff A B``: what differs between two saved plans (cuts, devices, micro-batching, predictions).

Exit status as diff(1): 0 when the plans place every node on the same stage and device with the same
micro-batching and schedule, 1 when they differ.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run", "differences"]

EXAMPLES = """examples:
  fxpipe diff fast.plan.json thorough.plan.json
  fxpipe diff a.json b.json && echo same cuts
"""


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("diff", help="compare two saved plans: cuts, devices, micro-batching, predictions",
                            epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter, parents=parents)
    parser.add_argument("a")
    parser.add_argument("b")


def differences(a: Any, b: Any) -> list[str]:
    """Lines naming what differs between plans ``a`` and ``b`` (empty: the same pipeline)."""
    out = [f"{name}: {getattr(a, name)!r} -> {getattr(b, name)!r}"
           for name in ("model", "fingerprint", "chunks", "schedule", "checkpoint", "batch_size", "virtual_stages")
           if getattr(a, name) != getattr(b, name)]
    if len(a.stages) != len(b.stages):
        out.append(f"stages: {len(a.stages)} -> {len(b.stages)}")
    stage_a, stage_b = a.stage_of(), b.stage_of()
    moved = [n for n in stage_a if stage_b.get(n) != stage_a[n]]
    if moved or set(stage_b) - set(stage_a):
        out.append(f"cuts: {len(moved)} of {len(stage_a)} nodes on another stage (first: "
                   f"{', '.join(f'{n} {stage_a[n]}->{stage_b.get(n)}' for n in moved[:3])})")
        out.append(f"  nodes per stage: {[len(s.nodes) for s in a.stages]} -> {[len(s.nodes) for s in b.stages]}")
    devices_a, devices_b = [s.device for s in a.stages], [s.device for s in b.stages]
    if devices_a != devices_b:
        out.append(f"devices: {devices_a} -> {devices_b}")
    if out:
        ia, ib = a.predicted.get("iteration_s"), b.predicted.get("iteration_s")
        if ia and ib:
            out.append(f"predicted iteration: {ia * 1e3:.2f} ms -> {ib * 1e3:.2f} ms ({ib / ia - 1:+.1%})")
    return out


def run(args: argparse.Namespace) -> int:
    import fxpipe
    found = differences(fxpipe.load_plan(args.a), fxpipe.load_plan(args.b))
    print("\n".join(found) if found else "same pipeline: every node on the same stage and device")
    return 1 if found else 0
