"""The knobs of ``fxpipe.compile`` that most users never touch, as two typed, immutable options objects.

:class:`ProfileOptions` says how the costs are measured (``profile=``; a string is its ``mode``);
:class:`CompileOptions` holds the rest (tracing, the memory limit, BatchNorm), as ``torch.compile`` keeps
its rarely used settings in ``options=``. Both validate themselves when made, so a wrong value fails
before anything runs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch.utils._pytree import tree_flatten
from fxpipe.compression_spec import check_compression

__all__ = ["COMPILE_MODES", "CONTENTION_STEPS", "EFFORTS", "FRONTENDS", "TIMINGS", "CompileOptions", "ProfileOptions",
           "stage_compile_kwargs"]

FRONTENDS = ("auto", "export", "fx")   # the front ends of fxpipe.frontend.capture
COMPILE_MODES = ("measure", "estimate")   # cost.profile also has "analytic", for fxpipe.plan()
TIMINGS = ("graph", "node")   # how "measure" times the nodes (fxpipe.cost.graph_timing)
CONTENTION_STEPS = 3
# What each effort sets, unless given explicitly. "fast" times every node once after one untimed run (about one
# training step of the model in all) and plans on that; "thorough" adds the rounds that time whole stages, their
# memory and their contention (each round and the contention about one to two training steps more).
EFFORTS: dict[str, dict[str, Any]] = {
    "fast": {"warmup": 1, "repeats": 1, "stage_timing": False, "contention_steps": 0},
    "thorough": {"warmup": 1, "repeats": 3, "stage_timing": True, "contention_steps": CONTENTION_STEPS},
}


def _whole(name: str, value: Any, least: int, unit: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be a whole number{unit}, {least} or more, got {value!r}")


@dataclass(frozen=True)
class ProfileOptions:
    """How ``fxpipe.compile`` measures what the model costs.

    Attributes:
        mode: ``"measure"`` (time every node on the first device) or ``"estimate"`` (FLOP count, fast).
        effort: ``"fast"`` (default) or ``"thorough"``: the defaults of ``warmup``, ``repeats``,
            ``stage_timing`` and ``contention_steps`` (:data:`EFFORTS`); a field given explicitly wins.
            ``"fast"`` times each node once after a warm-up and plans on the sum: a ResNet-50 compiles in
            about one training step. ``"thorough"`` (``profile="thorough"``) is three timed runs per node,
            then the stage-timing rounds, each stage's measured memory and, for CPU workers, their
            contention: several training steps more, for stage times measured whole (per-node sums are
            10-30 % off on a CPU) and memory measured rather than estimated.
        warmup, repeats: untimed and timed runs per node (and per stage with ``stage_timing``).
        timing: how ``mode="measure"`` times the nodes: ``"node"`` (each alone, synchronised around it) or
            ``"graph"`` (whole-graph runs as in a step, a clock mark per node and no synchronisation between
            them; the backward apportioned: :mod:`fxpipe.cost.graph_timing`). ``None`` (default): ``"graph"``
            on CUDA, where per-node synchronisation counted launch latency a step never pays, ``"node"``
            on CPU.
        stage_timing: (thorough) with ``mode="measure"``, also time every stage of the plan as a whole (a fused
            group, alone, forward and backward into ``.grad``), scale its nodes' costs to that and solve
            again until the cuts stop moving (at most 3 rounds; :mod:`fxpipe.refine.stage_profile`); then
            measure every stage's memory for the memory model (:mod:`fxpipe.refine.stage_memory`) and, for
            CPU workers that share the processors, how much slower each stage runs beside the others
            (:mod:`fxpipe.refine.contention`). Compiled stages (``CompileOptions.compile_stages``) are timed
            compiled in any case (at ``effort="fast"``: two rounds at most, without the memory and contention
            measurements).
        contention_steps: timed training steps of that contention measurement (each costs one step of
            the full batch); 0 skips it and the report falls back on a synthetic figure.
        calibrate: close the loop in training steps: run ``calibration_steps`` steps of the plan, scale
            every node's time by its stage's measured/predicted ratio and solve again until the cuts stop
            moving (:mod:`fxpipe.refine.calibrate`; ``plan.profile["calibration"]``).
        calibration_steps: training steps per calibration round.
        cache: reuse node costs profiled before for the same graph, device, micro-batch shapes, mode and
            thread count (``True``: ``$FXPIPE_CACHE_DIR`` or ``~/.cache/fxpipe/profiles``; a path;
            ``False``: always profile).
        progress: a tqdm bar of the node profiling on stderr when it is a terminal (quiet otherwise); the
            time it took is logged at INFO under the ``fxpipe`` logger either way.
        loss_fn, example_target: the training loss and a full batch's target (both or neither), what the
            measurement runs through: with ``effort="thorough"`` the last stage's memory and time are measured,
            and calibration times it, through the real loss; without them (and with the default
            ``effort="fast"``, which measures neither) the loss's buffers are estimated (a softmax
            cross-entropy's). The pipeline's own loss is :meth:`fxpipe.Pipeline.step`'s.
    """

    mode: str = "measure"
    effort: str = "fast"
    warmup: int | None = None            # None: the effort's (filled in when made)
    repeats: int | None = None
    timing: str | None = None            # None: "graph" on CUDA, "node" elsewhere
    stage_timing: bool | None = None
    contention_steps: int | None = None
    calibrate: bool = False
    calibration_steps: int = 2
    cache: bool | str = True
    progress: bool = False
    loss_fn: Callable[[Any, Any], Any] | None = field(default=None, compare=False)
    example_target: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if (self.loss_fn is None) != (self.example_target is None):
            raise ValueError("pass loss_fn and example_target together (the loss and a full batch's target, used to "
                             "measure the last stage's memory), or neither")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise ValueError(f"loss_fn must be callable as loss_fn(output, target), got {self.loss_fn!r}")
        if self.mode not in COMPILE_MODES:
            raise ValueError(f"profile mode must be one of {', '.join(COMPILE_MODES)}, got {self.mode!r}")
        if self.effort not in EFFORTS:
            raise ValueError(f"effort must be one of {', '.join(map(repr, EFFORTS))}, got {self.effort!r}")
        given = {name for name in EFFORTS[self.effort] if getattr(self, name) is not None}
        for name, value in EFFORTS[self.effort].items():
            if name not in given:
                object.__setattr__(self, name, value)   # frozen: filled in once, here
        if self.timing is not None and self.timing not in TIMINGS:
            raise ValueError(f"timing must be one of {', '.join(map(repr, TIMINGS))} or None, got {self.timing!r}")
        _whole("warmup", self.warmup, 0)
        _whole("repeats", self.repeats, 1)
        _whole("contention_steps", self.contention_steps, 0, " of steps")
        _whole("calibration_steps", self.calibration_steps, 1, " of steps")
        if "contention_steps" in given and self.contention_steps and not self.stage_timing:
            raise ValueError(f"contention_steps={self.contention_steps!r} is measured after stage timing, which "
                             f"effort={self.effort!r} leaves off: pass effort='thorough' or stage_timing=True")

    @classmethod
    def of(cls, profile: "str | ProfileOptions") -> "ProfileOptions":
        """``profile=`` as given to ``compile``: a mode string or the options themselves."""
        if isinstance(profile, ProfileOptions):
            return profile
        if isinstance(profile, str) and profile in EFFORTS:
            return cls(effort=profile)
        if isinstance(profile, str):
            return cls(mode=profile)
        raise TypeError(f"profile must be 'measure', 'estimate', 'fast', 'thorough' or fxpipe.ProfileOptions(...), "
                        f"got {profile!r}")

    @property
    def measures_stages(self) -> bool:
        """Whether the compiled stages are timed and measured after the first plan."""
        return self.mode == "measure" and self.stage_timing


@dataclass(frozen=True)
class CompileOptions:
    """Rarely needed settings of ``fxpipe.compile`` (and of ``fxpipe.plan`` and ``PipelineRank``, which take the
    same record).

    Attributes:
        frontend: ``"auto"`` (default), ``"fx"`` or ``"export"`` (:mod:`fxpipe.frontend.capture`): auto uses
            torch.fx where it traces the model faithfully and ``torch.export`` otherwise (a model fx cannot
            trace, keyword inputs, a torch.nn stack of layers fx would keep whole such as
            ``nn.TransformerEncoder``); ``plan.frontend`` and ``plan.summary()`` say which and why. A
            Hugging Face config's ``use_cache=True`` is off while tracing (no generation cache is returned).
        leaf_modules: module types or qualified names traced as one node each, kept whole in one stage (see
            :func:`fxpipe.trace`).
        concrete_args: tracing option (see :func:`fxpipe.frontend.trace.trace`).
        deferred_batch_norm: in training, update BatchNorm running statistics once per mini-batch
            from all its micro-batches (:mod:`fxpipe.runtime.execute.batchnorm`, as torchgpipe) instead of once
            per micro-batch; the user's buffers are updated in place.
        optimizer_state_factor: optimizer state per parameter byte (Adam: 2) for the memory limit.
        memory_bytes: per-device memory override for the memory limit.
        batch_dim: the dimension of the inputs that holds the samples, split into micro-batches: one
            number for every input (``1`` for a sequence-first ``nn.LSTM``/``nn.TransformerEncoder``,
            ``batch_first=False``), a sequence (one per forward argument, in order) or a dict by forward
            argument name (missing ones: 0). With the torch.export front end a name may be a keyword
            input's, and a nested input may take the same structure of numbers (one per tensor).
        check_micro_batching: with ``chunks > 1``, run the example batch whole and as micro-batches at
            compile (eval mode, no gradients) and refuse a model whose outputs differ
            (:mod:`fxpipe.runtime.checks.batch_check`). ``False`` for a model whose micro-batches are meant to be
            successive calls (one whose forward reads a buffer it updates from its batch, as the pipeline
            then does once per micro-batch, in order).
        output_batch_dim, target_batch_dim: the dimension the outputs are gathered along and the one
            ``pipe.step``'s target is split along; default: ``batch_dim`` when all inputs share one, else 0
            (the target: the output's).
        keep_blocks_whole: plan every repeated block (the layers of a transformer, the blocks of a CNN
            stage) in one stage, cutting inside blocks only when no such plan exists
            (:mod:`fxpipe.planning.grouped`; the plan summary's "kept whole" says which). ``False`` lets the
            planner cut between any two operations.
        compression: trade exactness for bytes at stage boundaries in ``pipe.step``: ``None`` (default,
            exact), ``"fp16"``, ``"bf16"``, ``"int8"`` (``"int8:channel"``, ``"int8:stochastic"``) or
            ``"topk:R"`` (the share ``R`` of largest magnitudes; gradients with error feedback) for the
            activations that cross a boundary and their gradients, ``"FORWARD/BACKWARD"`` for one codec each
            way (``"int8/topk:0.01"``; ``"fp32"``: exact), or a dict ``{stage: name}`` for the boundary after
            that stage (:mod:`fxpipe.runtime.boundaries.compression`). ``pipe(x)`` stays exact. The planner costs the
            compressed bytes; ``plan.summary()`` lists each boundary's bytes before and after.
        compile_stages: ``torch.compile`` each stage module after partitioning (:mod:`fxpipe.runtime.execute.compiled`):
            ``True`` (torch.compile's defaults), a dict of ``torch.compile`` keyword arguments
            (``{"mode": "max-autotune", "fullgraph": True}``), ``False`` (eager stages), or ``None`` (default):
            as the model, that is compiled with its own options when ``fxpipe.compile`` is given a
            ``torch.compile(model, ...)``. The stages are timed compiled before the final plan, the compile time
            is reported apart (``plan.compiled``, ``plan.summary()``), and ``zb-h1``/``zb-v`` are refused
            (their split backward would run a compiled backward twice).
        precision: what the parameters are kept in and the step computes in (:mod:`fxpipe.frontend.precision`):
            ``"bf16-mixed"`` (float32 parameters, gradients and optimizer state; forward and backward in
            bfloat16, as FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``; a float32
            model), or the model as it is built, ``"fp32"`` / ``"bf16"`` / ``"fp16"`` (the model's dtype, checked).
            ``None`` (default): for :func:`fxpipe.plan` on devices that compute bfloat16 faster than float32 (an
            H100 or A100 preset, not a V100), ``"bf16-mixed"`` for a float32 model; otherwise (``fxpipe.compile``'s
            measured plans too) the model's own dtype. The plan records it
            (``plan.layout.precision``, the summary's ``precision:`` line) and the ranks run it.
        time_limit_s: the cut solver's limit per solve; ``None`` (default): ``fxpipe.compile``'s 10 s,
            ``fxpipe.plan``'s 2 s (its auto search solves once or twice per schedule and micro-batch count; a
            search stopped by it says so with its gap in the plan).
    """

    frontend: str = "auto"
    leaf_modules: Iterable[type | str] = ()
    concrete_args: dict[str, Any] | None = None
    deferred_batch_norm: bool = False
    optimizer_state_factor: float = 0.0
    memory_bytes: Sequence[float] | None = None
    batch_dim: int | Sequence[int] | Mapping[str, int] = 0
    output_batch_dim: int | None = None
    target_batch_dim: int | None = None
    check_micro_batching: bool = True
    keep_blocks_whole: bool = True
    compression: str | Mapping[int, str] | None = None
    compile_stages: bool | Mapping[str, Any] | None = None
    precision: str | None = None
    time_limit_s: float | None = None

    def __post_init__(self) -> None:
        from solvers.layout import PRECISIONS   # torch-free: the layout record's spellings

        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} or None (the default: bf16-mixed "
                             f"for GPU presets in fxpipe.plan, else the model's own dtype), got {self.precision!r}")
        if self.frontend not in FRONTENDS:
            raise ValueError(f"frontend must be one of {', '.join(FRONTENDS)}, got {self.frontend!r}")
        if isinstance(self.leaf_modules, (str, type)):
            raise ValueError(f"leaf_modules is a list of module types or qualified names, got {self.leaf_modules!r}: "
                             f"pass [{self.leaf_modules!r}]" if isinstance(self.leaf_modules, str) else
                             f"leaf_modules is a list of module types or qualified names, got "
                             f"{self.leaf_modules.__name__}: pass [{self.leaf_modules.__name__}]")
        object.__setattr__(self, "leaf_modules", tuple(self.leaf_modules))   # frozen: a list given becomes a tuple
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s must be a positive number of seconds or None, got {self.time_limit_s!r}")
        check_compression(self.compression)   # ValueError naming the allowed codecs
        stage_compile_kwargs(self.compile_stages)   # ValueError for a key torch.compile does not take
        if self.optimizer_state_factor < 0:
            raise ValueError(f"optimizer_state_factor must be 0 or more, got {self.optimizer_state_factor!r}")
        dims = self.batch_dim
        values = (tree_flatten(list(dims.values()))[0] if isinstance(dims, Mapping) else
                  [dims] if isinstance(dims, int) else list(dims) if isinstance(dims, (list, tuple)) else [dims])
        if isinstance(dims, Mapping) and not all(isinstance(k, str) for k in dims):
            raise ValueError(f"batch_dim as a dict maps forward argument names to dimensions, got {dims!r}")
        for name, value in [("batch_dim", v) for v in values] + [("output_batch_dim", self.output_batch_dim),
                                                                 ("target_batch_dim", self.target_batch_dim)]:
            if value is not None:
                _whole(name, value, 0, " (a dimension; negative ones are not accepted)")


def stage_compile_kwargs(value: bool | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``CompileOptions.compile_stages`` as ``torch.compile`` keyword arguments: ``None`` for eager stages (or
    "as the model", decided by the caller), ``{}`` for ``True`` (torch.compile's defaults), a copy of a dict.
    Raises ``ValueError`` for another value or a key ``torch.compile`` does not take."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"compile_stages must be True, False, None or a dict of torch.compile keyword arguments "
                         f"({{'mode': 'max-autotune'}}), got {value!r}")
    allowed = [name for name in inspect.signature(torch.compile).parameters if name != "model"]
    unknown = sorted(map(str, set(value) - set(allowed)))
    if unknown:
        raise ValueError(f"compile_stages has {', '.join(map(repr, unknown))}, which torch.compile does not take; "
                         f"its keyword arguments are {', '.join(allowed)}")
    try:   # torch.compile checks its arguments when called (a backend's name, mode with options), compiles later
        torch.compile(_nothing, **value)
    except Exception as exc:
        raise ValueError(f"compile_stages={dict(value)!r}: torch.compile refuses it: {exc}") from exc
    return dict(value)


def _nothing() -> None:
    return None
