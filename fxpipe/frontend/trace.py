"""Tracing a model into a ``torch.fx.GraphModule`` with fxpipe's leaf-module policy.

Leaves are torch.fx's defaults (modules of ``torch.nn``) plus the user's
``leaf_modules``. A module whose parameters are reached from more than one
place (tied weights, or one module called twice) is traced *through*, so that
each shared parameter becomes a single ``get_attr`` node that the partitioner
can place once and hand to every stage that reads it: that keeps its gradient
correct when the readers land on different devices.

Code that fx cannot represent is refused with a :class:`fxpipe.TraceError` naming the
module, the operation and the fix: untraceable control flow, a custom
``torch.autograd.Function`` (its backward would be lost), a grad-mode or autocast
region (:mod:`fxpipe.frontend.grad_regions`: the region would be lost).
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import os
import traceback
from collections import Counter
from typing import Any, Iterable, Iterator

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten

from fxpipe.errors import TraceError
from fxpipe.frontend.grad_regions import DroppedRegion, refusing_grad_regions
from fxpipe.frontend.output_types import RecordingDictTypes

__all__ = ["trace", "shared_parameter_owners", "frame_outside", "dropped_region",
           "has_submodule"]


class _Tracer(RecordingDictTypes):
    def __init__(self, leaf_types: tuple[type, ...], leaf_names: set[str], through: set[str]) -> None:
        super().__init__()
        # A buffer read as a plain tensor is constant-folded by fx: ``self.count.add_(1)`` or
        # ``self.ema.mul_(0.9)`` would run once while tracing and never again. As get_attr nodes they run
        # at every call, in the stage that owns them.
        self.proxy_buffer_attributes = True
        self.leaf_types = leaf_types
        self.leaf_names = leaf_names
        self.through = through
        self.fxpipe_scope: list[str] = []
        self.failed_in: str | None = None
        self.forced: set[str] = set()   # leaves traced through because they share a parameter (above)
        self.groups: list[set[str]] = []   # per shared parameter (or reused module), the modules reaching it

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if qualname in self.through:
            return False
        # a TorchScript module is compiled code fx cannot look into: traced through, it becomes a read of its
        # C++ module (`self.s._c`) whose parameters no stage module holds, so a split backward never reaches them
        leaf = (qualname in self.leaf_names or bool(self.leaf_types and isinstance(m, self.leaf_types))
                or isinstance(m, torch.jit.ScriptModule))
        if not leaf and not super().is_leaf_module(m, qualname):
            return False
        # A leaf holding a parameter that code outside it reads too (a tied head inside a user's leaf) would
        # put that Parameter into two stage modules: traced through, its parameter reads become one node.
        inside = qualname + "."
        if any(any(o.startswith(inside) for o in group) and not all(o.startswith(inside) for o in group)
               for group in self.groups):
            self.forced.add(qualname)
            return False
        return True

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        self.fxpipe_scope.append(self.path_of_module(m))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:  # the innermost module wins
                self.failed_in = self.fxpipe_scope[-1]
            raise
        finally:
            self.fxpipe_scope.pop()


def shared_parameter_owners(model: nn.Module) -> set[str]:
    """Qualified names of modules that directly own a parameter reachable under two names."""
    return set().union(*shared_parameter_groups(model))


def shared_parameter_groups(model: nn.Module) -> list[set[str]]:
    """Per parameter reachable under two names, the modules that directly own it under each."""
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    return [{n.rpartition(".")[0] for n in names} for names in names_of.values() if len(names) > 1]


# torch.fx's folder and fxpipe's own (this file's parent's parent)
_LIBRARY_FOLDERS = tuple(os.path.dirname(os.path.abspath(path)) + os.sep
                         for path in (fx.__file__, os.path.dirname(os.path.abspath(__file__))))


def frame_outside(exc: BaseException, folders: tuple[str, ...]) -> str | None:
    """``file:line: `code``` of the innermost frame of ``exc``'s traceback outside ``folders`` (``None`` if
    every frame is inside them)."""
    # by the packages' own folders, not a path's words: a user's project may itself live in a folder named fxpipe
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not os.path.abspath(f.filename).startswith(folders)]
    if not frames:
        return None
    f = frames[-1]
    line = (f.line or linecache.getline(f.filename, f.lineno)).strip()
    return f"{f.filename}:{f.lineno}: `{line}`"


def _user_frame(exc: BaseException) -> str:
    """``file:line: code`` of the innermost frame outside torch.fx and fxpipe, for the error message."""
    return frame_outside(exc, _LIBRARY_FOLDERS) or "unknown location"


@contextlib.contextmanager
def _refuse_autograd_functions() -> Iterator[None]:
    """Make a custom ``torch.autograd.Function`` called on traced values an error.

    torch.fx would run the Function's ``forward`` on proxies and record its
    operations, so the pipeline would differentiate those instead of calling the
    Function's own ``backward`` (a straight-through estimator, a clipped
    gradient): a silently wrong gradient. Refusing sends the user to the fix
    (make the module a leaf), through the usual TraceError.
    """
    base = torch.autograd.function.Function
    original = base.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, fx.Proxy) for a in tree_flatten((args, kwargs))[0]):
            raise TypeError(f"custom torch.autograd.Function {cls.__name__} is called on traced values; torch.fx "
                            "would record its forward and lose its backward")
        return original.__get__(None, cls)(*args, **kwargs)

    base.apply = classmethod(apply)
    try:
        yield
    finally:
        base.apply = original


def dropped_region(exc: BaseException | None) -> DroppedRegion | None:
    """The :class:`DroppedRegion` behind ``exc``, if tracing failed on one (user code may have wrapped it)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, DroppedRegion):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class _AssignedTracedValue(Exception):
    """Raised after tracing when ``forward`` assigned a traced value to a module attribute."""

    def __init__(self, where: str, module: str) -> None:
        super().__init__(where)
        self.where, self.module = where, module


