"""The ``torch.export`` front end: a model and its example inputs become a flat ``torch.fx.GraphModule``.

``torch.export.export(model, args, kwargs, strict=False)`` traces below Python (it runs ``forward`` on fake
tensors and records ATen operations), so it follows what ``symbolic_trace`` cannot: a decorated
``forward(*args, **kwargs)`` (Hugging Face transformers), keyword arguments, ``ModelOutput`` results,
and it keeps grad-mode and autocast regions as higher-order operations. The training IR it gives by default
is not functionalised, so autograd runs over it as over the model.

The graph fxpipe partitions is ``ExportedProgram.module()``: its ``get_attr`` nodes reach the user's own
``Parameter`` and buffer objects under their qualified names (checked here, so gradients land in
``model.parameters()``). It is made flat: its placeholders are the leaves of ``(args, kwargs)`` and its
output a tuple of the leaves of the result; the two pytree specs (``gm.meta["fxpipe_in_spec"]`` and
``["fxpipe_out_spec"]``) give the user back the model's own input and output structure
(:mod:`fxpipe.runtime.execute.structure`). The batch dimension of every input leaf is exported as a symbolic size,
so one graph runs every micro-batch size; a model whose code fixes the batch size is refused.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch import nn
from torch.export import Dim, ShapesCollection
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils._pytree import tree_flatten

from fxpipe.errors import TraceError
from fxpipe.frontend.canonical import canonical_graph
from fxpipe.frontend.batch_dims import LEAF_DIMS, leaf_batch_dims
from fxpipe.frontend.grad_regions import TENSOR_HOOK, refusing_grad_regions
from fxpipe.frontend.model_loss import split_model_loss
from fxpipe.frontend.repeats import predicted_export
from fxpipe.frontend.failures import AS_WRITTEN, eager_failure, inputs_rejected
from fxpipe.frontend.trace import dropped_region, frame_outside

__all__ = ["PREDICTED", "export_graph", "flat_program"]


def _dynamic_batch(args: tuple, kwargs: dict, dims: list[int]) -> ShapesCollection:
    """Every tensor leaf's batch dimension symbolic (``Dim.AUTO``: export may still find it fixed, checked after)."""
    shapes = ShapesCollection()
    for leaf, batch_dim in zip(tree_flatten((args, kwargs))[0], dims):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > batch_dim:
            shapes[leaf] = {batch_dim: Dim.AUTO}
    return shapes


# torch's folder and fxpipe's (this file's parent's parent): a frame there is not the model's
_NOT_THE_MODEL = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
                  os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)


def _model_frame(exc: BaseException) -> str | None:
    """``file:line: `code``` of the innermost frame outside torch and fxpipe where export failed (the model's
    own line, in a library such as transformers too), following the chain of wrapped exceptions."""
    found, seen = None, set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        found = frame_outside(exc, _NOT_THE_MODEL) or found
        exc = exc.__cause__ or exc.__context__
    return found


def _fail(model: nn.Module, exc: BaseException) -> TraceError:
    """A TraceError naming where export failed (export's own message names the module and line)."""
    region = dropped_region(exc)
    if region is not None and region.operation == TENSOR_HOOK:
        return TraceError(
            f"the torch.export front end cannot keep the {region.operation} in {type(model).__name__}: the "
            "exported graph holds the operations but not the hook, so the pipeline would compute other gradients "
            f"than the model\n  operation: {region.where}\n  fix: compile with CompileOptions(frontend='fx') and "
            "make the module that registers it a leaf (leaf_modules=[ThatModule] runs its forward as written, hook "
            "included), or register the hook on the module's output from outside the model", module=None,
            operation=region.where)
    if region is not None:
        return TraceError(
            f"the torch.export front end cannot keep the {region.operation} in {type(model).__name__}: export "
            "records the operations inside it but not the region (it keeps no_grad, enable_grad, "
            f"set_grad_enabled and autocast regions, not this one), so the pipeline would compute other "
            f"gradients than the model\n  operation: {region.where}\n  fix: use `with torch.no_grad():` there "
            "(kept), or compile with CompileOptions(frontend='fx') and make the module that holds it a leaf "
            "(leaf_modules=[ThatModule] runs its forward as written)", module=None, operation=region.where)
    text = str(exc).strip().splitlines()
    first = next((line for line in text if line.strip()), type(exc).__name__)
    where = _model_frame(exc)
    return TraceError(
        f"torch.export cannot trace {type(model).__name__}: {type(exc).__name__}: {first}\n"
        f"  operation: {where or 'no frame of the model in the traceback (torch.export failed in its own code)'}\n"
        "  fix: a model that returns objects torch.export does not know (a cache object: use_cache=False for "
        "Hugging Face models) or whose Python control flow depends on tensor values must be changed there, or "
        "traced with CompileOptions(frontend='fx', leaf_modules=[...]) around the untraceable part",
        module=None, operation=where or first,
    )


