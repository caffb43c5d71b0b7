"""``fxpipe.Pipeline``: runs compiled stages over micro-batches (GPipe fill-drain).

Forward runs on one worker thread per stage. At clock ``c`` stage ``k``
processes micro-batch ``c - k``; a clock ends when all its tasks have. Backward
is left to autograd: the gathered output is an ordinary autograd tensor, so
``loss.backward()`` reaches every parameter, and gradients accumulate over
micro-batches exactly as one full-batch backward would. Checkpointing uses
``torch.utils.checkpoint`` (non-reentrant, RNG state preserved) per stage and
micro-batch, with torchgpipe's modes.
"""

from __future__ import annotations

import linecache
import re
import traceback
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from fxpipe.codegen import StageSpec
from fxpipe.errors import FxpipeError, StageError
from fxpipe.microbatch import gather, scatter
from fxpipe.plan import Plan
from fxpipe.worker import spawn_workers

__all__ = ["Pipeline", "CHECKPOINT_MODES"]

CHECKPOINT_MODES = ("always", "except_last", "never")
_ASSIGN = re.compile(r"^\s*(\w+)\s*=")


def failing_node(exc: BaseException) -> str | None:
    """Name of the fx node whose generated line raised ``exc``, if it came from stage code."""
    name = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename.startswith("<eval_with_key>"):
            m = _ASSIGN.match(linecache.getline(frame.filename, frame.lineno))
            if m:
                name = m.group(1)
    return name


def _to(value: Any, device: torch.device) -> Any:
    return tree_map(lambda t: t.to(device, non_blocking=True)
                    if isinstance(t, torch.Tensor) and t.device != device else t, value)


class Pipeline(nn.Module):
    """A model split into stages on devices; call it like the model."""

    def __init__(self, graph_module: fx.GraphModule, stages: list[StageSpec], devices: list[torch.device],
                 plan: Plan, checkpoint: str = "except_last", mode_dependent: bool = False) -> None:
        super().__init__()
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint must be one of {', '.join(CHECKPOINT_MODES)}, got {checkpoint!r}")
        self.stages = nn.ModuleList(s.module for s in stages)
        self.specs = stages
        self.devices = devices
        self.plan = plan
        self.chunks = plan.chunks
        self.checkpoint = checkpoint
        self._traced_training = bool(graph_module.meta.get("fxpipe_traced_training", False))
        self._mode_dependent = mode_dependent
        self._placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
        self._output = next(n for n in graph_module.graph.nodes if n.op == "output")
        self.train(self._traced_training)

    # ------------------------------------------------------------------ inputs
    def _bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        if len(args) > len(self._placeholders):
            raise TypeError(f"the model takes {len(self._placeholders)} inputs, got {len(args)}")
        bound = {p.target: a for p, a in zip(self._placeholders, args)}
        for key, value in kwargs.items():
            if key not in {p.target for p in self._placeholders}:
                raise TypeError(f"unexpected keyword input {key!r}")
            if key in bound:
                raise TypeError(f"input {key!r} given twice")
            bound[key] = value
        env = {}
        for p in self._placeholders:
            if p.target in bound:
                env[p.name] = bound[p.target]
            elif p.args:
                env[p.name] = p.args[0]
            else:
                raise TypeError(f"missing input {p.target!r}")
        return env

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._mode_dependent and self.training != self._traced_training:
            mode = "train" if self._traced_training else "eval"
            raise FxpipeError(
                f"this model's traced graph depends on train/eval mode (Python code reads self.training) "
                f"and it was compiled in {mode} mode; compile it again in the mode you want to run "
                f"(model.{'train' if self.training else 'eval'}() before fxpipe.compile)"
            )
        env0 = self._bind(args, kwargs)
        names = list(env0)
        micro = [dict(zip(names, values)) for values in scatter(list(env0.values()), self.chunks)]
        grad = torch.is_grad_enabled()
        m, p = len(micro), len(self.specs)
        with spawn_workers(p) as workers:
            for clock in range(m + p - 1):
                tasks = [(k, clock - k) for k in range(p) if 0 <= clock - k < m]
                for k, i in tasks:
                    workers.submit(k, (k, i), self._task(k, i, micro[i], grad, last=(i == m - 1)))
                failures = []
                for _ in tasks:
                    (k, i), ok, value = workers.collect()
                    if not ok:
                        failures.append((k, i, value))
                if failures:
                    k, i, exc = min(failures, key=lambda f: (f[0], f[1]))
                    node = failing_node(exc)
                    raise StageError(
                        f"stage {k} (device {self.devices[k]}) failed on micro-batch {i} at node "
                        f"{node!r}: {type(exc).__name__}: {exc}", stage=k, micro_batch=i, node=node,
                    ) from exc
        outputs = [fx.node.map_arg(self._output.args[0], lambda n, e=env: e[n.name]) for env in micro]
        return gather(outputs)

    def _task(self, k: int, i: int, env: dict[str, Any], grad: bool, last: bool):
        spec, device = self.specs[k], self.devices[k]
        use_checkpoint = grad and (self.checkpoint == "always" or (self.checkpoint == "except_last" and not last))

        def run() -> None:
            inputs = [_to(env[name], device) for name in spec.inputs]
            with torch.set_grad_enabled(grad):
                if use_checkpoint:
                    outs = torch_checkpoint(spec.module, *inputs, use_reentrant=False)
                else:
                    outs = spec.module(*inputs)
            for name, value in zip(spec.outputs, outs):
                env[name] = value
        return run

    def extra_repr(self) -> str:
        return f"stages={len(self.specs)}, chunks={self.chunks}, checkpoint={self.checkpoint!r}"
