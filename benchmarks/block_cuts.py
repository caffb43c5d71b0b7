"""What keeping transformer blocks whole costs: the predicted iteration time (estimate profile, so machine
load does not enter) of the default block-aligned plan against ``CompileOptions(keep_blocks_whole=False)``,
for GPT-2, BERT and Llama built from configs (random weights) on 2, 3 and 4 CPU workers.

    python benchmarks/block_cuts.py
"""

from __future__ import annotations

import torch

import fxpipe


def build(name: str, layers: int, d: int) -> torch.nn.Module:
    import transformers
    torch.manual_seed(0)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=layers, n_embd=d, n_head=4, vocab_size=1000, use_cache=False))
    if name == "bert":
        return transformers.BertForSequenceClassification(transformers.BertConfig(
            num_hidden_layers=layers, hidden_size=d, num_attention_heads=4, intermediate_size=4 * d, vocab_size=1000))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=d, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=4 * d, vocab_size=1000, use_cache=False))


def main() -> None:
    ids = torch.randint(0, 1000, (8, 64), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    for name in ("gpt2", "bert", "llama"):
        for layers, d in ((4, 32), (8, 256)):
            model = build(name, layers, d).eval()
            for workers in (2, 3, 4):
                t = {}
                for keep in (True, False):
                    pipe = fxpipe.compile(model, ["cpu"] * workers, (ids,), example_kwargs={"attention_mask": mask},
                                          chunks=4, stages=workers, profile=fxpipe.ProfileOptions(mode="estimate"),
                                          options=fxpipe.CompileOptions(keep_blocks_whole=keep))
                    t[keep] = pipe.plan.predicted["iteration_s"]
                print(f"{name:5s} L={layers} d={d:3d} workers={workers}: blocks whole {t[True] * 1e3:8.3f} ms  "
                      f"any cut {t[False] * 1e3:8.3f} ms  ratio {t[True] / t[False]:.3f}", flush=True)


if __name__ == "__main__":
    main()
