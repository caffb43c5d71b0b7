"""A model factory and batches for ``python -m fxpipe.launch`` (``--model examples/launch_model.py:make_model
--data examples/launch_model.py:batches``), and, run as a script,
the plan and weights it trains from: ``python examples/launch_model.py`` writes ``gpt.plan.json`` (two CPU
workers, estimated costs) and ``gpt.pt`` (the model's state dict) in the current directory."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from models import SkipTied  # noqa: E402


def make_model() -> torch.nn.Module:
    """A GPT-style model: embedding tied to the output head, a skip across every stage."""
    return SkipTied(vocab=50, width=32, depth=8)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 50, (10, 16), generator=g), torch.randint(0, 50, (10, 16), generator=g))
            for _ in range(100)]


if __name__ == "__main__":
    import fxpipe
    torch.manual_seed(0)
    model = make_model()
    torch.save(model.state_dict(), "gpt.pt")
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (batches()[0][0],), stages=2, chunks=4, schedule="1f1b", profile="estimate")
    pipe.plan.save("gpt.plan.json")
    print(f"gpt.plan.json: stages on devices {[s.device_index for s in pipe.plan.stages]}; gpt.pt: "
          f"{sum(p.numel() for p in model.parameters())} parameters")
