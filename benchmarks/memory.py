"""Peak memory per worker, measured: GPipe vs 1F1B vs ZB-H1, with and without checkpointing.

For each model, schedule and checkpoint mode, one training step's operations of
every worker are replayed alone under ``torch.profiler`` with ``profile_memory``
(:mod:`fxpipe.runtime.execute.memory_probe`): the peak of the allocator's running total is that
worker's peak memory above its parameters and gradients, i.e. activations plus
the transient buffers of forward, loss and backward. Beside it, the planner's
prediction (:mod:`fxpipe.planning.memory_model`): the worker's schedule walked with each
stage's sizes measured at compile time (:mod:`fxpipe.refine.stage_memory`: what one
micro-batch keeps from forward to backward, what each operation allocates on
top, with and without checkpointing and split backward; the loss is the real
one, passed to ``compile``), and the error of the estimate made from per-node
sizes alone (``est``: saved activations, boundary values, twice the largest
node output as workspace). Errors are (predicted - measured) / measured.

    python benchmarks/memory.py                      # transformer and resnet50, 2 and 4 workers
    python benchmarks/memory.py --models transformer --workers 2
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import fxpipe  # noqa: E402
from fxpipe.planning.memory_model import predict_worker_memory  # noqa: E402
from fxpipe.runtime.execute.memory_probe import measure_worker_memory  # noqa: E402
from speed import build, leaves  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
MODES = ("never", "except_last", "always")
ERRORS: list[float] = []
EST_ERRORS: list[float] = []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["transformer", "resnet50"])
    parser.add_argument("--workers", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    print(f"batch {args.batch} in {args.chunks} micro-batches; MiB above parameters and gradients; "
          f"fxpipe {fxpipe.__version__}, torch {torch.__version__}, cpu")
    for name in args.models:
        ns = argparse.Namespace(model=name, batch=args.batch, image_size=args.image_size, chunks=args.chunks)
        for workers in args.workers:
            model, x, y, loss_fn = build(ns)
            rows = []
            for checkpoint in MODES:
                pipe = fxpipe.compile(model, ["cpu"] * workers, (x,), chunks=args.chunks, stages=workers,
                                      checkpoint=checkpoint, profile=fxpipe.ProfileOptions(effort='thorough',
                                      loss_fn=loss_fn, example_target=y),
                                      options=fxpipe.CompileOptions(leaf_modules=leaves(ns)))   # measured memory
                estimated_plan = copy.deepcopy(pipe.plan)
                for st in estimated_plan.stages:
                    st.measured_bytes = None
                for schedule in SCHEDULES:
                    measured = measure_worker_memory(pipe, x, y, loss_fn, schedule=schedule)
                    predicted = predict_worker_memory(pipe.plan, schedule)
                    estimated = predict_worker_memory(estimated_plan, schedule)
                    cells = []
                    for w, pred, est in zip(measured, predicted, estimated):
                        error = (pred.activation_bytes - w.peak_bytes) / w.peak_bytes
                        est_error = (est.activation_bytes - w.peak_bytes) / w.peak_bytes
                        ERRORS.append(abs(error))
                        EST_ERRORS.append(abs(est_error))
                        cells.append(f"{w.peak_bytes / 2**20:7.1f} {pred.activation_bytes / 2**20:7.1f} {error:+4.0%}"
                                     f" {est_error:+4.0%}")
                    total = sum(w.peak_bytes for w in measured)
                    rows.append((f"{schedule}/{checkpoint}", cells, total))
            print(f"\n{name}, {workers} workers: peak MiB per worker, measured / predicted / error / est error")
            head = f"{'schedule/checkpoint':<20}  " + "  ".join(f"{'worker ' + str(k):>26}" for k in range(workers))
            print("=" * len(head) + "  " + "=" * 9)
            print(head + "  total MiB")
            print("=" * len(head) + "  " + "=" * 9)
            for label, cells, total in rows:
                print(f"{label:<20}  " + "  ".join(f"{c:>26}" for c in cells) + f"  {total / 2**20:9.1f}")
            print("=" * len(head) + "  " + "=" * 9)
    for label, found in (("measured stage sizes", ERRORS), ("estimated from node sizes", EST_ERRORS)):
        errors = sorted(found)
        print(f"\npredicted ({label}) vs measured peak activation memory over {len(errors)} workers: median error "
              f"{statistics.median(errors):.1%}, p90 {errors[int(0.9 * (len(errors) - 1))]:.1%}, "
              f"max {errors[-1]:.1%}, within 5%: {sum(e <= 0.05 for e in errors)}/{len(errors)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
