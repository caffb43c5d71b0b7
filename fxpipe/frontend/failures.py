"""Why a captured model fails on its example inputs, said so that the user fixes the right thing.

A graph that fails on the example batch has three possible causes, each with its own fix: the inputs
(the model run as written rejects them: a wrong image size), the trace (an optional argument left at
``None`` was traced as an input, so its ``if mask is not None:`` branch is in the graph and runs on
``None``; ``concrete_args`` fixes that) or the micro-batches (code that fixes the batch size). The graph
alone cannot tell the first two apart, since it fails on the whole batch either way; the caller that
still holds the model settles it by running the model as written (:func:`judged_by_the_model`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_map

__all__ = ["AS_WRITTEN", "inputs_rejected", "run_failure", "OptionalArgumentsTraced", "eager_failure",
           "judged_by_the_model"]

AS_WRITTEN = "run as written, before any trace or split into micro-batches"


def inputs_rejected(exc: BaseException, when: str) -> ValueError:
    """The error for a model that fails on its example inputs themselves, ``when`` run as the caller says:
    the inputs are what it rejects, not the micro-batches or a trace."""
    return ValueError(f"the model fails on example_inputs themselves ({when}): {type(exc).__name__}: {exc}; "
                      "check that example_inputs match the model's forward() (shapes, dtypes, image size: "
                      "model(*example_inputs) must run)")


class OptionalArgumentsTraced(ValueError):
    """A graph that fails with optional arguments traced at ``None``: those are the likely cause unless the
    model run as written fails too (:func:`judged_by_the_model` finds out)."""


def run_failure(exc: BaseException, gm: fx.GraphModule, given: int, whole_batch_fails: bool = False) -> ValueError:
    """The error for a traced graph ``gm`` that raised ``exc`` on example inputs with ``given`` leaves (module
    doc). ``whole_batch_fails``: the caller ran the whole example batch too and it failed the same way, so the
    micro-batches are not the cause and the message does not send the user after them."""
    left = [n.target for n in gm.graph.nodes if n.op == "placeholder"][given:]
    defaults = {n.target: n.args[0] for n in gm.graph.nodes if n.op == "placeholder" and n.args}
    optional = [a for a in left if a in defaults and defaults[a] is None]
    if optional:
        return OptionalArgumentsTraced(
            f"running the model on (micro-batches of) example_inputs failed: {type(exc).__name__}: {exc}; the "
            f"forward's optional argument(s) {optional} were left at None, but torch.fx traced them as inputs, so "
            "code under `if <arg> is not None:` is in the graph and runs on None; compile with "
            f"options=fxpipe.CompileOptions(concrete_args={{{', '.join(f'{a!r}: None' for a in optional)}}}) "
            "to trace the model as called without them (or pass them in example_inputs)")
    if whole_batch_fails:
        return inputs_rejected(exc, "the whole batch, before any split into micro-batches")
    return ValueError(f"running the model on (micro-batches of) example_inputs failed: {type(exc).__name__}: "
                      f"{exc}; check that example_inputs match the model's forward(); it runs on micro-batches "
                      "(parts of the example batch), so code that fixes the batch size (x.view(8, -1) for a batch "
                      "of 8, a tensor of that size made in forward) fails: use x.size(0) or -1 there, or compile "
                      "with chunks=1")


def eager_failure(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Exception | None:
    """What ``model(*args, **kwargs)`` raises when run as written (``None`` if it runs), leaving its buffers and
    the RNG as they were. Tensors go to the device of the model's first parameter: the caller may have moved
    the model to its first worker already."""
    device = next((p.device for p in model.parameters()), None)
    if device is not None:
        args, kwargs = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, (args, kwargs))
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    rng = torch.random.get_rng_state()
    try:
        model(*args, **kwargs)   # with grad on, as traced: forward code may need it (x.register_hook)
    except Exception as exc:
        return exc
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.random.set_rng_state(rng)
    return None


@contextlib.contextmanager
def judged_by_the_model(model: Any, args: tuple | None, kwargs: dict[str, Any] | None) -> Iterator[None]:
    """Within the block, an :class:`OptionalArgumentsTraced` is checked against ``model(*args, **kwargs)``: if
    the model run as written fails too, the inputs are at fault and the error says so instead."""
    try:
        yield
    except OptionalArgumentsTraced:
        if not isinstance(model, nn.Module) or args is None:
            raise
        eager = eager_failure(model, tuple(args), dict(kwargs or {}))
        if eager is None:
            raise
        raise inputs_rejected(eager, AS_WRITTEN) from eager
