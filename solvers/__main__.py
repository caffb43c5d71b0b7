"""Command line of the planner: ``python -m solvers solve|search|score|compare PROBLEM.json``."""

from __future__ import annotations

import argparse
import json
import sys
import time

from solvers import METHODS, InfeasibleError, Problem, Solution, SolverError, score, solve
from solvers.schedules import MEMORY_MODELS, get_schedule


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m solvers", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_solve = sub.add_parser("solve", help="solve a problem and print (or write) the solution JSON")
    p_solve.add_argument("problem")
    p_solve.add_argument("-o", "--output", help="write the solution here instead of stdout")
    p_solve.add_argument("--method", default="auto", choices=METHODS,
                         help="auto (default): exact DP, then the search over ideals or convex partitions on every placement (or on the DP's)")
    p_solve.add_argument("--time-limit", type=float, default=10.0, help="time limit of the whole solve in seconds (default 10); the best plan found by then is returned")
    p_search = sub.add_parser("search", help="joint search over micro-batches, schedule and stages; prints the table")
    p_search.add_argument("problem")
    p_search.add_argument("--micro-batches", type=int, nargs="+", help="counts to try (default: the problem's)")
    p_search.add_argument("--schedules", nargs="+",
                          default=[s for s in MEMORY_MODELS if not get_schedule(s).split_backward],
                          help="memory models to search (default: those with a whole backward)")
    p_search.add_argument("--stages", type=int, nargs="+", help="stage counts to try (default: free)")
    p_search.add_argument("--node-overhead", type=float, default=0.0,
                          help="per-node seconds that do not shrink with the micro-batch (default 0)")
    p_search.add_argument("--method", default="dp", choices=METHODS)
    p_search.add_argument("--time-limit", type=float, default=10.0)
    p_search.add_argument("-o", "--output", help="write the best solution here")
    p_cmp = sub.add_parser("compare", help="score fxpipe's solver and every anchor partitioner on problems")
    p_cmp.add_argument("problems", nargs="+")
    p_score = sub.add_parser("score", help="print the reference score of a solution")
    p_score.add_argument("problem")
    p_score.add_argument("solution")
    started = time.perf_counter()
    args = parser.parse_args(argv)
    try:
        if args.command == "compare":
            from solvers.compare import compare, format_table
            print(format_table(compare([Problem.load(p) for p in args.problems])))
            return 0
        problem = Problem.load(args.problem)
        if args.command == "search":
            from solvers.joint import format_trials, joint_search
            best, variant, trials = joint_search(problem, args.micro_batches, args.schedules,
                                                 args.stages or [None], args.method, args.time_limit,
                                                 args.node_overhead)
            print(format_trials(trials))
            print(f"best: {variant.micro_batches} micro-batches, {variant.schedule}, {len(best.stages)} stages, "
                  f"{best.predicted['iteration_s'] * 1e3:.3f} ms per iteration")
            if args.output:
                best.save(args.output)
            return 0
        if args.command == "solve":
            # The limit is the whole command's: reading the problem counts too.
            budget = max(0.0, args.time_limit - (time.perf_counter() - started))
            doc = json.dumps(solve(problem, args.method, budget).to_dict(), indent=1)
            if args.output:
                with open(args.output, "w") as f:
                    f.write(doc)
            else:
                print(doc)
        else:
            sc = score(problem, Solution.load(args.solution))
            print(json.dumps(sc.as_predicted(), indent=1))
    except InfeasibleError as exc:
        print(f"infeasible: {exc}", file=sys.stderr)
        return 3
    except (SolverError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