def _check_own_tensors(model: nn.Module, gm: fx.GraphModule) -> None:
    """Every parameter and buffer the graph reads must be the model's own object (gradients land there)."""
    own = {name: t for name, t in list(model.named_parameters(remove_duplicate=False))
           + list(model.named_buffers(remove_duplicate=False))}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = gm
        for part in node.target.split("."):
            value = getattr(value, part)
        if isinstance(value, torch.Tensor) and own.get(node.target) is not value:
            # A constant the program made (a lifted tensor constant) is fine; one of the model's is not.
            if node.target in own:
                raise TraceError(f"torch.export gave a copy of {node.target!r} instead of the model's own tensor; "
                                 "its gradient would not reach model.parameters(). fix: use "
                                 "CompileOptions(frontend='fx')",
                                 module=node.target.rpartition(".")[0] or None, operation=node.target)


def _flatten_graph(gm: fx.GraphModule) -> None:
    """Plain positional placeholders and a tuple output; the pytree specs move to ``gm.meta``."""
    codegen = gm.graph._codegen
    info = getattr(codegen, "pytree_info", None)
    if info is not None:
        gm.meta["fxpipe_in_spec"] = info.in_spec
        gm.meta["fxpipe_out_spec"] = info.out_spec
        gm.graph._codegen = fx.graph.CodeGen()
    output = next(n for n in gm.graph.nodes if n.op == "output")
    result = output.args[0]
    if not isinstance(result, (tuple, list)):
        output.args = ((result,),)
    # The guard export adds checks the example's shapes: micro-batches have other sizes by design.
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn" and not node.users:
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.graph.lint()
    gm.recompile()


def _written_tensor(node: fx.Node) -> fx.Node:
    """The node whose tensor ``node``'s value is, through in-place ATen operators (``add_`` returns its
    ``self``, the argument its schema marks as written and returned), else ``node`` itself."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        schema = node.target._schema
        alias = schema.returns[0].alias_info if len(schema.returns) == 1 else None
        if alias is None or not alias.is_write:
            return node
        written = [i for i, a in enumerate(schema.arguments)
                   if a.alias_info is not None and a.alias_info.before_set == alias.before_set]
        if not written or written[0] >= len(node.args) or not isinstance(node.args[written[0]], fx.Node):
            return node
        node = node.args[written[0]]
    return node


def _drop_self_write_backs(gm: fx.GraphModule) -> None:
    """Erase the ``copy_(buffer, value)`` that ``ExportedProgram.module()`` appends for a mutated buffer
    where ``value`` is the buffer itself, updated in place (``self.count += 1`` exports as ``add_``).

    The copy is a no-op there, but at the graph's end it lands in the last stage while the update runs in
    the first, which the pipeline must refuse (a buffer updated across stages); without it the update
    stays where the model makes it."""
    no_ops = [node for node in gm.graph.nodes
              if node.op == "call_function" and node.target is torch.ops.aten.copy_.default and not node.users
              and len(node.args) >= 2 and isinstance(node.args[1], fx.Node)
              and _written_tensor(node.args[1]) is node.args[0]]
    for node in no_ops:
        gm.graph.erase_node(node)
    if no_ops:   # _flatten_graph has compiled the graph already
        gm.graph.lint()
        gm.recompile()


def _check_batch_symbolic(gm: fx.GraphModule, args: tuple, kwargs: dict, dims: list[int]) -> None:
    """Refuse a graph whose batch size export fixed: it would run only batches of the example's size."""
    leaves = tree_flatten((args, kwargs))[0]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, leaf, batch_dim in zip(placeholders, leaves, dims):
        val = node.meta.get("val")
        if isinstance(leaf, torch.Tensor) and leaf.dim() > batch_dim and isinstance(val, torch.Tensor):
            if is_concrete_int(val.shape[batch_dim]):   # an int, or a SymInt export resolved to one
                raise TraceError(
                    f"torch.export fixed the batch size of input {node.name!r} at {leaf.shape[batch_dim]}: the "
                    "model's code depends on the batch size (a reshape with a literal batch, a branch on it), so "
                    "its micro-batches could not run\n  operation: the use of the batch size in forward\n  fix: "
                    "compute shapes from the input's own sizes (x.reshape(x.shape[0], -1), not a literal batch) "
                    "and do not loop over the batch dimension", module=None, operation=node.name)


