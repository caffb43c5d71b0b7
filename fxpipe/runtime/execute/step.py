"""A training step with an explicit schedule: forward and backward per stage, on the stage's thread.

``pipe(x)`` leaves backward to one ``loss.backward()``, which on CPU runs on a
single autograd thread. :func:`run_step` instead cuts autograd at every stage
boundary: a stage's inputs from earlier stages are fresh leaves, its backward is
``torch.autograd.backward(outputs, output_grads)`` run by its own worker, and
the leaves' gradients travel back to the producing stages (summed when a value
feeds several stages, e.g. a skip connection or a tied weight). Each worker runs
its stages' operations in the schedule's order (:func:`solvers.schedules.worker_orders`:
GPipe, 1F1B, interleaved 1F1B with several stages per worker, ZB-H1, ZB-V), waiting
only for the data it needs: ``F(k, i)`` after the producers' forwards of
micro-batch ``i``, ``B(k, i)`` after its consumers' backwards. A zero-bubble
schedule's ``B`` computes only the gradients of the stage's inputs and its ``W``
the parameters' (:mod:`fxpipe.runtime.backward.split_backward`). The order never deadlocks: its
needs are implied by the simulator's dependencies, under which it runs to the
end (tested for every schedule). On GPUs each worker enqueues on its device's
compute stream and values cross devices on copy streams, ordered by events
(:mod:`fxpipe.runtime.boundaries.streams`); on CPU the same calls do nothing, and CPU workers
beyond the processors take turns, one operation at a time (the host's turns, :mod:`fxpipe.runtime.execute.host`). The loss of micro-batch ``i`` is computed on the last stage before
``B(p-1, i)`` and combined as :mod:`fxpipe.runtime.losses.losses` says (``reduction="mean"``: weighted
``n_i / N``; ``"sum"``; ``"token"``: ``(sum, count)`` divided by the global count; ``"auto"``: one of those
as :mod:`fxpipe.runtime.losses.auto_loss` finds, or refused), so the accumulated gradients are those of one
full-batch backward of that loss.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, Callable, ContextManager

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from fxpipe.runtime.execute.batchnorm import tracking
from fxpipe.runtime.execute.caller_state import CallerState
from fxpipe.runtime.execute.codegen import StageSpec
from fxpipe.runtime.execute.host import UNSHARED, Host
from fxpipe.runtime.losses.auto_loss import AutoLoss
from fxpipe.runtime.losses.losses import REDUCTIONS, LossFailure, StepGradients, total_count, weigh
from fxpipe.runtime.execute.microbatch import batch_size_of
from fxpipe.runtime.backward.rng import is_random, rng_guard, step_seed
from fxpipe.runtime.backward.split_backward import WeightPass, backward_inputs, full_backward, leaf_nodes
from fxpipe.runtime.boundaries.streams import DeviceStreams, Event
from fxpipe.runtime.boundaries.transport import LOSS, Transport
from fxpipe.runtime.execute.step_board import Board, OpTiming, StepFailure, run_workers
from fxpipe.runtime.backward.recompute import checkpoint_stage, forward_saving_nothing
from solvers.schedules import Op, worker_orders

__all__ = ["run_step", "StepFailure", "REDUCTIONS", "OpTiming"]

def run_step(specs: list[StageSpec], devices: list[torch.device], output_arg: Any,
             micro_inputs: list[dict[str, Any]], micro_targets: list[Any], loss_fn: Callable[[Any, Any], torch.Tensor],
             schedule: str, checkpoint: Callable[[int, int], bool], reduction: str = "mean",
             timings: list[OpTiming] | None = None, workers: int | None = None,
             random: list[bool] | None = None, host: Host = UNSHARED, caller: CallerState | None = None,
             sizes: list[int] | None = None,
             grad_tensors: list[torch.Tensor] | None = None,
             transport: Transport | None = None, orders: list[list[Op]] | None = None,
             around: Callable[[str, int, int], ContextManager[None]] | None = None,
             loss_dims: tuple[int, int] = (0, 0), auto: AutoLoss | None = None, inline: bool = False,
             ) -> tuple[torch.Tensor | None, list[Any]]:
    """Run forward and backward of every micro-batch; return the weighted loss and per-micro-batch outputs.

    ``workers`` threads (default: one per stage; fewer for ``interleaved-1f1b`` and ``zb-v``) run
    the operations of :func:`solvers.schedules.worker_orders`. ``timings``, if given,
    receives an :class:`OpTiming` per operation. ``random[k]`` says that stage ``k`` draws
    random numbers (:mod:`fxpipe.runtime.backward.rng`; default: found from its graph). Every operation runs
    inside a turn of ``host`` (:mod:`fxpipe.runtime.execute.host`: CPU workers beyond the processors take turns) and in
    ``caller``'s grad mode and autocast (:mod:`fxpipe.runtime.execute.caller_state`; default: this thread's now).
    ``sizes`` are the micro-batches' sample counts (default: dimension 0 of their inputs); with
    ``reduction="token"`` the gradients of ``grad_tensors`` (default: the stages' parameters) are the ones
    divided by the global count. ``transport`` (:mod:`fxpipe.runtime.boundaries.transport`; default: every stage in this
    process) moves values and gradients between stages and says which workers run here; where the last
    stage runs elsewhere the loss is that process's (from :meth:`Transport.end`) and the outputs are ``None``.
    ``orders`` replaces the schedule's per-worker orders (one stage per worker; :mod:`solvers.asynchronous`
    holds forwards back for bounded staleness), and ``around(kind, stage, micro_batch)``, a context manager,
    wraps each operation on its worker (asynchronous training swaps weight versions and steps optimizers in it,
    :mod:`fxpipe.runtime.execute.asynchronous`). ``reduction="auto"`` (:mod:`fxpipe.runtime.losses.auto_loss`) reads the
    outputs' and targets' batch dimensions from ``loss_dims``; ``auto`` is its state (default: a new one; given
    with another ``reduction``, it computes the losses and the step does not divide by their counts). ``inline``:
    a process running one worker runs it on the calling thread (a profiler started there sees its allocations).

    Raises :class:`StepFailure` for the first operation that failed (all workers stop).
    """
    step = _Step(specs, devices, output_arg, micro_inputs, micro_targets, loss_fn, schedule, checkpoint, reduction,
                 timings, workers, random, host, caller, sizes, transport, orders, around)
    step.prepare_loss(reduction, loss_dims, auto)
    step_grads = StepGradients(grad_tensors or [q for spec in specs for q in spec.module.parameters()]) \
        if reduction in ("token", "auto") else None   # "auto" may refuse the loss at any micro-batch
    try:
        step.run(inline)
        return step.result(step_grads)
    except BaseException:   # a failed step (or Ctrl-C) leaves the gradients as they were before it
        if step_grads is not None:
            step_grads.restore()
        raise


class _Step:
    """One step's state and its operations (:func:`run_step` says what each argument is): the forward, the
    loss, the backward and the weight pass of a stage's micro-batch, what each waits for, and each worker's walk
    through its order. The workers share it; each operation touches only its own stage's and micro-batch's
    entries."""

    def __init__(self, specs: list[StageSpec], devices: list[torch.device], output_arg: Any,
                 micro_inputs: list[dict[str, Any]], micro_targets: list[Any], loss_fn: Callable[[Any, Any], Any],
                 schedule: str, checkpoint: Callable[[int, int], bool], reduction: str,
                 timings: list[OpTiming] | None, workers: int | None, random: list[bool] | None, host: Host,
                 caller: CallerState | None, sizes: list[int] | None, transport: Transport | None,
                 orders: list[list[Op]] | None, around: Callable[[str, int, int], ContextManager[None]] | None) -> None:
        p, m = len(specs), len(micro_inputs)
        self.specs, self.devices, self.output_arg, self.p, self.m = specs, devices, output_arg, p, m
        self.micro_targets, self.loss_fn = micro_targets, loss_fn
        self.checkpoint, self.reduction = checkpoint, reduction
        self.timings, self.around = timings, around
        self.caller = CallerState.capture() if caller is None else caller
        self.n_workers = p if workers is None else workers
        # worker_orders raises ValueError for a shape the schedule cannot run
        self.orders = worker_orders(schedule, p, m, self.n_workers) if orders is None else orders
        # a split backward is read off the orders: their input-gradient passes (and the forwards it recomputes)
        self.split = any(kind == "I" for order in self.orders for kind, _, _ in order)
        self.weight_passes: dict[tuple[int, int], WeightPass] = {}
        self.recomputations: dict[tuple[int, int], Callable[[], Any]] = {}   # checkpointed forwards, split backward
        self.found: dict[int, tuple[list[torch.Tensor], set[Any]]] = {}   # stage -> parameters, autograd nodes
        self.random = [is_random(spec.module) for spec in specs] if random is None else random
        self.seed = step_seed(self.random)   # masks depend on (seed, stage, micro-batch), not on the thread
        self.producer = {name: k for k, spec in enumerate(specs) for name in spec.outputs}
        self.consumers: dict[int, set[int]] = {k: set() for k in range(p)}
        for k, spec in enumerate(specs):
            for name in spec.inputs:
                if name in self.producer:
                    self.consumers[self.producer[name]].add(k)
        self.sizes = [batch_size_of(list(mb.values())) for mb in micro_inputs] if sizes is None else sizes
        self.transport = Transport() if transport is None else transport
        self.replicas = self.transport.replicas   # dp copies of this pipeline (pp x dp): gradients averaged after
        self.total = sum(self.sizes) if self.replicas is None else self.replicas.samples / self.replicas.count
        self.leaves: dict[tuple[int, int], dict[str, Any]] = {}  # (stage, mb) -> its input leaves by name
        self.outs: dict[tuple[int, int], dict[str, Any]] = {}    # (stage, mb) -> its outputs by name
        self.streams = DeviceStreams(devices)
        self.final_nodes = _output_nodes(output_arg)
        self.transport.begin(specs, devices, self.streams, micro_inputs, [n.name for n in self.final_nodes])
        self.turns = host.turns(devices, self.n_workers)
        self.losses: list[torch.Tensor | None] = [None] * m
        self.counts: list[Any] = [None] * m
        self.outputs: list[Any] = [None] * m
        self.board = Board()
        self.backwards = [0] * p   # each stage's backwards run so far
        self.in_output = {self.producer[n.name] for n in self.final_nodes if n.name in self.producer}
        self.run_op = {"F": self.forward, "B": self.backward, "I": self.input_backward, "W": self.weights}
        self.auto: AutoLoss | None = None

    def prepare_loss(self, reduction: str, loss_dims: tuple[int, int], auto: AutoLoss | None) -> None:
        """The automatic loss's state: ``auto``, or a new one for ``reduction="auto"`` (replicas' token sums must
        all be scaled alike: by 1 / N; the whole batch at once is exact as it is)."""
        if reduction == "auto" and auto is None:
            whole = self.m == 1 and self.replicas is None
            auto = AutoLoss(*loss_dims, estimate_scale=self.replicas is None, check=not whole, own_mean=whole)
        self.auto = auto

    def parameters_of(self, k: int) -> tuple[list[torch.Tensor], set[Any]]:
        """Stage ``k``'s parameters as its forwards use them now (FSDP2 swaps in unsharded ones for the step) and
        their autograd nodes: found again only when they are other tensors than last time (each costs a view)."""
        now = list(self.specs[k].module.parameters())
        known = self.found.get(k)
        if known is None or len(known[0]) != len(now) or any(a is not b for a, b in zip(known[0], now)):
            self.found[k] = (now, leaf_nodes(now))
        return self.found[k]

    def send_back(self, stage_inputs: dict[str, Any], consumer: int, i: int, ready: Event) -> None:
        for name, value in stage_inputs.items():
            if name in self.producer:
                self.transport.send_grads(name, consumer, i, value, ready)

    def stage_inputs(self, k: int, i: int) -> dict[str, Any]:
        """Stage ``k``'s inputs for micro-batch ``i`` on its device, its compute stream waiting for their copies."""
        device, copies = self.devices[k], []
        inputs = {}
        for name in self.specs[k].inputs:
            if name in self.producer:
                inputs[name], event = self.transport.fetch(name, k, i, device)
            else:
                inputs[name], event = self.transport.placeholder(name, i, device)
            copies.append(event)
        self.streams.wait(device, copies)
        return inputs

    def forward(self, k: int, i: int) -> None:
        spec, device = self.specs[k], self.devices[k]
        inputs = self.stage_inputs(k, i)
        args = [inputs[name] for name in spec.inputs]
        # deferred BatchNorm counts this forward (not a checkpoint's recomputation)
        with tracking(), rng_guard(device, self.random[k], self.seed, k, i):
            if self.checkpoint(k, i) and self.split:   # its backward recomputes by hand, so that it can split too
                result, self.recomputations[(k, i)] = forward_saving_nothing(spec.module, *args)
            elif self.checkpoint(k, i):
                result = checkpoint_stage(spec.module, *args, preserve_rng_state=self.random[k])
            else:
                result = spec.module(*args)
        self.leaves[(k, i)] = inputs
        self.outs[(k, i)] = dict(zip(spec.outputs, result))
        self.transport.publish(k, i, self.outs[(k, i)], self.streams.record(device))

    def model_outputs(self, i: int) -> dict[str, Any]:
        """Micro-batch ``i``'s model outputs on the last stage's device (where the loss runs), by name."""
        device, transport = self.devices[-1], self.transport
        final, copies = {}, []
        for n in self.final_nodes:
            fetch = transport.fetch if n.name in self.producer else \
                lambda name, _, i, d: transport.placeholder(name, i, d)
            final[n.name], event = fetch(n.name, LOSS, i, device)
            copies.append(event)
        self.streams.wait(device, copies)
        return final

    def loss_backward(self, i: int) -> None:
        device = self.devices[-1]
        final = self.model_outputs(i)
        target, event = self.streams.move(self.micro_targets[i], device)
        self.streams.wait(device, [event])
        structure = fx.node.map_arg(self.output_arg, lambda n: final[n.name])
        self.outputs[i] = fx.node.map_arg(self.output_arg, lambda n: final[n.name].detach()
                                          if isinstance(final[n.name], torch.Tensor) else final[n.name])
        auto, replicas = self.auto, self.replicas
        try:
            if auto is not None:   # loss_fn and its backward on copies of the outputs; pushed into the stages below
                pushed, self.losses[i], self.counts[i] = auto(self.loss_fn, structure, target, i,
                                                              self.sizes[i] / self.total, 1.0 / self.total)
            else:
                root, self.losses[i], self.counts[i] = weigh(self.loss_fn(structure, target), self.reduction,
                                                             self.sizes[i], self.total,
                                                             1.0 if replicas is None else replicas.count)
        except Exception as exc:   # the user's loss, not a stage: reported as such (fxpipe.runtime.execute.pipeline)
            raise LossFailure(exc) from exc
        if auto is None:
            root.backward()
        elif pushed:
            torch.autograd.backward([t for t, _ in pushed], [g for _, g in pushed])
        self.send_back({name: leaf for name, leaf in final.items() if name in self.producer}, LOSS, i,
                       self.streams.record(device))

    def input_backward(self, k: int, i: int) -> None:
        """A split backward's input-gradient pass; its weight pass ``W`` runs later."""
        self.backward(k, i, split=True)

    def backward(self, k: int, i: int, split: bool = False) -> None:
        """Micro-batch ``i``'s backward of stage ``k`` (the loss's first on the last stage): whole, or (``split``)
        its input gradients only."""
        if k == self.p - 1:
            self.loss_backward(i)
        self.backwards[k] += 1   # after the loss (which may fail), before the stage's own backward
        if self.backwards[k] == self.m and not self.split and self.transport.before_last_backward is not None:
            self.transport.before_last_backward(k)
        received = self.transport.received(k, i)
        stage_outs = self.outs[(k, i)]
        if (k, i) in self.recomputations:   # the same random numbers as its forward drew
            with rng_guard(self.devices[k], self.random[k], self.seed, k, i):
                stage_outs = dict(zip(self.specs[k].outputs, self.recomputations.pop((k, i))()))
        pairs = []
        for name, by_pos in received.items():
            flat = tree_flatten(stage_outs[name])[0]
            pairs += [(flat[pos], _with_standard_strides(g)) for pos, g in by_pos.items() if flat[pos].requires_grad]
        roots, root_grads = [t for t, _ in pairs], [g for _, g in pairs]
        stage_leaves = self.leaves.pop((k, i))
        if split:
            inputs = [t for t in tree_flatten(list(stage_leaves.values()))[0] if isinstance(t, torch.Tensor)]
            self.weight_passes[(k, i)] = backward_inputs(roots, root_grads, inputs, *self.parameters_of(k))
        else:   # checkpoint's own recomputation, replaying the forward's random numbers
            with rng_guard(self.devices[k], self.random[k] and self.checkpoint(k, i)):
                self.weight_passes[(k, i)] = full_backward(roots, root_grads)
        self.send_back(stage_leaves, k, i, self.streams.record(self.devices[k]))
        del self.outs[(k, i)]

    def weights(self, k: int, i: int) -> None:
        self.weight_passes.pop((k, i)).run()

    def needs(self, kind: str, k: int, i: int) -> list[tuple[str, int, int]]:
        """The operations here that ``(kind, k, i)`` waits for; another process's arrive through the transport."""
        if kind == "W":
            return []          # its B ran earlier on the same worker
        p = self.p
        if kind == "F":
            found = [("F", self.producer[name], i) for name in self.specs[k].inputs if name in self.producer]
        else:
            # a backward, whole or input pass, waits for its consumers' gradients (board.finish records either as B)
            found = [("B", c, i) for c in self.consumers[k]] + [("F", k, i)]
            if k in self.in_output and k != p - 1:
                found.append(("B", p - 1, i))   # the loss's gradient for this stage's model outputs
            found += [("F", s, i) for s in range(p)] if k == p - 1 else []
        return [op for op in found if self.transport.local(op[1])]

    def run(self, inline: bool) -> None:
        """Every worker of this process through its order; an interrupt stops them all before it is raised."""
        self.origin = time.perf_counter()
        run_workers(self.work, self.transport.workers(self.n_workers), self.board, inline)

    def work(self, w: int) -> None:
        """Worker ``w``'s operations in its order. New threads have torch's defaults: each worker runs in the
        caller's state, entered once for the whole step and keeping autocast's casts, so a weight is cast once
        per step, as in the plain model's one forward; per operation, clearing them, where ``around`` swaps
        weight versions between operations."""
        if self.around is None:
            with self.caller.entered(keep_casts=True):
                self.work_through(w, nullcontext, lambda kind, k, i: nullcontext())
        else:
            self.work_through(w, self.caller.entered, self.around)

    def work_through(self, w: int, in_op: Callable[[], ContextManager[Any]],
                     wrap: Callable[[str, int, int], ContextManager[None]]) -> None:
        board = self.board
        for kind, k, i in self.orders[w]:
            if not board.wait(self.needs(kind, k, i)):
                return
            with self.turns.turn(self.devices[k]):   # may this operation run now (fxpipe.runtime.execute.host)
                start = time.perf_counter()
                try:
                    with self.streams.computing(self.devices[k]), in_op(), wrap(kind, k, i):
                        self.run_op[kind](k, i)
                except LossFailure as exc:
                    board.fail(StepFailure(k, i, "loss", exc.exc))
                    return
                except BaseException as exc:  # handed to the caller
                    board.fail(StepFailure(k, i, PASS_NAMES[kind], exc))
                    return
                end = time.perf_counter()
            if self.timings is not None:
                self.timings.append(OpTiming(kind, k, i, start - self.origin, end - self.origin, self.checkpoint(k, i)))
            board.finish(("B" if kind == "I" else kind, k, i))   # its gradients are sent either way

    def result(self, step_grads: StepGradients | None) -> tuple[torch.Tensor | None, list[Any]]:
        """The step's loss and outputs once every worker returned, or its first failure raised; the replicas'
        last stages agree on the loss first, and the gradients are divided by the whole batch's count."""
        p, m, board, replicas = self.p, self.m, self.board, self.replicas
        here = self.transport.local(p - 1)
        if here and replicas is not None and replicas.tie is not None and self.auto is not None:
            tied = replicas.tie(self.auto, board.failure is not None)   # every step, on all last-stage replicas
            if tied is not None and board.failure is None:
                board.fail(StepFailure(p - 1, -1, "loss", tied))
        failure, sent = self.transport.end(board.failure, lambda: _result(self.losses, self.counts) if here else None)
        if failure is not None:
            raise failure
        if here:
            loss = torch.stack([x.to(self.devices[-1]) for x in self.losses]).sum()
            count = total_count(self.counts, self.devices[-1])
        else:   # the process of the last stage sent them with its end of the step
            assert sent is not None
            loss, count = torch.tensor(sent["loss"], dtype=getattr(torch, sent["dtype"])), sent["count"]
        if replicas is not None and self.reduction in ("auto", "token"):
            count = replicas.sum_counts(count)   # the whole batch's, over the replicas (DDP averages the rest)
        if step_grads is not None:   # None: the micro-batches were weighted by their samples
            step_grads.finish(count)
        # the loss in its own dtype: a count kept in float64 (auto's token factor) must not promote it
        return ((loss / count).to(loss.dtype) if count is not None else loss), (self.outputs if here else [None] * m)


PASS_NAMES = {"F": "forward", "B": "backward", "I": "backward", "W": "weight-gradient pass"}


def _result(losses: list[Any], counts: list[Any]) -> dict[str, Any]:
    """The step's loss (summed parts) and count (``"token"``), as numbers another process can be sent."""
    total = torch.stack([x.detach().cpu() for x in losses]).sum()
    count = None if counts[0] is None else float(sum(float(c) for c in counts))
    return {"loss": total.item(), "count": count, "dtype": str(losses[0].dtype).removeprefix("torch.")}


def _with_standard_strides(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with standard contiguous strides when it has other ones. A value of a 1-sample micro-batch
    is "contiguous" with any stride on its size-1 dimensions, and a gradient received for it keeps them;
    some CPU backward kernels read those strides: XCiT's patch embedding got 73 % wrong weight gradients
    from such a micro-batch (autograd, inside one graph, hands them standard strides)."""
    standard, step = [], 1
    for size in reversed(grad.shape):
        standard.append(step)
        step *= max(size, 1)
    if tuple(reversed(standard)) == grad.stride():
        return grad
    return grad.clone(memory_format=torch.contiguous_format)


def _output_nodes(arg: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(arg, lambda n: found.append(n) or n)
    return list(dict.fromkeys(found))
