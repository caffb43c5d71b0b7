"""Cost-model fidelity: predicted against measured stage times on CPU workers.

For each model, worker count (2, 4) and schedule (GPipe, 1F1B): compile with
measured per-node profiles, run ``--steps`` training steps with ``pipe.step``
(the first is a warm-up), and compare every stage's predicted forward and
backward time per micro-batch with the median measured in the steps (see
``Pipeline.report``). Beside it, the analytic prediction: the same graph costed
under ``FakeTensorMode`` with this CPU's roofline (``Devices.preset("cpu")``,
a one-second microbenchmark). ``shared`` is the same measured profile put
through the simulator with the workers sharing this machine's cores
(cores per worker from :mod:`fxpipe.cost.cpu.sharing`, and each stage's speed beside
the others, fitted at compile time to a few steps of the plan's schedule by
:mod:`fxpipe.refine.contention`), as ``pipe.report()`` predicts: the steps measured
here are later ones, after the compile. Then ``calibrate=True``: the plan made again on
stage times measured in two earlier steps, run and compared the same way.
Peak memory per worker: :mod:`fxpipe.planning.memory_model` (on the stage sizes
measured at compile time through the real loss, :mod:`fxpipe.refine.stage_memory`)
against a profiled replay of the step (:mod:`fxpipe.runtime.execute.memory_probe`). Prints one row per (model, workers, schedule,
stage) and the median and 90th percentile of the absolute errors; ``run-to-run``
is how far the median of the first half of the measured steps is from that of
the second half, the measurement's own reproducibility on this machine.

    python benchmarks/fidelity.py [--steps 4] [--models resnet18 ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torchvision
from torch import nn

import fxpipe
from fxpipe.cost.devices import calibrate_cpu
from fxpipe.cost.cpu.sharing import cpu_sharing
from fxpipe.planning.memory_model import predict_worker_memory
from fxpipe.planning.report import per_micro_batch, predicted_times
from fxpipe.cost.profile import profile_graph

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from models import SkipTied  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from allocator import keep_freed_memory  # noqa: E402
from make_problems import UNet  # noqa: E402


def _vgg11():
    return torchvision.models.vgg11(dropout=0.0)


MODELS = {   # name -> (model, inputs, target, loss)
    "resnet18": (lambda: torchvision.models.resnet18(), lambda: torch.randn(32, 3, 64, 64),
                 lambda: torch.randint(0, 1000, (32,)), nn.functional.cross_entropy),
    "vgg11": (_vgg11, lambda: torch.randn(16, 3, 64, 64), lambda: torch.randint(0, 1000, (16,)),
              nn.functional.cross_entropy),
    "googlenet": (lambda: torchvision.models.googlenet(aux_logits=False, init_weights=False),
                  lambda: torch.randn(16, 3, 64, 64), lambda: torch.randint(0, 1000, (16,)),
                  nn.functional.cross_entropy),
    "transformer": (lambda: SkipTied(vocab=512, width=256, depth=8), lambda: torch.randint(0, 512, (32, 64)),
                    lambda: torch.randint(0, 512, (32, 64)),
                    lambda out, t: nn.functional.cross_entropy(out.reshape(-1, 512), t.reshape(-1))),
    "mobilenet_v3": (lambda: torchvision.models.mobilenet_v3_small(), lambda: torch.randn(32, 3, 64, 64),
                     lambda: torch.randint(0, 1000, (32,)), nn.functional.cross_entropy),
    "unet": (lambda: UNet(), lambda: torch.randn(8, 3, 64, 64), lambda: torch.randint(0, 2, (8, 64, 64)),
             nn.functional.cross_entropy),
}


def run(pipe: fxpipe.Pipeline, x: torch.Tensor, y: torch.Tensor, loss_fn, steps: int) -> list[list]:
    """The timings of each of ``steps - 1`` steps after a warm-up."""
    timings = []
    for step in range(steps):
        pipe.step(x, y, loss_fn)
        if step:
            timings.append(pipe.last_step["timings"])
    return timings


def medians(steps: list[list], stage: int) -> tuple[float, float]:
    """Median forward and backward (B plus W) seconds per micro-batch of ``stage`` over the steps."""
    fwd, bwd = [], []
    for timings in steps:
        f, b = per_micro_batch([(t.kind, t.micro_batch, t.end_s - t.start_s) for t in timings if t.stage == stage])
        fwd += f
        bwd += b
    return statistics.median(fwd), statistics.median(bwd)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=7,
                        help="training steps per pipeline; the first is a warm-up, the rest are measured")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--allocator", default="keep", choices=("keep", "default"),
                        help="keep: glibc keeps freed memory mapped (benchmarks/allocator.py), so neither the "
                             "profile nor the steps pay page faults; default: the environment as it is")
    args = parser.parse_args(argv)
    if args.allocator == "keep" and argv is None:
        keep_freed_memory()
    torch.set_num_threads(args.threads)
    cpu = calibrate_cpu()
    print(f"CPU roofline: {cpu.flops['float32'] / 1e9:.1f} GFLOP/s, {cpu.memory_bandwidth_Bps / 1e9:.1f} GB/s, "
          f"{args.threads} thread(s) per worker, allocator: {args.allocator}")
    print(f"{'model':<13} {'w':>1} {'sched':<5} {'st':>2}  {'fwd pred':>8} {'meas':>7} {'err':>5}  "
          f"{'bwd pred':>8} {'meas':>7} {'err':>5}  {'analytic f':>10} {'err':>5}  {'shared f/b':>11}  "
          f"{'calibrated':>11}  "
          f"{'mem MiB':>7} {'pred':>7} {'err':>5}")
    analytic_err, memory_err = [], []
    by_workers: dict[int, dict[str, list[float]]] = {}   # workers -> prediction kind -> absolute errors
    machine = cpu_sharing()
    print(f"CPU sharing: {machine.cores:g} cores (in units of one worker's threads), "
          f"{machine.parallel_efficiency:.0%} parallel efficiency of two workers on a synthetic mix; the shared "
          f"prediction uses each plan's own stage speeds beside the others, measured at compile time (# lines)")
    for name in args.models:
        build, make_x, make_y, loss_fn = MODELS[name]
        for workers in (2, 4):
            for schedule in ("gpipe", "1f1b"):
                torch.manual_seed(0)
                model = build().train()
                x, y = make_x(), make_y()
                pipe = fxpipe.compile(model, ["cpu"] * workers, (x,), chunks=4, stages=workers, schedule=schedule,
                                      checkpoint="never", profile=fxpipe.ProfileOptions(effort="thorough",
                                      cache=False, loss_fn=loss_fn, example_target=y))
                timings = run(pipe, x, y, loss_fn, args.steps)
                pipe.step(x, y, loss_fn, measure_memory=True)
                memory = pipe.last_step["memory"]
                predicted_memory = predict_worker_memory(pipe.plan, schedule)
                calibrated = fxpipe.compile(model, ["cpu"] * workers, (x,), chunks=4, stages=workers,
                                            schedule=schedule, checkpoint="never",
                                            profile=fxpipe.ProfileOptions(effort="thorough", calibrate=True,
                                            loss_fn=loss_fn, example_target=y))
                cal_timings = run(calibrated, x, y, loss_fn, args.steps)
                # Analytic costs of the same graph, summed per stage.
                analytic = profile_graph(fxpipe.trace(model), (x[: x.shape[0] // 4],), torch.device("cpu"),
                                         mode="analytic", spec=cpu)
                sharing = pipe.cpu_sharing()
                _, shared = predicted_times([st.fwd_s for st in pipe.plan.stages],
                                            [st.bwd_s for st in pipe.plan.stages], pipe.chunks, schedule, workers,
                                            sharing)
                print(f"# {name} {workers} {schedule}: stages run beside the others at "
                      f"{sharing.parallel_efficiency:.0%} of their speed alone (median)")
                for st in pipe.plan.stages:
                    fwd, bwd = medians(timings, st.index)
                    sf, sb = shared[st.index]
                    esf, esb = (sf - fwd) / fwd, (sb - bwd) / bwd
                    errors = by_workers.setdefault(workers, {"shared": [], "measured": [], "calibrated": [],
                                                             "run-to-run": []})
                    errors["shared"] += [abs(esf), abs(esb)]
                    half = len(timings) // 2    # how well the measurement reproduces itself: one half vs the other
                    if half:
                        (f1, b1), (f2, b2) = medians(timings[:half], st.index), medians(timings[half:], st.index)
                        errors["run-to-run"] += [abs(f2 - f1) / fwd, abs(b2 - b1) / bwd]
                    a_fwd = sum(analytic[n].fwd_s for n in st.nodes)
                    ef, eb, ea = (st.fwd_s - fwd) / fwd, (st.bwd_s - bwd) / bwd, (a_fwd - fwd) / fwd
                    errors["measured"] += [abs(ef), abs(eb)]
                    analytic_err.append(abs(ea))
                    cst = calibrated.plan.stages[st.index]
                    cf, cb = medians(cal_timings, st.index)
                    ecf, ecb = (cst.fwd_s - cf) / cf, (cst.bwd_s - cb) / cb
                    errors["calibrated"] += [abs(ecf), abs(ecb)]
                    em = (predicted_memory[st.index].activation_bytes - memory[st.index]) / memory[st.index]
                    memory_err.append(abs(em))
                    print(f"{name:<13} {workers:>1} {schedule:<5} {st.index:>2}  {st.fwd_s * 1e3:8.2f} {fwd * 1e3:7.2f} "
                          f"{ef:+5.0%}  {st.bwd_s * 1e3:8.2f} {bwd * 1e3:7.2f} {eb:+5.0%}  {a_fwd * 1e3:10.2f} "
                          f"{ea:+5.0%}  {esf:+5.0%} {esb:+5.0%}  {ecf:+5.0%} {ecb:+5.0%}  {memory[st.index] / 2**20:7.1f} "
                          f"{predicted_memory[st.index].activation_bytes / 2**20:7.1f} {em:+5.0%}", flush=True)
    measured_err, shared_err, calibrated_err = ([e for errors in by_workers.values() for e in errors[kind]]
                                                for kind in ("measured", "shared", "calibrated"))
    print(f"\nmeasured-profile stage time error (forward and backward): median {statistics.median(measured_err):.1%}, "
          f"p90 {percentile(measured_err, 0.9):.1%} over {len(measured_err)}")
    print(f"measured profile with CPU sharing (as pipe.report()): median {statistics.median(shared_err):.1%}, "
          f"p90 {percentile(shared_err, 0.9):.1%} over {len(shared_err)}")
    for workers, errors in sorted(by_workers.items()):
        print(f"  {workers} workers: " + ", ".join(f"{kind} median {statistics.median(v):.1%} p90 {percentile(v, 0.9):.1%}"
                                                for kind, v in errors.items() if v))
    print(f"analytic (roofline) forward error: median {statistics.median(analytic_err):.1%}, "
          f"p90 {percentile(analytic_err, 0.9):.1%} over {len(analytic_err)}")
    print(f"calibrated plan (calibrate=True) stage time error: median {statistics.median(calibrated_err):.1%}, "
          f"p90 {percentile(calibrated_err, 0.9):.1%} over {len(calibrated_err)}")
    print(f"peak activation memory per worker (model vs profiled replay): median {statistics.median(memory_err):.1%}, "
          f"p90 {percentile(memory_err, 0.9):.1%}, within 5%: {sum(e <= 0.05 for e in memory_err)}/{len(memory_err)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
