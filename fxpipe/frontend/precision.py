"""Mixed precision as the plan runs it: float32 parameters, bfloat16 compute (``"bf16-mixed"``).

A layout's ``precision`` (:data:`solvers.layout.PRECISIONS`) is ``"fp32"``, ``"bf16"`` or ``"fp16"`` (the
parameters, their gradients and the optimizer's state in that dtype, the compute too: the model as it is
built) or ``"bf16-mixed"``: the semantics of FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``, as torchtitan trains, on every layout. The parameters stay float32 (so do their
gradients, accumulated over the micro-batches and reduced in float32, and the optimizer's state), and the
forward and backward compute in bfloat16.

:func:`mixed_precision` is that policy as one rewrite of the captured graph, made once after capture and
before anything is costed, so the costs, the plan and every stage that runs are of the same graph:

* every float32 parameter the graph reads goes through :func:`compute_copy`, its bfloat16 copy (one node before
  each reader, so a tied weight read in two stages is cast in each, not sent along the pipeline). The copy is
  cast once while the parameter is unchanged (its version counter, which an optimizer's step or
  ``load_state_dict`` moves), so every micro-batch of a step and its recomputation share one copy, as
  FSDP2's unsharded bfloat16 parameter is one; the gradient flows back through the cast into the float32
  parameter's ``.grad``, where the micro-batches accumulate in float32;
* every float32 input of the model goes through :func:`compute_input` (FSDP2's ``cast_forward_inputs``): cast by a
  forward pre-hook while the model is traced (:func:`traced_as_computed`; torch.export records the casts), or by a
  node after its placeholder where the trace did not record them (torch.fx).

Buffers keep their dtype, as FSDP2 leaves them (a rotary embedding's float32 frequencies stay float32), so do a
batch norm's weight and bias (read as float32 by its kernel beside its float32 running statistics), and the
model's own casts run as written (a Hugging Face attention's float32 softmax). The pipeline of a rewritten graph
is exact against one process running the same rewritten graph, that is the same float32 model under the same
policy (``tests/test_precision.py``). On FSDP2 meshes the ranks also give ``fully_shard`` the policy
(:func:`fxpipe.distributed.parallel.apply.apply_data_parallel`): its parameters are then bfloat16 when the
graph reads them, and :func:`compute_copy` returns them as they are.

Written here, not taken from torch: torch's policy is FSDP2's alone (``fully_shard`` needs a process group and
shards), and ``torch.autocast`` computes in other dtypes than the policy does (a norm or a softmax in float32, a
matrix product's weight cast again for every micro-batch).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

import torch
import torch.fx as fx

__all__ = ["COMPUTE_DTYPE", "PRECISION_OF_DTYPE", "compute_copies", "compute_copy", "compute_input", "is_mixed",
           "mixed_precision", "precision_of", "check_precision", "is_compute_copy", "read_attribute",
           "resolve_precision", "traced_as_computed", "with_precision"]

COMPUTE_DTYPE = torch.bfloat16
_MASTER = torch.float32
#: a dtype's name (``str(dtype)`` without ``torch.``, as plans record it) -> the precision of a model built in it
PRECISION_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}
# id(parameter) -> (a weak reference to it, (its version, grad mode), its copy); by id, as a tensor's == is
# elementwise, and dropped with the parameter
_COPIES: dict[int, tuple[Any, tuple[int, bool], torch.Tensor]] = {}
_LOCK = threading.Lock()   # CPU workers are threads of one process


def precision_of(dtype: torch.dtype) -> str:
    """The precision of a model that trains in ``dtype`` as it is built: ``"fp32"``, ``"bf16"``, ``"fp16"``,
    ``"fp64"``."""
    return PRECISION_OF_DTYPE.get(str(dtype).removeprefix("torch."), "fp32")


def is_mixed(precision: str | None) -> bool:
    """Whether ``precision`` computes in another dtype than the parameters are kept in."""
    return precision == "bf16-mixed"


@torch.compiler.disable
def compute_copy(param: torch.Tensor) -> torch.Tensor:
    """``param``'s bfloat16 copy, cast once while it is unchanged (module docstring); a parameter that is not
    float32 (FSDP2's unsharded bfloat16 one under its policy, or one the user keeps in another dtype) as it is."""
    if param.dtype != _MASTER:
        return param
    key = (param._version, torch.is_grad_enabled())
    with _LOCK:
        held = _COPIES.get(id(param))
    if held is not None and held[0]() is param and held[1] == key:
        return held[2]
    copy = param.to(COMPUTE_DTYPE)
    with _LOCK:
        if held is None or held[0]() is not param:
            weakref.finalize(param, _COPIES.pop, id(param), None)
        _COPIES[id(param)] = (weakref.ref(param), key, copy)
    return copy


def compute_copies(params: Any) -> list[torch.Tensor]:
    """The bfloat16 copies :func:`compute_copy` holds of ``params`` (the latest of each, kept between steps until
    the parameter's next read): what a rank keeps beside its float32 parameters under ``"bf16-mixed"``."""
    with _LOCK:
        held = [(p, _COPIES.get(id(p))) for p in params]
    return [entry[2] for p, entry in held if entry is not None and entry[0]() is p]


def compute_input(value: Any) -> Any:
    """A float32 tensor input of the model in bfloat16 (FSDP2's ``cast_forward_inputs``); anything else as it is."""
    if isinstance(value, torch.Tensor) and value.dtype == _MASTER:
        return value.to(COMPUTE_DTYPE)
    return value


def is_compute_copy(node: object) -> bool:
    """Whether graph value ``node`` is a parameter's :func:`compute_copy` (:func:`mixed_precision`'s cast)."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is compute_copy


def read_attribute(node: object) -> fx.Node | None:
    """The ``get_attr`` node (a parameter or buffer) that graph value ``node`` is, or is the compute copy of
    (:func:`mixed_precision` puts :func:`compute_copy` between a parameter and its readers); ``None`` otherwise.
    The passes that look for a layer's parameters in a graph (tensor parallelism's) read through the copy."""
    if is_compute_copy(node) and node.args:
        node = node.args[0]
    return node if isinstance(node, fx.Node) and node.op == "get_attr" else None


def mixed_precision(gm: fx.GraphModule, cast_inputs: bool = True) -> fx.GraphModule:
    """Rewrite ``gm`` in place to run under ``"bf16-mixed"`` (module docstring) and return it; ``cast_inputs=False``
    where the trace recorded the inputs' casts itself (torch.export traces :func:`traced_as_computed`'s hook, whose
    casts check their input is float32). Each cast node
    takes its first user's module path (``nn_module_stack``), so a block kept whole keeps its casts; the node
    names are the same on every machine that rewrites the same graph, so a plan's stages name them."""
    graph = gm.graph
    leaves = [n.target for n in graph.nodes if n.op == "call_module" and any(
        p.dtype == _MASTER for p in gm.get_submodule(n.target).parameters())]
    if leaves:
        raise ValueError(f"precision='bf16-mixed' reads every float32 parameter through its bfloat16 copy, but "
                         f"the graph calls {len(leaves)} module(s) whole that hold float32 parameters "
                         f"({', '.join(map(repr, leaves[:3]))}{', ...' if len(leaves) > 3 else ''}): trace with "
                         "CompileOptions(frontend='export') or 'auto' (the default: torch.export, whose graph "
                         "reads every parameter), without leaf_modules holding parameters")
    for node in list(graph.nodes):
        if node.op == "placeholder" and node.users and cast_inputs:
            _insert_after(graph, node, compute_input)
        elif node.op == "get_attr" and node.users and _float_parameter(gm, node.target):
            for user in sorted(node.users, key=_position(graph)):   # one copy a reader: a tied weight's readers
                if not _batch_norm(user):                         # each cast it in their own stage
                    _insert_after(graph, node, compute_copy, user)
    graph.lint()
    gm.recompile()
    gm.meta["fxpipe_precision"] = "bf16-mixed"
    return gm


