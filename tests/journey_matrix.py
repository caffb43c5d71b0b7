"""Test helper, run under ``torchrun``: many journeys in one group of processes.

``python -m torch.distributed.run --nproc-per-node N tests/journey_matrix.py CASES.json`` runs, for every case
of the JSON list (``{"plan", "family", "schedule", "lr", "checkpoint", "out"}``), what a user runs as two commands —
``fxpipe.launch`` for 3 steps with a checkpoint, then ``fxpipe.launch --resume`` for the rest — by calling
:func:`fxpipe.launch.main` with those very arguments, once each, in this process; a case with ``"argv"`` (and
``"name"``, ``"plan"``, ``"out"``) runs that one command instead, and one that also has ``"fails": true`` is
expected to end with an error (its output kept, the next case run). The process group is joined
once, here, and kept (``main`` uses the one it finds and is kept from destroying it): a group joined again on
torchrun's store would read the keys its previous incarnation left there (the old ranks' addresses). Each rank's output of a case goes to ``out/rankR.txt``; a case
that fails stops this rank with exit status 1 (the others end on their waits' timeout). One torchrun for every
model, schedule and resume saves the start-up of the processes (importing torch and transformers) per case.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import torch.distributed as dist
from journey_target import STEPS

import fxpipe.launch


def main(cases_path: str) -> int:
    rank = int(os.environ["RANK"])
    with open(cases_path) as f:
        cases = json.load(f)
    dist.init_process_group("gloo")
    destroy, dist.destroy_process_group = dist.destroy_process_group, lambda *a, **k: None
    try:
        return _run(cases, rank)
    finally:
        dist.destroy_process_group = destroy
        destroy()


def _commands(case: dict) -> list[list[str]]:
    """The launch commands of a case: its own (``"argv"``), else a journey's two."""
    if "argv" in case:
        return [case["argv"]]
    name = case["family"].replace("-", "_")
    common = ["--plan", case["plan"], "--model", f"journey_target:{name}", "--data", f"journey_target:data_{name}",
              "--lr", str(case["lr"]), "--checkpoint", case["checkpoint"], "--timeout", "120",
              "--schedule", case["schedule"]]
    return [[*common, "--steps", "3"], [*common, "--resume", "--steps", str(STEPS - 3)]]


def _run(cases: list[dict], rank: int) -> int:
    for case in cases:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = 0
            for argv in _commands(case):
                code = code or fxpipe.launch.main(argv)
        os.makedirs(case["out"], exist_ok=True)
        with open(os.path.join(case["out"], f"rank{rank}.txt"), "w") as f:
            f.write(out.getvalue() + err.getvalue())
        if (code != 0) != bool(case.get("fails")):
            what = "failed" if code else "did not fail"
            print(f"rank {rank}: {case.get('family', case.get('name'))} ({case['plan']}) {what}:\n{err.getvalue()}",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
