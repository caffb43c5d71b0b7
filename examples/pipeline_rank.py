"""Train a small GPT-style model (embedding tied to the output head, a skip across every stage) with one process
per pipeline stage: ``torchrun --standalone --nproc-per-node 2 examples/pipeline_rank.py``.

Rank 0 plans (``fxpipe.compile`` on CPU workers, estimated costs) and saves the plan; every rank loads it and
builds only its own stages (:class:`fxpipe.distributed.PipelineRank`). Each step prints the loss on the last
stage's rank and, for comparison, the loss of the same model trained in this one process.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import fxpipe  # noqa: E402
from fxpipe.distributed import PipelineRank  # noqa: E402
from models import SkipTied  # noqa: E402


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return SkipTied(vocab=50, width=32, depth=8)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 50, (10, 16), generator=g), torch.randint(0, 50, (10, 16), generator=g))
               for _ in range(5)]
    path = os.path.join(tempfile.gettempdir(), f"fxpipe-example-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}.json")
    if rank == 0:
        pipe = fxpipe.compile(make_model(), ["cpu"] * world, (batches[0][0],), stages=world, chunks=4,
                              schedule="1f1b", profile="estimate")
        # compiled here for CPU workers of one process: say which node runs each stage (torchrun's
        # LOCAL_WORLD_SIZE processes per node), as a plan for GPUs on several nodes records it
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        for st in pipe.plan.stages:
            st.node, st.device_index = divmod(st.index, per_node)
        pipe.plan.save(path)
    dist.barrier()
    stage = PipelineRank(path, make_model, loss_fn)
    # one write per line: the ranks share torchrun's stdout, and print's separate newline could interleave
    sys.stdout.write(f"rank {rank} (node {os.environ.get('GROUP_RANK', 0)}): stages {stage.own}, "
                     f"{sum(p.numel() for p in stage.parameters())} parameters\n")
    sys.stdout.flush()
    opt = torch.optim.SGD(stage.parameters(), lr=0.5)
    reference = make_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step, (x, y) in enumerate(batches):
        loss = stage.step(x, y)
        opt.step()
        opt.zero_grad()
        ref = loss_fn(reference(x), y)
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if loss is not None:
            print(f"step {step}: loss {loss.item():.6f} (one process: {ref.item():.6f})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
