"""One step of a pipeline's data-parallel replica: its share of the batch in, the whole batch's gradients and loss out.

Every rank is given the whole batch; :meth:`DataParallelStep.share` keeps this replica's share of every batched
value (``torch.tensor_split`` along the plan's batch dims: shares differ by at most one sample): the positional
inputs, the target, and the model's keyword inputs (``labels=labels``, or a dict batch given as ``kwargs=``), so
the model's own loss trains on a mesh as it does on one pipeline. The step weighs its micro-batches over the whole
batch (:class:`fxpipe.runtime.losses.losses.Replicas`): a micro-batch of ``n`` samples counts ``dp * n / N`` of a mean,
and a token loss's count (the model's own loss, ``reduction="token"``, or ``"auto"`` finding an
``F.cross_entropy`` mean) is summed over the replicas before any rank divides by it, so the gradients and the
returned loss are the whole batch's, as one process would compute them, even when the shares differ. Under
``"auto"`` the last stages' replicas also check their reference samples against each other
(:meth:`fxpipe.runtime.losses.sample_mean_check.SampleMeanCheck.tie`), so a loss whose samples weigh differently is
refused on every rank even where each replica's own samples weigh alike.

The reduction (all-reduce, or reduce-scatter) overlaps the pipeline's drain: it starts the moment this rank's own
operations of the step are over (the transport's ``when_local_done``), not when the whole pipeline's are. Before
the gradients, the replicas all-reduce one flag saying whether any of their steps failed, so no replica waits in
the gradients' all-reduce for one that will never join it, and every replica of a failed step raises. Under FSDP2
(not under a split backward) the gradients are reduced earlier, block by block inside each stage's last backward
(:meth:`fxpipe.distributed.parallel.fsdp.ShardedStages.reduce_from_here`), so the flag is exchanged before that
backward (the transport's ``before_last_backward``); a replica that failed before makes its own exchange there
(its last stage's before the replicas' sample check), which meets the others'. A replica that fails inside its
last backward, after agreeing, leaves the others' reduce-scatters to end at ``timeout_s``, with an error.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from fxpipe.distributed.parallel.tp import sum_partial_grads
from fxpipe.distributed.stages import train_step
from fxpipe.errors import FxpipeError, LossReductionError
from fxpipe.runtime.losses.losses import Replicas
from fxpipe.runtime.execute.microbatch import BatchLayout, batch_size_of, scatter
from solvers.schedules import get_schedule

__all__ = ["DataParallelStep", "STEP_OPTIONS"]

# fxpipe.Pipeline.step's own keywords: passed on whole, never split (``kwargs=`` holds model inputs and is split)
STEP_OPTIONS = frozenset({"schedule", "return_outputs", "measure_memory", "chunks"})


class DataParallelStep:
    """This rank's replica of ``stages`` (:class:`fxpipe.distributed.stages.RankStages`) among the ``grid``'s
    data-parallel ranks: ``data`` (:func:`fxpipe.distributed.parallel.apply.apply_data_parallel`) reduces the
    gradients, ``tp`` (:class:`fxpipe.distributed.parallel.apply.TensorParallel`) sums the per-head ones."""

    def __init__(self, stages: Any, grid: list[list[int]], group: Any, data: Any, tp: Any, timeout_s: float) -> None:
        flat = [r for row in grid for r in row]
        self.stages, self.group, self.data, self.tp, self.timeout_s = stages, group, data, tp, timeout_s
        self.dp, self.dp_rank = len(flat), flat.index(dist.get_rank())
        self.layout = BatchLayout.of(stages.plan.batch_dims)
        self._rank_done = stages.pipe.transport.when_local_done
        stages.pipe.transport.when_local_done = self._reduce_when_done
        if getattr(data, "reduces_in_backward", False):
            stages.pipe.transport.before_last_backward = self._reduce_from_here
        self._agreed: bool | None = None   # this step's replicas' agreement that none failed, once exchanged
        self._early = False   # this step's agreement comes before the last backward (_reduce_from_here)
        self._reduced: BaseException | str | None = None
        # (start, end) wall-clock times of the last step's gradient reduction, comparable across processes
        self.all_reduce_s: tuple[float, float] | None = None

    @staticmethod
    def group_of(grid: list[list[int]], timeout_s: float) -> Any:
        """The process group of the ``grid``'s ranks, whose waits end after ``timeout_s``."""
        return dist.new_group([r for row in grid for r in row], timeout=datetime.timedelta(seconds=timeout_s),
                              use_local_synchronization=True)

    def share(self, inputs: Any, target: Any, kwargs: dict[str, Any]) -> tuple[tuple, Any, dict[str, Any], int]:
        """This replica's inputs, target and keywords (the model's keyword inputs split like the inputs), and the
        whole batch's samples."""
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        model_kw = {k: v for k, v in kwargs.items() if k not in STEP_OPTIONS and k != "kwargs"}
        dict_kw = dict(kwargs.get("kwargs") or {})
        names = [p.target for p in self.stages.pipe.inputs.placeholders[:len(inputs)]]
        values = [*inputs, target, *model_kw.values(), *dict_kw.values()]
        dims = [*self.layout.input_dims(names), self.layout.target, *self.layout.input_dims(list(model_kw)),
                *self.layout.input_dims(list(dict_kw))]
        total = batch_size_of(values, dims)
        if 0 < total < self.dp:
            raise ValueError(f"a batch of {total} samples cannot be shared by the mesh's {self.dp} data-parallel "
                             f"replicas: give every step at least {self.dp} samples (drop_last=True in the data "
                             "loader drops a short last batch)")
        shares = scatter(values, self.dp, dims)
        mine = shares[self.dp_rank]
        n, k = len(inputs), len(model_kw)
        out = {key: v for key, v in kwargs.items() if key in STEP_OPTIONS}
        out.update(zip(model_kw, mine[n + 1:n + 1 + k]))
        if "kwargs" in kwargs:
            out["kwargs"] = dict(zip(dict_kw, mine[n + 1 + k:]))
        return tuple(mine[:n]), mine[n], out, sum(batch_size_of(s, dims) for s in shares)

    def step(self, inputs: Any, target: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
        """One step of this replica's share of the batch; the whole batch's loss where ``stages`` return one."""
        inputs, target, kwargs, total = self.share(inputs, target, kwargs)
        stages = self.stages
        stages.pipe.transport.replicas = Replicas(self.dp, total, self._sum_counts, self._tie if stages.last else None)
        self._reduced, self.all_reduce_s, self._agreed = "not run", None, None
        split = get_schedule(kwargs.get("schedule") or stages.pipe.schedule).split_backward
        # the replicas agree that none failed before the last backward (FSDP2 reducing in it), else at the end
        self._early = getattr(self.data, "reduces_in_backward", False) and not split
        self.data.begin(split)
        try:
            loss = train_step(stages, inputs, target, **kwargs)   # its transport reduces when this rank is done
        except Exception as exc:
            if not self.tp.ranks:
                raise
            raise FxpipeError(f"rank {dist.get_rank()}: its step failed ({type(exc).__name__}: {exc}); its stages "
                              f"are tensor-parallel with ranks {self.tp.ranks}, and one of them that failed or died "
                              "ends this rank's tp collectives: that rank's own error says why") from exc
        self._raise_if_not_reduced()
        if loss is None:
            return None
        whole = loss.detach() / self.dp   # this share's part of the batch's loss
        dist.all_reduce(whole, group=self.group)
        return whole

    def _wire_device(self) -> torch.device:
        device = next(iter(self.data.parameters()), torch.empty(0)).device
        return device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    def _sum_counts(self, count: Any) -> Any:
        """The step's token count summed over the replicas, divided by ``dp`` (DDP averages the gradients each
        replica divides by it); ``None`` where no replica has one. Every replica calls it after its all-reduce."""
        self._raise_if_not_reduced()
        got = torch.tensor([0.0 if count is None else float(count), 0.0 if count is None else 1.0],
                           dtype=torch.float64, device=self._wire_device())
        dist.all_reduce(got, group=self.group)
        if got[1].item() == 0:
            return None
        if got[1].item() != self.dp:
            raise LossReductionError(
                f"rank {dist.get_rank()}: loss_fn returned a token loss ((loss_sum, count), or an F.cross_entropy/"
                f"F.nll_loss mean) on {int(got[1].item())} of the {self.dp} data-parallel replicas and a per-sample "
                "mean on the others: one step cannot weight its micro-batches both ways; return (loss_sum, count) "
                "on every replica and pass reduction='token'", stage=-1, micro_batch=-1, node=None)
        return got[0].item() / self.dp

    def _tie(self, auto: Any, failed: bool) -> BaseException | None:
        """On a last stage's rank: every replica's reference sample against replica 0's (``"auto"``'s check).
        All the last stages' replicas call it once per step, failed or not. Never raises: returns the refusal."""
        try:
            if self._early and self._agreed is None:   # a replica that failed before its last backward: the
                self._agreed = self._exchange(failed)    # others' agreement comes first there (_reduce_from_here)
            checker = auto.checker
            ref = None if failed or checker is None or auto.kind != "sample" else checker.references.get(None)
            gathered: list[Any] = [None] * self.dp
            dist.all_gather_object(gathered, None if ref is None else ref.to("cpu"), group=self.group)
            if any(r is None for r in gathered):
                return None   # a failure, a token loss (counted over the replicas instead) or nothing checked
            checker.tie(auto.loss_fn, [r.to(ref.device) for r in gathered])
            return None
        except BaseException as exc:   # the refusal, or a failed exchange: this step fails on every rank
            return exc

    def _raise_if_not_reduced(self) -> None:
        if self._reduced == "failed":
            raise FxpipeError(f"rank {dist.get_rank()}: another dp replica of this rank's stages failed its step, "
                              "so the gradients were not reduced; that replica's processes report the error")
        if isinstance(self._reduced, BaseException):
            raise FxpipeError(f"rank {dist.get_rank()}: the reduction of this rank's gradients over its dp group "
                              f"failed ({type(self._reduced).__name__}: {self._reduced}); a replica that died or "
                              f"took longer than timeout_s={self.timeout_s:g} s ends it") from self._reduced
        if self._reduced is not None:
            raise FxpipeError(f"rank {dist.get_rank()}: the step ended without this rank's dp reduction "
                              f"({self._reduced})")

    def _exchange(self, failed: bool) -> bool:
        """Every replica's word on whether its step failed, once a step (an all-reduce of one flag): ``True`` where
        none did."""
        flag = torch.tensor([1.0 if failed else 0.0], device=self._wire_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return flag.item() == 0

    def _reduce_from_here(self, stage: int) -> None:
        """The transport's call before ``stage``'s last backward of the step (FSDP2, not under a split backward):
        the replicas agree that none failed (the exchange :meth:`_reduce_when_done` makes otherwise; a replica
        that failed before makes its own there, which meets this one), and then each of the stage's blocks
        reduce-scatters its gradients as its backward ends, overlapping the backwards before it. A replica that
        fails after agreeing leaves the others' reduce-scatters to end at ``timeout_s``, with an error."""
        if not self._early:   # (a step under a split backward never calls it)
            return
        if self._agreed is None:
            self._agreed = self._exchange(False)
        if self._agreed:
            self.data.reduce_from_here(stage)

    def _reduce_when_done(self, failed: bool) -> None:
        """The transport's call once this rank's operations are over: reduce the gradients over ``dp``
        unless a replica's step failed. Never raises (the transport is ending its step); :meth:`step` does."""
        try:
            if self._agreed is None:
                self._agreed = self._exchange(failed)
            if not self._agreed or failed:
                self._reduced = "failed"
            else:
                started = time.time()
                self.data.reduce()
                if self.tp.summed:   # a per-head norm's weight: each tp rank summed its heads' gradients only
                    sum_partial_grads(self.tp.summed, self.tp.group)
                self.all_reduce_s = (started, time.time())
                self._reduced = None
        except BaseException as exc:   # raised by step, after the transport has heard the other ranks
            self._reduced = exc
        done: Callable[[bool], None] | None = self._rank_done
        if done is not None:   # every owner of a tie calls it, failed or not (it never raises)
            done(failed or self._reduced is not None)
