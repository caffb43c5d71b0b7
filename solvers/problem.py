"""The planning problem (``fxpipe-problem/1`` and ``/2``): a costed DAG, devices and links.

Version 2 adds ``max_replicas``: a stage may run as a data-parallel group of up
to that many devices (see :mod:`solvers.groups` for how such a stage is scored).
Version 1 files are read as ``max_replicas = 1``; a problem is written as
version 1 unless it allows replicas.

Loading validates everything a solver relies on, so solvers never see a
cycle, a dangling edge, a negative cost or a link matrix of the wrong size.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx

from solvers.errors import InvalidProblemError
from solvers.schedules import MEMORY_MODELS
from solvers.schedules import inflight as schedule_inflight

__all__ = ["Node", "Edge", "Device", "Problem", "SCHEDULES", "PROBLEM_FORMAT", "PROBLEM_FORMATS"]

PROBLEM_FORMAT = "fxpipe-problem/1"
PROBLEM_FORMATS = ("fxpipe-problem/1", "fxpipe-problem/2")
SCHEDULES = MEMORY_MODELS   # the memory models the cut solver plans under (interleaved-1f1b plans as 1f1b)


@dataclass(frozen=True)
class Node:
    id: str
    fwd_s: float
    bwd_s: float
    param_bytes: float = 0.0
    act_bytes: float = 0.0


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    bytes: float


@dataclass(frozen=True)
class Device:
    id: str
    memory_bytes: float
    speed: float = 1.0


def _number(obj: dict[str, Any], key: str, where: str, default: float | None = None) -> float:
    if key not in obj:
        if default is None:
            raise InvalidProblemError(f"{where}: missing field {key!r}")
        return default
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidProblemError(f"{where}: field {key!r} must be a finite number, got {value!r}")
    if value < 0:
        raise InvalidProblemError(f"{where}: field {key!r} must be >= 0, got {value!r}")
    return float(value)


@dataclass
class Problem:
    """A validated planning problem.

    ``order`` is a topological order of the nodes: the given node order when
    it is already topological (fxpipe passes the traced graph's order), else
    the lexicographic topological order by input position.
    """

    nodes: list[Node]
    edges: list[Edge]
    devices: list[Device]
    bandwidth_Bps: list[list[float]]
    latency_s: list[list[float]]
    micro_batches: int = 1
    schedule: str = "gpipe"
    stages: int | None = None
    optimizer_state_factor: float = 0.0
    name: str = "problem"
    max_replicas: int = 1
    order: list[str] = field(default_factory=list)
    recompute: bool = False   # every stage checkpointed: one micro-batch's activations at a time

    def __post_init__(self) -> None:
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        ids = [n.id for n in self.nodes]
        if not ids:
            raise InvalidProblemError("problem has no nodes")
        seen: set[str] = set()
        for node_id in ids:
            if node_id in seen:
                raise InvalidProblemError(f"node id {node_id!r} appears twice")
            seen.add(node_id)
        for e in self.edges:
            for end in (e.src, e.dst):
                if end not in seen:
                    raise InvalidProblemError(
                        f"edge {e.src!r} -> {e.dst!r} names node {end!r}, which is not in 'nodes'"
                    )
            if e.src == e.dst:
                raise InvalidProblemError(f"edge {e.src!r} -> {e.dst!r} is a self-loop")
        if self.schedule not in SCHEDULES:
            raise InvalidProblemError(
                f"unknown schedule {self.schedule!r}; expected one of {', '.join(SCHEDULES)}"
            )
        if not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise InvalidProblemError(f"micro_batches must be an integer >= 1, got {self.micro_batches!r}")
        d = len(self.devices)
        if d == 0:
            raise InvalidProblemError("problem has no devices")
        if isinstance(self.max_replicas, bool) or not isinstance(self.max_replicas, int) or not (
                1 <= self.max_replicas <= d):
            raise InvalidProblemError(
                f"max_replicas must be an integer in 1..{d} (the number of devices), got {self.max_replicas!r}")
        if self.stages is not None and not (1 <= self.stages <= min(d, len(ids))):
            raise InvalidProblemError(
                f"stages={self.stages} but it must lie in 1..{min(d, len(ids))} "
                f"({d} devices, {len(ids)} nodes); use null to let the solver choose"
            )
        for name, matrix in (("bandwidth_Bps", self.bandwidth_Bps), ("latency_s", self.latency_s)):
            if len(matrix) != d or any(len(row) != d for row in matrix):
                shape = f"{len(matrix)}x{len(matrix[0]) if matrix else 0}"
                raise InvalidProblemError(
                    f"links.{name} is {shape} but there are {d} devices; it must be {d}x{d}"
                )
            for i, row in enumerate(matrix):
                for j, v in enumerate(row):
                    if not isinstance(v, (int, float)) or v < 0 or not math.isfinite(v):
                        raise InvalidProblemError(f"links.{name}[{i}][{j}] must be a finite number >= 0, got {v!r}")
                    if name == "bandwidth_Bps" and i != j and v <= 0:
                        raise InvalidProblemError(
                            f"links.bandwidth_Bps[{i}][{j}] is 0: devices {i} and {j} cannot talk; "
                            "give every pair of distinct devices a positive bandwidth"
                        )
        for dev in self.devices:
            if dev.speed <= 0:
                raise InvalidProblemError(f"device {dev.id!r}: speed must be > 0, got {dev.speed}")
        graph = self.graph()
        if not nx.is_directed_acyclic_graph(graph):
            cycle = nx.find_cycle(graph)
            path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
            raise InvalidProblemError(f"the graph has a cycle: {path}")
        index = {n: i for i, n in enumerate(ids)}
        if all(index[e.src] < index[e.dst] for e in self.edges):
            self.order = list(ids)
        else:
            self.order = list(nx.lexicographical_topological_sort(graph, key=index.__getitem__))

    # ------------------------------------------------------------------ helpers
    def graph(self) -> nx.DiGraph:
        g = nx.DiGraph()
        g.add_nodes_from(n.id for n in self.nodes)
        g.add_edges_from((e.src, e.dst) for e in self.edges)
        return g

    def node_map(self) -> dict[str, Node]:
        return {n.id: n for n in self.nodes}

    def inflight(self, stage: int, num_stages: int) -> int:
        """Micro-batches whose activations stage ``stage`` holds at its peak."""
        if self.recompute:   # checkpointed: the one being recomputed (kept inputs are the caller's check)
            return 1
        return schedule_inflight(self.schedule, stage, num_stages, self.micro_batches)

    # ------------------------------------------------------------------ JSON
    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> "Problem":
        if not isinstance(doc, dict):
            raise InvalidProblemError("a problem must be a JSON object")
        fmt = doc.get("format")
        if fmt not in PROBLEM_FORMATS:
            raise InvalidProblemError(f"format is {fmt!r}; this solver reads {' and '.join(map(repr, PROBLEM_FORMATS))}")
        if fmt == PROBLEM_FORMAT and doc.get("max_replicas", 1) != 1:
            raise InvalidProblemError("max_replicas needs format 'fxpipe-problem/2' (version 1 has one device per stage)")
        for key in ("nodes", "edges", "devices", "links"):
            if key not in doc:
                raise InvalidProblemError(f"missing field {key!r}")
        nodes = []
        for i, n in enumerate(doc["nodes"]):
            where = f"nodes[{i}]"
            if not isinstance(n, dict) or "id" not in n:
                raise InvalidProblemError(f"{where}: missing field 'id'")
            where = f"node {n['id']!r}"
            nodes.append(Node(str(n["id"]), _number(n, "fwd_s", where), _number(n, "bwd_s", where),
                              _number(n, "param_bytes", where, 0.0), _number(n, "act_bytes", where, 0.0)))
        edges = []
        for i, e in enumerate(doc["edges"]):
            where = f"edges[{i}]"
            if not isinstance(e, dict) or "src" not in e or "dst" not in e:
                raise InvalidProblemError(f"{where}: an edge needs 'src' and 'dst'")
            edges.append(Edge(str(e["src"]), str(e["dst"]), _number(e, "bytes", where, 0.0)))
        devices = []
        for i, dv in enumerate(doc["devices"]):
            where = f"devices[{i}]"
            if not isinstance(dv, dict) or "id" not in dv:
                raise InvalidProblemError(f"{where}: missing field 'id'")
            devices.append(Device(str(dv["id"]), _number(dv, "memory_bytes", where),
                                  _number(dv, "speed", where, 1.0)))
        links = doc["links"]
        if not isinstance(links, dict) or "bandwidth_Bps" not in links:
            raise InvalidProblemError("links: missing field 'bandwidth_Bps'")
        latency = links.get("latency_s") or [[0.0] * len(devices) for _ in devices]
        stages = doc.get("stages")
        return cls(
            nodes=nodes, edges=edges, devices=devices,
            bandwidth_Bps=[list(map(float, r)) for r in links["bandwidth_Bps"]],
            latency_s=[list(map(float, r)) for r in latency],
            micro_batches=doc.get("micro_batches", 1), schedule=doc.get("schedule", "gpipe"),
            stages=stages, optimizer_state_factor=_number(doc, "optimizer_state_factor", "problem", 0.0),
            name=str(doc.get("name", "problem")), max_replicas=doc.get("max_replicas", 1),
            recompute=bool(doc.get("recompute", False)),
        )

    def to_dict(self) -> dict[str, Any]:
        doc = {
            "format": PROBLEM_FORMATS[1] if self.max_replicas > 1 else PROBLEM_FORMAT,
            "name": self.name,
            "micro_batches": self.micro_batches,
            "schedule": self.schedule,
            "stages": self.stages,
            "optimizer_state_factor": self.optimizer_state_factor,
            "nodes": [vars(n).copy() for n in self.nodes],
            "edges": [vars(e).copy() for e in self.edges],
            "devices": [vars(d).copy() for d in self.devices],
            "links": {"bandwidth_Bps": self.bandwidth_Bps, "latency_s": self.latency_s},
        }
        if self.max_replicas > 1:
            doc["max_replicas"] = self.max_replicas
        if self.recompute:
            doc["recompute"] = True
        return doc

    @classmethod
    def load(cls, path: str | Path) -> "Problem":
        try:
            doc = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise InvalidProblemError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(doc)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))
