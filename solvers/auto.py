"""The default method: phases that each may improve the plan or the bound, and never lose a plan.

1. the DP (exact over contiguous stages, any placement); when its space holds an
   optimum of the reference problem (a chain-like order, where every convex
   partition is contiguous, and every placement searched), that is the answer,
   with the DP's gap if its time ran out: another phase would search the same plans;
2. when the DP did not prove its plan optimal and the graph has few ideals
   (:func:`solvers.dp.convex.convex_lattice`), the same label search over chains of ideals, exact over
   the whole reference space: when it finishes, that is the answer (on a chain-like order it searches the
   DP's space again, with other bounds, and is the last phase);
3. otherwise a lower bound over the whole reference space from the heaviest chain of nodes
   (:mod:`solvers.spine`), then, with HiGHS, the exact decomposition over convex partitions x
   placements (:mod:`solvers.exact`) when the placements are few enough, else the
   ILP over convex partitions on the DP's placement, warm-started from the DP.

``time_limit_s`` bounds the whole solve: the DP takes all of it when its space
holds an optimum of the reference problem and the order is too long for the search over ideals, or when
the problem allows replica groups (no later phase searches them), else :data:`DP_SHARE`; the search over
ideals :data:`IDEALS_SHARE` of the rest when the ILP phases could follow, else all of it. The heaviest chain's bound
then takes what it needs of the rest (up to :data:`SPINE_SHARE` of it when the exact
decomposition is to follow, which certifies on its own), and the convex phase (model
building included) what is left. A phase that finds nothing or times out
leaves the earlier phases' plan, and ``solver["phases"]`` says what each did.
The certificate combines them: every phase's ``lower_bound_s`` holds over the
whole reference space (:mod:`solvers.certificate`), so the largest one does.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from solvers.certificate import certify, contiguous_is_convex
from solvers.dp import solve_dp
from solvers.dp.convex import convex_lattice, few_steps, solve_convex
from solvers.errors import InfeasibleError
from solvers.problem import Problem
from solvers.solution import Solution
from solvers.spine import spine_lower_bound

__all__ = ["DP_SHARE", "IDEALS_SHARE", "SPINE_SHARE", "solve_auto"]

DP_SHARE = 0.5
"""Of the whole limit, what the DP may take when its space need not hold an optimum of the reference problem.

