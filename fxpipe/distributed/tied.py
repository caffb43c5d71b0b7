"""Tied weights over torch.distributed: each rank whose stages read a tied parameter keeps its own copy, and the
copies' gradients are all-reduced over those ranks once per step (Megatron-LM's embedding group).

In one process the copies' gradients are summed into the model's parameter (:mod:`fxpipe.runtime.boundaries.tied`). On
ranks, each *owning* rank (one whose stages read the parameter) holds one tensor of it as its own parameter (the
model's own where it holds the first reading stage, else its copy, put in the model under the parameter's names
so that ``named_parameters``, weights and checkpoints find it by them); :meth:`PipelineRank.parameters` yields it
once, so every owning rank's optimizer steps it. A rank with two reading stages (``zb-v`` puts the first and the
last on one worker) sums its other copy into it first. Then:

- when this rank's own operations of a step are over (the transport's ``when_local_done``; under
  :mod:`fxpipe.distributed.mesh` after the ``dp`` reduction, summing the dp-averaged gradients, under FSDP2 each
  owner's shard of them: the owners at one dp coordinate hold the same shard), the owners all-reduce (sum) that step's gradient of it in a
  process group of their own, made identically on every rank at construction; it ends once the last owner's
  backward is done. Before it, the owners all-reduce whether any of their steps failed, so none waits for a
  failed one. Gradients accumulated by earlier steps (``.grad`` not cleared) are set aside and added back after,
  so only the step's own gradient is summed.
- every owner applies the same gradient with the same optimizer, so the copies stay equal (Megatron's
  embedding group; DeepSpeed's ``ds_pipe_replicated`` does the same). At the start of each step every rank
  of the pipeline compares the owners' checksums of each copy (:func:`fxpipe.runtime.boundaries.tied.checksum`, one small
  all-gather): copies that diverged (one rank's optimizer stepped and another's did not) are refused on every
  rank with :class:`fxpipe.runtime.boundaries.tied.TiedWeightsDiverged` before anything is updated.
- ``clip_grad_norm_`` counts a tied parameter once: the copies on ranks other than the first owner's are marked
  ``fxpipe_counted_elsewhere``.
"""

from __future__ import annotations

import datetime
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from fxpipe.runtime.boundaries.tied import Tie, TiedWeights, TiedWeightsDiverged, checksum

__all__ = ["RankTies", "install_representatives", "COUNTED_ELSEWHERE"]

COUNTED_ELSEWHERE = "fxpipe_counted_elsewhere"   # a Parameter attribute: another rank counts it in a global norm


def _names_of(module: nn.Module, param: torch.Tensor) -> list[str]:
    return [n for n, p in module.named_parameters(remove_duplicate=False) if p is param]