def _insert_after(graph: fx.Graph, node: fx.Node, cast: Any, only: fx.Node | None = None) -> None:
    """``cast(node)`` put before ``node``'s first reader (or before ``only``, for that reader alone), which then
    read it."""
    users = [only] if only is not None else list(node.users)
    first = min(users, key=_position(graph))
    with graph.inserting_before(first):
        new = graph.call_function(cast, (node,))
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in first.meta:
            new.meta[key] = first.meta[key]
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor) and value.dtype == _MASTER:
        new.meta["val"] = value.to(COMPUTE_DTYPE)
    elif value is not None:
        new.meta["val"] = value
    node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new and (only is None or user is only))


def _batch_norm(node: fx.Node) -> bool:
    """A batch norm operation: its weight and bias stay float32, as its running statistics (buffers) do; the
    kernels take a bfloat16 input with float32 parameters and statistics (CPU, cuDNN), and the statistics stay
    float32 sums of many samples."""
    name = str(getattr(node.target, "__name__", node.target))
    return node.op == "call_function" and "batch_norm" in name


def _position(graph: fx.Graph) -> Any:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: order[n]


def _float_parameter(gm: fx.GraphModule, target: str) -> bool:
    module_path, _, name = target.rpartition(".")
    try:
        owner = gm.get_submodule(module_path) if module_path else gm
    except AttributeError:
        return False
    value = getattr(owner, name, None)
    return isinstance(value, torch.nn.Parameter) and value.dtype == _MASTER