@contextlib.contextmanager
def _refusing_attribute_assignments(model: nn.Module) -> Iterator[None]:
    """Keep the model's attributes as they were, and refuse a forward that assigns one a traced value.

    ``self.count += 1`` or ``self.ema = 0.9 * self.ema + ...`` on a buffer makes a new tensor and
    assigns it: torch.fx records the arithmetic but not the assignment, so the pipeline would never update
    the buffer, and fx leaves its Proxy in the user's model in place of the tensor. The attributes are put
    back and the trace fails with the fix (update in place, which fx records, or torch.export, which
    records the assignment: the auto front end then takes it). Only state is refused: a buffer, a
    parameter, or an attribute that held a tensor before (a recurrent state kept across calls). A new
    attribute (``self.last_attention = attn``, kept for inspection) computes nothing later calls read,
    and is only put back."""
    before = [(name, module, dict(module.__dict__), dict(module._buffers), dict(module._parameters))
              for name, module in model.named_modules(remove_duplicate=False)]
    try:
        yield
    finally:
        assigned = []
        for name, module, attributes, buffers, parameters in before:
            for now, then in ((module.__dict__, attributes), (module._buffers, buffers),
                              (module._parameters, parameters)):
                changed = [k for k, v in now.items() if isinstance(v, fx.Proxy) and then.get(k) is not v]
                assigned += [(name, k) for k in changed if now is not module.__dict__
                             or isinstance(then.get(k), torch.Tensor)]
                for k in changed:
                    if k in then:
                        now[k] = then[k]
                    else:
                        del now[k]
    if assigned:
        module, attribute = assigned[0]
        owner = f"submodule {module!r}" if module else "the model"
        raise _AssignedTracedValue(f"self.{attribute} in {owner} ({type(model.get_submodule(module)).__name__})",
                                   module)


def _trace_once(model: nn.Module, tracer: _Tracer, concrete_args: dict[str, Any] | None) -> fx.GraphModule:
    try:
        with _refusing_attribute_assignments(model), _refuse_autograd_functions(), refusing_grad_regions():
            graph = tracer.trace(model, concrete_args=concrete_args)
    except _AssignedTracedValue as exc:
        raise TraceError(
            f"torch.fx cannot trace the update of {exc.where}: forward assigns it a value computed from traced "
            "tensors (`self.x = ...` or `self.x += ...` on a buffer makes a new tensor), and torch.fx records "
            "the computation but not the assignment, so the pipeline would never update it\n"
            f"  operation: assignment to {exc.where}\n"
            "  fix: update it in place (self.x.add_(1), self.x.mul_(0.9).add_(y, alpha=0.1)), which torch.fx "
            "records, or compile with options=fxpipe.CompileOptions(frontend='export') (or 'auto' with "
            "example_inputs), which records it",
            module=exc.module or None, operation=f"assignment to {exc.where}") from None
    except Exception as exc:  # fx raises TraceError, TypeError, RuntimeError, AttributeError...
        module = tracer.failed_in or ""
        kind = type(model.get_submodule(module)).__name__ if module else type(model).__name__
        where = f"submodule {module!r} ({kind})" if module else f"the model's own forward ({kind})"
        region = dropped_region(exc)
        if region is not None:
            fix = (f"make the module that holds it a leaf: fxpipe.compile(..., options=fxpipe.CompileOptions("
                   f"leaf_modules=[{kind}])) runs its forward as written, region included, inside one stage"
                   if module else "move the region into a submodule and make that a leaf (fxpipe.compile(..., "
                   "options=fxpipe.CompileOptions(leaf_modules=[ThatModule])) runs its forward as written, region "
                   "included)")
            raise TraceError(
                f"the torch.fx front end cannot keep the {region.operation} in {where}: tracing records the "
                "operations inside it but not the region, so the pipeline would compute other gradients or "
                f"dtypes than the model\n  operation: {region.where}\n  fix: {fix}, or move the region out of "
                "the model's forward (around the whole call, `with torch.autocast(...): pipe(x)`, it is kept)",
                module=module or None, operation=region.where,
            ) from exc
        fix = (f"make it a leaf: fxpipe.compile(..., options=fxpipe.CompileOptions(leaf_modules=[{kind}])) keeps "
               "it whole inside one stage"
               if module else "pass concrete_args for the input that drives the control flow, "
               "or move the untraceable code into a submodule and make that a leaf")
        forced = sorted(f for f in tracer.forced if not module or module == f or module.startswith(f + "."))
        if forced:
            fix = (f"{forced[0]!r} is a leaf but holds a Parameter that code outside it reads too (tied "
                   "weights), and one Parameter must live in one stage, so it is traced through: untie the "
                   "weight, or make a module that holds every reader of it the leaf")
        raise TraceError(
            f"torch.fx cannot trace {where}: {type(exc).__name__}: {exc}\n"
            f"  operation: {_user_frame(exc)}\n  fix: {fix}",
            module=module or None, operation=_user_frame(exc),
        ) from exc
    gm = fx.GraphModule(tracer.root, graph, model.__class__.__name__)
    gm.meta["fxpipe_out_dict_types"] = tracer.output_dict_types
    return gm


