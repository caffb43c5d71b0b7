"""Compile-time check that micro-batching computes the model: the example batch run whole and as micro-batches.

A pipeline splits the batch along its batch dimension (:mod:`fxpipe.runtime.execute.microbatch`). That is only
the model's function when no sample sees another along that dimension. A sequence-first ``nn.LSTM`` or
``nn.TransformerEncoder`` (``batch_first=False``: inputs ``(sequence, batch, ...)``) split along dimension
0 is cut along time: every output has the right shape and the wrong numbers. So once per compile, in eval
mode (BatchNorm then uses its running statistics and dropout is off, so a correct split agrees to rounding)
and without gradients, :func:`check_micro_batching` runs the traced graph on the example batch whole and
as the planned micro-batches and refuses a model whose outputs differ, naming the likely cause and the
fix. Every submodule's mode, the buffers, ``.grad`` and the random generator are restored afterwards.

Only the first two micro-batches are run, together and apart: a model that mixes samples along the split
dimension mixes them across any two micro-batches (a recurrence carries its state from the first into the
second; a batch statistic changes with the samples it sees), and this costs one forward of two
micro-batches twice rather than two forwards of the whole batch, which for a large model was a fifth of
the compile.

A difference beyond rounding is not always mixing: a network that amplifies rounding (BatchNorm running
variances near zero, from statistics gathered over a few values per channel) changes its outputs by as
much when its inputs move by one unit in the last place. Before refusing, the check measures that
(:func:`_rounding_sensitivity`); where it explains the difference the model is passed with a warning that
its outputs, split or not, are rounding-limited, since no comparison can tell mixing from rounding there.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from fxpipe.errors import FxpipeError
from fxpipe.frontend.fingerprint import is_dropout_call
from fxpipe.frontend.failures import eager_failure, run_failure
from fxpipe.runtime.execute.microbatch import BatchLayout, batch_size_of, scatter
from fxpipe.runtime.execute.no_trace import leaving_no_trace
from fxpipe.runtime.backward.rng import is_random

__all__ = ["check_micro_batching", "RTOL", "RTOL_FLOAT64", "SENSITIVITY"]

RTOL = 1e-3   # relative to the output's largest magnitude. Rounding of another summation order passes: a
# deep float32 network whose kernels change with the batch size differs by ~1e-4 (EfficientNet-B0: 1.3e-4);
# samples mixed along the split dimension differ by whole percents (an LSTM split along time: 42 %).
# Beyond RTOL the comparison is made again in float64 before refusing: a deep network with badly scaled
# activations differs in float32 from rounding alone (random EfficientNet-B2: 3 %; B7, outputs ~1e7: 170 %)
# and in float64 by far less (B2: 1e-13, B7: 2.8e-6), while mixed samples differ by percents in both.
RTOL_FLOAT64 = 1e-4
SENSITIVITY = 0.1   # a one-ulp change of the inputs that moves the outputs by this fraction of the split's
# difference or more makes that difference rounding's to the check (a randomly calibrated EfficientNet-B7:
# split 0.77, one ulp 0.5; an LSTM split along time: 0.42 against 1e-7)


def _sequence_first(gm: nn.Module) -> list[str]:
    """Submodules whose inputs are sequence-first by default (``batch_first=False``)."""
    found = []
    for name, m in gm.named_modules():
        if isinstance(m, (nn.RNNBase, nn.MultiheadAttention)) and not m.batch_first:
            found.append(f"{name} ({type(m).__name__}, batch_first=False)")
    return found


def _difference(whole: Any, parts: list[Any], dim: int) -> tuple[float, str] | None:
    """The largest relative difference between ``whole`` and ``parts`` joined along ``dim``, and where."""
    flat, spec = tree_flatten(whole)
    columns = [tree_flatten(p) for p in parts]
    if any(s != spec for _, s in columns):
        return float("inf"), "the outputs' structure"
    worst: tuple[float, str] | None = None
    for i, leaf in enumerate(flat):
        column = [c[i] for c, _ in columns]
        if not isinstance(leaf, torch.Tensor) or leaf.dim() <= dim:
            continue   # no batch dimension to join along (a number, a batch-level scalar): nothing to compare
        joined = torch.cat([c.to(leaf.device) for c in column], dim)
        where = f"output leaf {i} of shape {tuple(leaf.shape)}"
        if joined.shape != leaf.shape:
            return float("inf"), f"{where} (micro-batches joined give {tuple(joined.shape)})"
        if not leaf.is_floating_point() and not leaf.is_complex():
            error = 0.0 if torch.equal(joined, leaf) else float("inf")
        else:
            scale = leaf.abs().max().item() if leaf.numel() else 0.0
            diff = (joined - leaf).abs().max().item() if leaf.numel() else 0.0
            error = diff / scale if scale > 0 else diff
        if worst is None or error > worst[0]:
            worst = (error, where)
    return worst


def _refuse_outputs_without_the_batch(whole: Any, samples: int, dim: int) -> None:
    """An output leaf whose batch dimension is not the batch's size (a parameter, a weight matrix, a
    statistic over the batch returned beside the outputs) cannot be joined across micro-batches."""
    for i, leaf in enumerate(tree_flatten(whole)[0]):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > dim and leaf.size(dim) != samples:
            raise FxpipeError(
                f"output leaf {i} of shape {tuple(leaf.shape)} has {leaf.size(dim)} rows along the output's batch "
                f"dimension {dim} when the model runs {samples} samples: it is not per sample (a parameter, or a value "
                "computed over the whole batch, returned beside the outputs), and the pipeline joins every output "
                "across micro-batches. Return only per-sample outputs and compute that one outside the pipeline, "
                "or set CompileOptions(output_batch_dim=...) if the outputs hold the samples along another "
                "dimension")


def _leading(values: list[Any], samples: int, dims: list[int]) -> list[Any]:
    """``values`` with every batched tensor leaf cut to its first ``samples`` samples (as :func:`scatter`
    splits: leaves without the batch dimension are kept whole)."""
    return [tree_map(lambda t, d=dim: t.narrow(d, 0, samples) if isinstance(t, torch.Tensor) and t.dim() > d else t,
                     value) for value, dim in zip(values, dims)]


def _agrees_in_float64(gm: fx.GraphModule, inputs: tuple, samples: int, micro: list, dims: list[int],
                       layout: BatchLayout) -> bool:
    """The same comparison on a float64 copy of the graph: rounding vanishes there, mixing does not."""
    def wide(t: Any) -> Any:
        return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    try:
        twin = copy.deepcopy(gm).double().eval()
        with torch.no_grad():
            whole = twin(*tree_map(wide, _leading(list(inputs), samples, dims)))
            parts = [twin(*tree_map(wide, part)) for part in micro]
    except Exception:   # a graph that cannot run in float64 keeps the float32 verdict
        return False
    found = _difference(whole, parts, layout.output)
    return found is None or found[0] <= RTOL_FLOAT64


def _rounding_sensitivity(gm: fx.GraphModule, inputs: tuple, samples: int, dims: list[int],
                          layout: BatchLayout, whole: Any) -> float:
    """How far ``gm``'s outputs on the leading ``samples`` move when every floating input moves by one unit
    in the last place (relative to the output, as :func:`_difference`); 0 without floating inputs."""
    def floating(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.is_floating_point()
    leading = _leading(list(inputs), samples, dims)
    if not any(floating(t) for t in tree_flatten(leading)[0]):
        return 0.0
    with leaving_no_trace(gm), torch.no_grad():
        moved = gm(*tree_map(lambda t: t * (1 + torch.finfo(t.dtype).eps) if floating(t) else t, leading))
    found = _difference(whole, [moved], layout.output)
    return 0.0 if found is None else found[0]


def _pass_through(x: Any, *args: Any, **kwargs: Any) -> Any:
    return x


def _pass_through_with_mask(x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return x, torch.ones_like(x, dtype=torch.bool)


def _without_dropout(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm``'s graph with its dropout calls passing their input through, over the same modules and tensors.

    torch.export records dropout as an operator with the training flag of the traced mode
    (``aten.dropout(x, p, True)``), which eval mode does not switch off. A dropout mask acts on each element
    (or channel) of each sample alone, so it cannot be what mixes samples: the check runs without it."""
    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if is_dropout_call(node):
            native = "native_dropout" in str(node.target)   # returns (output, mask)
            node.op, node.target = "call_function", _pass_through_with_mask if native else _pass_through
    return fx.GraphModule(gm, graph)


