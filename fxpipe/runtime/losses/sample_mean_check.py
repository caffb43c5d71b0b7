"""Whether ``loss_fn`` averages over samples: the check behind ``reduction="auto"`` for a loss it does not recognise.

Weighting micro-batch ``i``'s loss by ``n_i / N`` is exact when ``loss_fn`` is a mean over samples of equal
weight, ``L(B) = (1/|B|) sum_s f(s)``. It is not when samples count differently (a mean over tokens of
padded sequences, over a mask: ``L(B) = sum_s w_s f(s) / sum_s w_s``), for a summed loss, or for a loss that
mixes samples. :class:`SampleMeanCheck` tells them apart from gradients, which, unlike loss values, show a
sample's weight even where two samples' losses happen to be equal. A reference sample ``r`` (the first
sample of the step's first micro-batch, kept detached with the gradient ``g_r`` of ``loss_fn`` on it alone)
is added to each micro-batch ``B`` of ``n`` samples, whose gradient ``g_B`` the step itself computed:
for a per-sample mean the gradient of ``loss_fn(r + B)`` is ``[g_r, n g_B] / (n + 1)`` exactly. For a
weighted mean it is ``[w_r g_r, W_B g_B] / (W_B + w_r)`` (``W_B`` the micro-batch's total weight), which
equals the former only when ``W_B = n w_r``: every micro-batch checked against the same ``r`` then has
the same weight per sample, and ``n_i / N`` is exactly the full batch's weighting. A summed loss gives
``[g_r, g_B]``; a loss mixing samples is not proportional to either.

Cost per micro-batch: one more ``loss_fn`` forward and backward on ``n + 1`` samples (plus one on ``r`` per
step) and two passes over the gradients; ``benchmarks/auto_loss.py`` measures it. Gradients are compared in
the outputs' dtype, to a tolerance of :data:`TOLERANCE` of the largest (float32: ``1e-4``): a micro-batch whose
samples weigh ``1 + d`` times the reference's on average deviates by about ``d n / (n + 1)^2``, so a ``d``
of at most about ``(n + 1)`` tolerances can pass (float32, 8 samples a micro-batch: ``d = 0.05 %`` was
refused, ``0.01 %`` passed).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Hashable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.errors import LossReductionError
from fxpipe.runtime.losses.losses import TOKEN_EXAMPLE

__all__ = ["SampleMeanCheck", "TOLERANCE"]

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}


def _batched(leaf: Any, dim: int) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() > dim


def _take(value: Any, dim: int, start: int, length: int) -> Any:
    """Samples ``start:start+length`` of every batched leaf (cloned, detached); other leaves as they are."""
    leaves, spec = tree_flatten(value)
    return tree_unflatten([t.detach().narrow(dim, start, length).clone() if _batched(t, dim) else t
                           for t in leaves], spec)


def _join(first: Any, rest: Any, dim: int) -> Any:
    """``first``'s samples before ``rest``'s, leaf by leaf; unbatched leaves are ``rest``'s."""
    a, spec = tree_flatten(first)
    b, _ = tree_flatten(rest)
    return tree_unflatten([torch.cat([x.detach(), y.detach()], dim) if _batched(y, dim) else y
                           for x, y in zip(a, b)], spec)


def _graded(value: Any, positions: list[int]) -> tuple[Any, list[torch.Tensor]]:
    """``value`` with fresh leaves requiring grad at ``positions``, and those leaves."""
    leaves, spec = tree_flatten(value)
    fresh = [t.detach().requires_grad_(True) if p in positions else t for p, t in enumerate(leaves)]
    return tree_unflatten(fresh, spec), [fresh[p] for p in positions]


def _scalar(result: Any) -> torch.Tensor:
    if not isinstance(result, torch.Tensor) or result.numel() != 1:
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(result).__name__}")
    return result.reshape(())


def _grads(loss: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    if not loss.requires_grad:
        return [torch.zeros_like(t) for t in leaves]
    got = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, got)]


class Reference:
    """The reference sample: its output and target (detached), ``loss_fn``'s gradient on it alone for the output
    leaves at ``positions``, and the micro-batch it came from."""

    def __init__(self, output: Any, target: Any, grads: list[torch.Tensor], positions: list[int],
                 micro_batch: int) -> None:
        self.output, self.target, self.grads, self.positions = output, target, grads, positions
        self.micro_batch = micro_batch
        self.largest = max((float(torch.linalg.vector_norm(g, math.inf)) for g in grads), default=0.0)

    def to(self, device: torch.device | str) -> "Reference":
        """A copy on ``device`` (sent to other processes from the CPU)."""
        def move(value: Any) -> Any:
            leaves, spec = tree_flatten(value)
            return tree_unflatten([t.to(device) if isinstance(t, torch.Tensor) else t for t in leaves], spec)
        return Reference(move(self.output), move(self.target), [g.to(device) for g in self.grads], self.positions,
                         self.micro_batch)

    @property
    def device(self) -> torch.device:
        return self.grads[0].device