PREDICTED = "fxpipe_predicted_repeats"
"""``gm.meta`` key: how a predicted graph was made (:mod:`fxpipe.frontend.repeats`)."""


@contextlib.contextmanager
def _without_stack_traces() -> Iterator[None]:
    """torch.export without each node's Python stack trace (``node.meta["stack_trace"]``): nothing in fxpipe
    reads it, and recording it is an eighth of the export of a 32-layer Hugging Face model (1 s of 8)."""
    before = fx.config.do_not_emit_stack_traces
    fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx.config.do_not_emit_stack_traces = before


def export_graph(model: nn.Module, args: tuple, kwargs: dict[str, Any] | None = None,
                 batch_dim: Any = 0, *, predict_repeats: bool = False) -> fx.GraphModule:
    """``model`` exported on ``(args, kwargs)`` as a flat GraphModule over its own parameters (module doc).

    ``predict_repeats``: a deep stack of alike layers is not traced layer by layer but predicted from the
    graphs of a few (:mod:`fxpipe.frontend.repeats`; ``gm.meta[PREDICTED]`` then says so), for callers that
    never run the graph. Raises :class:`fxpipe.TraceError` when torch.export cannot trace it or fixes its
    batch size."""
    if predict_repeats:
        found = predicted_export(model, lambda: export_graph(model, args, kwargs, batch_dim))
        if found is not None:
            gm, note = found
            _check_own_tensors(model, gm)
            gm.meta[PREDICTED] = note
            return gm
    kwargs = dict(kwargs or {})
    dims = leaf_batch_dims(model, tuple(args), kwargs, batch_dim)   # by input (CompileOptions.batch_dim)
    try:
        with refusing_grad_regions(only=(torch.inference_mode, torch.Tensor)), _without_stack_traces():
            program = torch.export.export(model, tuple(args), kwargs, strict=False,
                                          dynamic_shapes=_dynamic_batch(tuple(args), kwargs, dims)
                                          .dynamic_shapes(model, tuple(args), kwargs))
    except TraceError:
        raise
    except Exception as exc:   # export raises UserError, RuntimeError, TypeError, torch._dynamo errors...
        eager = eager_failure(model, tuple(args), kwargs)
        if eager is not None:
            raise inputs_rejected(eager, AS_WRITTEN) from eager
        raise _fail(model, exc) from exc
    gm = flat_program(program, type(model).__name__)
    _check_own_tensors(model, gm)
    _check_batch_symbolic(gm, tuple(args), kwargs, dims)
    gm.meta[LEAF_DIMS] = dims
    gm.meta["fxpipe_traced_training"] = model.training
    return gm


def flat_program(program: torch.export.ExportedProgram, name: str = "Exported") -> fx.GraphModule:
    """An ExportedProgram as a flat GraphModule over the program's parameters and buffers (module doc)."""
    exported = program.module()
    # A plain GraphModule over the same attributes: export's module checks every call's input shapes
    # against the example's (a forward pre-hook), and micro-batches differ from it by design.
    gm = fx.GraphModule(exported, exported.graph, name)
    gm.meta.update(exported.meta)
    _flatten_graph(gm)
    _drop_self_write_backs(gm)
    canonical_graph(gm)   # the same graph whichever device traced it: the plan's is the ranks'
    split_model_loss(gm)   # a loss the model computes itself, made exact across micro-batches
    gm.meta.setdefault("fxpipe_traced_training", bool(exported.training))
    return gm
