"""A call of the pipeline bound to the traced graph's inputs and split into micro-batches.

``pipe(*args, **kwargs)`` and ``pipe.step(inputs, target, ...)`` take what the model takes; the stages
take the graph's placeholders. :class:`CallInputs` binds one to the other (positional, keyword and
default arguments; a torch.export graph's flat leaves through its input spec), checks the call against
what was compiled (:mod:`fxpipe.runtime.checks.guards`) and splits inputs and targets along their batch
dimensions (:mod:`fxpipe.runtime.execute.microbatch`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from fxpipe.planning.plan import Plan
from fxpipe.runtime.checks.guards import ModelGuard, check_inputs
from fxpipe.runtime.execute.microbatch import BatchLayout, batch_size_of, leaf_batch_sizes, scatter
from fxpipe.runtime.execute.structure import flat_inputs

__all__ = ["CallInputs"]


class CallInputs:
    """The graph's inputs, the plan's batch layout and chunks, and the guard of the compiled model."""

    def __init__(self, graph_module: fx.GraphModule, plan: Plan, guard: ModelGuard | None = None) -> None:
        self.placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
        self.in_spec = graph_module.meta.get("fxpipe_in_spec")   # a torch.export graph's input structure
        self.layout = BatchLayout.of(plan.batch_dims)
        self.chunks = plan.chunks
        self.signature = plan.profile.get("inputs", [])
        self.guard = guard

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The call's values by placeholder name (defaults filled in); ``TypeError`` as Python would say it."""
        args, kwargs = flat_inputs(args, kwargs, self.in_spec, [p.target for p in self.placeholders])
        if len(args) > len(self.placeholders):
            raise TypeError(f"the model takes {len(self.placeholders)} inputs, got {len(args)}")
        bound = {p.target: a for p, a in zip(self.placeholders, args)}
        for key, value in kwargs.items():
            if key not in {p.target for p in self.placeholders}:
                raise TypeError(f"unexpected keyword input {key!r}")
            if key in bound:
                raise TypeError(f"input {key!r} given twice")
            bound[key] = value
        env = {}
        for p in self.placeholders:
            if p.target in bound:
                env[p.name] = bound[p.target]
            elif p.args:
                env[p.name] = p.args[0]
            else:
                raise TypeError(f"missing input {p.target!r}")
        return env

    def _dims(self) -> dict[str, int]:
        return {p.name: self.layout.inputs.get(p.target, 0) for p in self.placeholders}

    def micro_batches(self, args: tuple, kwargs: dict, chunks: int | None = None) -> list[dict[str, Any]]:
        """The bound inputs split into ``chunks`` (default the plan's) micro-batches, each a dict by placeholder
        name; a batch of fewer samples (a data loader's short last batch) into one micro-batch per sample."""
        env = self.bind(args, kwargs)
        if self.guard is not None:
            self.guard.check()
        dims = self._dims()
        check_inputs(self.signature, env, dims)
        names = list(env)
        values, per = list(env.values()), [dims[n] for n in names]
        count = self.count(chunks)
        count = min(count, batch_size_of(values, per) or count)   # an empty batch: scatter says so
        return [dict(zip(names, mb)) for mb in scatter(values, count, per)]

    def count(self, chunks: int | None) -> int:
        """The micro-batches asked for: ``chunks``, else the plan's; ``ValueError`` for one under 1."""
        count = self.chunks if chunks is None else chunks
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"chunks must be a positive int (micro-batches per step), got {count!r}; pass e.g. "
                             f"chunks={self.chunks}, the plan's")
        return count

    def micro_targets(self, target: Any, count: int | None = None) -> list[Any]:
        """``target`` split into ``count`` (default the plan's chunks; the inputs' micro-batches) micro-batches
        along the layout's target dimension; ``None`` (a loss of the output alone: self-supervised, a model
        that returns its loss terms) is ``None`` for every one."""
        count = self.chunks if count is None else count
        if target is None:
            return [None] * count
        dim = self.layout.target
        shapes = [tuple(t.shape) for t in tree_flatten(target)[0] if isinstance(t, torch.Tensor)]
        if shapes and not any(len(shape) > dim for shape in shapes):
            raise ValueError(f"pipe.step's target is split into micro-batches along dimension {dim} (the "
                             f"outputs' batch dimension, or CompileOptions.target_batch_dim), but no tensor in it "
                             f"has that dimension: target tensor shapes {shapes}; compile with "
                             "CompileOptions(target_batch_dim=...) set to the dimension of the target that holds "
                             "the samples (0 for a target of shape (batch,))")
        sizes = leaf_batch_sizes(target, dim)
        if len(set(sizes.values())) > 1:   # batch_size_of's message would name the inputs' batch_dim
            raise ValueError(f"pipe.step's target tensors disagree on the batch size along dimension {dim}: "
                             f"{sizes}; each must hold one entry per sample of the batch there (a tensor laid "
                             "out otherwise: CompileOptions(target_batch_dim=...) names the dimension)")
        return [t[0] for t in scatter([target], count, dim)]

    def targets_fit(self, targets: list[Any], sizes: list[int]) -> bool:
        """Whether ``micro_targets``' micro-batches hold the inputs' ``sizes`` samples each (or are all None)."""
        if len(targets) != len(sizes):
            return False
        return all(t is None for t in targets) or all(batch_size_of([t], self.layout.target) == n
                                                      for t, n in zip(targets, sizes))

    def sizes(self, micro: list[dict[str, Any]]) -> list[int]:
        """Samples per micro-batch."""
        dims = self._dims()
        return [batch_size_of(list(mb.values()), [dims[n] for n in mb]) for mb in micro]