class SampleMeanCheck:
    """The check of every micro-batch of a step (or of each mini-batch ``key`` of a stream) against one
    reference sample; :meth:`check` raises :class:`fxpipe.errors.LossReductionError` where it fails."""

    def __init__(self, output_dim: int = 0, target_dim: int = 0) -> None:
        self.output_dim, self.target_dim = output_dim, target_dim
        self.references: dict[Hashable, Reference] = {}

    def positions(self, output: Any) -> list[int]:
        """The output leaves whose gradients are compared: floating, batched, requiring grad."""
        return [p for p, t in enumerate(tree_flatten(output)[0])
                if _batched(t, self.output_dim) and t.is_floating_point() and t.requires_grad]

    def unbatched(self, output: Any, micro_batch: int) -> None:
        """Refuse a loss whose gradient reaches output leaves without the batch dimension (a scalar the model
        computed over its micro-batch, such as its own loss): how micro-batches should weigh those cannot be
        seen by adding a sample. ``output`` holds the leaves after the loss's backward."""
        for p, t in enumerate(tree_flatten(output)[0]):
            if (isinstance(t, torch.Tensor) and not _batched(t, self.output_dim) and t.is_floating_point()
                    and t.grad is not None and bool(t.grad.ne(0).any())):
                raise LossReductionError(
                    f"loss_fn uses output leaf {p}, a {t.dim()}-dim tensor without the batch dimension "
                    f"{self.output_dim} (a value the model computed over the whole micro-batch, such as a loss it "
                    "returns), so reduction='auto' cannot check how micro-batches should weigh it: pass "
                    "reduction='token' with loss_fn returning (loss_sum, count) for a mean over tokens, "
                    "reduction='sum' for a sum, or reduction='mean' to weight micro-batches by their samples. "
                    "This step's gradients were left as they were before it.", stage=-1, micro_batch=micro_batch,
                    node=None)

    def check(self, loss_fn: Callable[[Any, Any], Any], output: Any, target: Any, grads: list[torch.Tensor],
              micro_batch: int, key: Hashable = None, positions: list[int] | None = None,
              names: tuple[str, str] | None = None, weight: float = 1.0) -> None:
        """``output`` (the micro-batch's outputs, as ``loss_fn`` was given them), ``target`` and ``grads``, the
        gradient of ``weight * loss_fn(output, target)`` for each leaf of :meth:`positions` (or ``positions``).
        ``names`` says what the micro-batch and the reference are, for the message."""
        positions = self.positions(output) if positions is None else positions
        if not positions:
            return   # nothing to weigh
        largest = max(float(torch.linalg.vector_norm(g, math.inf)) for g in grads) / weight
        if not math.isfinite(largest):
            return   # the step's own gradient is not finite: its error, not the weighting's
        n = tree_flatten(output)[0][positions[0]].size(self.output_dim)
        with torch.enable_grad():
            ref = self.references.get(key)
            if ref is None:
                ref_out, ref_target = _take(output, self.output_dim, 0, 1), _take(target, self.target_dim, 0, 1)
                graded, leaves = _graded(ref_out, positions)
                ref = Reference(ref_out, ref_target, _grads(_scalar(loss_fn(graded, ref_target)), leaves),
                                positions, micro_batch)
                self.references[key] = ref
            try:
                joined, leaves = _graded(_join(ref.output, output, self.output_dim), positions)
                joined_target = _join(ref.target, target, self.target_dim)
            except RuntimeError as exc:   # torch.cat: shapes differ beyond the batch dimension
                raise LossReductionError(
                    f"reduction='auto' cannot check that loss_fn is a mean over samples: the outputs or targets of "
                    f"micro-batch {micro_batch} do not join those of micro-batch {ref.micro_batch} along the batch "
                    f"dimension ({exc}); micro-batches of one update must have samples of one shape, or pass "
                    "reduction='token' with (loss_sum, count), or reduction='mean'", stage=-1,
                    micro_batch=micro_batch, node=None) from exc
            both = _grads(_scalar(loss_fn(joined, joined_target)), leaves)
        # a per-sample mean: both == [ref.grads, n * grads / weight] / (n + 1), leaf by leaf
        d, k = self.output_dim, n / ((n + 1) * weight)
        deviations = [float(torch.linalg.vector_norm(x, math.inf)) for u, g, r in zip(both, grads, ref.grads)
                      for x in (torch.sub(u.narrow(d, 1, n), g, alpha=k), u.narrow(d, 0, 1) - r.to(u.dtype) / (n + 1))]
        tol = max(TOLERANCE.get(g.dtype, 1e-4) for g in grads)
        if all(x <= tol * max(n * largest, ref.largest) / (n + 1) for x in deviations):   # NaN: not
            return
        raise LossReductionError(self._message(ref, [g / weight for g in grads], both, n, micro_batch, tol, names),
                                 stage=-1, micro_batch=micro_batch, node=None)

    def tie(self, loss_fn: Callable[[Any, Any], Any], references: list[Reference]) -> None:
        """Check the reference samples of data-parallel replicas (``references[d]``, replica ``d``'s) against
        replica 0's: each replica checked its micro-batches against its own, so all samples weigh alike only
        if these do. Raises :class:`fxpipe.errors.LossReductionError` where one does not."""
        device = references[0].device
        base = references[0]
        for d, other in enumerate(references[1:], 1):
            other = other.to(device)
            pair = SampleMeanCheck(self.output_dim, self.target_dim)
            pair.references[None] = base
            pair.check(loss_fn, other.output, other.target, other.grads, other.micro_batch,
                       positions=other.positions,
                       names=(f"the first sample of data-parallel replica {d}",
                              "the first sample of replica 0 (each replica's micro-batches weigh alike)"))

    def _message(self, ref: Reference, grads: list[torch.Tensor], both: list[torch.Tensor], n: int,
                 micro_batch: int, tol: float, names: tuple[str, str] | None = None) -> str:
        d = self.output_dim
        g_b = torch.cat([g.flatten().double() for g in grads])
        u_b = torch.cat([u.narrow(d, 1, n).flatten().double() for u in both])
        u_r = torch.cat([u.narrow(d, 0, 1).flatten().double() for u in both])
        g_r = torch.cat([g.flatten().double() for g in ref.grads])
        which = (f"micro-batch {micro_batch}" if micro_batch != ref.micro_batch else
                 f"micro-batch {micro_batch} (with a copy of its first sample)") if names is None else names[0]
        summed = _close([torch.cat([u_r, u_b])], [torch.cat([g_r, g_b])], tol)
        scale = float(g_b.dot(g_b))
        rho = float(u_b.dot(g_b)) / scale if scale > 0 else math.nan
        proportional = scale > 0 and _close([u_b], [rho * g_b], tol) and 0 < rho < 1
        ref_name = f"the first sample of micro-batch {ref.micro_batch}" if names is None else names[1]
        kept = "This step's gradients were left as they were before it."
        if summed:
            return (f"loss_fn sums over samples: on {which} its gradients do not shrink when {ref_name} joins the "
                    "micro-batch, as a mean's would, so weighting micro-batches by their share of the samples "
                    "would scale the gradients wrongly. Pass reduction='sum' for a summed loss (reduction='mean' "
                    f"weights micro-batches by their samples without this check). {kept}")
        if proportional:
            found = (f"loss_fn is not a mean over samples: on {which} a sample counts {rho / (1 - rho) / n:.4g} "
                     f"times as much as {ref_name} on average (found from loss_fn's gradients with and without "
                     "that sample), so weighting micro-batches by their share of the samples would give wrong "
                     "gradients.")
        else:
            found = (f"loss_fn is not a mean over samples: on {which} the gradient of a sample changes when "
                     f"{ref_name} joins the micro-batch, and not by a common factor (samples weigh differently, "
                     "or the loss mixes samples, e.g. in-batch negatives or a batch statistic, which "
                     "micro-batches cannot compute as the full batch would).")
        return (f"{found} For a mean over tokens or over a mask, return (loss_sum, count) and pass "
                f"reduction='token'; the step divides by the whole batch's count:\n    {TOKEN_EXAMPLE}\n"
                "(an F.cross_entropy or F.nll_loss mean that loss_fn returns as it is needs neither: "
                "reduction='auto' finds its count). reduction='mean' weights micro-batches by their share of the "
                f"samples without this check. {kept}")


def _close(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> bool:
    """Whether ``got`` equals ``want`` up to ``tol`` of the largest value of ``want``."""
    scale, diff = 0.0, 0.0
    for a, b in zip(got, want):
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            return False
        if b.numel():
            scale = max(scale, float(b.abs().max()))
            diff = max(diff, float((a.to(b.dtype) - b).abs().max()))
    return diff <= tol * scale
