"""The front end's one call: a model becomes a traced graph, its fingerprint, whether its mode matters and
which front end made it.

Three front ends (``frontend=`` of :func:`fxpipe.compile`): ``"fx"`` (:mod:`~fxpipe.frontend.trace`,
``torch.fx.symbolic_trace`` with leaf modules), ``"export"`` (:mod:`~fxpipe.frontend.export`,
``torch.export`` on the example inputs) and ``"auto"``, which uses fx where it traces the model faithfully
(fx refuses what it would drop: grad-mode and autocast regions, custom autograd Functions) and export
otherwise: a model fx cannot trace, one called with keyword arguments (fx binds inputs by position and
flattens no ``ModelOutput``), or one in which fx would keep a stack of layers in one node (a
``torch.nn.TransformerEncoder``: fx's default leaves are the modules of ``torch.nn``, and a leaf cannot be cut). A ``torch.fx.GraphModule`` or ``torch.export.ExportedProgram`` the user made
is partitioned as given. The choice and its reason go into the plan (``plan.frontend``) and the fingerprint.
"""

from __future__ import annotations

import copy
import functools
import itertools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_map

from fxpipe.errors import TraceError
from fxpipe.frontend.experts import refuse_router_loss
from fxpipe.frontend.export import PREDICTED, export_graph, flat_program
from fxpipe.frontend.fingerprint import graph_fingerprint
from fxpipe.frontend.generation_cache import CACHE_OFF_REASON, generation_cache_off
from fxpipe.frontend.kept_whole import KEEP_WHOLE, module_groups
from fxpipe.frontend.input_record import record_inputs, recorded_inputs
from fxpipe.frontend.modes import keeping_modes
from fxpipe.frontend.precision import is_mixed, mixed_precision, traced_as_computed, with_precision
from fxpipe.frontend.trace import has_submodule, trace
from fxpipe.options import FRONTENDS

__all__ = ["Captured", "capture", "capture_as_built", "capture_as_planned", "first_line", "hidden_layer_stacks",
           "FRONTENDS"]


@dataclass
class Captured:
    """A model as the rest of the flow sees it."""

    graph: fx.GraphModule
    fingerprint: str          # names the graph: a plan made for another one is refused
    # tracing in the other train/eval mode gives another graph; None: not known yet (:meth:`depends_on_mode`)
    mode_dependent: bool | None
    # {"name": "fx"|"export"|"given", "reason": ..., "inputs": the example inputs' record (input_record.py)}
    frontend: dict[str, Any] = field(default_factory=dict)
    # The model in eval mode, for checks that need it (fxpipe.runtime.checks.batch_check): ``graph`` itself unless
    # that was traced in train mode and depends on the mode (a BatchNorm traced through computes batch
    # statistics whatever gm.eval() says), then the eval-mode trace; None where eval mode does not trace.
    eval_graph: fx.GraphModule | None = None
    # traces the other mode (on the example inputs given, else a copy of the model on ``meta``, whatever devices
    # its parameters are on by then): (whether its graph differs, that graph or None where it does not trace);
    # None once known
    other_mode: Callable[..., tuple[bool, fx.GraphModule | None]] | None = field(default=None, repr=False, compare=False)

    @property
    def dependence(self) -> bool | Callable[[], bool]:
        """:attr:`mode_dependent` where known, else :meth:`depends_on_mode` to ask it when needed (a pipeline's
        :class:`~fxpipe.runtime.checks.traced_mode.TracedMode`)."""
        return self.depends_on_mode if self.mode_dependent is None else self.mode_dependent

    def depends_on_mode(self, inputs: tuple[tuple, dict[str, Any]] | None = None) -> bool:
        """Whether the graph depends on the train/eval mode, traced in the other mode the first time it is asked
        (:func:`capture_as_built` defers torch.export's second trace until a pipeline runs in the other mode, the
        micro-batching check fails on the graph itself, or a plan of the other mode is loaded). With ``inputs``
        (the example ``(args, kwargs)``) the model itself is traced, and the other mode's graph of a train-mode
        trace is kept as :attr:`eval_graph`; without, a ``meta`` copy of it, and no eval graph is kept."""
        if self.mode_dependent is None:
            traced_training = bool(self.graph.meta.get("fxpipe_traced_training", True))
            self.mode_dependent, other = self.other_mode(inputs) if self.other_mode is not None else (False, None)
            kept = other if inputs is not None else None
            self.eval_graph = kept if self.mode_dependent and traced_training else self.graph
            self.frontend["mode_dependent"] = self.mode_dependent
            self.other_mode = None
        return self.mode_dependent

    def dtype_mismatch(self, planned_dtype: str | None) -> str | None:
        """Why this graph cannot be a plan's made for ``planned_dtype`` (``plan.profile["dtype"]``: the dtype
        ``fxpipe.plan`` planned the model's training in, bfloat16 for ``fxpipe plan hf:`` on a preset), or ``None``.
        A model traces to another graph in another dtype (a cast that is a no-op in one is a node in the other),
        and trains in its own: the fix is to build it in the planned dtype, or plan it in its own."""
        floats = sorted({str(t.dtype).removeprefix("torch.") for t in self.graph.parameters() if t.is_floating_point()})
        if not planned_dtype or not floats or planned_dtype in floats:
            return None
        return (f"the plan was made for training in {planned_dtype} and the model's parameters are "
                f"{', '.join(floats)}: build the model in {planned_dtype} (model.to(torch.{planned_dtype}), or "
                f"torch_dtype=torch.{planned_dtype} for a Hugging Face model), or plan it in {floats[0]} "
                f"(fxpipe plan --dtype {floats[0]}, or a {floats[0]} model for fxpipe.plan)")


