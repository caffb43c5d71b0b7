"""``fxpipe.Pipeline``: runs compiled stages over micro-batches.

``pipe.step(inputs, target, loss_fn)`` is the training step: forward and
backward of every micro-batch per stage, in the plan's schedule (GPipe or
1F1B), each stage on its own thread (:mod:`fxpipe.runtime.execute.step`).

``pipe(x)`` is the call of the model (GPipe fill-drain forward), one worker thread per stage
(:mod:`fxpipe.runtime.execute.fill_drain`). At clock ``c`` stage ``k`` processes micro-batch ``c - k``; a clock
ends when all its tasks have. Backward is left to autograd: the gathered output is an ordinary autograd tensor, so
``loss.backward()`` reaches every parameter, and gradients accumulate over micro-batches exactly as one full-batch
backward would (except through a train-mode BatchNorm, which normalises each micro-batch by its own statistics).
Checkpointing uses ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved, buffers replayed and left alone
by the recomputation: :mod:`fxpipe.runtime.backward.recompute`) per stage and micro-batch, with torchgpipe's modes.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten

from fxpipe.runtime.execute.batchnorm import commit_statistics
from fxpipe.runtime.execute.caller_state import CallerState
from fxpipe.runtime.execute.codegen import StageSpec, split_graph
from fxpipe.errors import FxpipeError
from fxpipe.runtime.execute.failures import step_error
from fxpipe.runtime.execute.fill_drain import fill_drain
from fxpipe.runtime.execute.call_inputs import CallInputs
from fxpipe.runtime.backward.input_grads import InputGraphs
from fxpipe.frontend.model_loss import MODEL_LOSS, ModelLoss
from fxpipe.runtime.losses.model_loss import gather_outputs, no_model_loss_error, own_loss, with_micro_batch_mean
from fxpipe.planning.memory_model import (CHECKPOINT_SPELLINGS, checkpointed, is_checkpoint_mode,
                                          refuse_with_schedule)
from fxpipe.runtime.execute.memory_probe import allocations, measure_worker_memory
from fxpipe.planning.plan import Plan
from fxpipe.planning.report import step_report
from fxpipe.runtime.checks.guards import ModelGuard
from fxpipe.runtime.execute.host import UNSHARED, Host
from fxpipe.runtime.backward.rng import is_random, step_seed
from fxpipe.runtime.losses.losses import REDUCTIONS
from fxpipe.runtime.execute.structure import FlatInputs, flat_inputs, model_output
from fxpipe.runtime.checks.traced_mode import TracedMode
from fxpipe.runtime.execute.step import OpTiming, StepFailure, run_step
from fxpipe.runtime.boundaries.tied import TiedWeights
from fxpipe.runtime.execute.compiled import refuse_split_backward
from fxpipe.runtime.boundaries.compression import BoundaryCompression
from fxpipe.runtime.boundaries.transport import Transport
from solvers.schedules import SCHEDULES, get_schedule, worker_orders

__all__ = ["Pipeline", "CHECKPOINT_MODES", "STEP_SCHEDULES"]

CHECKPOINT_MODES = ("always", "except_last", "never")
STEP_SCHEDULES = SCHEDULES
class Pipeline(nn.Module):
    """A model split into stages on devices; call it like the model."""

    def __init__(self, graph_module: fx.GraphModule, stages: list[StageSpec], devices: list[torch.device],
                 plan: Plan, checkpoint: str = "except_last", mode_dependent: bool | Callable[[], bool] = False,
                 host: Host = UNSHARED, guard: ModelGuard | None = None,
                 compiled: dict[str, Any] | None = None) -> None:
        super().__init__()
        chosen = all(is_checkpoint_mode(st.checkpoint) for st in plan.stages)
        if not is_checkpoint_mode(checkpoint) and not (checkpoint == "auto" and chosen):
            raise ValueError(f"checkpoint must be one of {CHECKPOINT_SPELLINGS}, got {checkpoint!r}")
        for st in plan.stages:
            refuse_with_schedule(st.checkpoint or checkpoint, plan.schedule)
        self.stages = nn.ModuleList(s.module for s in stages)
        self.specs = stages
        # parameters several stages read: a copy per stage, refreshed before a call, summed after a step
        self.tied = TiedWeights([s.module for s in stages])
        self.devices = devices
        self.plan = plan
        self.chunks = plan.chunks
        self.schedule = plan.schedule
        self.last_step: dict[str, Any] | None = None
        self.checkpoint = checkpoint
        self._traced_training = bool(graph_module.meta.get("fxpipe_traced_training", False))
        self._mode = TracedMode(self._traced_training, mode_dependent)
        self.host = host   # CPU workers take turns through it (fxpipe.cost.cpu.CpuHost); GPUs never wait
        self.transport: Transport | None = None   # how stages exchange values in pipe.step (default: in-process)
        self.compression: BoundaryCompression | None = None   # CompileOptions.compression, kept across steps
        # the torch.compile keyword arguments every stage module was compiled with (fxpipe.runtime.execute.compiled);
        # None: the stages run eagerly
        self.compiled = compiled
        self._output = next(n for n in graph_module.graph.nodes if n.op == "output")
        self._graph = (graph_module,)   # a tuple: not a submodule (its parameters are the stages')
        self._value_specs: list[StageSpec] | None = None
        # a torch.export graph is flat: the model's input and output structures (fxpipe.runtime.execute.structure)
        self._out_spec = graph_module.meta.get("fxpipe_out_spec")
        self._out_dict_types = graph_module.meta.get("fxpipe_out_dict_types")   # fx: an OrderedDict's type
        self._meta = graph_module.meta
        # a loss the model computes itself, summed per micro-batch (fxpipe.frontend.model_loss)
        self._model_loss: ModelLoss | None = graph_module.meta.get(MODEL_LOSS)
        self.inputs = CallInputs(graph_module, plan, guard)   # a call bound to the graph and split
        self.layout = self.inputs.layout   # where the samples are in inputs, outputs and targets
        # Only the pipeline's own flag (what _check_mode compares): self.train() would recurse into the
        # stages and reset every submodule the user had set apart, e.g. a frozen BatchNorm in eval mode.
        self.training = self._traced_training

    @property
    def has_model_loss(self) -> bool:
        """Whether the model computes its own loss and :meth:`step` can train on it without a ``loss_fn``."""
        return self._model_loss is not None

    @property
    def guard(self) -> ModelGuard | None:
        """The compiled model's parameters, checked unchanged at every call (:mod:`fxpipe.runtime.checks.guards`)."""
        return self.inputs.guard

    @guard.setter
    def guard(self, guard: ModelGuard | None) -> None:
        self.inputs.guard = guard

    def specs_sending_tied_weights(self) -> list[StageSpec]:
        """The stages with each tied parameter held by the first stage that reads it only and sent to the others
        as a value every micro-batch (:func:`fxpipe.runtime.execute.codegen.split_graph` without copies): what
        asynchronous training runs, where each stage's optimizer steps its own parameters. :attr:`specs` where
        no parameter is tied across stages."""
        if not self.tied:
            return self.specs
        if self._value_specs is None:
            self._value_specs = split_graph(self._graph[0], self.plan.stage_of(), len(self.specs))
        return self._value_specs

    def stage_checkpoint(self, stage: int) -> str:
        """The checkpoint mode of ``stage``: the plan's choice for it (``checkpoint="auto"``) or the pipeline's."""
        return self.plan.stages[stage].checkpoint or self.checkpoint

    def _checkpointed(self, stage: int, micro_batch: int, micro_batches: int) -> bool:
        """Whether ``stage`` runs micro-batch ``micro_batch`` under activation checkpointing (torchgpipe's modes)."""
        return checkpointed(self.stage_checkpoint(stage), micro_batch, micro_batches)

    # ------------------------------------------------------------------ forward
    def _check_mode(self) -> None:
        """Refuse the other train/eval mode of a mode-dependent graph (:mod:`fxpipe.runtime.checks.traced_mode`)."""
        self._mode.check(self.training, self.guard.model if self.guard is not None else None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_mode()
        micro = self.inputs.micro_batches(args, kwargs)
        caller = CallerState.capture()   # grad mode and autocast are thread-local: the workers enter the caller's
        self.tied.prepare()
        self.tied.read_primary(caller.grad)   # loss.backward() then reaches the model's own tied parameters
        random = self._random_stages()
        seed = step_seed(random)
        # GPipe fill-drain, one worker per stage (fxpipe.runtime.execute.fill_drain)
        fill_drain(self, self.specs, self.devices, micro, caller, self._checkpointed, random, seed, self.host)
        outputs = [fx.node.map_arg(self._output.args[0], lambda n, e=env: e[n.name]) for env in micro]
        return self._joined(outputs, self._counts(micro))

    # ------------------------------------------------------------------ training step
    def step(self, inputs: Any, target: Any = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, *,
             schedule: str | None = None, reduction: str = "auto", return_outputs: bool = False,
             measure_memory: bool = False, chunks: int | None = None, kwargs: dict[str, Any] | None = None,
             **model_kwargs: Any) -> Any:
        """Forward and backward of one mini-batch with an explicit schedule; returns the loss.

        ``inputs`` is the model's input (a tuple for several; tensors inside tuples, lists and dicts
        are split); ``target`` (a tensor or such a structure) is split into micro-batches like them,
        moved to the last stage's device, and ``loss_fn(output, target)`` is applied per micro-batch
        there (:mod:`fxpipe.runtime.losses.losses`); ``target=None`` passes ``None`` to every call (a loss of
        the output alone):

        - ``reduction="auto"`` (the default) weighs each micro-batch exactly or refuses the step
          (:mod:`fxpipe.runtime.losses.auto_loss`): an ``F.cross_entropy``/``F.nll_loss`` mean that ``loss_fn``
          returns as it is (``nn.CrossEntropyLoss`` too; padded labels with ``ignore_index``, class weights,
          shifted logits) is weighted by its own count, the non-ignored targets, as ``"token"`` would; a
          ``(loss_sum, count)`` pair is ``"token"``; any other scalar loss is checked, micro-batch by
          micro-batch, to be a mean over samples of equal weight (one more ``loss_fn`` forward and backward
          each) and weighted as ``"mean"``. A loss that is not (a mean over tokens or a mask written by hand, a
          sum, a loss mixing samples) raises :class:`fxpipe.LossReductionError` naming the fix, with the
          gradients left as they were before the step.
        - ``reduction="mean"`` weights micro-batch ``i`` by ``n_i / N``, unchecked (the promise of a mean over
          samples of equal weight: ``mse_loss``, ``cross_entropy`` with one label per sample). Not exact for a
          loss averaged over elements spread unevenly over the samples, e.g. ``cross_entropy(ignore_index=-100)``
          on padded sequences.
        - ``reduction="token"``: ``loss_fn`` returns ``(loss_sum, count)`` (e.g.
          ``cross_entropy(..., reduction="sum")`` and ``(target != -100).sum()``); the gradients are
          those of the total sum over the whole batch's count, and the returned loss is that mean.
        - ``reduction="sum"`` weights every micro-batch by 1 (for a summed loss).

        Without ``loss_fn`` the step trains on the loss the model computes itself, as
        ``model(ids, labels=labels).loss.backward()`` on the whole batch: ``pipe.step(ids, labels=labels)``
        on a pipeline compiled with ``example_kwargs={"labels": labels}``. Keyword arguments other than the
        step's own go to the model (``kwargs=`` takes them as a dict, for a model keyword named like one of
        the step's). The model's cross-entropy over its counted targets is summed per micro-batch and divided
        once by the whole batch's count (:mod:`fxpipe.frontend.model_loss`), so padded labels train exactly;
        a model loss that cannot be combined so is refused with the reason.

        The returned loss and the gradients accumulated in ``.grad`` then equal one full-batch
        ``loss_fn(model(inputs), target).backward()`` — except for layers that mix samples: a
        BatchNorm in train mode normalises each micro-batch by its own statistics (as torchgpipe), so
        its gradients differ from a full batch's (``fxpipe.compile`` warns). ``schedule`` defaults to
        the plan's (``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"`` with the plan's stages per
        device, ``"zb-h1"`` or ``"zb-v"`` with two stages per device in a V). With ``return_outputs`` returns ``(loss, output)``.
        ``chunks`` runs this step in that many micro-batches instead of the plan's (``fxpipe.launch --chunks``); a
        batch of fewer samples than the micro-batches (a data loader's short last batch) runs one per sample.
        ``measure_memory`` records each worker's peak memory for :meth:`report`
        (``torch.cuda.max_memory_allocated`` on GPUs; on CPU a profiled replay of each
        worker after the step, :mod:`fxpipe.runtime.execute.memory_probe`, which costs about one more step; a rank of
        ``fxpipe.distributed`` on CPU runs its one worker on the calling thread under ``torch.profiler``:
        ``last_step["memory"]`` is then that rank's peak above what it held before the step).
        """
        schedule = schedule or self.schedule
        if schedule not in STEP_SCHEDULES:
            raise ValueError(f"schedule {schedule!r} is not supported by pipe.step; use one of {STEP_SCHEDULES}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        refuse_split_backward(schedule, self.compiled)
        for k in range(len(self.specs)):
            refuse_with_schedule(self.stage_checkpoint(k), schedule)
        self._check_mode()
        caller = CallerState.capture()   # the workers run in the caller's autocast, as the model would
        if not caller.grad:
            raise FxpipeError(f"pipe.step computes gradients, but it is called under {caller.describe()} "
                              "(gradients are off in this thread): call it outside that block, or use pipe(x) "
                              "to run the model without training it")
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        kwargs = dict(kwargs or {})
        twice = sorted(set(kwargs) & set(model_kwargs))
        if twice:
            raise TypeError(f"pipe.step got the model's keyword input(s) {twice} both in kwargs= and as keywords")
        kwargs.update(model_kwargs)
        if loss_fn is None and self._model_loss is None:
            raise no_model_loss_error(self._meta)
        if loss_fn is None and target is not None:
            raise TypeError("pipe.step was given a target but no loss_fn: the model's own loss reads its labels as an "
                            "input, so pass them by keyword (pipe.step(ids, labels=labels)), or pass a loss_fn")
        graphs = InputGraphs()   # inputs carrying the caller's graph: one backward into it, after the step
        inputs, kwargs = graphs.detach(inputs), graphs.detach(kwargs)
        if self.inputs.in_spec is not None:   # the graph's leaves once, for the memory probe's replay as well
            inputs, kwargs = FlatInputs(flat_inputs(inputs, kwargs, self.inputs.in_spec,
                                                     [p.target for p in self.inputs.placeholders])[0]), {}
        micro = self.inputs.micro_batches(inputs, kwargs, chunks)
        self.tied.prepare()   # a copy that diverged is refused here, before anything runs
        self.tied.read_primary(False)
        sizes = self.inputs.sizes(micro)
        targets = self.inputs.micro_targets(target, len(micro))
        if not self.inputs.targets_fit(targets, sizes):
            raise ValueError(f"target must have the batch size of the inputs, {sum(sizes)}, along its batch "
                             f"dimension {self.layout.target} (it is split into micro-batches the same way; "
                             "CompileOptions(target_batch_dim=...) names another dimension)")
        counts = self._counts(micro)   # the model's own loss: what each micro-batch's sum divides by
        if self._model_loss is None:
            loss_fn = self.structured_loss(loss_fn)
        elif loss_fn is None:   # (fxpipe.runtime.losses.model_loss)
            loss_fn, targets, reduction = own_loss(self._model_loss), counts, "token"
        else:
            loss_fn = with_micro_batch_mean(self.structured_loss(loss_fn), self._model_loss)
            targets = list(zip(targets, counts))
        m = len(micro)
        self._refuse_short_batch(schedule, m, chunks or self.chunks)
        grad_leaves = [t for t in tree_flatten(inputs)[0]
                       if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad]

        def ckpt(k: int, i: int) -> bool:
            return self._checkpointed(k, i, m)
        timings: list[OpTiming] = []
        cuda = sorted({d for d in self.devices if d.type == "cuda"}, key=str)
        on_gpu = measure_memory and len(cuda) == len(set(self.devices))
        transport = self.transport or Transport()
        # a rank's one CPU worker, run on this thread under the profiler: the rank's peak above what it held
        rank_cpu = measure_memory and not on_gpu and transport.remote
        with ExitStack() as measuring:   # each GPU's peak above what it held before the step
            gpu_memory = {d: measuring.enter_context(allocations(d)) for d in (cuda if on_gpu else [])}
            rank_memory = measuring.enter_context(allocations(torch.device("cpu"))) if rank_cpu else None
            transport.compression = self.compression
            started = time.perf_counter()
            try:
                loss, outs = run_step(self.specs, self.devices, self._output.args[0], micro, targets,
                                      loss_fn, schedule, ckpt, reduction, timings, workers=self._workers(schedule),
                                      random=self._random_stages(), host=self.host, caller=caller, sizes=sizes,
                                      grad_tensors=list(self.parameters()) + grad_leaves, transport=transport,
                                      loss_dims=(self.layout.output, self.layout.target), inline=rank_cpu)
            except BaseException as failure:
                commit_statistics(self.modules(), discard=True)
                self.tied.clear()
                if not isinstance(failure, StepFailure):
                    raise
                raise step_error(failure, self.devices) from failure.exc
            wall_s = time.perf_counter() - started
        self.tied.reduce()   # the copies' gradients into the tied parameters', once per step
        commit_statistics(self.modules())
        graphs.hand_on()
        self.last_step = {"schedule": schedule, "micro_batches": m, "wall_s": wall_s,
                          "timings": timings, "workers": self._workers(schedule), "bytes_moved": dict(transport.moved)}
        if on_gpu:
            owner = [self.devices[w] for w in range(self._workers(schedule))]
            self.last_step.update(memory=[gpu_memory[d].peak_bytes for d in owner],
                                  memory_method="torch.cuda.max_memory_allocated")
        elif rank_memory is not None:
            self.last_step.update(memory=[rank_memory.peak_bytes],
                                  memory_method="torch.profiler over this rank's worker, run on the calling thread")
        elif measure_memory:
            if self._model_loss is not None:   # the replay needs the gradients' shapes only
                leaf = self._model_loss.leaf
                found = measure_worker_memory(self, inputs, None, lambda out, _: out[leaf], schedule=schedule,
                                              chunks=m)
            else:
                found = measure_worker_memory(self, inputs, target, loss_fn, schedule=schedule, chunks=m)
            self.last_step.update(memory=[w.peak_bytes for w in found],
                                  memory_method="profiled replay of each worker, torch.profiler")
        if not return_outputs:
            return loss
        return loss, self._joined(outs, counts)

    def _counts(self, micro: list[dict[str, Any]]) -> list[torch.Tensor]:
        """What each micro-batch's summed model loss divides by (none without a model loss)."""
        return [self._model_loss.count(mb) for mb in micro] if self._model_loss is not None else []

    def _joined(self, outputs: list[Any], counts: list[torch.Tensor]) -> Any:
        """The micro-batches' outputs as the model's one output (its loss the whole batch's)."""
        return model_output(gather_outputs(outputs, self.layout.output, self._model_loss, counts), self._out_spec,
                            self._out_dict_types)

    def structured_loss(self, loss_fn: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
        """``loss_fn`` called on the model's own output structure (a ``ModelOutput`` with ``.logits``) where the
        graph's outputs are flat leaves (the torch.export front end) or fx kept a dict of another type as a
        plain one; ``loss_fn`` itself otherwise."""
        spec, types = self._out_spec, self._out_dict_types
        if spec is None and types is None:
            return loss_fn
        return lambda out, target: loss_fn(model_output(out, spec, types), target)

    def report(self) -> str:
        """Predicted against measured, per stage (and per worker's memory), for the last :meth:`step`.

        Times are per micro-batch (median over the step); a checkpointed micro-batch's
        predicted backward includes its recomputed forward. ``idle`` is the stage's share of
        the step spent waiting (bubble and transfers). The same numbers go into
        ``plan.measured`` (saved with the plan). See :mod:`fxpipe.planning.report`.
        """
        if self.last_step is None:
            raise FxpipeError("no step to report on yet: run pipe.step(inputs, target, loss_fn) first")
        text, self.plan.measured = step_report(self.plan, self.last_step, self.cpu_sharing())
        return text

    def cpu_sharing(self) -> Any:
        """How this pipeline's workers share the machine, as the report simulates it: the host's answer
        (:meth:`fxpipe.runtime.execute.host.Host.sharing`; for CPU workers :class:`fxpipe.cost.cpu.CpuSharing`, with
        each stage's speed beside the others measured at compile time); ``None`` where devices run on their own."""
        return self.host.sharing(self.plan, self.devices)

    def _refuse_short_batch(self, schedule: str, m: int, planned: int) -> None:
        """Refuse a batch of fewer samples than the ``planned`` micro-batches (it runs one micro-batch a sample)
        whose ``m`` micro-batches ``schedule`` cannot run, naming the batch: the schedule's own fix (another
        ``chunks``) does not change how many samples there are."""
        if m >= planned:
            return
        record, p, workers = get_schedule(schedule), len(self.specs), self._workers(schedule)
        try:
            record.check(p, workers, m)
        except ValueError as exc:
            need = (f"micro-batches in groups of its {workers} workers" if record.placement == "looped" else
                    f"at least as many micro-batches as its {p} stages")
            raise ValueError(f"this batch has {m} samples, fewer than the {planned} micro-batches planned, so it "
                             f"runs as {m} micro-batches of one sample; {schedule} runs {need}: give the step a "
                             f"batch of at least {planned} samples (a DataLoader's drop_last=True drops a short "
                             f"last batch)") from exc

    def _workers(self, schedule: str) -> int:
        return get_schedule(schedule).workers(len(self.specs), self.plan.workers)

    def schedule_table(self, schedule: str | None = None, micro_batches: int | None = None) -> str:
        """The operations of every worker in order, one line per worker.

        ``F3`` is the forward of micro-batch 3, ``B3`` its backward; a split backward
        (``zb-h1``, ``zb-v``) runs ``I3``, its input gradients, and ``W3``, its weight-gradient
        pass; with several stages per worker ``F3.5`` names stage 5.
        """
        schedule = schedule or self.schedule
        m, p, workers = micro_batches or self.chunks, len(self.specs), self._workers(schedule)
        lines = [f"{schedule}, {p} stages on {workers} workers, {m} micro-batches"]
        for w, order in enumerate(worker_orders(schedule, p, m, workers)):
            ops = " ".join(f"{kind}{i}" + (f".{k}" if workers != p else "") for kind, k, i in order)
            lines.append(f"worker {w} ({self.devices[w]}): {ops}")
        return "\n".join(lines)

    def _random_stages(self) -> list[bool]:
        """Which stages draw random numbers in the current train/eval mode (:mod:`fxpipe.runtime.backward.rng`)."""
        return [is_random(spec.module) for spec in self.specs]

    def extra_repr(self) -> str:
        return (f"stages={len(self.specs)}, chunks={self.chunks}, checkpoint={self.checkpoint!r}"
                + (f", compiled={self.compiled!r}" if self.compiled is not None else ""))
