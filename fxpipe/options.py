"""The knobs of ``fxpipe.compile`` that most users never touch, as two typed, immutable options objects.

:class:`ProfileOptions` says how the costs are measured (``profile=``; a string is its ``mode``);
:class:`CompileOptions` holds the rest (tracing, the memory limit, BatchNorm), as ``torch.compile`` keeps
its rarely used settings in ``options=``. Both validate themselves when made, so a wrong value fails
before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

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
    """

    concrete_args: dict[str, Any] | None = None
    deferred_batch_norm: bool = False
    optimizer_state_factor: float = 0.0
    memory_bytes: Sequence[float] | None = None

    def __post_init__(self) -> None:
        if self.optimizer_state_factor < 0:
            raise ValueError(f"optimizer_state_factor must be 0 or more, got {self.optimizer_state_factor!r}")
