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
the parameters' (:mod:`fxpipe.runtime.split_backward`). The order never deadlocks: its
needs are implied by the simulator's dependencies, under which it runs to the
end (tested for every schedule). On GPUs each worker enqueues on its device's
compute stream and values cross devices on copy streams, ordered by events
(:mod:`fxpipe.runtime.streams`); on CPU the same calls do nothing, and CPU workers
beyond the processors take turns, one operation at a time (the host's turns, :mod:`fxpipe.runtime.host`). The loss of micro-batch ``i`` is computed on the last stage before
``B(p-1, i)`` and combined as :mod:`fxpipe.runtime.losses` says (``reduction="mean"``: weighted
``n_i / N``; ``"sum"``; ``"token"``: ``(sum, count)`` divided by the global count; ``"auto"``: one of those
as :mod:`fxpipe.runtime.auto_loss` finds, or refused), so the accumulated gradients are those of one
full-batch backward of that loss.
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from fxpipe.runtime.batchnorm import tracking
from fxpipe.runtime.caller_state import CallerState
from fxpipe.runtime.codegen import StageSpec
from fxpipe.runtime.host import UNSHARED, Host
from fxpipe.runtime.auto_loss import AutoLoss
from fxpipe.runtime.losses import REDUCTIONS, LossFailure, StepGradients, total_count, weigh
from fxpipe.runtime.microbatch import batch_size_of
from fxpipe.runtime.rng import is_random, rng_guard, step_seed
from fxpipe.runtime.split_backward import WeightPass, backward_inputs, full_backward, leaf_nodes
from fxpipe.runtime.streams import DeviceStreams, Event
from fxpipe.runtime.transport import LOSS, Transport
from fxpipe.runtime.worker import spawn_workers
from fxpipe.runtime.recompute import checkpoint_stage, forward_saving_nothing
from solvers.schedules import Op, get_schedule, worker_orders

__all__ = ["run_step", "StepFailure", "REDUCTIONS", "OpTiming"]

@dataclass(frozen=True)
class OpTiming:
    """When one operation ran, in seconds from the start of the step."""

    kind: str         # "F", "B" or "W" (a backward includes the recomputation of a checkpointed forward)
    stage: int
    micro_batch: int
    start_s: float
    end_s: float
    checkpointed: bool


class StepFailure(Exception):
    """An operation failed: which stage, micro-batch and pass, with the original exception."""

    def __init__(self, stage: int, micro_batch: int, kind: str, exc: BaseException) -> None:
        super().__init__(f"stage {stage} {kind} of micro-batch {micro_batch}: {exc}")
        self.stage, self.micro_batch, self.kind, self.exc = stage, micro_batch, kind, exc


class _Board:
    """What has finished, shared by the workers; any failure wakes everyone."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.done: set[tuple[str, int, int]] = set()
        self.failure: StepFailure | None = None

    def wait(self, needs: list[tuple[str, int, int]]) -> bool:
        with self.cond:
            self.cond.wait_for(lambda: self.failure is not None or all(n in self.done for n in needs))
            return self.failure is None

    def finish(self, op: tuple[str, int, int]) -> None:
        with self.cond:
            self.done.add(op)
            self.cond.notify_all()

    def fail(self, failure: StepFailure) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = failure
            self.cond.notify_all()


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
    random numbers (:mod:`fxpipe.runtime.rng`; default: found from its graph). Every operation runs
    inside a turn of ``host`` (:mod:`fxpipe.runtime.host`: CPU workers beyond the processors take turns) and in
    ``caller``'s grad mode and autocast (:mod:`fxpipe.runtime.caller_state`; default: this thread's now).
    ``sizes`` are the micro-batches' sample counts (default: dimension 0 of their inputs); with
    ``reduction="token"`` the gradients of ``grad_tensors`` (default: the stages' parameters) are the ones
    divided by the global count. ``transport`` (:mod:`fxpipe.runtime.transport`; default: every stage in this
    process) moves values and gradients between stages and says which workers run here; where the last
    stage runs elsewhere the loss is that process's (from :meth:`Transport.end`) and the outputs are ``None``.
    ``orders`` replaces the schedule's per-worker orders (one stage per worker; :mod:`solvers.asynchronous`
    holds forwards back for bounded staleness), and ``around(kind, stage, micro_batch)``, a context manager,
    wraps each operation on its worker (asynchronous training swaps weight versions and steps optimizers in it,
    :mod:`fxpipe.runtime.asynchronous`). ``reduction="auto"`` (:mod:`fxpipe.runtime.auto_loss`) reads the
    outputs' and targets' batch dimensions from ``loss_dims``; ``auto`` is its state (default: a new one; given
    with another ``reduction``, it computes the losses and the step does not divide by their counts). ``inline``:
    a process running one worker runs it on the calling thread (a profiler started there sees its allocations).

    Raises :class:`StepFailure` for the first operation that failed (all workers stop).
    """
    p, m = len(specs), len(micro_inputs)
    caller = CallerState.capture() if caller is None else caller
    n_workers = p if workers is None else workers
    if orders is None:
        orders = worker_orders(schedule, p, m, n_workers)   # raises ValueError for a shape it cannot run
    split = get_schedule(schedule).split_backward
    weight_passes: dict[tuple[int, int], WeightPass] = {}
    recomputations: dict[tuple[int, int], Callable[[], Any]] = {}   # checkpointed forwards of a split backward
    found: dict[int, tuple[list[torch.Tensor], set[Any]]] = {}   # stage -> its parameters and their autograd nodes

    def parameters_of(k: int) -> tuple[list[torch.Tensor], set[Any]]:
        """Stage ``k``'s parameters as its forwards use them now (FSDP2 swaps in unsharded ones for the step) and
        their autograd nodes: found again only when they are other tensors than last time (each costs a view)."""
        now = list(specs[k].module.parameters())
        if k not in found or len(found[k][0]) != len(now) or any(a is not b for a, b in zip(found[k][0], now)):
            found[k] = (now, leaf_nodes(now))
        return found[k]
    random = [is_random(spec.module) for spec in specs] if random is None else random
    seed = step_seed(random)   # masks depend on (seed, stage, micro-batch), not on which thread ran first
    producer = {name: k for k, spec in enumerate(specs) for name in spec.outputs}
    consumers: dict[int, set[int]] = {k: set() for k in range(p)}
    for k, spec in enumerate(specs):
        for name in spec.inputs:
            if name in producer:
                consumers[producer[name]].add(k)
    sizes = [batch_size_of(list(mb.values())) for mb in micro_inputs] if sizes is None else sizes
    transport = Transport() if transport is None else transport
    replicas = transport.replicas   # dp copies of this pipeline (pp x dp): their gradients are averaged after
    total = sum(sizes) if replicas is None else replicas.samples / replicas.count
    leaves: dict[tuple[int, int], dict[str, Any]] = {}  # (stage, mb) -> its input leaves by name
    outs: dict[tuple[int, int], dict[str, Any]] = {}    # (stage, mb) -> its outputs by name
    streams = DeviceStreams(devices)
    transport.begin(specs, devices, streams, micro_inputs, [n.name for n in _output_nodes(output_arg)])
    turns = host.turns(devices, n_workers)
    losses: list[torch.Tensor | None] = [None] * m
    counts: list[Any] = [None] * m
    outputs: list[Any] = [None] * m
    board = _Board()

    def send_back(stage_inputs: dict[str, Any], consumer: int, i: int, ready: Event) -> None:
        for name, value in stage_inputs.items():
            if name in producer:
                transport.send_grads(name, consumer, i, value, ready)

    def stage_inputs(k: int, i: int) -> dict[str, Any]:
        """Stage ``k``'s inputs for micro-batch ``i`` on its device, its compute stream waiting for their copies."""
        device, copies = devices[k], []
        inputs = {}
        for name in specs[k].inputs:
            if name in producer:
                inputs[name], event = transport.fetch(name, k, i, device)
            else:
                inputs[name], event = transport.placeholder(name, i, device)
            copies.append(event)
        streams.wait(device, copies)
        return inputs

    def forward(k: int, i: int) -> None:
        spec, device = specs[k], devices[k]
        inputs = stage_inputs(k, i)
        args = [inputs[name] for name in spec.inputs]
        # deferred BatchNorm counts this forward (not a checkpoint's recomputation)
        with tracking(), rng_guard(device, random[k], seed, k, i):
            if checkpoint(k, i) and split:   # its backward recomputes by hand, so that it can split too
                result, recomputations[(k, i)] = forward_saving_nothing(spec.module, *args)
            elif checkpoint(k, i):
                result = checkpoint_stage(spec.module, *args, preserve_rng_state=random[k])
            else:
                result = spec.module(*args)
        leaves[(k, i)] = inputs
        outs[(k, i)] = dict(zip(spec.outputs, result))
        transport.publish(k, i, outs[(k, i)], streams.record(device))

    def loss_backward(i: int) -> None:
        device = devices[-1]
        final, copies = {}, []
        for n in _output_nodes(output_arg):
            fetch = transport.fetch if n.name in producer else lambda name, _, i, d: transport.placeholder(name, i, d)
            final[n.name], event = fetch(n.name, LOSS, i, device)
            copies.append(event)
        target, event = streams.move(micro_targets[i], device)   # the loss runs on the last stage's device
        streams.wait(device, copies + [event])
        structure = fx.node.map_arg(output_arg, lambda n: final[n.name])
        outputs[i] = fx.node.map_arg(output_arg, lambda n: final[n.name].detach()
                                     if isinstance(final[n.name], torch.Tensor) else final[n.name])
        try:
            if auto is not None:   # loss_fn and its backward on copies of the outputs; pushed into the stages below
                pushed, losses[i], counts[i] = auto(loss_fn, structure, target, i, sizes[i] / total, 1.0 / total)
            else:
                root, losses[i], counts[i] = weigh(loss_fn(structure, target), reduction, sizes[i], total,
                                                   1.0 if replicas is None else replicas.count)
        except Exception as exc:   # the user's loss, not a stage: reported as such (fxpipe.runtime.pipeline)
            raise LossFailure(exc) from exc
        if auto is None:
            root.backward()
        elif pushed:
            torch.autograd.backward([t for t, _ in pushed], [g for _, g in pushed])
        send_back({name: leaf for name, leaf in final.items() if name in producer}, LOSS, i, streams.record(device))

    backwards = [0] * p   # each stage's backwards run so far

    def backward(k: int, i: int) -> None:
        if k == p - 1:
            loss_backward(i)
        backwards[k] += 1   # after the loss (which may fail), before the stage's own backward
        if backwards[k] == m and not split and transport.before_last_backward is not None:
            transport.before_last_backward(k)
        received = transport.received(k, i)
        stage_outs = outs[(k, i)]
        if (k, i) in recomputations:   # the same random numbers as its forward drew
            with rng_guard(devices[k], random[k], seed, k, i):
                stage_outs = dict(zip(specs[k].outputs, recomputations.pop((k, i))()))
        pairs = []
        for name, by_pos in received.items():
            flat = tree_flatten(stage_outs[name])[0]
            pairs += [(flat[pos], _with_standard_strides(g)) for pos, g in by_pos.items() if flat[pos].requires_grad]
        roots, root_grads = [t for t, _ in pairs], [g for _, g in pairs]
        stage_leaves = leaves.pop((k, i))
        if split:
            inputs = [t for t in tree_flatten(list(stage_leaves.values()))[0] if isinstance(t, torch.Tensor)]
            weight_passes[(k, i)] = backward_inputs(roots, root_grads, inputs, *parameters_of(k))
        else:   # checkpoint's own recomputation, replaying the forward's random numbers
            with rng_guard(devices[k], random[k] and checkpoint(k, i)):
                weight_passes[(k, i)] = full_backward(roots, root_grads)
        send_back(stage_leaves, k, i, streams.record(devices[k]))
        del outs[(k, i)]

    def weights(k: int, i: int) -> None:
        weight_passes.pop((k, i)).run()

    in_output = {producer[n.name] for n in _output_nodes(output_arg) if n.name in producer}

    def needs(kind: str, k: int, i: int) -> list[tuple[str, int, int]]:
        """The operations here that ``(kind, k, i)`` waits for; another process's arrive through the transport."""
        if kind == "W":
            return []          # its B ran earlier on the same worker
        if kind == "F":
            found = [("F", producer[name], i) for name in specs[k].inputs if name in producer]
        else:
            found = [("B", c, i) for c in consumers[k]] + [("F", k, i)]
            if k in in_output and k != p - 1:
                found.append(("B", p - 1, i))   # the loss's gradient for this stage's model outputs
            found += [("F", s, i) for s in range(p)] if k == p - 1 else []
        return [op for op in found if transport.local(op[1])]

    origin = time.perf_counter()

    wrap = around or (lambda kind, k, i: nullcontext())
    run_op = {"F": forward, "B": backward, "W": weights}
    pass_name = {"F": "forward", "B": "backward", "W": "weight-gradient pass"}

    # New threads have torch's defaults: each worker runs in the caller's state, entered once for the whole step
    # and keeping autocast's casts, so a weight is cast once per step, as in the plain model's one forward; per
    # operation, clearing them, where ``around`` swaps weight versions between operations.
    in_step, in_op = ((lambda: caller.entered(keep_casts=True)), nullcontext) if around is None \
        else (nullcontext, caller.entered)

    def work(w: int) -> None:
        with in_step():
            work_through(w)

    def work_through(w: int) -> None:
        for kind, k, i in orders[w]:
            if not board.wait(needs(kind, k, i)):
                return
            with turns.turn(devices[k]):   # may this operation run now (fxpipe.runtime.host)
                start = time.perf_counter()
                try:
                    with streams.computing(devices[k]), in_op(), wrap(kind, k, i):
                        run_op[kind](k, i)
                except LossFailure as exc:
                    board.fail(StepFailure(k, i, "loss", exc.exc))
                    return
                except BaseException as exc:  # handed to the caller
                    board.fail(StepFailure(k, i, pass_name[kind], exc))
                    return
                end = time.perf_counter()
            if timings is not None:
                timings.append(OpTiming(kind, k, i, start - origin, end - origin, checkpoint(k, i)))
            board.finish((kind, k, i))

    if reduction == "auto" and auto is None:   # replicas' token sums must all be scaled alike: by 1 / N
        whole = m == 1 and replicas is None   # the whole batch at once: any loss is exact as it is
        auto = AutoLoss(*loss_dims, estimate_scale=replicas is None, check=not whole, own_mean=whole)
    # "auto" may refuse the loss at any micro-batch: the step's gradients stay apart until it ends
    step_grads = StepGradients(grad_tensors or [q for spec in specs for q in spec.module.parameters()]) \
        if reduction in ("token", "auto") else None
    try:
        _run_workers(work, transport.workers(n_workers), board, inline)
    except BaseException:   # Ctrl-C in the caller: every worker stopped first (none writes .grad after it)
        if step_grads is not None:   # a failed step leaves the gradients as they were before it
            step_grads.restore()
        raise
    here = transport.local(p - 1)
    if here and replicas is not None and replicas.tie is not None and auto is not None:
        tied = replicas.tie(auto, board.failure is not None)   # the last stages' replicas, all of them, every step
        if tied is not None and board.failure is None:
            board.fail(StepFailure(p - 1, -1, "loss", tied))
    failure, result = transport.end(board.failure, lambda: _result(losses, counts) if here else None)
    if failure is not None:
        if step_grads is not None:
            step_grads.restore()
        raise failure
    if here:
        loss, count = torch.stack([x.to(devices[-1]) for x in losses]).sum(), total_count(counts, devices[-1])
    else:   # the process of the last stage sent them with its end of the step
        assert result is not None
        loss, count = torch.tensor(result["loss"], dtype=getattr(torch, result["dtype"])), result["count"]
    if replicas is not None and reduction in ("auto", "token"):
        try:   # the whole batch's count, over the replicas (DDP then averages what each divides by it)
            count = replicas.sum_counts(count)
        except BaseException:
            if step_grads is not None:
                step_grads.restore()
            raise
    if step_grads is not None:   # None: the micro-batches were weighted by their samples
        step_grads.finish(count)
    # the loss in its own dtype: a count kept in float64 (auto's token factor) must not promote it
    return ((loss / count).to(loss.dtype) if count is not None else loss), (outputs if here else [None] * m)


def _run_workers(work: Callable[[int], None], ids: list[int], board: _Board, inline: bool = False) -> None:
    """``work(w)`` for every worker ``w`` of ``ids``, each on a thread of its own (:mod:`fxpipe.runtime.worker`),
    until all have returned; ``inline`` with one worker: on the calling thread (what a profiler started there
    sees). Ctrl-C while they run stops every worker at its next operation before it is raised."""
    if inline and len(ids) == 1:
        try:
            work(ids[0])
        except Exception as exc:   # outside any operation (its own failures are the board's)
            board.fail(StepFailure(-1, -1, f"worker {ids[0]}", exc))
        return
    with spawn_workers(len(ids)) as pool:
        for lane, w in enumerate(ids):
            pool.submit(lane, w, lambda w=w: work(w))
        try:
            for _ in ids:
                w, ok, exc = pool.collect()
                if not ok:   # outside any operation (its own failures are the board's): stop the others too
                    board.fail(StepFailure(-1, -1, f"worker {w}", exc))
        except BaseException as interrupt:
            board.fail(StepFailure(-1, -1, "step", interrupt))
            raise   # spawn_workers waits for the workers before it returns


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
