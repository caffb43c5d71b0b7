"""The LLM journey's model and data for ``python -m fxpipe.launch`` (``PYTHONPATH=examples``): a tiny Llama built
from its config exactly as ``fxpipe plan hf:llama --config ...`` builds it, and padded batches of keyword inputs
(``input_ids``, ``labels`` right-padded with -100) that train on the model's own loss.

Run as a script, ``python examples/journey.py --check ckpt`` trains the same batches in one process, on the whole
batches, and compares its losses (from ``--log``, the launch runs' output) and parameters with the checkpoint
the launch runs wrote.
"""

from __future__ import annotations

import argparse
import re

import torch
from transformers import AutoConfig, AutoModelForCausalLM

CONFIG = {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}
"""``--config num_hidden_layers=4,hidden_size=64,...`` of the plan command."""
BATCH, SEQ, STEPS, LR = 8, 16, 5, 0.1


def model() -> torch.nn.Module:
    """The planned model, the same weights on every process (seed 0)."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **CONFIG)).train()


def batches() -> list[dict[str, torch.Tensor]]:
    """Batches of token ids and labels padded with -100 past each sequence's length (the last batch smaller)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(STEPS):
        n = BATCH if step < STEPS - 1 else BATCH - 2
        ids = torch.randint(0, CONFIG["vocab_size"], (n, SEQ), generator=g)
        labels = ids.clone()
        for row, length in enumerate(torch.randint(2, SEQ + 1, (n,), generator=g).tolist()):
            labels[row, length:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def check(checkpoint: str, log: str) -> None:
    """One process trains the whole batches; print how far the launch runs' losses and parameters are."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    reference = model()
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    losses = []
    for batch in batches():
        loss = reference(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with open(log) as f:
        launched = [float(v) for v in re.findall(r"^step \d+: loss ([0-9.]+)$", f.read(), re.M)]
    from fxpipe.distributed import snapshots
    latest = snapshots.latest(checkpoint)[0]   # the last checkpoint fxpipe.launch published there
    dcp_to_torch_save(latest, latest + ".pt")
    saved = torch.load(latest + ".pt")
    worst = max((saved[f"model.{n}"] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    print(f"one process: losses {' '.join(f'{x:.6f}' for x in losses)}")
    print(f"launched:    losses {' '.join(f'{x:.6f}' for x in launched)}")
    print(f"largest loss difference {max(abs(a - b) for a, b in zip(losses, launched)):.1e}, "
          f"largest parameter difference {worst:.1e} over {len(list(reference.parameters()))} parameters")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", required=True, help="the launch runs' checkpoint directory")
    parser.add_argument("--log", required=True, help="the launch runs' output (their step lines)")
    args = parser.parse_args()
    check(args.check, args.log)
