"""Memory per rank of pp x FSDP2 (``PipelineRank`` over ``ParallelDims(pp, dp_shard)``): the bytes of this
rank's parameters, gradients and AdamW state (``exp_avg``, ``exp_avg_sq``; the scalar ``step`` counted too),
local shards only (``DTensor.to_local()``), after one training step of a small Llama, for each ``dp_shard``.

Each configuration starts ``pp * dp_shard`` gloo processes on this machine (file rendezvous); every rank reports
its bytes, the table shows the largest rank's and the ratio to ``dp_shard=1`` at the same ``pp``.

    flock /tmp/fxpipe-bench.lock python benchmarks/fsdp_memory.py [--pp 2] [--dp 1,2] [--width 128] [--layers 4]

Measured (2-core CPU, gloo; Llama width 128, 4 layers, vocab 512: 2.75 MiB of fp32 parameters), MiB of the largest
rank: ``--pp 2 --dp 1,2``: 5.510 (1.377 params + 1.377 grads + 2.755 AdamW) -> 2.755 (ratio 0.500);
``--pp 1 --dp 1,2,4``: 11.018 -> 5.509 (0.500) -> 2.755 (0.250). Parameters, gradients and optimizer state all
drop by the dp_shard degree (between steps; a step's unsharded parameters and gradients are not counted here).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import transformers

import fxpipe

VOCAB, SEQ, BATCH = 512, 16, 8


def build(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=width, intermediate_size=2 * width, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False)).train()


def loss_fn(out, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _rank(rank: int, world: int, out: str, plan_json: str, pp: int, width: int, layers: int) -> None:
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    from fxpipe.distributed import PipelineRank
    from fxpipe.distributed.parallel import ParallelDims
    mesh = ParallelDims(pp=pp, dp_shard=world // pp).build_mesh("cpu")
    stage = PipelineRank(fxpipe.Plan.from_dict(json.loads(plan_json)), functools.partial(build, width, layers),
                             loss_fn, mesh=mesh, timeout_s=300)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    stage.step(ids, ids, schedule="1f1b")
    opt.step()
    params = list(stage.parameters())
    row = {"params": sum(_local(p).nbytes for p in params),
           "grads": sum(_local(p.grad).nbytes for p in params if p.grad is not None),
           "adamw": sum(_local(v).nbytes for p in params for v in opt.state[p].values() if torch.is_tensor(v))}
    torch.save(row, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def measure(pp: int, dp: int, plan_json: str, width: int, layers: int) -> list[dict[str, int]]:
    world = pp * dp
    with tempfile.TemporaryDirectory(prefix="fxpipe-fsdp-mem-") as out:
        mp.start_processes(_rank, args=(world, out, plan_json, pp, width, layers), nprocs=world, start_method="spawn")
        return [torch.load(f"{out}/rank{r}.pt") for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", default="1,2", help="dp_shard degrees, comma-separated")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    model = build(args.width, args.layers)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    plan = fxpipe.compile(copy.deepcopy(model), ["cpu"] * args.pp, (ids,), chunks=2, stages=args.pp,
                          schedule="1f1b", profile=fxpipe.ProfileOptions(mode="estimate")).plan
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"Llama width {args.width}, {args.layers} layers, vocab {VOCAB}: {total / 2**20:.2f} MiB of fp32 "
          f"parameters; pp={args.pp}; bytes of the largest rank (local shards), after one step with AdamW")
    print(f"{'dp_shard':>8} {'ranks':>5} {'params MiB':>10} {'grads MiB':>9} {'AdamW MiB':>9} {'total MiB':>9} "
          f"{'vs dp_shard=1':>13}")
    base = None
    for dp in [int(d) for d in args.dp.split(",")]:
        rows = measure(args.pp, dp, json.dumps(plan.to_dict()), args.width, args.layers)
        worst = max(rows, key=lambda r: sum(r.values()))
        whole = sum(worst.values())
        base = whole if dp == 1 else base
        ratio = f"{whole / base:.3f}" if base else "-"
        print(f"{dp:>8} {args.pp * dp:>5} {worst['params'] / 2**20:>10.3f} {worst['grads'] / 2**20:>9.3f} "
              f"{worst['adamw'] / 2**20:>9.3f} {whole / 2**20:>9.3f} {ratio:>13}")


if __name__ == "__main__":
    main()
