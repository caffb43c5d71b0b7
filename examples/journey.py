"""A model and a dataset of your own for the LLM journey, as ``python -m fxpipe.launch`` takes them:
``--model examples/journey.py:model --data examples/journey.py:batches`` (a file path, from any directory; or
``pkg.module:name`` on ``PYTHONPATH``). The model is a tiny Llama built from its config exactly as ``fxpipe plan
hf:llama --config ...`` builds it; the batches are keyword inputs (``input_ids``, ``labels`` right-padded with -100)
that train on the model's own loss, the last batch smaller. The README's journey uses ``--model hf:llama`` and
``--data mock:...`` instead; ``python -m fxpipe.launch ... --compare CKPT`` checks either against one process.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

CONFIG = {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}
"""``--config num_hidden_layers=4,hidden_size=64,...`` of the plan command."""
BATCH, SEQ, STEPS = 8, 16, 5


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