def _put(module: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, attr = name.rpartition(".")
    module.get_submodule(owner)._parameters[attr] = param


def install_representatives(tied: TiedWeights, modules: list[nn.Module]) -> Callable[[], None]:
    """Where this rank holds a copy of a tied parameter but not the parameter itself, the copy takes the
    parameter's place (under all its names) in ``modules`` (the model, the traced graph). Returns the function
    that does it, to be called once the other ranks' tensors have been dropped (their names are looked up now)."""
    moves = []
    for tie in tied:
        if tied.local(tie.primary_stage):
            continue
        mine = [c for c in tie.copies if tied.local(c.stage)]
        if not mine:
            continue
        primary = tie.primary_of()
        moves += [(module, name, mine[0]) for module in modules for name in _names_of(module, primary)]

    def install() -> None:
        for module, name, copy in moves:
            _put(module, name, copy.weight)
    return install


class RankTies:
    """This rank's part of the pipeline's tied parameters: the owners' groups, the step's all-reduce and the
    divergence check. ``stage_rank[k]`` is the rank (in ``group``) of stage ``k``."""

    def __init__(self, tied: TiedWeights, stage_rank: list[int], rank: int, group: Any, timeout_s: float) -> None:
        self.tied, self.rank, self.pipeline_group = tied, rank, group
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        local = group is not None   # a pipeline of a pp x dp mesh: only its members make its groups
        timeout = datetime.timedelta(seconds=timeout_s)
        self.owners: dict[str, list[int]] = {}
        self.groups: dict[str, Any] = {}
        for tie in tied:   # in name order on every rank
            owners = sorted({stage_rank[k] for k in tie.stages})
            self.owners[tie.name] = owners
            if len(owners) > 1 and (not local or rank in owners):
                self.groups[tie.name] = dist.new_group([ranks[r] for r in owners], timeout=timeout,
                                                       use_local_synchronization=local)
        for tie in tied:
            rep = tied.representative(tie)
            if rep is not None and self.owners[tie.name][0] != rank:
                setattr(rep, COUNTED_ELSEWHERE, True)
        self.saved: dict[str, torch.Tensor | None] = {}
        self.failure: BaseException | None = None

    def _mine(self) -> list[tuple[Tie, torch.Tensor]]:
        """The ties this rank owns together with another rank, and this rank's tensor of each."""
        found = []
        for tie in self.tied:
            rep = self.tied.representative(tie)
            if rep is not None and tie.name in self.groups and self.rank in self.owners[tie.name]:
                found.append((tie, rep))
        return found

    def check(self) -> None:
        """Collective over the pipeline: every owner's checksum of every tie; copies that differ are refused on
        every rank, before anything is updated."""
        ties = [tie for tie in self.tied if len(self.owners[tie.name]) > 1]   # the same list on every rank
        if not ties:
            return
        mine = {tie.name: rep for tie, rep in self._mine()}
        row = torch.zeros(len(ties), 3, dtype=torch.float64)
        for i, tie in enumerate(ties):
            if tie.name in mine:
                total, norm = checksum(mine[tie.name])
                row[i] = torch.tensor([1.0, total, norm], dtype=torch.float64)
        device = "cuda" if dist.get_backend(self.pipeline_group) == "nccl" else "cpu"
        rows = [torch.zeros_like(row, device=device) for _ in range(dist.get_world_size(self.pipeline_group))]
        dist.all_gather(rows, row.to(device), group=self.pipeline_group)
        rows = [r.cpu() for r in rows]
        for i, tie in enumerate(ties):
            held = [(r, float(rows[r][i][1]), float(rows[r][i][2])) for r in range(len(rows)) if rows[r][i][0] > 0]
            (r0, s0, n0), numel = held[0], self._numel(tie)
            for r, s, n in held[1:]:
                if abs(n - n0) > 1e-6 * max(abs(n0), 1e-30) or abs(s - s0) > 1e-6 * max(abs(n0), 1e-30) * math.sqrt(numel):
                    raise TiedWeightsDiverged(
                        f"the copies of tied parameter {tie.name!r} on ranks {r0} and {r} differ (sum {s0:.9g} against "
                        f"{s:.9g}, norm {n0:.9g} against {n:.9g}): one rank's copy was updated and the other's was not. "
                        "Every rank that holds it must step it with the same optimizer over stage.parameters() after "
                        "every stage.step, or load the same weights into it on every rank (a checkpoint, "
                        "fxpipe.distributed.checkpoint.load); nothing was updated")

    def _numel(self, tie: Tie) -> int:
        for c in tie.copies:
            return c.weight.numel()
        return 1

    def begin(self) -> None:
        """Set aside the gradients earlier steps left, so that only this step's are all-reduced."""
        self.failure = None
        self.saved = {}
        for tie, rep in self._mine():
            self.saved[tie.name] = rep.grad
            rep.grad = None

    def when_local_done(self, failed: bool) -> None:
        """The transport's call once this rank's operations are over: the local copies' gradients summed, then the
        step's gradient of each tie all-reduced over its owners unless one of their steps failed. Never raises
        (the transport is ending its step); :meth:`end` does."""
        try:
            if not failed:
                self.tied.reduce()
            for tie, rep in self._mine():
                group = self.groups[tie.name]
                nccl = dist.get_backend(group) == "nccl"
                flag = torch.tensor([1.0 if failed else 0.0], device=rep.device if nccl else "cpu")
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
                if flag.item() > 0:
                    continue
                if rep.grad is None:   # no micro-batch reached it here: the others' gradient is still its own
                    rep.grad = torch.zeros_like(rep)
                grad = rep.grad.to_local() if hasattr(rep.grad, "to_local") else rep.grad   # FSDP2: this shard
                dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
        except BaseException as exc:   # raised by end(), after the transport has heard the other ranks
            self.failure = exc

    def end(self, ok: bool) -> None:
        """Add back the gradients :meth:`begin` set aside; raise an all-reduce's failure."""
        for tie, rep in self._mine():
            before = self.saved.get(tie.name)
            if before is not None:
                rep.grad = before if rep.grad is None or not ok else before.add_(rep.grad)
        self.saved = {}
        if ok and self.failure is not None:
            failure, self.failure = self.failure, None
            raise RuntimeError(f"the all-reduce of a tied parameter's gradient over the ranks that hold it failed "
                               f"({type(failure).__name__}: {failure})") from failure