def trace(
    model: nn.Module,
    leaf_modules: Iterable[type | str] = (),
    concrete_args: dict[str, Any] | None = None,
) -> fx.GraphModule:
    """Trace ``model`` into a GraphModule whose parameters are ``model``'s own objects.

    ``leaf_modules`` lists module classes or qualified names kept whole.
    ``concrete_args`` is forwarded to ``torch.fx.Tracer.trace``.
    Raises :class:`fxpipe.TraceError` naming the module and the operation.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxpipe needs an nn.Module, got {type(model).__name__}")
    _refuse_variadic_forward(model)
    leaves = list(leaf_modules)
    leaf_types = tuple(x for x in leaves if isinstance(x, type))
    leaf_names = {x for x in leaves if isinstance(x, str)}
    unknown = [n for n in leaf_names if n and not has_submodule(model, n)]
    if unknown:
        raise ValueError(f"leaf_modules names {unknown}, which are not submodules of the model")
    groups = shared_parameter_groups(model)
    through = set().union(*groups)
    for _ in range(len(list(model.modules())) + 1):
        tracer = _Tracer(leaf_types, leaf_names, set(through))
        tracer.groups = groups
        gm = _trace_once(model, tracer, concrete_args)
        # A leaf with parameters called from two places would have to live on two stages.
        calls = Counter(n.target for n in gm.graph.nodes if n.op == "call_module")
        reused = {t for t, c in calls.items()
                  if c > 1 and any(True for _ in gm.get_submodule(t).parameters())}
        if not reused - through:
            break
        for name in reused:
            through.update(sub for sub, _ in _param_owners(model, name))
    gm.meta["fxpipe_traced_training"] = model.training
    return gm


def _refuse_variadic_forward(model: nn.Module) -> None:
    """torch.fx makes ``forward(self, *xs)`` one input holding a tuple (and ``**kw`` one holding a dict),
    where the pipeline binds one input per argument: refused with the fix (torch.export binds each value;
    the auto front end then takes it)."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):   # a builtin or C forward: nothing to read
        return
    variadic = [p for p in parameters if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if variadic:
        shown = ", ".join(("*" if p.kind == p.VAR_POSITIONAL else "**") + p.name for p in variadic)
        raise TraceError(
            f"torch.fx cannot trace the model's own forward ({type(model).__name__}): it takes {shown}, which "
            "torch.fx makes one input holding all those values, where the pipeline binds one input per "
            f"argument\n  operation: def forward(self, ..., {shown})\n  fix: compile with "
            "options=fxpipe.CompileOptions(frontend='export') (or 'auto' with example_inputs), which binds every "
            "value, or name the arguments in forward",
            module=None, operation=f"forward(..., {shown})")


def has_submodule(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def _param_owners(model: nn.Module, name: str) -> Iterable[tuple[str, nn.Module]]:
    """``name`` and its descendants that own parameters directly."""
    root = model.get_submodule(name)
    for sub, mod in root.named_modules(prefix=name):
        if any(True for _ in mod.parameters(recurse=False)):
            yield sub, mod
    yield name, root
