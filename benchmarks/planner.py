"""Planner benchmark: fxpipe's solver against the anchor partitioners on the fixed corpus.

Reads ``benchmarks/problems/*.json`` (made once by ``make_problems.py``: six real
models on 4 and 8 NVLink GPUs, the 8-GPU PIX/PHB/SYS Titan V box, and two such
boxes over 100 Gb/s), runs ``solvers.solve(method="auto")`` (the command line's
default: exact DP with placement, then convex partitions on every placement or the DP's) with a
time limit, and every anchor. Prints per problem and method the reference
iteration time, the ratio to fxpipe, the certified gap and the solve time; then
geometric means, the best anchor partitioner per problem, and topology-blind
placement on the communication-heavy problems of the Titan V boxes. Then the
whole solve on synthetic residual chains of 400 nodes on the Titan V box and 3000
nodes on two such boxes (the issue's scale targets: certified in < 1 s and < 10 s).

    python benchmarks/planner.py                      # whole corpus, ~10 minutes
    python benchmarks/planner.py --only resnet101 --time-limit 5
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

from solvers import Problem, score, solve
from solvers.anchors import anchor_solution
from solvers.compare import compare, format_table

HERE = Path(__file__).parent
PARTITIONERS = ("uniform", "parameters", "block", "pippy")
COMM_HEAVY = 0.15   # share of transfers in the blind plan's bottleneck stage


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else math.nan


def synthetic(n: int, box: str, seed: int = 0) -> Problem:
    """A residual chain (a skip over every 3 nodes) on the devices and links of a corpus topology
    (``titan8``: the 8-GPU PIX/PHB/SYS Titan V box; ``titan16x2``: two of them over a network)."""
    rng = random.Random(seed)
    like = Problem.load(HERE / "problems" / f"resnet101@{box}.json").to_dict()
    nodes = [dict(id=f"n{i}", fwd_s=rng.uniform(1e-4, 1e-3), bwd_s=rng.uniform(2e-4, 2e-3),
                  param_bytes=rng.uniform(0, 4e6), act_bytes=rng.uniform(1e6, 8e6)) for i in range(n)]
    edges = [dict(src=f"n{i}", dst=f"n{i + 1}", bytes=rng.uniform(1e6, 8e6)) for i in range(n - 1)]
    edges += [dict(src=f"n{i}", dst=f"n{i + 3}", bytes=rng.uniform(1e6, 8e6)) for i in range(0, n - 3, 3)]
    return Problem.from_dict(dict(format="fxpipe-problem/1", name=f"chain{n}@{box}", micro_batches=8,
                                  schedule="1f1b", optimizer_state_factor=2.0, nodes=nodes, edges=edges,
                                  devices=like["devices"], links=like["links"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-limit", type=float, default=10.0, help="per method phase (DP, ILP), seconds")
    parser.add_argument("--only", nargs="*", help="problem names containing any of these")
    parser.add_argument("--skip-scaling", action="store_true")
    args = parser.parse_args(argv)
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
        if not p.name.endswith("@titan8"):
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
        print("\nWhole solve (method auto, the command's default) on synthetic residual chains:")
        for n, box in ((400, "titan8"), (3000, "titan16x2")):
            p = synthetic(n, box)
            started = time.perf_counter()
            sol = solve(p, "auto", args.time_limit)
            print(f"  {n} nodes x {len(p.devices)} devices ({box}): {time.perf_counter() - started:.2f} s, "
                  f"{len(sol.stages)} stages, optimal={sol.solver['optimal']}, gap {sol.solver['gap']:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