def check_micro_batching(gm: fx.GraphModule, example_inputs: tuple, layout: BatchLayout, chunks: int) -> None:
    """Refuse (:class:`fxpipe.FxpipeError`) a model whose outputs change when ``example_inputs`` is split into
    ``chunks`` micro-batches along ``layout``; see the module doc. Dropout is passed through
    (:func:`_without_dropout`); skipped for ``chunks == 1`` and for a graph that draws other random numbers
    even in eval mode (two runs could not agree)."""
    if chunks <= 1:
        return
    model = gm
    arguments = [n.target for n in gm.graph.nodes if n.op == "placeholder"][:len(example_inputs)]
    dims = layout.input_dims(arguments)
    modes = {m: m.training for m in gm.modules()}
    device = next((t.device for t in gm.parameters()), None)
    inputs = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) and device is not None else t,
                      tuple(example_inputs))
    try:
        gm.eval()
        if is_random(gm):
            gm = _without_dropout(model)
            if is_random(gm):
                return
        with leaving_no_trace(model), torch.no_grad():
            try:
                micro = scatter(list(inputs), chunks, dims)[:2]   # the two the check needs (module doc)
                samples = sum(batch_size_of(part, dims) for part in micro)
                whole = gm(*_leading(list(inputs), samples, dims))
                parts = [gm(*part) for part in micro]
            except Exception as exc:
                # when the whole batch fails too, the micro-batches are not the cause, and its error (with the
                # caller's shapes) is the one to show
                whole_exc = eager_failure(gm, inputs, {})
                raise run_failure(exc if whole_exc is None else whole_exc, gm, len(example_inputs),
                                  whole_exc is not None) from exc
    finally:
        for m, training in modes.items():
            m.training = training
    _refuse_outputs_without_the_batch(whole, samples, layout.output)
    found = _difference(whole, parts, layout.output)
    if found is None or found[0] <= RTOL:
        return
    if found[0] != float("inf") and _agrees_in_float64(gm, inputs, samples, micro, dims, layout):
        return   # float32 rounding of a deep, badly scaled network (EfficientNet-B2: 3 %), not mixing
    error, where = found
    if error != float("inf"):
        moved = _rounding_sensitivity(gm, inputs, samples, dims, layout, whole)
        if moved >= SENSITIVITY * error:
            warnings.warn(
                f"this model amplifies rounding: in eval mode its outputs move by {moved:.2g} relative when its "
                f"inputs move by one unit in the last place, and its example batch run whole and as micro-batches "
                f"differ by {error:.2g} at {where}, so fxpipe cannot tell whether micro-batching mixes samples "
                "and compiles it. The pipeline's outputs will differ from the model's by as much as rounding "
                "moves them. Usual cause: BatchNorm running variances near zero (statistics gathered over a few "
                "values per channel), which more samples in those statistics cure", stacklevel=3)
            return
    suspects = _sequence_first(gm)
    raise FxpipeError(
        f"micro-batching changes this model's outputs: in eval mode, the example batch's first {len(parts)} "
        f"micro-batches (of {chunks}, split along dimension {sorted(set(dims))} of the inputs) run together and "
        f"apart differ by "
        f"{'a different shape or structure' if error == float('inf') else f'{error:.2g} relative to the output'} at {where}. "
        "The model mixes samples along the split dimension: a sequence-first layout (nn.LSTM/GRU/RNN, "
        "nn.TransformerEncoder or nn.MultiheadAttention with batch_first=False take (sequence, batch, ...))"
        + (f", here {', '.join(suspects[:3])}" if suspects else "")
        + ", or a batch-level operation (statistics over the batch, a reshape across samples). Fix: tell fxpipe "
        "where the samples are with options=fxpipe.CompileOptions(batch_dim=1) (output_batch_dim=/target_batch_dim= "
        "for outputs and targets laid out otherwise), or compile with chunks=1 for a model that needs the "
        "whole batch")
