"""The knobs of ``fxpipe.compile`` that most users never touch, as two typed, immutable options objects.

:class:`ProfileOptions` says how the costs are measured (``profile=``; a string is its ``mode``);
:class:`CompileOptions` holds the rest (tracing, the memory limit, BatchNorm), as ``torch.compile`` keeps
its rarely used settings in ``options=``. Both validate themselves when made, so a wrong value fails
before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["COMPILE_MODES", "CONTENTION_STEPS", "CompileOptions", "ProfileOptions"]

COMPILE_MODES = ("measure", "estimate")   # cost.profile also has "analytic", for fxpipe.plan()
CONTENTION_STEPS = 3


def _whole(name: str, value: Any, least: int, unit: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be a whole number{unit}, {least} or more, got {value!r}")


@dataclass(frozen=True)
class ProfileOptions:
    """How ``fxpipe.compile`` measures what the model costs.

    Attributes:
        mode: ``"measure"`` (time every node on the first device) or ``"estimate"`` (FLOP count, fast).
        warmup, repeats: untimed and timed runs per node (and per stage with ``stage_timing``).
        stage_timing: with ``mode="measure"``, also time every stage of the plan as a whole (a fused
            group, alone, forward and backward into ``.grad``), scale its nodes' costs to that and solve
            again until the cuts stop moving (at most 3 rounds; :mod:`fxpipe.refine.stage_profile`); then
            measure every stage's memory for the memory model (:mod:`fxpipe.refine.stage_memory`) and, for
            CPU workers that share the processors, how much slower each stage runs beside the others
            (:mod:`fxpipe.refine.contention`).
        contention_steps: timed training steps of that contention measurement (each costs one step of
            the full batch); 0 skips it and the report falls back on a synthetic figure.
        calibrate: close the loop in training steps: run ``calibration_steps`` steps of the plan, scale
            every node's time by its stage's measured/predicted ratio and solve again until the cuts stop
            moving (:mod:`fxpipe.refine.calibrate`; ``plan.profile["calibration"]``).
        calibration_steps: training steps per calibration round.
        cache: reuse node costs profiled before for the same graph, device, micro-batch shapes, mode and
            thread count (``True``: ``$FXPIPE_CACHE_DIR`` or ``~/.cache/fxpipe/profiles``; a path;
            ``False``: always profile).
        progress: print a profiling progress bar on stderr.
    """

    mode: str = "measure"
    warmup: int = 1
    repeats: int = 3
    stage_timing: bool = True
    contention_steps: int = CONTENTION_STEPS
    calibrate: bool = False
    calibration_steps: int = 2
    cache: bool | str = True
    progress: bool = False

    def __post_init__(self) -> None:
        if self.mode not in COMPILE_MODES:
            raise ValueError(f"profile mode must be one of {', '.join(COMPILE_MODES)}, got {self.mode!r}")
        _whole("warmup", self.warmup, 0)
        _whole("repeats", self.repeats, 1)
        _whole("contention_steps", self.contention_steps, 0, " of steps")
        _whole("calibration_steps", self.calibration_steps, 1, " of steps")

    @classmethod
    def of(cls, profile: "str | ProfileOptions") -> "ProfileOptions":
        """``profile=`` as given to ``compile``: a mode string or the options themselves."""
        if isinstance(profile, ProfileOptions):
            return profile
        if isinstance(profile, str):
            return cls(mode=profile)
        raise TypeError(f"profile must be 'measure', 'estimate' or fxpipe.ProfileOptions(...), got {profile!r}")

    @property
    def measures_stages(self) -> bool:
        """Whether the compiled stages are timed and measured after the first plan."""
        return self.mode == "measure" and self.stage_timing


@dataclass(frozen=True)
class CompileOptions:
    """Rarely needed settings of ``fxpipe.compile``.

    Attributes:
        concrete_args: tracing option (see :func:`fxpipe.frontend.trace.trace`).
        deferred_batch_norm: in training, update BatchNorm running statistics once per mini-batch
            from all its micro-batches (:mod:`fxpipe.runtime.batchnorm`, as torchgpipe) instead of once
            per micro-batch; the user's buffers are updated in place.
        optimizer_state_factor: optimizer state per parameter byte (Adam: 2) for the memory limit.
        memory_bytes: per-device memory override for the memory limit.
        batch_dim: the dimension of the inputs that holds the samples, split into micro-batches: one
            number for every input (``1`` for a sequence-first ``nn.LSTM``/``nn.TransformerEncoder``,
            ``batch_first=False``), a sequence (one per forward argument, in order) or a dict by forward
            argument name (missing ones: 0).
        check_micro_batching: with ``chunks > 1``, run the example batch whole and as micro-batches at
            compile (eval mode, no gradients) and refuse a model whose outputs differ
            (:mod:`fxpipe.runtime.batch_check`). ``False`` for a model whose micro-batches are meant to be
            successive calls (one whose forward reads a buffer it updates from its batch, as the pipeline
            then does once per micro-batch, in order).
        output_batch_dim, target_batch_dim: the dimension the outputs are gathered along and the one
            ``pipe.step``'s target is split along; default: ``batch_dim`` when all inputs share one, else 0
            (the target: the output's).
    """

    concrete_args: dict[str, Any] | None = None
    deferred_batch_norm: bool = False
    optimizer_state_factor: float = 0.0
    memory_bytes: Sequence[float] | None = None
    batch_dim: int | Sequence[int] | Mapping[str, int] = 0
    output_batch_dim: int | None = None
    target_batch_dim: int | None = None
    check_micro_batching: bool = True

    def __post_init__(self) -> None:
        if self.optimizer_state_factor < 0:
            raise ValueError(f"optimizer_state_factor must be 0 or more, got {self.optimizer_state_factor!r}")
        dims = self.batch_dim
        values = (list(dims.values()) if isinstance(dims, Mapping) else
                  [dims] if isinstance(dims, int) else list(dims) if isinstance(dims, (list, tuple)) else [dims])
        if isinstance(dims, Mapping) and not all(isinstance(k, str) for k in dims):
            raise ValueError(f"batch_dim as a dict maps forward argument names to dimensions, got {dims!r}")
        for name, value in [("batch_dim", v) for v in values] + [("output_batch_dim", self.output_batch_dim),
                                                                 ("target_batch_dim", self.target_batch_dim)]:
            if value is not None:
                _whole(name, value, 0, " (a dimension; negative ones are not accepted)")
