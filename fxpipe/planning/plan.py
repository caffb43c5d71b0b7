"""``fxpipe.Plan``: the pipeline decision and its predicted costs, as versioned JSON.

A plan names, for every stage, its device and the traced nodes it runs, and
carries the graph fingerprint of the model it was made for, the profiled
problem it was solved from and the solver's certificate. Loading parses JSON
and checks fields; it never executes code.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from fxpipe.planning.memory_model import planned_mode, predict_worker_memory
from fxpipe.planning.plan_format import PLAN_FORMAT, check_plan_document, read_plan_document
from fxpipe.planning.throughput import throughput_line
from fxpipe.errors import PlanFormatError
from solvers.layout import Layout
from solvers.schedules import inflight, stage_worker

# bytes per parameter and the memory table's short name of the dtype a plan was costed at (profile["dtype"])
_DTYPES = {"float32": (4, "fp32"), "bfloat16": (2, "bf16"), "float16": (2, "fp16"), "float64": (8, "fp64")}

# Exports of a plan that later layers provide (planning does not import them): name -> function(plan, ...).
# fxpipe.distributed.torch_pipelining registers "torch_pipelining" when imported (``import fxpipe`` does).
EXPORTERS: dict[str, Callable[..., Any]] = {}

__all__ = ["EXPORTERS", "Plan", "PlanStage", "load_plan", "PLAN_FORMAT", "aligned_table", "boundary_name"]



def aligned_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """Lines of a right-aligned text table: the header, a rule, then the rows."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    return [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]


@dataclass
class PlanStage:
    index: int
    device: str
    nodes: list[str]
    param_bytes: float = 0.0
    act_bytes: float = 0.0
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    comm_s: float = 0.0
    stage_s: float = 0.0
    peak_bytes: float = 0.0
    input_bytes: float = 0.0       # per micro-batch: values received from other stages (kept until backward)
    output_bytes: float = 0.0      # per micro-batch: values sent on or returned (kept until backward)
    overlap_bytes: float = 0.0     # the part of inputs and outputs the stage's own nodes save (in act_bytes)
    workspace_bytes: float = 0.0   # transient buffers of an operation's forward/backward
    loss_bytes: float = 0.0        # the loss's transient buffers, on the stage that computes it
    checkpoint: str = ""           # this stage's checkpoint mode ("" = the plan's)
    memory_bytes: float = 0.0      # the memory of its device the plan gives it (interleaved: a share)
    measured_bytes: dict[str, float] | None = None   # solvers.activation_memory.StageBytes, measured
    modules: list[str] = field(default_factory=list)   # module paths of its first and last operation
    node: int = 0                  # the host (torchrun's node rank) its device is on
    device_index: int = -1         # its device's index in Plan.devices (-1: the stage's worker, in order)
    # its repeated blocks, for per-block recomputation (fxpipe.planning.block_figures)
    blocks: list[dict[str, float]] = field(default_factory=list)


