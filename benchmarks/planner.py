"""Planner benchmark: fxpipe's solver against the anchor partitioners on the fixed corpus.

Reads ``benchmarks/problems/*.json`` (made once by ``make_problems.py``: six real
models on 4 and 8 NVLink GPUs, the 8-GPU PIX/PHB/SYS Titan V box, and two such
boxes over 100 Gb/s), runs ``solvers.solve(method="auto")`` (the command line's
default: exact DP with placement, then convex partitions on every placement or the DP's) with a
time limit, and every anchor. Prints per problem and method the reference
iteration time, the ratio to fxpipe, the certified gap and the solve time; then
geometric means, the best anchor partitioner per problem, and topology-blind
placement on the communication-heavy problems of the Titan V boxes. Then the
scale table: the whole command (``python -m solvers solve``) on the synthetic residual
chains of ``benchmarks/problems/scale/`` (400 nodes on the Titan V box, 3000 on two such
boxes; the issue's targets: certified in < 1 s and < 10 s; also another seed, and every third GPU
at half speed), repeated, with the load average.

    python benchmarks/planner.py                      # whole corpus, ~10 minutes
    python benchmarks/planner.py --only resnet101 --time-limit 5
    python benchmarks/planner.py --scale-only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from solvers import Problem, score
from solvers.anchors import anchor_solution
from solvers.compare import compare, format_table

HERE = Path(__file__).parent
PARTITIONERS = ("uniform", "parameters", "block", "pippy", "pytorch-auto", "megatron")
COMM_HEAVY = 0.15   # share of transfers in the blind plan's bottleneck stage


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else math.nan


def scale_table(time_limit_s: float, repeats: int) -> str:
    """Whole command (``python -m solvers solve P.json``, a fresh process) on the scale problems."""
    rows = []
    for path in sorted((HERE / "problems" / "scale").glob("*.json")):
        problem = Problem.load(path)
        times, doc = [], {}
        for _ in range(repeats):
            started = time.perf_counter()
            run = subprocess.run([sys.executable, "-m", "solvers", "solve", str(path),
                                  "--time-limit", str(time_limit_s)], capture_output=True, text=True)
            times.append(time.perf_counter() - started)
            doc = json.loads(run.stdout) if run.returncode == 0 else {}
        solver = doc.get("solver", {})
        rows.append([problem.name, str(len(problem.nodes)), str(len(problem.devices)),
                     f"{min(times):.2f}", f"{statistics.median(times):.2f}",
                     "yes" if solver.get("optimal") else "no",
                     f"{solver['gap']:.2%}" if "gap" in solver else "no plan"])
    head = ["problem", "nodes", "devices", "seconds (min)", "seconds (median)", "certified", "gap"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [head] + rows]
    load = os.getloadavg()
    return "\n".join(lines + [f"({repeats} runs each, time limit {time_limit_s} s, whole command; "
                               f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-limit", type=float, default=10.0, help="of the whole solve, seconds")
    parser.add_argument("--only", nargs="*", help="problem names containing any of these")
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument("--skip-interleaved", action="store_true", help="skip the interleaved Titan V table")
    parser.add_argument("--scale-only", action="store_true", help="only the scale table")
    parser.add_argument("--repeats", type=int, default=3, help="runs per scale problem (default 3)")
    args = parser.parse_args(argv)
    if args.scale_only:
        print(scale_table(args.time_limit, args.repeats))
        return 0
    paths = sorted((HERE / "problems").glob("*.json"))
    problems = [Problem.load(p) for p in paths]
    if args.only:
        problems = [p for p in problems if any(s in p.name for s in args.only)]
    rows = compare(problems, "auto", time_limit_s=args.time_limit,
                   progress=lambda name: print(f"solving {name}", file=sys.stderr, flush=True))
    print(format_table(rows))

    by_problem: dict[str, dict[str, float]] = {}
    for r in rows:
        by_problem.setdefault(r.problem, {})[r.method] = r.relative
    best_anchor = [min(v[a] for a in PARTITIONERS if math.isfinite(v[a]))
                   for v in by_problem.values() if any(math.isfinite(v[a]) for a in PARTITIONERS)]
    worse = [(r.problem, r.method) for r in rows if math.isfinite(r.relative) and r.relative < 1 - 1e-9]
    print(f"\nbest anchor partitioner per problem, geometric mean vs fxpipe: {geomean(best_anchor):.3f}x "
          f"over {len(best_anchor)} problems (worst case {min(best_anchor):.3f}x)")
    print(f"problems where an anchor beats fxpipe: {worse or 'none'}")
    heavy = []
    for p in problems:
        if "titan" not in p.name:
            continue
        sol = anchor_solution(p, "blind")
        sc = score(p, sol)
        if sc.comm_s[sc.bottleneck] >= COMM_HEAVY * sc.stage_s[sc.bottleneck]:
            heavy.append((p.name, by_problem[p.name]["blind"]))
    print(f"topology-blind on communication-heavy Titan V problems (transfers >= {COMM_HEAVY:.0%} of the "
          f"blind bottleneck stage): geometric mean {geomean([h for _, h in heavy]):.3f}x over {len(heavy)}: "
          + ", ".join(f"{n} {h:.3f}x" for n, h in heavy))

    # Not part of the corpus: the same Titan V problems with the device list interleaved across the
    # sockets (0,4,1,5,2,6,3,7), as a scheduler that hands out GPUs round-robin would give them. On the
    # box as numbered, stage i on device i already follows the topology; here it does not.
    interleave = [0, 4, 1, 5, 2, 6, 3, 7]
    shuffled = []
    for p in problems:
        if not p.name.endswith("@titan8") or args.skip_interleaved:
            continue
        doc = p.to_dict()
        doc["name"] = p.name + "-interleaved"
        doc["devices"] = [doc["devices"][i] for i in interleave]
        for key in ("bandwidth_Bps", "latency_s"):
            doc["links"][key] = [[doc["links"][key][i][j] for j in interleave] for i in interleave]
        shuffled.append(Problem.from_dict(doc))
    if shuffled:
        print("\nTitan V box with the device list interleaved across sockets (not in the corpus):")
        extra = compare(shuffled, "dp", anchors=["blind"], time_limit_s=args.time_limit,
                        progress=lambda name: print(f"solving {name}", file=sys.stderr, flush=True))
        print(format_table(extra))

    if not args.skip_scaling:
        print("\nScale: the whole command on synthetic residual chains (benchmarks/make_problems.py --scale):")
        print(scale_table(args.time_limit, args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
