"""Published large training runs, as configured, for ``benchmarks/scale.py --published``.

Each run is planned with its own mesh, batch, sequence length, recomputation and precision fixed (only the
micro-batches and the cuts are fxpipe's), and its predicted tokens/s per GPU is printed beside the published one.

Sources (torchtitan's ``docs/performance.md``; all runs FSDP2 over bf16 weights, AdamW, eager):

- commit eaea6f6 (2024-12), on Meta's Grand Teton H100s (HBM2e, 96 GB at 2.4 TB/s, 500 W: the ``h100-96gb``
  preset), 400 Gb/s RDMA a GPU between hosts: Table 1 (Llama 3.1 8B, 8 GPUs, local batch 2, selective activation
  checkpointing: 5,762 tokens/s/GPU, 82.4 GiB) and Table 3 (the same on 128 GPUs: 5,605, 67.0 GiB);
- commit 0413364 (2024-05), on 64 A100-80GB: Llama 3 8B (local batch 1, selective op: 2,973 tokens/s/GPU) and 70B
  (local batch 1, full: 331), Llama 2 13B (local batch 2, sequences of 4096, no checkpointing: 2,162).

Left out: the rows with ``torch.compile``, Float8 or asynchronous tensor parallelism (torchtitan's 8B compiled
6,667, its 70B and 405B rows): fxpipe costs every operation at the preset's roofline, with no model of what
compilation fuses or of Float8 matmuls, so those rows would be predicted as the eager bf16 run. torchtitan's
``selective`` op mode keeps every other matmul output and fxpipe's ``selective`` all of them (more memory, less
recomputed); its ``full`` is fxpipe's ``blocks``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PublishedRun", "RUNS", "LLAMA2_13B"]

LLAMA2_13B = ("num_hidden_layers=40,hidden_size=5120,intermediate_size=13824,num_attention_heads=40,"
              "num_key_value_heads=40,vocab_size=32000,max_position_embeddings=4096")


@dataclass(frozen=True)
class PublishedRun:
    name: str
    shape: str            # scale.py's --shape, or "" with config
    preset: str
    nodes: int
    batch: int            # global, sequences
    seq_len: int
    mesh: str
    checkpoint: str       # fxpipe's name of the run's recomputation
    tokens_per_gpu: float
    source: str
    config: str = ""      # Hugging Face config keys (Llama 2)


RUNS = [
    PublishedRun("Llama 3.1 8B, FSDP 8", "8b", "h100-96gb", 1, 16, 8192, "pp=1,dp=8,tp=1,dp_mode=shard", "selective",
                 5762, "torchtitan eaea6f6, Table 1"),
    PublishedRun("Llama 3.1 8B, FSDP 128", "8b", "h100-96gb", 16, 256, 8192, "pp=1,dp=128,tp=1,dp_mode=shard",
                 "selective", 5605, "torchtitan eaea6f6, Table 3"),
    PublishedRun("Llama 3 8B, FSDP 64", "8b", "a100", 8, 64, 8192, "pp=1,dp=64,tp=1,dp_mode=shard", "selective",
                 2973, "torchtitan 0413364, Llama 3 table"),
    PublishedRun("Llama 3 70B, FSDP 64", "70b", "a100", 8, 64, 8192, "pp=1,dp=64,tp=1,dp_mode=shard", "blocks",
                 331, "torchtitan 0413364, Llama 3 table"),
    PublishedRun("Llama 2 13B, FSDP 64", "", "a100", 8, 128, 4096, "pp=1,dp=64,tp=1,dp_mode=shard", "never",
                 2162, "torchtitan 0413364, Llama 2 table", config=LLAMA2_13B),
]