@dataclass
class Plan:
    """Stages, devices, micro-batching and predictions of one compiled pipeline."""

    fingerprint: str
    model: str
    devices: list[str]
    chunks: int
    schedule: str
    checkpoint: str
    batch_size: int
    stages: list[PlanStage]
    predicted: dict[str, Any] = field(default_factory=dict)
    solver: dict[str, Any] = field(default_factory=dict)
    profile: dict[str, Any] = field(default_factory=dict)
    traced_training: bool = False
    problem: dict[str, Any] | None = None
    fxpipe_version: str = ""
    virtual_stages: int = 1     # stages per device (interleaved-1f1b): stage s runs on worker s % (stages / v)
    measured: dict[str, Any] = field(default_factory=dict)   # pipe.report(): predicted vs measured of a real step
    # where the samples are: {"inputs": {argument: dim}, "output": dim, "target": dim}; missing means dim 0
    batch_dims: dict[str, Any] = field(default_factory=dict)
    # the front end that traced the model and why that one: {"name": "fx"|"export"|"given", "reason": ...}
    frontend: dict[str, Any] = field(default_factory=dict)   # name, reason, the example inputs' record
    # compiled stages (fxpipe.runtime.execute.compiled): {"options": torch.compile's arguments as JSON, "compile_s": seconds
    # the stages' first forward and backward spent compiling, "stage_compile_s": per stage}; None: eager stages
    compiled: dict[str, Any] | None = None
    # where the pp x dp x tp mesh this pipeline is one position of runs (fxpipe.plan(mesh=...): the order of its
    # dims, the links each dimension crosses, the pipeline's ranks); None: a pipeline alone
    mesh: dict[str, Any] | None = None
    # the layout's degrees, data-parallel mode, order and sequence parallelism; None: one pipeline of the plan's
    # workers. Read and set as ``plan.layout`` (the whole record, with the schedule and recomputation)
    _layout: Layout | None = field(default=None, repr=False)

    @property
    def workers(self) -> int:
        """How many workers (devices) run the stages."""
        return len(self.stages) // max(1, self.virtual_stages)

    # ------------------------------------------------------------------ views
    def _where(self, stage: PlanStage) -> str:
        """``cuda:0``, or ``1:cuda:0`` (node 1) when the plan spans several nodes."""
        return f"{stage.node}:{stage.device}" if any(s.node for s in self.stages) else stage.device

    def stage_of(self) -> dict[str, int]:
        return {n: s.index for s in self.stages for n in s.nodes}

    def summary(self) -> str:
        """A table of stages with predicted times and memory, then the pipeline totals."""
        head = ["stage", "device", "nodes", "param MiB", "fwd ms", "bwd ms", "comm ms", "act MiB", "peak MiB", "stage ms"]
        rows = []
        worst = self.predicted.get("bottleneck_stage")
        peaks = self.worker_peaks()
        for s in self.stages:
            rows.append([
                f"{s.index}{'*' if s.index == worst else ''}", self._where(s), str(len(s.nodes)),
                f"{s.param_bytes / 2**20:.1f}", f"{s.fwd_s * 1e3:.2f}", f"{s.bwd_s * 1e3:.2f}",
                f"{s.comm_s * 1e3:.3f}", f"{s.act_bytes / 2**20:.1f}", f"{peaks[s.index] / 2**20:.1f}",
                f"{s.stage_s * 1e3:.2f}",
            ])
        out = [f"fxpipe plan for {self.model}: {len(self.stages)} stages, batch {self.batch_size} in "
               f"{self.chunks} micro-batches, schedule {self.schedule}, checkpoint {self.recomputation()}"]
        if self.mesh:   # fxpipe.planning.mesh_view: the mesh, and the best plan of every other shape
            from fxpipe.planning.mesh_view import mesh_head
            out = mesh_head(self) + out
        out += aligned_table(head, rows)
        if self.frontend:
            out.append(f"front end: {self.frontend.get('name', '?')} ({self.frontend.get('reason', '')})")
        if self.compiled:
            out.append(compiled_line(self.compiled))
        if self.layout.precision in PRECISION_LINES:
            out.append(f"precision: {self.layout.precision} ({PRECISION_LINES[self.layout.precision]})")
        elif self.frontend.get("precision_fallback"):   # fxpipe.analytic_model: the default could not be captured
            out.append(f"precision: {self.frontend['precision_fallback']}")
        cuts = [boundary_name(a.modules[-1], b.modules[0])
                for a, b in zip(self.stages, self.stages[1:]) if a.modules and b.modules]
        if cuts:
            out.append("stage boundaries: " + "; ".join(cuts))
        if self.solver.get("kept_whole"):
            out.append(f"kept whole: {self.solver['kept_whole']}")
        sizes = [f"after stage {b['stage']}: {b['bytes'] / 1024:.1f} KiB each way"
                 + (f" -> {b['forward_bytes'] / 1024:.1f} KiB forward, {b['backward_bytes'] / 1024:.1f} KiB "
                    f"back ({b['codec']})" if b["codec"] else " (exact)")
                 for b in self.predicted.get("boundaries", [])]
        if sizes:
            out.append("boundary bytes per micro-batch: " + "; ".join(sizes))
        tied = [f"{t['name']} ({t['bytes'] / 2**20:.1f} MiB) in stages {t['stages']}: "
                f"{t['all_reduce_per_step_bytes'] / 2**20:.1f} MiB per step"
                for t in self.predicted.get("tied_weights", [])]
        if tied:   # fxpipe.planning.tied_cost: a copy per reading stage, the gradient summed once per step
            out.append("tied weights, a copy per stage, gradients summed once per step: " + "; ".join(tied))
        p = self.predicted
        if p:
            out.append(
                f"bottleneck: stage {worst} (*)  predicted iteration {p['iteration_s'] * 1e3:.2f} ms  "
                f"throughput {p['throughput_samples_per_s']:.1f} samples/s  "
                f"(profile: {self.profile.get('mode', '?')} on {self.profile.get('device', '?')}; "
                f"solver: {self.solver.get('method', '?')}"
                + (f", optimal={self.solver['optimal']})" if "optimal" in self.solver else ")")
            )
            if "iteration_shared_s" in p:   # CPU workers sharing the processors (fxpipe.compile)
                out.append(f"with the CPU workers sharing the processors (as pipe.report()): predicted iteration "
                           f"{p['iteration_shared_s'] * 1e3:.2f} ms")
            tokens = throughput_line(self)   # of the step predicted above
            if tokens:
                out.append(tokens)
            if "exact_over" in self.solver and not self.solver.get("optimal"):
                # "optimal" is over every convex partition and placement; say what was searched exactly
                out.append(f"exact over: {self.solver['exact_over']}"
                           f"{'' if self.solver.get('space_optimal') else ' (stopped by the time limit)'}; "
                           f"gap to the best possible plan at most {self.solver.get('gap', float('nan')):.1%}"
                           + (f" ({self.solver['objective']})" if self.solver.get("objective") else ""))
        if self.solver.get("mesh_search"):
            from fxpipe.planning.mesh_view import mesh_table
            out += mesh_table(self, aligned_table)
        if self.solver.get("search"):   # schedule="auto" / chunks="auto": every candidate, the chosen one marked *
            # (feasible None: not solved, its lower bound above the chosen plan's time)
            near = self.solver.get("search_tolerance")
            out.append("schedule search (simulated iteration; * chosen" + (
                f": the fewest chunks, then the first schedule, within {near:.0%} of the fastest" if near else "")
                + "):")
            out += aligned_table(["schedule", "chunks", "checkpoint", "iteration ms", "peak MiB", "feasible"], [
                [("* " if t["chosen"] else "  ") + t["schedule"], str(t["chunks"]), t["checkpoint"] or "-",
                 f"{t['iteration_s'] * 1e3:.3f}" if t["feasible"] else "-",
                 f"{t['peak_bytes'] / 2**20:.1f}" if t["feasible"] else "-",
                 "yes" if t["feasible"] else (t.get("why", "") if t["feasible"] is None else
                                               "no: " + t.get("why", ""))[:60]] for t in self.solver["search"]])
        return "\n".join(out)

    def worker_peaks(self) -> list[float]:
        """Per stage, the predicted peak bytes of the device that runs it
        (:func:`fxpipe.planning.memory_model.predict_worker_memory`: the one memory figure every table shows)."""
        peaks = [w.peak_bytes for w in predict_worker_memory(self)]
        workers = len(peaks)
        return [peaks[stage_worker(self.schedule, s.index, workers)] for s in self.stages]

    @property
    def layout(self) -> Layout:
        """The layout this plan runs (:class:`solvers.layout.Layout`, the plan JSON's ``layout``): its degrees,
        dp mode, order and sequence parallelism (one pipeline of ``workers`` without a mesh), the schedule, the
        stages per device and each stage's recomputation as the runtime runs it (``planned_mode``). Setting it
        sets the degrees; the schedule and recomputation are the plan's own fields, read here."""
        planned = planned_mode(self)
        modes = tuple((st.checkpoint if planned == "auto" else planned) for st in self.stages)
        base = self._layout if self._layout is not None else Layout(pp=self.workers)
        return dataclasses.replace(base, schedule=self.schedule, virtual_stages=len(self.stages) // self.workers,
                                   recomputation=modes)

    @layout.setter
    def layout(self, value: Layout) -> None:
        if value.pp != self.workers:
            raise ValueError(f"layout {value}: pp={value.pp} but the plan runs on {self.workers} workers")
        self._layout = value.degrees()

    def recomputation(self) -> str:
        """The checkpoint mode as the stages run it: ``"auto (never)"``, ``"auto (stage 0: always, 1: never)"``
        (``"auto"`` gives each device its own), or the mode asked for."""
        if self.checkpoint != "auto":
            return self.checkpoint
        modes = [s.checkpoint or "auto" for s in self.stages]
        if len(set(modes)) == 1:
            return f"auto ({modes[0]})"
        return "auto (" + ", ".join(f"{'stage ' if i == 0 else ''}{i}: {m}" for i, m in enumerate(modes)) + ")"

    def memory_table(self) -> str:
        """Per worker: parameter memory (with gradients and optimizer state), activation memory
        at the schedule's peak (:mod:`fxpipe.planning.memory_model`: in-flight micro-batches,
        checkpointing, workspace), their sum and the device's memory, in GiB (torchgpipe's table). A worker
        that runs several stages (interleaved 1F1B, ZB-V) is one row naming them. Parameters are counted in
        the dtype the plan was costed at (``profile["dtype"]``; float32 when it does not say)."""
        problem = self.problem or {}
        memory = {d["id"]: d["memory_bytes"] for d in problem.get("devices", [])}
        placed = self.solver.get("stage_devices") or []
        dtype = str(self.profile.get("dtype", "float32"))
        size, short = _DTYPES.get(dtype, (4, dtype))
        p, m = len(self.stages), self.chunks
        predicted = predict_worker_memory(self)
        workers = len(predicted)

        def device_memory(s: PlanStage) -> float | None:
            if s.index < len(placed) and placed[s.index] and placed[s.index][0] in memory:
                return memory[placed[s.index][0]]
            return next((v for k, v in memory.items() if k.endswith(":" + s.device) or k == s.device),
                        s.memory_bytes or None)
        rows = []
        for w in predicted:
            mine = [s for s in self.stages if stage_worker(self.schedule, s.index, workers) == w.worker]
            held = "+".join(str(inflight(self.schedule, s.index, p, m)) for s in mine)
            params = sum(s.param_bytes for s in mine)
            room = [device_memory(s) for s in mine]
            device = sum(room) if all(room) else None
            rows.append([",".join(str(s.index) for s in mine), self._where(mine[0]),
                         f"{params / size / 1e6:.0f}M" if params else "0", f"{w.param_bytes / 2**30:.2f}", held,
                         f"{w.activation_bytes / 2**30:.2f}", f"{w.peak_bytes / 2**30:.2f}",
                         f"{device / 2**30:.1f}" if device else "-"])
        copies = sum(t["bytes"] * (len(t["stages"]) - 1) for t in self.predicted.get("tied_weights", []))
        # a mesh's stages hold 1/tp of their parameters on each device
        tp = self.layout.tp if self.layout is not None else (self.mesh or {}).get("tp", 1)
        total_params = (sum(s.param_bytes for s in self.stages) - copies) * tp   # the model's: a tied weight once
        head = ["stage" if workers == p else "stages", "device", f"params ({short})", "param+grad+opt GiB",
                "in flight", "activation GiB", "peak GiB", "device GiB"]
        out = aligned_table(head, rows)
        shards = f", 1/{tp} of them on each device of a stage (tp={tp})" if tp > 1 else ""
        out.append(f"model: {total_params / size / 1e9:.2f}B parameters ({short}){shards}; the pipeline's "
                   f"{workers} devices: {sum(float(r[3]) for r in rows):.2f} GiB parameter memory, "
                   f"{sum(float(r[5]) for r in rows):.2f} GiB peak activation memory")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.summary()

    # ------------------------------------------------------------------ pictures (fxpipe.planning.pictures)
    def plot(self) -> Any:
        """A matplotlib ``Figure``: per stage, compute and transfer time and peak memory against its device's."""
        from fxpipe.planning.pictures import plot_stages
        return plot_stages(self)

    def timeline(self, measured: Any = None) -> Any:
        """A matplotlib ``Figure``: the simulated schedule per worker, the predicted iteration marked; with
        ``measured=pipe.last_step["timings"]``, the measured step beside it."""
        from fxpipe.planning.pictures import plot_timeline
        return plot_timeline(self, measured)

    def graph_plot(self) -> Any:
        """A matplotlib ``Figure``: the traced graph, each node coloured by its stage."""
        from fxpipe.planning.pictures import plot_graph
        return plot_graph(self)

    # ------------------------------------------------------------------ other runtimes
    def to_torch_pipelining(self, model: Any, loss_fn: Any = None, **kwargs: Any) -> tuple[list[Any], Any]:
        """This rank's ``torch.distributed.pipelining.PipelineStage`` s and a torch schedule running them, for a
        plan whose values only cross from a stage to the next (else a ``NotAdjacentError`` saying which value
        skips and that fxpipe's own runtime runs it): :func:`fxpipe.distributed.torch_pipelining.to_torch_pipelining`."""
        if "torch_pipelining" not in EXPORTERS:
            raise RuntimeError("plan.to_torch_pipelining needs fxpipe.distributed: import fxpipe (or "
                               "fxpipe.distributed.torch_pipelining) first")
        return EXPORTERS["torch_pipelining"](self, model, loss_fn, **kwargs)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        del doc["_layout"]
        return {"format": PLAN_FORMAT, **doc, "layout": self.layout.to_dict()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=_json_scalar)

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON to ``path``."""
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, doc: Any) -> "Plan":
        """A plan from its JSON document, checked against the plan schema (:mod:`fxpipe.planning.plan_format`)."""
        doc = check_plan_document(doc)
        stages = [PlanStage(**{"index": i, **{k: v for k, v in s.items()}}) for i, s in enumerate(doc["stages"])]
        kwargs = {k: doc[k] for k in cls.__dataclass_fields__ if k in doc and k not in ("stages", "layout")}
        plan = cls(stages=stages, **kwargs)
        try:
            stored = Layout.from_dict(doc["layout"])
            plan.layout = stored
        except ValueError as exc:
            raise PlanFormatError(f"plan field layout: {exc}; save the plan again with plan.save()") from None
        _agrees(plan, stored)
        return plan


def _json_scalar(value: Any) -> Any:
    """A numpy scalar a solver left in a plan's record (a time-limited search's ``optimal`` as ``numpy.bool_``) as
    the Python value JSON writes; anything else is refused as ``json`` refuses it."""
    if hasattr(value, "item") and getattr(value, "shape", None) == ():
        return value.item()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _agrees(plan: Plan, stored: Layout) -> None:
    """A stored layout's schedule, stages per device and recomputation (where it says them) are the plan's."""
    runs = plan.layout
    for name in ("schedule", "virtual_stages", "recomputation"):
        said = getattr(stored, name)
        if said not in (None, ()) and said != getattr(runs, name):
            raise PlanFormatError(f"plan field layout/{name} is {said!r} but the plan runs {getattr(runs, name)!r} "
                                  "(its schedule, stages and their checkpoint modes); save the plan again with "
                                  "plan.save()")


def load_plan(path: str | Path) -> Plan:
    """Read a plan saved by :meth:`Plan.save`. Parses JSON only, with bounded memory; never executes code."""
    return Plan.from_dict(read_plan_document(path))


#: the summary's line for a precision that is not a model's float32 as built (fxpipe.frontend.precision)
PRECISION_LINES = {
    "bf16-mixed": "float32 parameters, gradients and optimizer state; forward and backward in bfloat16",
}


def compiled_line(compiled: dict[str, Any]) -> str:
    """One line of the summary: the stages' torch.compile options and their compile time, apart from the step."""
    options = ", ".join(f"{k}={v!r}" for k, v in compiled.get("options", {}).items())
    if "compile_s" not in compiled:
        return (f"compiled stages: torch.compile({options}), compiled at their first call (not timed); "
                "zb-h1/zb-v not run (a compiled backward does not split)")
    each = ", ".join(f"{s:.1f}" for s in compiled.get("stage_compile_s", []))
    return (f"compiled stages: torch.compile({options}); compile {compiled['compile_s']:.1f} s (stages {each} s), "
            "not in the stage or step times; zb-h1/zb-v not run (a compiled backward does not split)")


def boundary_name(before: str, after: str) -> str:
    """A cut between the operations of modules ``before`` and ``after`` named where their paths part, an
    index kept with its list: ``model.layers.11 | model.layers.12``, ``model.layers.3 | model.norm``;
    ``(model)`` is the model's own code."""
    a, b = before.split(".") if before else [], after.split(".") if after else []
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1

    def named(parts: list[str]) -> str:
        end = k + 1 + (k + 1 < len(parts) and parts[k + 1].isdigit())
        return ".".join(parts[:end]) or "(model)"
    return f"{named(a)} | {named(b)}"
