"""Per-stage speeds inside a pipeline of workers that share processors, fitted to a measured step.

CPU workers of one process run on the same processors: beside each other an
operation is slowed by the cores it gets, the caches and the memory bandwidth
it shares, and the interpreter lock its Python holds; how much depends on the
operation (a bandwidth-bound classifier suffers more than a convolution, a
model of many small operations more than one of few large ones) and on what
runs beside it, which the schedule decides. :func:`fit_stage_speeds` takes
each stage's time alone and the median forward and backward of one
micro-batch measured in real steps of the same schedule, and finds the speed of
every stage's forward and backward while others run (the ``stage_efficiency``
of :func:`solvers.simulate.simulate`) for which the simulated step reproduces
those medians: a fixed point of ``speed *= simulated / measured``, one
simulation per round. An operation that never runs beside another in the
simulation, or takes no time, keeps speed 1 (nothing to fit). Speeds above 1 are kept: they say
the stage ran faster inside the step than it was timed alone (warm caches),
which the prediction should repeat.

Written here rather than handed to a library optimiser because each round is
one run of this project's own simulator and the update is exact for an
operation that always runs beside another (its duration is its time alone over
its speed).
"""

from __future__ import annotations

from typing import Sequence

from solvers.simulate import simulate, stage_medians

__all__ = ["fit_stage_speeds"]

_LOWEST, _HIGHEST = 0.05, 4.0


def fit_stage_speeds(fwd_s: Sequence[float], bwd_s: Sequence[float], measured: Sequence[Sequence[float]],
                     micro_batches: int, schedule: str, cores: float, workers: int | None = None,
                     slots: int | None = None, rounds: int = 30, tolerance: float = 1e-3) -> list[list[float]]:
    """Per stage ``[forward, backward]`` speed beside other operations (see the module doc) that makes
    :func:`solvers.simulate.simulate` give the ``measured`` ``(forward, backward)`` median per micro-batch
    of every stage, from the times alone ``fwd_s``, ``bwd_s``; ``cores``, ``workers`` and ``slots`` as for
    :func:`simulate`. Stops when every median is within ``tolerance`` (relative), or after ``rounds``."""
    p = len(fwd_s)
    if len(bwd_s) != p or len(measured) != p or any(len(pair) != 2 for pair in measured):
        raise ValueError(f"fit_stage_speeds needs a (forward, backward) measurement for each of the {p} stages")
    if any(x < 0 for pair in measured for x in pair):
        raise ValueError("measured stage times cannot be negative")
    alone = [[fwd_s[s], bwd_s[s]] for s in range(p)]
    # an operation that takes no time (the backward of a stage where nothing trains) has no speed to fit
    fitted_ops = [(s, j) for s in range(p) for j in (0, 1) if measured[s][j] > 0 and alone[s][j] > 0]

    def predict(speeds: list[list[float]]) -> list[tuple[float, float]]:
        sim = simulate(list(fwd_s), list(bwd_s), micro_batches, schedule, workers=workers, cores=cores,
                       stage_efficiency=speeds, slots=slots)
        return stage_medians(sim.timeline, p)
    speeds = [[1.0, 1.0] for _ in range(p)]
    best, best_error = [list(s) for s in speeds], float("inf")
    for _ in range(rounds):
        predicted = predict(speeds)
        ratios = {(s, j): predicted[s][j] / measured[s][j] for s, j in fitted_ops}
        error = max((abs(r - 1.0) for r in ratios.values()), default=0.0)
        if error < best_error:
            best, best_error = [list(s) for s in speeds], error
        if error <= tolerance:
            break
        for (s, j), r in ratios.items():
            speeds[s][j] = min(_HIGHEST, max(_LOWEST, speeds[s][j] * r))
    # an operation the simulation never runs beside another cannot be fitted: its speed there is 1
    fitted = predict(best)
    for s in range(p):
        for j in (0, 1):
            if best[s][j] != 1.0:
                trial = [list(pair) for pair in best]
                trial[s][j] = 1.0
                if abs(predict(trial)[s][j] - fitted[s][j]) <= 1e-9 * max(fitted[s][j], 1e-12):
                    best[s][j] = 1.0
    return best
