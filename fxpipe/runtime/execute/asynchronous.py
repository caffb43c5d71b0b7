"""``fxpipe.AsyncTrainer``: asynchronous 1F1B training — PipeDream weight stashing, PipeDream-2BW, stale-synchronous.

``pipe.step`` is synchronous: every micro-batch of a mini-batch sees the same weights and the
optimizer steps after the flush. :class:`AsyncTrainer` runs a whole stream of mini-batches through
the stages in 1F1B order without that flush, and every stage steps its own optimizer (over its own
parameters) after each *group* of micro-batches:

- ``mode="stash"`` (PipeDream, Narayanan et al. 2019): a group is ``update_every`` micro-batches
  (default 1). A forward uses the stage's latest weights; the stage stashes that version and the
  micro-batch's backward uses it again, so forward and backward agree. Stage ``k`` keeps at most one
  version per in-flight micro-batch (``p - k``; :func:`solvers.asynchronous.stashed_versions`).
- ``mode="2bw"`` (PipeDream-2BW, Narayanan et al. 2021): the same with gradients accumulated over
  ``update_every >= p - 1`` micro-batches (default: one mini-batch, at least ``p - 1``), so at most two versions are live.
- ``mode="ssp"`` (stale-synchronous): one group per mini-batch (as ``pipe.step`` + ``optimizer.step``);
  a stage may run forwards up to ``staleness`` mini-batches ahead of 1F1B, and a forward may miss at
  most ``staleness`` of its stage's updates (default 1); ``staleness=0`` is synchronous training, bit for bit.

Given an :class:`fxpipe.distributed.PipelineRank` instead of a pipeline, each rank runs its own stages'
orders, stashes their versions and steps their optimizers, with values and gradients crossing ranks as in
``PipelineRank.step``; the losses come back on the last stage's rank.

``staleness`` bounds the lag in every mode (:mod:`solvers.asynchronous` holds forwards back). The
weights live as the model's parameters (the optimizers' copy); a version is a detached clone that the
forward runs on in place of the parameters (swapped in as ``torch.func.functional_call`` does), inside ``pipe.step``'s schedule interpreter
(:func:`fxpipe.runtime.execute.step.run_step`, given the orders and a wrapper around every operation).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from fxpipe.errors import FxpipeError, LossReductionError
from fxpipe.planning.memory_model import WorkerPrediction, predict_worker_memory
from fxpipe.runtime.execute.batchnorm import commit_statistics
from fxpipe.runtime.losses.auto_loss import AutoLoss
from fxpipe.runtime.execute.caller_state import CallerState
from fxpipe.runtime.execute.failures import step_error
from fxpipe.runtime.backward.input_grads import InputGraphs
from fxpipe.runtime.execute.step import StepFailure, run_step
from fxpipe.runtime.boundaries.transport import Transport
from solvers.asynchronous import ASYNC_MODES, async_orders, check_orders, stashed_versions
from solvers.schedules import REGISTRY

__all__ = ["AsyncTrainer", "ASYNC_MODES"]

REDUCTIONS = ("auto", "mean", "sum")


class _Stage:
    """One stage's weights: the parameters its optimizer steps, and the versions its in-flight micro-batches use."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.module, self.optimizer = module, optimizer
        self.params = dict(module.named_parameters())
        self.version = 0                                   # groups finished (updates applied)
        self.latest: dict[str, torch.Tensor] | None = None   # the current version's clone, made when first used
        self.in_flight: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}   # micro-batch -> (version, weights)
        self.max_versions = 0
        self.max_lag = 0
        self.lags: list[int] = []

    def begin(self, j: int, group: int) -> None:
        if self.latest is None:   # a clone: the optimizer steps the parameters in place, a saved version must stay
            self.latest = {n: q.detach().clone().requires_grad_(q.requires_grad) for n, q in self.params.items()}
        self.in_flight[j] = (self.version, self.latest)
        self.max_versions = max(self.max_versions, len({v for v, _ in self.in_flight.values()}))
        self.lags.append(group - self.version)
        self.max_lag = max(self.max_lag, group - self.version)

    def finish(self, j: int, ends_group: bool, count: Callable[[], Any] | None = None) -> None:
        """After micro-batch ``j``'s backward: its version's gradients join the parameters'; step at a group's end
        (first dividing the group's gradients by ``count()``, the group's token count, where one is given)."""
        _, used = self.in_flight.pop(j)
        for name, t in used.items():
            if t.grad is not None:
                q = self.params[name]
                q.grad = t.grad if q.grad is None else q.grad + t.grad   # same sums, same order as autograd's
                t.grad = None
        if ends_group:
            if count is not None and self.optimizer is not None:
                scale = 1.0 / float(count())
                with torch.no_grad():
                    for q in self.params.values():
                        if q.grad is not None:
                            q.grad.mul_(scale)
            if self.optimizer is not None:
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            self.version += 1
            self.latest = None


