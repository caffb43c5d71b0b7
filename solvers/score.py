"""The reference score of ``fxpipe-problem/1`` and ``/2``: the yardstick every solver is judged by.

Stage time ``t_s`` = compute / device speed + transfers of every tensor that
crosses its boundary (forward and gradient, charged to both ends, once per
receiving stage); iteration time ``T = sum t_s + (m - 1) max t_s``; memory
``M_s = params (1 + optimizer factor) + activations x in-flight micro-batches``.
A stage on a replica group (version 2) is scored as :mod:`solvers.groups` says:
compute and activations divided by ``r``, plus its all-reduce spread over ``m``.
"""

from __future__ import annotations

from dataclasses import dataclass

from solvers.errors import InvalidProblemError
from solvers.groups import GroupTable, allreduce_s
from solvers.problem import Problem
from solvers.solution import Solution

__all__ = ["Score", "score", "score_assignment", "transfer_cost_s"]


@dataclass(frozen=True)
class Score:
    iteration_s: float
    stage_s: list[float]
    compute_s: list[float]
    comm_s: list[float]
    peak_bytes: list[float]        # per device of the stage
    feasible: bool
    bottleneck: int
    allreduce_s: list[float] | None = None   # per iteration; None when no stage is replicated

    def as_predicted(self) -> dict:
        out = {"iteration_s": self.iteration_s, "stage_s": self.stage_s, "compute_s": self.compute_s,
               "comm_s": self.comm_s, "peak_bytes": self.peak_bytes, "feasible": self.feasible,
               "bottleneck": self.bottleneck}
        if self.allreduce_s is not None:
            out["allreduce_s"] = self.allreduce_s
        return out


def transfer_cost_s(problem: Problem, nbytes: float, src_dev: int, dst_dev: int) -> float:
    """One-way time of ``nbytes`` between two devices (forward or gradient, not both)."""
    return nbytes / problem.bandwidth_Bps[src_dev][dst_dev] + problem.latency_s[src_dev][dst_dev]


def score_assignment(problem: Problem, stage_of: dict[str, int],
                     device_of_stage: list[int] | list[tuple[int, ...]]) -> Score:
    """Score ``node -> stage index`` with ``stage -> device index`` (or a tuple of replica devices).

    Raises if an edge goes backwards.
    """
    p = len(device_of_stage)
    table = GroupTable(problem)
    group = [table.add(tuple(d) if isinstance(d, (tuple, list)) else (d,)) for d in device_of_stage]
    replicated = any(table.groups[g].replicas > 1 for g in group)
    nodes = problem.node_map()
    compute = [0.0] * p
    params = [0.0] * p
    acts = [0.0] * p
    for node_id, node in nodes.items():
        s = stage_of[node_id]
        compute[s] += (node.fwd_s + node.bwd_s) / table.groups[group[s]].speed
        params[s] += node.param_bytes
        acts[s] += node.act_bytes
    # (src node, receiving stage) -> bytes: one transfer per receiving stage.
    sends: dict[tuple[str, int], float] = {}
    for e in problem.edges:
        a, b = stage_of[e.src], stage_of[e.dst]
        if b < a:
            raise InvalidProblemError(
                f"edge {e.src!r} -> {e.dst!r} goes backwards, from stage {a} to stage {b}"
            )
        if a != b:
            key = (e.src, b)
            sends[key] = max(sends.get(key, 0.0), e.bytes)
    comm = [0.0] * p
    for (src, b), nbytes in sends.items():
        a = stage_of[src]
        c = 2.0 * table.transfer_s(nbytes, group[a], group[b])
        comm[a] += c
        comm[b] += c
    ar = [allreduce_s(table.groups[group[s]], params[s]) for s in range(p)]
    stage_s = [compute[s] + comm[s] + ar[s] / problem.micro_batches for s in range(p)]
    worst = max(range(p), key=stage_s.__getitem__)
    iteration = sum(stage_s) + (problem.micro_batches - 1) * stage_s[worst]
    factor = 1.0 + problem.optimizer_state_factor
    peak = [params[s] * factor + acts[s] * problem.inflight(s, p) / table.groups[group[s]].replicas
            for s in range(p)]
    feasible = all(peak[s] <= table.groups[group[s]].memory_bytes for s in range(p))
    return Score(iteration, stage_s, compute, comm, peak, feasible, worst, ar if replicated else None)


def score(problem: Problem, solution: Solution) -> Score:
    """Validate ``solution`` against ``problem`` and compute its reference score."""
    device_index = {d.id: i for i, d in enumerate(problem.devices)}
    stage_of: dict[str, int] = {}
    device_of_stage: list[tuple[int, ...]] = []
    used: set[int] = set()
    for s, stage in enumerate(solution.stages):
        if not stage.devices:
            raise InvalidProblemError(f"stage {s} has no device")
        if len(stage.devices) > problem.max_replicas:
            raise InvalidProblemError(
                f"stage {s} has {len(stage.devices)} devices but the problem allows max_replicas="
                f"{problem.max_replicas}; replicated stages need format fxpipe-problem/2 with max_replicas set")
        for dev in stage.devices:
            if dev not in device_index:
                raise InvalidProblemError(f"stage {s} names device {dev!r}, which is not in the problem")
            if device_index[dev] in used:
                raise InvalidProblemError(f"device {dev!r} is used by two stages (or twice in one group)")
            used.add(device_index[dev])
        device_of_stage.append(tuple(device_index[d] for d in stage.devices))
        if not stage.nodes:
            raise InvalidProblemError(f"stage {s} is empty")
        for n in stage.nodes:
            if n in stage_of:
                raise InvalidProblemError(f"node {n!r} is in stage {stage_of[n]} and stage {s}")
            stage_of[n] = s
    missing = [n.id for n in problem.nodes if n.id not in stage_of]
    if missing:
        raise InvalidProblemError(f"{len(missing)} nodes are in no stage, e.g. {missing[:3]}")
    known = problem.node_map()   # once: built per node, scoring a 2,500-node problem took seconds
    unknown = [n for n in stage_of if n not in known]
    if unknown:
        raise InvalidProblemError(f"solution names nodes not in the problem: {unknown[:3]}")
    return score_assignment(problem, stage_of, device_of_stage)
