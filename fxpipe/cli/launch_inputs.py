"""What ``fxpipe.launch`` trains with besides the plan: ``--model``, ``--data`` and ``--loss`` resolved, the
optimizers and losses it names, and ``--compare`` (one process checking a launched run).

``--model`` is read as ``fxpipe plan`` reads MODEL (:class:`fxpipe.cli.models.ModelSpec`), ``--data`` and
``--loss`` functions as its factories are found (:func:`fxpipe.cli.models.load_function`), so the shell has one
spelling of a model for planning and for training. Every bad argument is a :class:`UsageError`: one line, exit 2.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch
import torch.nn.functional as F

from fxpipe.planning.plan import load_plan

__all__ = ["LOSSES", "OPTIMIZERS", "UsageError", "compare", "data_source", "loss_function", "model_factory"]

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


class UsageError(ValueError):
    """A bad argument: exit 2."""


def _cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension's classes, for (N, C) or token outputs (N, T, C)."""
    return F.cross_entropy(out.flatten(0, -2), target.flatten()) if out.dim() > 2 else F.cross_entropy(out, target)


LOSSES: dict[str, Callable[[Any, Any], torch.Tensor]] = {"cross_entropy": _cross_entropy, "mse": F.mse_loss}


def model_factory(args: argparse.Namespace, plan: Any) -> Callable[[], torch.nn.Module]:
    """``--model`` as ``fxpipe plan`` reads MODEL (:class:`fxpipe.cli.models.ModelSpec`: ``hf:TYPE`` with
    ``--config``, in the dtype the plan was made for; ``torchvision:``, ``timm:``, ``pkg.module:factory``,
    ``path/to/file.py:factory``), built after ``torch.manual_seed(--seed)``: the same weights on every process."""
    from fxpipe.cli.hf import parse_config
    from fxpipe.cli.models import ModelSpec
    planned = (plan.profile or {}).get("dtype")
    try:
        spec = ModelSpec(args.model, parse_config(args.config) if args.config else None,
                         getattr(torch, planned) if planned else None)
    except ValueError as exc:
        raise UsageError(f"--model {args.model}: {exc}") from exc

    def build() -> torch.nn.Module:
        torch.manual_seed(args.seed)
        try:
            return spec.make()[0]
        except ValueError as exc:
            raise UsageError(f"--model {args.model}: {exc}") from exc
    return build


def _function(spec: str, flag: str) -> Callable[..., Any]:
    from fxpipe.cli.models import load_function
    try:
        return load_function(spec, flag)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def data_source(args: argparse.Namespace) -> Callable[[Any, torch.nn.Module], Any]:
    """``--data`` resolved (a function imported now, so that a bad one ends the process before anything is
    built): its batches for a plan and the model built for it, ``mock``'s (:mod:`fxpipe.cli.mock_data`) or the
    function's, called with no argument."""
    if args.data == "mock" or args.data.startswith("mock:"):
        from fxpipe.cli.mock_data import parse_mock

        def mock(plan: Any, model: torch.nn.Module) -> Any:
            try:
                return parse_mock(args.data, plan.frontend, model)
            except ValueError as exc:
                raise UsageError(str(exc)) from exc
        return mock
    batches = _function(args.data, "--data")
    return lambda plan, model: batches()


def loss_function(args: argparse.Namespace) -> Callable[[Any, Any], torch.Tensor] | None:
    """``--loss``: ``None`` for the model's own (``auto``, ``model``), a named one, or a function."""
    return None if args.loss in ("auto", "model") else LOSSES.get(args.loss) or _function(args.loss, "--loss")


def compare(args: argparse.Namespace) -> int:
    """``--compare DIR``: this process trains what the run in DIR trained, whole, and compares
    (:func:`fxpipe.cli.compare_run.compare_run`)."""
    from fxpipe.cli.compare_run import compare_run
    plan = load_plan(args.plan)
    model = model_factory(args, plan)()
    # dict batches train on the model's own loss; (inputs, target) pairs on --loss, cross-entropy for auto
    loss_fn = loss_function(args) or LOSSES["cross_entropy"]
    optimizer = OPTIMIZERS[args.optimizer]
    return compare_run(args.compare, model, data_source(args)(plan, model), lambda ps: optimizer(ps, lr=args.lr),
                       loss_fn, precision=plan.layout.precision)