def first_line(exc: BaseException) -> str:
    """An exception's first non-blank line (its type's name where it has none): the cause, in one line."""
    return next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def _tag(gm: fx.GraphModule, name: str) -> str:
    """The fingerprint's tag of a graph of front end ``name`` (the groups kept whole, where there are)."""
    groups = gm.meta.get(KEEP_WHOLE)
    return name if groups is None else f"{name}+keep:{sorted(groups)}"


def _meta_copy(model: nn.Module) -> nn.Module:
    """``model`` copied with every parameter and buffer on ``meta`` (no data copied); the model itself where it
    does not copy."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    try:
        return copy.deepcopy(model, memo)
    except Exception:   # a module holding what does not copy (a lock, a weak reference): the model itself
        return model


def _on_meta(tree: Any) -> Any:
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, tree)


def _other_mode(model: nn.Module, name: str, leaves: list[Any], concrete_args: Any, meta_inputs: tuple,
                batch_dim: Any, training: bool, precision: str | None, alike: str,
                inputs: tuple[tuple, dict[str, Any]] | None = None) -> tuple[bool, fx.GraphModule | None]:
    """Whether ``model`` traced by front end ``name`` in the mode it was not traced in (``training``), as
    :func:`capture` traced it (the precision's input casts, the generation cache off), gives another graph than
    the one whose mode-blind fingerprint is ``alike``, and that graph (rewritten for ``precision`` where it is
    traced on ``inputs``, to be kept), or
    ``(True, None)`` where it does not trace: on ``inputs`` (the example inputs) where given, else a copy of it on
    ``meta`` (whatever devices its parameters are on by then) on the example inputs' ``meta`` copies."""
    try:
        other = _trace_other_mode(model, name, leaves, concrete_args, meta_inputs, batch_dim, training, precision,
                                  inputs)
    except TraceError:
        return True, None   # the other mode does not trace: this mode's graph only
    differs = graph_fingerprint(other, _tag(other, name), modes_alike=True) != alike
    if is_mixed(precision) and inputs is not None:   # kept as the eval graph: rewritten as with_precision does
        mixed_precision(other, name != "export")
    return differs, other


def _trace_other_mode(model: nn.Module, name: str, leaves: list[Any], concrete_args: Any, meta_inputs: tuple,
                      batch_dim: Any, training: bool, precision: str | None,
                      inputs: tuple[tuple, dict[str, Any]] | None) -> fx.GraphModule:
    target, (args, kwargs) = (model, inputs) if inputs is not None else (_meta_copy(model), meta_inputs)
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    if inputs is None and any(t.device.type != "meta" for t in target.parameters()):
        raise TraceError("the model did not copy to meta")   # inputs on meta, parameters not: no trace
    with traced_as_computed(target, precision), generation_cache_off(target, kwargs), keeping_modes(target):
        target.train(not training)
        other = _traced(target, name, leaves, concrete_args, args, kwargs, batch_dim)
    if leaves and name == "export":
        other.meta[KEEP_WHOLE] = module_groups(other, leaves)[0]
    return other


def _traced(model: nn.Module, name: str, leaf_modules: list[Any], concrete_args: Any, args: tuple,
            kwargs: dict[str, Any], batch_dim: Any) -> fx.GraphModule:
    if name == "fx":
        return trace(model, leaf_modules, concrete_args)
    return export_graph(model, args, kwargs, batch_dim)


def _choose(model: nn.Module, frontend: str, leaf_modules: list[Any], concrete_args: Any, args: tuple | None,
            kwargs: dict[str, Any], batch_dim: Any, predict: bool = False) -> tuple[fx.GraphModule, str, str]:
    """The graph, the front end that made it and why that one (``predict``: export_graph's ``predict_repeats``)."""
    exported = functools.partial(export_graph, model, args, kwargs, batch_dim, predict_repeats=predict)
    if frontend not in FRONTENDS:
        raise ValueError(f"frontend must be one of {', '.join(FRONTENDS)}, got {frontend!r}")
    if frontend != "fx" and args is None:
        if frontend == "export":
            raise ValueError("frontend='export' traces on the example inputs: pass example_inputs")
        return trace(model, leaf_modules, concrete_args), "fx", "no example inputs to export with"
    if frontend == "fx":
        if kwargs:
            raise ValueError("frontend='fx' binds inputs by position and cannot take example_kwargs: pass them "
                             "in example_inputs in the forward's order, or use CompileOptions(frontend='export') "
                             "(or 'auto')")
        return trace(model, leaf_modules, concrete_args), "fx", "frontend='fx' was asked for"
    if frontend == "export":
        return exported(), "export", "frontend='export' was asked for"
    if kwargs:
        return (exported(), "export",
                "keyword arguments (torch.fx binds inputs by position)")
    try:
        gm = trace(model, leaf_modules, concrete_args)
    except TraceError as fx_failure:
        try:
            gm = exported()
        except TraceError as export_failure:
            also = str(export_failure).replace("\n", "\n    ")
            raise TraceError(f"{fx_failure}\n  torch.export (frontend='export') fails as well: {also}",
                             module=fx_failure.module, operation=fx_failure.operation) from fx_failure
        return gm, "export", f"torch.fx cannot trace it: {first_line(fx_failure)}"
    stacks = hidden_layer_stacks(gm, leaf_modules)
    if stacks:   # the planner could cut between those layers only in export's graph
        try:
            return (exported(), "export",
                    f"torch.fx keeps {stacks[0]} whole (a torch.nn module holding a stack of layers): torch.export "
                    "reaches its layers")
        except TraceError:
            return gm, "fx", f"torch.fx traces the model faithfully ({stacks[0]} in one stage: torch.export fails)"
    return gm, "fx", "torch.fx traces the model faithfully"


def hidden_layer_stacks(gm: fx.GraphModule, leaf_modules: list[Any]) -> list[str]:
    """The calls of fx's graph to a module torch.fx keeps whole by default (a ``torch.nn`` one, not one of
    the user's ``leaf_modules``) that holds a stack of layers (an ``nn.ModuleList`` of two or more:
    ``nn.TransformerEncoder``, ``nn.TransformerDecoder``, ``nn.Transformer``), as ``"path (Class)"``. Their
    layers are where a pipeline wants to cut, and fx cannot trace through them (their fast-path checks are
    control flow on tensors)."""
    kept = tuple(x for x in leaf_modules if isinstance(x, type))
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.target in leaf_modules:
            continue
        module = gm.get_submodule(node.target)
        if kept and isinstance(module, kept) or not type(module).__module__.startswith("torch.nn"):
            continue
        if any(isinstance(m, nn.ModuleList) and len(m) > 1 for m in module.modules()):
            found.append(f"{node.target} ({type(module).__name__})")
    return found


def capture(model: Any, leaf_modules: Iterable[Any] = (), concrete_args: Any = None, frontend: str = "auto",
            args: tuple | None = None, kwargs: dict[str, Any] | None = None, batch_dim: Any = 0, *,
            other_mode: bool = True, mode_dependent: bool | None = None, precision: str | None = None) -> Captured:
    """:func:`capture_as_built` at ``precision`` (:mod:`fxpipe.frontend.precision`): under ``"bf16-mixed"`` the
    model is traced as it computes and its graph rewritten to read every float32 parameter through its bfloat16
    copy, the ``"auto"`` front end being torch.export (whose flat graph reads every parameter); any other
    precision captures the model as it is built. The fingerprint is the trace's, before the rewrite."""
    forced = is_mixed(precision) and frontend == "auto" and isinstance(model, nn.Module) \
        and not isinstance(model, fx.GraphModule)
    with traced_as_computed(model, precision):
        captured = capture_as_built(model, leaf_modules, concrete_args, "export" if forced else frontend, args, kwargs,
                                    batch_dim, other_mode=other_mode, mode_dependent=mode_dependent,
                                    precision=precision)
    if captured.mode_dependent is None and captured.frontend.get("name") == "fx":
        captured.depends_on_mode((args or (), dict(kwargs or {})))   # an fx trace is cheap: found out now
    if forced:   # the reason is the precision's, not an asked front end
        captured.frontend["reason"] = captured.frontend["reason"].replace(
            "frontend='export' was asked for", "precision='bf16-mixed': torch.export's graph reads every parameter", 1)
    return with_precision(captured, precision)


def capture_as_built(model: Any, leaf_modules: Iterable[Any] = (), concrete_args: Any = None,
                     frontend: str = "auto", args: tuple | None = None, kwargs: dict[str, Any] | None = None,
                     batch_dim: Any = 0, *, other_mode: bool = True,
                     mode_dependent: bool | None = None, precision: str | None = None) -> Captured:
    """Trace ``model`` with the front end ``frontend`` chooses (module doc), and make ready to find whether its
    graph depends on ``model.training`` by tracing it once more in the other mode (:meth:`Captured.depends_on_mode`:
    :func:`capture` does it at once for torch.fx, whose trace is cheap; torch.export's second trace, seconds for a
    Hugging Face model, waits until something needs the answer, which most pipelines never do). Every submodule's
    own flag is restored either way (:func:`fxpipe.frontend.modes.keeping_modes`): a frozen BatchNorm stays in
    eval mode.

    Only the mode the user compiles in must trace: code that runs only in the other mode (a training-only
    branch fx cannot follow) makes the graph mode-dependent, so the pipeline refuses to run in that mode
    (with "compile again in the mode you want") rather than failing this compile.

    ``other_mode=False`` gives up the second trace, for a caller that never runs the graph (:func:`fxpipe.plan`):
    ``mode_dependent`` is then False and ``eval_graph`` None, and a pipeline built from the plan captures the
    model again. Such a caller also takes a deep stack of alike layers predicted from a few of them
    (:mod:`fxpipe.frontend.repeats`), which the front end's reason then says.

    The answer, once found, is recorded in the front end's record (``frontend["mode_dependent"]``, kept in a plan
    saved after), and a caller that knows it (``mode_dependent``: :func:`capture_as_planned`, from the plan of
    the same graph) never traces the other mode (``eval_graph`` is then ``graph`` where the graph does not
    depend on the mode, else ``None`` unless the model is in eval mode). ``precision``: the one :func:`capture`
    traces at, for the other mode's trace."""
    kwargs = dict(kwargs or {})
    if isinstance(model, torch.export.ExportedProgram):
        gm = flat_program(model)
        # exported in train mode, its batch norms compute batch statistics in any mode: no eval graph
        eval_graph = None if gm.meta["fxpipe_traced_training"] else gm
        return Captured(gm, graph_fingerprint(gm, "given"), False, eval_graph=eval_graph, frontend=
                        {"name": "given", "reason": "a torch.export.ExportedProgram, partitioned as given"})
    if isinstance(model, fx.GraphModule):
        gm = model
        gm.meta.setdefault("fxpipe_traced_training", model.training)
        return Captured(gm, graph_fingerprint(gm, "given"), False, eval_graph=gm, frontend=
                        {"name": "given", "reason": "a torch.fx.GraphModule, partitioned as given"})
    refuse_router_loss(model, kwargs)
    leaves = list(leaf_modules)
    unknown = [n for n in leaves if isinstance(n, str) and n and not has_submodule(model, n)]
    if unknown:
        raise ValueError(f"leaf_modules names {unknown}, which are not submodules of the model; name them by "
                         "their path in model.named_modules() (as 'transformer.h.0') or pass their class")
    with generation_cache_off(model, kwargs) as cache_off:   # a Hugging Face KV cache: not a training output
        gm, name, reason = _choose(model, frontend, leaves, concrete_args, args, kwargs, batch_dim,
                                   predict=not other_mode)
        if PREDICTED in gm.meta:
            reason += "; " + gm.meta[PREDICTED]
        if cache_off:
            reason += "; " + CACHE_OFF_REASON
        if name == "export" and leaves:
            # torch.export's graph holds every operation: a leaf is kept whole by keeping its operations in one
            # stage (the planner's groups), as fx keeps it whole by not tracing into it
            groups, missed = module_groups(gm, leaves)
            gm.meta[KEEP_WHOLE] = groups
            reason += "; leaf_modules kept whole in one stage each"
            if missed:
                warnings.warn(f"leaf_modules {missed!r} match no module the forward calls: nothing to keep whole",
                              UserWarning, stacklevel=3)
        tag = _tag(gm, name)   # with the groups kept whole: the same graph planned under other constraints
        fingerprint = graph_fingerprint(gm, tag)
        planned: dict[str, Any] = {"name": name, "reason": reason}
        if args is not None:   # what a rank needs to capture the model again the same way (capture_as_planned)
            planned["inputs"] = record_inputs(args, kwargs, batch_dim)
        if not other_mode:
            return Captured(gm, fingerprint, False, planned, None)
        training = model.training
        trace_other = functools.partial(_other_mode, model, name, leaves, concrete_args, _on_meta((args or (), kwargs)),
                                        batch_dim, training, precision, graph_fingerprint(gm, tag, modes_alike=True))
    captured = Captured(gm, fingerprint, mode_dependent, planned, gm, trace_other)
    if mode_dependent is None:   # torch.export's second trace deferred (Captured.depends_on_mode); fx's: capture
        captured.eval_graph = None if training else gm
    else:
        planned["mode_dependent"] = mode_dependent
        captured.eval_graph = None if mode_dependent and training else gm
        captured.other_mode = None
    return captured


def capture_as_planned(model: nn.Module, planned: dict[str, Any], leaf_modules: Iterable[Any] = (),
                       concrete_args: Any = None, precision: str | None = None) -> Captured:
    """Capture ``model`` as the plan's model was captured (``plan.frontend``: the front end and the example
    inputs' structure, shapes and dtypes), from no data: zeros of the recorded shapes on the model's device
    (``meta`` for a model built there). The one way a process that was handed a plan traces its model."""
    name = planned.get("name") if isinstance(planned, dict) else None
    # whether the graph depends on the mode, where the plan's capture found out (a plan of fxpipe.plan, or of an
    # older fxpipe, does not say: traced again in the other mode here)
    known = planned.get("mode_dependent") if isinstance(planned, dict) else None
    if name == "export":
        device = next((t.device for t in model.parameters()), torch.device("cpu"))
        args, kwargs = recorded_inputs(planned.get("inputs"), device)
        batch_dim = planned["inputs"].get("batch_dim")
        return capture(model, leaf_modules, concrete_args, "export", args, kwargs,
                       0 if batch_dim is None else batch_dim, mode_dependent=known, precision=precision)
    return capture(model, leaf_modules, concrete_args, "fx" if name == "fx" else "auto", mode_dependent=known,
                   precision=precision)