Past its first seconds the DP rarely improves its plan on the corpus of ``benchmarks/planner.py``, while the
heaviest chain's bound needs seconds on 16 devices: at 0.8 the bound of ViT-B/16 on two Titan V boxes was
25.8 % below the plan, at 0.5 it is 0.69 %, with the same plans everywhere."""

IDEALS_SHARE = 0.7
"""Of the time left after the DP, what the label search over ideals may take when the ILP phases could follow
(they get the rest if it does not finish). On the corpus it finishes in 0.4-2 s or is not run
(:data:`solvers.dp.lattice.MAX_STEPS`)."""

SPINE_SHARE = 0.4
"""Of the time left after the DP, what the heaviest chain's bound may take before the exact decomposition
(the rest is the decomposition's). Before the ILP on the DP's placement alone it may take all of it: that
ILP proves nothing over other placements, and on the corpus's problems of that kind it never bettered
the DP's plan."""


def _phase(name: str, run: Callable[[], Solution | None], log: list[dict[str, Any]]) -> Solution | None:
    """Run one phase; record its outcome; a phase that fails leaves None (never an exception)."""
    started = time.perf_counter()
    entry: dict[str, Any] = {"phase": name}
    try:
        sol = run()
    except InfeasibleError as exc:
        sol, entry["status"], entry["error"] = None, "no plan", str(exc)
    else:
        if sol is None:
            entry["status"] = "no plan within its time limit"
        else:
            entry.update(status="optimal" if sol.solver["optimal"] else
                         ("finished its space" if sol.solver["space_optimal"] else "stopped by its time limit"),
                         iteration_s=sol.predicted["iteration_s"], lower_bound_s=sol.solver["lower_bound_s"],
                         exact_over=sol.solver["exact_over"])
    entry["time_s"] = time.perf_counter() - started
    log.append(entry)
    return sol


def solve_auto(problem: Problem, time_limit_s: float = 10.0) -> Solution:
    """Best plan of all phases, certified as far as they together prove."""
    from solvers.exact import MAX_PLACEMENTS, placements, solve_exact
    from solvers.ilp import ilp_available, solve_ilp

    started = time.perf_counter()
    log: list[dict[str, Any]] = []
    errors: list[InfeasibleError] = []

    def keep_error(run: Callable[[], Solution | None]) -> Callable[[], Solution | None]:
        def wrapped() -> Solution | None:
            try:
                return run()
            except InfeasibleError as exc:
                errors.append(exc)
                raise
        return wrapped

    deadline = started + time_limit_s
    # When the DP's space may hold an optimum (a chain-like order), no later phase searches anything new
    # but the search over ideals, the same space with other bounds: the DP may take the whole budget, or
    # half when the order is short enough for that search; otherwise it leaves the rest to the bound and
    # the convex phase.
    # Replica groups: only the DP searches them (the later phases place one device per stage), so it takes
    # the whole budget.
    chain_like = contiguous_is_convex(problem) and problem.max_replicas == 1
    replicas = problem.max_replicas > 1
    lattice = None if replicas else convex_lattice(problem)   # None past MAX_IDEALS ideals (ViT-B/16: 0.3 s)
    dp_share = 1.0 if (chain_like and lattice is None) or replicas else DP_SHARE
    found = [s for s in [_phase("dp", keep_error(lambda: solve_dp(problem, time_limit_s=dp_share * time_limit_s)),
                                log)] if s is not None]
    dp = found[0] if found else None
    if dp is None and chain_like and errors and errors[0].proven:
        raise errors[0]   # the DP's space holds every plan of the reference problem, and it proved none fits
    rest = lambda: max(0.0, deadline - time.perf_counter())  # noqa: E731
    spine_lower = 0.0
    covered = dp is not None and (dp.solver["optimal"] or dp.solver["covers_reference"])
    if (lattice is not None and dp is not None and not dp.solver["optimal"] and rest() > 0
            and few_steps(problem, lattice, dp.predicted["iteration_s"])):
        # few ideals: the label search over them is exact over the whole reference space, and finishes
        # where the bound and the ILP below would not (ResNet-101 over 8 or 16 Titan V GPUs); on a chain it
        # searches the DP's space again, with other bounds and the smallest stage counts first, which found
        # U-Net plans 8-10 % faster than the DP's on the Titan V boxes
        share = IDEALS_SHARE if not covered and ilp_available() else 1.0
        sol = _phase("ideals", keep_error(lambda: solve_convex(problem, share * rest(), dp, lattice=lattice,
                                                                prove=covered)), log)
        if sol is not None:
            found.append(sol)
            covered = covered or sol.solver["space_optimal"]
    candidates = placements(problem, MAX_PLACEMENTS) if not covered and problem.max_replicas == 1 else None
    if dp is not None and not covered and rest() > 0:
        # a bound over the whole space from the heaviest chain (solvers.spine): the convex phase's own
        # bound holds for one placement only, or closes slowly
        phase_started = time.perf_counter()
        spine_lower = spine_lower_bound(problem, (SPINE_SHARE if candidates is not None else 1.0) * rest())
        log.append({"phase": "spine", "status": "lower bound over the whole reference space",
                    "lower_bound_s": spine_lower, "time_s": time.perf_counter() - phase_started})
    left = rest()
    if covered:
        pass   # every convex partition on every placement was in the DP's space: nothing else to search
    elif left <= 0:
        log.append({"phase": "convex", "status": f"skipped: the time limit of {time_limit_s} s is spent",
                    "time_s": 0.0})
    elif not ilp_available():
        log.append({"phase": "convex", "status": "skipped: HiGHS (highspy) is not installed", "time_s": 0.0})
    elif problem.max_replicas > 1:
        log.append({"phase": "convex", "status": "skipped: the ILP models one device per stage, "
                                                 "the problem allows replica groups", "time_s": 0.0})
    else:
        if candidates is not None:
            sol = _phase("exact", keep_error(lambda: solve_exact(problem, rest(), dp, candidates)), log)
        elif dp is not None:
            sol = _phase("ilp", keep_error(lambda: solve_ilp(problem, rest(), warm_start=dp)), log)
        else:
            sol = _phase("ilp", keep_error(lambda: solve_ilp(problem, rest())), log)
        if sol is not None:
            found.append(sol)
    if not found:
        raise errors[0] if errors else InfeasibleError(
            f"no phase found a plan within the time limit of {time_limit_s} s; raise the time limit",
            min_peak_bytes=None, proven=False)
    best = min(found, key=lambda s: s.predicted["iteration_s"])
    lower = max([s.solver["lower_bound_s"] for s in found] + [spine_lower])
    chosen = next(e["phase"] for e in log if e.get("iteration_s") == best.predicted["iteration_s"])
    covering = [s for s in found if s.solver["covers_reference"]]
    return certify(problem, best, method="auto", started=started,
                   exact_over="; ".join(f"{e['phase']}: {e['exact_over']}" for e in log if "exact_over" in e),
                   covers_reference=bool(covering), space_optimal=any(s.solver["space_optimal"] for s in covering),
                   global_lower_s=lower, chosen=chosen, phases=log)