@contextmanager
def _swapped(module: nn.Module, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """``module`` computing with ``weights`` in place of its parameters (every name a tied one has), then back.
    Only the stage's own worker runs the module, so the swap is seen by no other thread."""
    by_id = {id(q): weights[name] for name, q in module.named_parameters()}
    places = []
    for name, q in module.named_parameters(remove_duplicate=False):
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        places.append((owner, attr, q))
        owner._parameters[attr] = by_id[id(q)]   # as torch.func.functional_call does, for the whole operation
    try:
        yield
    finally:
        for owner, attr, q in places:
            owner._parameters[attr] = q


class AsyncTrainer:
    """Asynchronous training of a compiled pipeline, or of this rank's stages of an
    :class:`fxpipe.distributed.PipelineRank` (see the module docstring for the modes).

    ``optimizer_fn(params)`` makes one stage's optimizer (e.g. ``lambda ps: torch.optim.SGD(ps, lr=0.1)``);
    ``update_every`` counts micro-batches per update (``"stash"``: 1; ``"2bw"``: a mini-batch's, at least ``p - 1``); ``staleness``
    the updates a forward may miss (``None``: unbounded; ``"ssp"``: 1). Errors in the arguments are raised here.
    """

    def __init__(self, pipe: Any, optimizer_fn: Callable[[list[nn.Parameter]], torch.optim.Optimizer], *,
                 mode: str = "stash", update_every: int | None = None, staleness: int | None = None,
                 schedule: str = "1f1b", reduction: str = "auto") -> None:
        if getattr(pipe, "mesh", None) is not None:
            raise ValueError("asynchronous modes run one pipeline (fxpipe.distributed.PipelineRank without a mesh), "
                             "not dp or tp replicas of it: their gradients are reduced once per synchronous step; "
                             "use stage.step there")
        if isinstance(getattr(pipe, "pipe", None), nn.Module) and hasattr(pipe, "own"):
            pipe = pipe.pipe   # an fxpipe.distributed.PipelineRank: its pipeline, with the transport to the others
            if pipe.tied:
                tie = next(iter(pipe.tied))
                raise ValueError(f"parameter {tie.name!r} is read by stages {tie.stages} (tied weights), and on ranks "
                                 "each of those holds a copy that asynchronous modes would update apart: train it "
                                 "with stage.step, or asynchronously in one process (fxpipe.compile)")
        p = len(pipe.specs)
        if mode not in ASYNC_MODES:
            raise ValueError(f"unknown asynchronous mode {mode!r}; allowed: {', '.join(map(repr, ASYNC_MODES))}")
        if schedule not in REGISTRY or not REGISTRY[schedule].asynchronous:
            allowed = [n for n, r in REGISTRY.items() if r.asynchronous]
            others = ", ".join(n for n in REGISTRY if n not in allowed)
            raise ValueError(f"asynchronous modes run the {' or '.join(allowed)} schedule (PipeDream's one-forward-"
                             f"one-backward), got schedule={schedule!r}; allowed: {', '.join(map(repr, allowed))} "
                             f"({others} are synchronous schedules of pipe.step)")
        if pipe.plan.workers != p:
            raise ValueError(f"asynchronous modes need one stage per worker, and this plan puts {p} stages on "
                             f"{pipe.plan.workers} workers (interleaved-1f1b): compile with schedule='1f1b'")
        self.transport = pipe.transport or Transport()   # which stages run here: every one, or this rank's
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS} for asynchronous training, got {reduction!r}"
                             + (" (under the default 'auto' a (loss_sum, count) pair returned by loss_fn is weighted "
                                "by its count)" if reduction == "token" else ""))
        for name, value, low in (("update_every", update_every, 1), ("staleness", staleness, 0)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"{name} must be None or an integer >= {low}, got {value!r}")
        if mode == "ssp" and update_every is not None:
            raise ValueError("mode='ssp' updates once per mini-batch (as synchronous training); "
                             "update_every is for 'stash' and '2bw'")
        # 2BW's default: a mini-batch, and never fewer than the p - 1 that keep the versions at two
        self.update_every = update_every or {"stash": 1, "2bw": max(pipe.chunks, p - 1)}.get(mode, pipe.chunks)
        if mode == "2bw" and self.update_every < p - 1:
            raise ValueError(f"mode='2bw' keeps two weight versions, which needs update_every >= {p - 1} "
                             f"(stages - 1) micro-batches; got {self.update_every}: raise update_every or chunks, "
                             "or use mode='stash'")
        self.staleness = 1 if mode == "ssp" and staleness is None else staleness
        # SSP lets the first stages run `staleness` mini-batches ahead (more micro-batches in flight); the
        # others keep 1F1B's p - k, PipeDream's
        self.ahead = self.staleness * pipe.chunks if mode == "ssp" else 0
        self.pipe, self.mode, self.reduction = pipe, mode, reduction
        # a tied weight lives in its first stage and reaches the others as a value (the version that stage
        # stashed for the micro-batch), its gradient coming back: each stage steps only its own parameters
        self.specs = pipe.specs_sending_tied_weights()
        owner: dict[int, int] = {}
        for k, spec in enumerate(self.specs):
            for name, q in spec.module.named_parameters():
                if owner.setdefault(id(q), k) != k:
                    raise ValueError(f"parameter {name!r} is shared by stages {owner[id(q)]} and {k} (tied weights); "
                                     "asynchronous modes update each stage's parameters apart: use pipe.step")
        # a stage without trained parameters, or another rank's, has no optimizer here
        self.stages = [_Stage(spec.module, optimizer_fn(trained) if self.transport.local(k) and (
            trained := [q for q in spec.module.parameters() if q.requires_grad]) else None)
            for k, spec in enumerate(self.specs)]
        self.last: dict[str, Any] | None = None

    def version_bound(self, micro_batches: int | None = None) -> list[int]:
        """The most weight versions each stage keeps (its in-flight micro-batches' distinct versions)."""
        m, p = micro_batches or 10**9, len(self.stages)
        u = self.update_every if self.mode != "ssp" else self.pipe.chunks
        return [stashed_versions(k, p, m, u, self.ahead, self.staleness) for k in range(p)]

    def predicted_memory(self, mini_batches: int = 8) -> list[WorkerPrediction]:
        """:func:`fxpipe.planning.memory_model.predict_worker_memory` of a stream of ``mini_batches`` in this
        trainer's order, the stashed weight versions counted."""
        m = mini_batches * self.pipe.chunks
        orders = async_orders(len(self.stages), self._groups([b for b in range(mini_batches)
                                                              for _ in range(self.pipe.chunks)]),
                              self.staleness, self.ahead)
        return predict_worker_memory(self.pipe.plan, schedule="1f1b", micro_batches=m, orders=orders,
                                     weight_versions=self.version_bound(m))

    def _groups(self, batch_of: list[int]) -> list[int]:
        """Each micro-batch's update group: its mini-batch (SSP) or ``update_every`` micro-batches."""
        return batch_of if self.mode == "ssp" else [j // self.update_every for j in range(len(batch_of))]

    def train(self, batches: Iterable[tuple[Any, Any]],
              loss_fn: Callable[[Any, Any], torch.Tensor]) -> list[float] | None:
        """Train on ``batches`` (``(inputs, target)`` mini-batches) as one stream; return each mini-batch's loss
        (``None`` on a rank of :class:`fxpipe.distributed.PipelineRank` without the last stage; every rank must be
        given the same batches).

        The versions kept and the lags seen are in :attr:`last` (``versions``, ``lag`` per stage). An input
        computed by the caller (requires grad, has a ``grad_fn``) runs as a detached leaf, and one backward into
        the caller's graph hands on its gradient after the stream, weighted as the stages' own. A failing
        operation raises :class:`fxpipe.StageError` (as ``pipe.step``); the updates applied before it stay.
        """
        pipe = self.pipe
        pipe._check_mode()
        caller = CallerState.capture()
        if not caller.grad:
            raise FxpipeError(f"AsyncTrainer.train computes gradients, but it is called under {caller.describe()}")
        loss_fn = pipe.structured_loss(loss_fn)
        graphs = InputGraphs()   # inputs carrying the caller's graph: one backward into each, after the stream
        micro, targets, sizes, batch_of = self._stream(batches, graphs)
        if not micro:
            return []
        groups = self._groups(batch_of)
        orders = async_orders(len(self.stages), groups, self.staleness, self.ahead)
        check_orders(orders)   # never start an order that cannot finish
        group_samples: dict[int, int] = {}
        for g, n in zip(groups, sizes):
            group_samples[g] = group_samples.get(g, 0) + n
        last_of = {g: j for j, g in enumerate(groups)}
        members: dict[int, list[int]] = {}
        for j, g in enumerate(groups):
            members.setdefault(g, []).append(j)
        weight = [n / group_samples[g] if self.reduction != "sum" else 1.0 for n, g in zip(sizes, groups)]
        raw: list[float] = [0.0] * len(micro)
        batch_samples = [0] * (batch_of[-1] + 1)
        for b, n in zip(batch_of, sizes):
            batch_samples[b] += n
        first = {b: batch_of.index(b) for b in set(batch_of)}   # checkpoint modes count within a mini-batch
        last_of_batch = {b: j for j, b in enumerate(batch_of)}
        position = [j - first[b] for j, b in enumerate(batch_of)]
        count = [position[last_of_batch[b]] + 1 for b in batch_of]
        auto = None
        if self.reduction == "auto":   # an update of one micro-batch is its own loss: nothing to weigh or check
            single = all(len(js) == 1 for js in members.values())
            auto = _StreamLoss(pipe.layout, weight, groups, [1.0 / group_samples[g] for g in groups], single,
                               not all(self.transport.local(k) for k in range(len(self.stages))))

        def weighted_loss(out: Any, tagged: tuple[Any, int]) -> torch.Tensor:
            target, j = tagged
            loss = loss_fn(out, target)
            raw[j] = float(loss.detach())
            return loss * weight[j]   # as pipe.step weighs a micro-batch of its mini-batch (bit for bit)

        def group_count(g: int) -> Callable[[], Any] | None:
            """The token count of group ``g`` (its gradients are sums until its end), once its losses ran."""
            if auto is None or auto.kind != "token" or auto.own_mean:
                return None
            return lambda: sum(auto.counts[j] for j in members[g])

        @contextmanager
        def around(kind: str, k: int, j: int) -> Iterator[None]:
            stage = self.stages[k]
            if kind == "F":
                stage.begin(j, groups[j])
            with _swapped(stage.module, stage.in_flight[j][1]):   # this micro-batch's version, also in a recompute
                yield
            if kind == "B":
                stage.finish(j, last_of[groups[j]] == j, group_count(groups[j]))

        for q in pipe.parameters():
            q.grad = None
        compression = getattr(pipe, "compression", None)
        self.transport.compression = compression
        if compression is not None:   # top-k's residuals kept per slot of a mini-batch, as in pipe.step
            compression.slots = position
        try:
            run_step(self.specs, pipe.devices, pipe._output.args[0], micro,
                     targets if auto is not None else [(t, j) for j, t in enumerate(targets)],
                     loss_fn if auto is not None else weighted_loss, "1f1b",
                     lambda k, j: pipe._checkpointed(k, position[j], count[j]), "sum",
                     random=pipe._random_stages(), host=pipe.host, caller=caller, sizes=sizes,
                     orders=orders, around=around, transport=self.transport, auto=auto)
        except StepFailure as failure:   # the updates already applied stay; nothing in flight survives
            commit_statistics(pipe.modules(), discard=True)
            for st in self.stages:
                st.in_flight.clear()
                st.max_versions, st.max_lag, st.lags = 0, 0, []
            for q in pipe.parameters():
                q.grad = None
            raise step_error(failure, pipe.devices) from failure.exc
        finally:
            if compression is not None:
                compression.slots = None
        commit_statistics(pipe.modules())
        graphs.hand_on()
        self.last = {"versions": [st.max_versions for st in self.stages], "lag": [st.max_lag for st in self.stages],
                     "lags": [st.lags for st in self.stages], "micro_batches": len(micro),
                     "bytes_moved": dict(self.transport.moved)}
        for st in self.stages:
            st.max_versions, st.max_lag, st.lags = 0, 0, []
        if not self.transport.local(len(self.stages) - 1):
            return None   # the losses are computed on the last stage's rank
        return self._losses(auto, raw, sizes, batch_of, batch_samples)

    def _stream(self, batches: Iterable[tuple[Any, Any]], graphs: InputGraphs) -> tuple[list, list, list, list[int]]:
        """The stream's micro-batches, their targets, sample counts and mini-batch of each; inputs carrying the
        caller's graph are detached into ``graphs``."""
        pipe = self.pipe
        micro, targets, sizes, batch_of = [], [], [], []
        for b, (inputs, target) in enumerate(batches):
            inputs = graphs.detach(inputs if isinstance(inputs, tuple) else (inputs,))
            mb = pipe.inputs.micro_batches(inputs, {})
            n = pipe.inputs.sizes(mb)
            tg = pipe.inputs.micro_targets(target, len(mb))
            if not pipe.inputs.targets_fit(tg, n):
                raise ValueError(f"mini-batch {b}: the target must have the inputs' batch size, {sum(n)}")
            micro += mb
            targets += tg
            sizes += n
            batch_of += [b] * len(mb)
        return micro, targets, sizes, batch_of

    def _losses(self, auto: "_StreamLoss | None", raw: list[float], sizes: list[int], batch_of: list[int],
                batch_samples: list[int]) -> list[float]:
        """Each mini-batch's loss from its micro-batches' (their share of its samples; summed for ``"sum"``;
        the per-token mean of a token loss)."""
        if auto is not None and auto.kind == "token":   # each mini-batch's per-token mean
            sums, counts = [0.0] * (batch_of[-1] + 1), [0.0] * (batch_of[-1] + 1)
            for j, b in enumerate(batch_of):
                sums[b] += float(auto.records[j][0])
                counts[b] += float(auto.records[j][1])
            return [x / c if c else math.nan for x, c in zip(sums, counts)]
        if auto is not None:
            raw = [float(auto.records[j][0]) for j in range(len(raw))]
        per_batch = [0.0] * (batch_of[-1] + 1)
        for j, b in enumerate(batch_of):
            per_batch[b] += raw[j] * (sizes[j] / batch_samples[b] if self.reduction != "sum" else 1.0)
        return per_batch


class _StreamLoss(AutoLoss):
    """``reduction="auto"`` over a stream: micro-batch ``j`` weighted by its share of its update group's samples,
    checked against a reference sample of its group, its token count (``counts``) dividing the group's gradients
    at the group's end. Over torch.distributed only the last stage's rank would know that count: there a
    cross-entropy mean is checked as any other loss (a per-sample one passes, a padded one is refused) and a
    ``(loss_sum, count)`` pair refused, unless every update is one micro-batch (then divided by its own count at
    once)."""

    def __init__(self, layout: Any, weights: list[float], groups: list[int], scales: list[float], single: bool,
                 distributed: bool) -> None:
        super().__init__(layout.output, layout.target, check=not single, own_mean=single,
                         recognise=single or not distributed)
        self.weights, self.groups, self.fixed = weights, groups, scales   # fixed: 1 / the group's samples
        self.distributed = distributed and not single
        self.counts: dict[int, Any] = {}

    def __call__(self, loss_fn: Callable[[Any, Any], Any], output: Any, target: Any, micro_batch: int,
                 weight: float, scale: float, key: Any = None) -> Any:
        try:
            pushed, part, count = super().__call__(loss_fn, output, target, micro_batch, self.weights[micro_batch],
                                                   self.fixed[micro_batch], self.groups[micro_batch])
        except LossReductionError as exc:
            if not self.distributed or "loss_fn returned (loss_sum, count)" in str(exc):
                raise
            raise LossReductionError(
                f"{exc} Over torch.distributed, AsyncTrainer cannot divide updates of several micro-batches by a "
                "count (only the last stage's rank has it): for a mean over tokens, use mode='stash' with "
                "update_every=1 (each micro-batch its own update), or train in one process.", stage=-1,
                micro_batch=micro_batch, node=None) from exc
        self.counts[micro_batch] = count
        return pushed, part, count

    def _same_kind(self, kind: str, micro_batch: int) -> None:
        super()._same_kind(kind, micro_batch)
        if kind == "token" and self.distributed:
            raise LossReductionError(
                "loss_fn returned (loss_sum, count), and AsyncTrainer over torch.distributed updates after groups of "
                "several micro-batches, whose gradients would have to be divided by the group's count on every "
                "rank; only the last stage's rank has it. Use update_every=1 with mode='stash' (each micro-batch "
                "its own update, divided by its own count), train in one process, or return a mean over samples. "
                "No update was made.", stage=-1, micro_batch=micro_batch, node=None)
