"""Planner problems whose node costs fxpipe measured: ``fxpipe.compile`` on CPU workers, exported.

The roofline corpus of ``make_problems.py`` puts FLOP counts on a GPU; these problems are what
``fxpipe.compile`` itself hands the planner with its default, measured profile (every node timed on
this machine's CPU, forward and backward; bytes from one real run) for CPU worker threads, with the
CPU links fxpipe models. Each is written to ``benchmarks/problems/<model>@cpu<k>-measured.json``
(the name marks it measured) and joins the corpus that ``planner.py`` reads. Node times depend on
this machine and its load, so a re-run gives a similar, not an identical, corpus.

    python benchmarks/make_measured_problems.py                 # ~1-2 minutes on 2 shared cores
    python benchmarks/make_measured_problems.py --models resnet18 --workers 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torchvision
from torch import nn

import fxpipe
import solvers

sys.path.insert(0, str(Path(__file__).parent))
from make_problems import GPT  # noqa: E402  (the corpus's GPT block, at a CPU size)

HERE = Path(__file__).parent


def _vit() -> nn.Module:
    return torchvision.models.VisionTransformer(image_size=64, patch_size=8, num_layers=6, num_heads=4,
                                                hidden_dim=192, mlp_dim=768, num_classes=100)


# name -> (constructor, batch)
MODELS = {
    "resnet18": (lambda: torchvision.models.resnet18(num_classes=100), lambda: torch.randn(16, 3, 64, 64)),
    "gpt_small": (lambda: GPT(vocab=2048, width=256, depth=6, heads=4, seq=64),
                  lambda: torch.randint(0, 2048, (16, 64))),
    "vit_tiny": (_vit, lambda: torch.randn(16, 3, 64, 64)),
    "mobilenet_v3_small": (lambda: torchvision.models.mobilenet_v3_small(num_classes=100),
                           lambda: torch.randn(16, 3, 64, 64)),
}


def measured_problem(name: str, workers: int) -> solvers.Problem:
    build, batch = MODELS[name]
    torch.manual_seed(0)
    pipe = fxpipe.compile(build().train(), ["cpu"] * workers, (batch(),), chunks=4, schedule="1f1b")
    doc = dict(pipe.plan.problem)
    doc["name"] = f"{name}@cpu{workers}-measured"
    return solvers.Problem.from_dict(doc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--workers", type=int, default=4, help="CPU worker threads (default 4)")
    parser.add_argument("--out", default=str(HERE / "problems"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        started = time.perf_counter()
        problem = measured_problem(name, args.workers)
        problem.save(out / f"{problem.name}.json")
        print(f"{problem.name}: {len(problem.nodes)} nodes, "
              f"{sum(n.fwd_s + n.bwd_s for n in problem.nodes) * 1e3:.1f} ms per micro-batch "
              f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
