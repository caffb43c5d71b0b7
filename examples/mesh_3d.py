"""Train a small Hugging Face Llama on a 3-D mesh — pipeline × FSDP2 × tensor parallel, 8 processes:
``torchrun --standalone --nproc-per-node 8 examples/mesh_3d.py``.

Rank 0 plans a 2-stage pipeline (``fxpipe.compile`` on CPU workers, estimated costs) and saves the plan; every
rank builds the mesh (pp=2 × dp_shard=2 × tp=2, ``fxpipe.distributed.parallel.ParallelDims``) and its
:class:`fxpipe.distributed.PipelineRank`: its pipeline stage, tensor-parallel over ``tp`` (attention and MLP
sharded by heads) and FSDP2-sharded over ``dp_shard``, each dp replica training on its share of the batch. The
labels are right-padded with ``-100``; the loss is the token mean. Each step prints the loss beside the same
model trained on the whole batch in this one process, and the last line the largest relative difference of any
parameter (every rank's shards gathered) from that model's after the last step.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

import fxpipe  # noqa: E402
from fxpipe.distributed import PipelineRank  # noqa: E402
from fxpipe.distributed.parallel import ParallelDims  # noqa: E402

VOCAB, SIZES = 96, (8, 8, 9)   # the last batch shared unevenly over the two dp replicas


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, use_cache=False))


def loss_fn(out, labels: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out["logits"]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def batch(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, 12), generator=g)
    labels = ids.clone()
    for row, length in enumerate(torch.randint(3, 13, (size,), generator=g).tolist()):
        labels[row, length:] = -100   # right-padded, as a data collator pads
    return ids, labels


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-4, weight_decay=0.1)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batches = [batch(n, seed=i + 1) for i, n in enumerate(SIZES)]
    path = os.path.join(tempfile.gettempdir(), f"fxpipe-mesh-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}.json")
    if rank == 0:
        pipe = fxpipe.compile(make_model(), ["cpu"] * 2, (batches[0][0],), chunks=2, profile="estimate")
        pipe.plan.save(path)
    dist.barrier()
    dims = ParallelDims(pp=2, dp_shard=2, tp=2)
    mesh = dims.build_mesh("cpu")
    stage = PipelineRank(path, make_model, loss_fn, mesh=mesh)   # a plan or its path
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in stage.parameters())
    coords = mesh.get_coordinate()
    sys.stdout.write(f"rank {rank}: pp {coords[0]} dp_shard {coords[1]} tp {coords[2]}: stages {stage.ranked.own}, "
                     f"{local} of the model's {sum(p.numel() for p in make_model().parameters())} parameters\n")
    sys.stdout.flush()
    opt = optimizer(stage.parameters())
    reference = make_model()
    ref_opt = optimizer(reference.parameters())
    for step, (ids, labels) in enumerate(batches):
        loss = stage.step(ids, labels, schedule="1f1b")
        opt.step()
        opt.zero_grad()
        want = loss_fn(reference(ids), labels)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if loss is not None and tuple(coords[1:]) == (0, 0):   # the last stage's first replica and tp rank says it
            sys.stdout.write(f"step {step}: {len(ids)} sequences, loss {loss.item():.6f} "
                             f"(one process: {want.item():.6f})\n")
            sys.stdout.flush()
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in stage.named_parameters()}
    gathered: list[dict] = [None] * dist.get_world_size()   # type: ignore[list-item]
    dist.all_gather_object(gathered, full)
    if rank == 0:
        own = dict(reference.named_parameters())
        worst = max(((a - own[n]).abs().max() / own[n].abs().max().clamp_min(1e-12)).item()
                    for part in gathered for n, a in part.items())
        names = {n for part in gathered for n in part}
        sys.stdout.write(f"{len(names)} parameters of {len(own)} gathered; largest relative difference from one "
                         f"process: {worst:.1e}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