def resolve_precision(asked: str | None, model_dtype: torch.dtype, mixed_by_default: bool = False) -> str:
    """The precision a plan runs: ``asked`` (``CompileOptions.precision``), checked against the dtype the model
    is built in; ``None``: ``"bf16-mixed"`` for a float32 model where ``mixed_by_default`` (:func:`fxpipe.plan`
    for devices whose bfloat16 rate is faster than float32's), else the model's own. ``ValueError`` naming both
    dtypes and the fix, before anything is costed."""
    own = precision_of(model_dtype)
    if asked is None:
        return "bf16-mixed" if mixed_by_default and model_dtype == _MASTER else own
    if is_mixed(asked) and model_dtype != _MASTER:
        raise ValueError(f"precision='{asked}' keeps float32 parameters and computes in bfloat16, but the model's "
                         f"parameters are {str(model_dtype).removeprefix('torch.')}: build it in float32 (what "
                         f"from_config builds; model.float()), or plan it as it is (precision='{own}')")
    if not is_mixed(asked) and asked != own:
        mixed = " or precision='bf16-mixed' (float32 kept, bfloat16 computed)" if model_dtype == _MASTER else ""
        raise ValueError(f"precision='{asked}' but the model's parameters are "
                         f"{str(model_dtype).removeprefix('torch.')}: build the model in that dtype, or pass "
                         f"precision='{own}' (the model as it is){mixed}")
    return asked


def with_precision(captured: Any, precision: str | None) -> Any:
    """``captured`` (:class:`fxpipe.frontend.capture.Captured`) with its graphs rewritten for ``precision``
    (:func:`mixed_precision` for ``"bf16-mixed"``; nothing else rewrites). Its fingerprint stays the model's as
    built: a float32 model launches a ``"bf16-mixed"`` plan made for it."""
    if is_mixed(precision) and captured.frontend.get("name") == "given":
        raise ValueError("precision='bf16-mixed' rewrites the traced graph (every float32 parameter read through its "
                         "bfloat16 copy), which fxpipe does not do to a GraphModule or ExportedProgram you made: pass "
                         "the nn.Module, or a graph of a bfloat16 model with its own precision")
    if is_mixed(precision) and captured.graph.meta.get("fxpipe_precision") is None:
        eval_graph = captured.eval_graph
        cast_inputs = captured.frontend.get("name") != "export"   # export traced the inputs' casts
        mixed_precision(captured.graph, cast_inputs)
        if eval_graph is not None and eval_graph is not captured.graph and "fxpipe_precision" not in eval_graph.meta:
            mixed_precision(eval_graph, cast_inputs)
    return captured


@contextlib.contextmanager
def traced_as_computed(model: Any, precision: str | None) -> Iterator[None]:
    """Under ``"bf16-mixed"``, ``model``'s float32 parameters hold bfloat16 values while it is traced, and their own
    float32 values again after: the graph records the casts the model makes as it computes in bfloat16 (a Hugging
    Face norm's ``.to(input_dtype)`` is a cast to bfloat16, not the float32 a float32 trace bakes in), and its
    parameters are the model's float32 ones, read through :func:`compute_copy`. Buffers stay as they are, as
    FSDP2 leaves them. Nothing else changes the model (the same Parameter objects, bit for bit after)."""
    if not is_mixed(precision) or not isinstance(model, torch.nn.Module):
        yield
        return
    norms = {id(p) for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
             for p in m.parameters(recurse=False)}   # kept float32, as the rewrite keeps them (_batch_norm)
    kept = [(p, p.data) for p in model.parameters() if p.dtype == _MASTER and id(p) not in norms]
    # the float32 inputs cast as they enter the model (FSDP2's cast_forward_inputs): the trace records the casts,
    # its placeholders keep the inputs' own dtypes (the plan's input signature)
    hook = model.register_forward_pre_hook(_cast_inputs, with_kwargs=True)
    try:
        with torch.no_grad():
            for p, data in kept:
                p.data = data.to(COMPUTE_DTYPE)
        yield
    finally:
        hook.remove()
        for p, data in kept:
            p.data = data


def _cast_inputs(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tuple(compute_input(a) for a in args), {k: compute_input(v) for k, v in kwargs.items()}


def check_precision(precision: str | None, model: Any, where: str = "") -> None:
    """Refuse a model a plan of ``precision`` cannot run, naming the dtypes and the fix: ``"bf16-mixed"`` keeps
    float32 parameters (a model built in bfloat16 would train in bfloat16, silently)."""
    if not is_mixed(precision) or not isinstance(model, torch.nn.Module):
        return
    floats = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()})
    if floats and "float32" not in floats:
        raise ValueError(f"{where}the plan is precision='{precision}' (float32 parameters, bfloat16 compute) but the "
                         f"model's parameters are {', '.join(floats)}: build the model in float32 (what "
                         "from_config builds, without dtype=), or plan it as it is (precision='bf16')")
