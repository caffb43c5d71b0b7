"""Test helper: tiny Hugging Face models of the families the LLM journey covers, built from their configs
(random weights, nothing downloaded), and padded batches for them.

Each builder returns ``(model, batch)`` where ``batch`` is the keyword inputs of one training step with labels
right-padded by ``-100`` at uneven lengths (as a data collator pads them): ``model(**batch).loss`` is the
whole batch's mean over its counted tokens.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import transformers

__all__ = ["FAMILIES", "MOE", "build", "padded_batch"]

VOCAB, WIDTH, SEQ = 96, 32, 12


def _llama(tied: bool) -> Any:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=WIDTH, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=tied))


def _gpt2() -> Any:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=4, n_embd=WIDTH, n_head=4, n_positions=64, vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))


def _qwen2() -> Any:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        num_hidden_layers=4, hidden_size=WIDTH, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64))


def _qwen3() -> Any:   # Qwen2's block with a per-head RMS norm of the queries and keys (q_norm, k_norm)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        num_hidden_layers=4, hidden_size=WIDTH, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=WIDTH // 4, vocab_size=VOCAB, max_position_embeddings=64))


def _bert() -> Any:
    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=4, hidden_size=WIDTH, intermediate_size=64, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _t5() -> Any:
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=WIDTH, d_ff=64, num_heads=4, d_kv=8, vocab_size=VOCAB,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))


FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": lambda: _llama(False), "llama-tied": lambda: _llama(True), "gpt2": _gpt2, "qwen2": _qwen2,
    "bert-mlm": _bert, "t5": _t5,
}
def _moe(config: Any, **sizes: Any) -> Callable[[], Any]:
    """A tiny mixture of experts of ``config``'s family: 8 experts of width 16, 2 chosen per token."""
    sizes = {"num_hidden_layers": 2, "hidden_size": WIDTH, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": VOCAB, "max_position_embeddings": 64, "num_experts_per_tok": 2, **sizes}
    return lambda: transformers.AutoModelForCausalLM.from_config(config(**sizes))


MOE: dict[str, Callable[[], Any]] = {   # stacked experts beside a router: what expert parallelism shards
    "qwen3_moe": _moe(transformers.Qwen3MoeConfig, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
                      head_dim=8),
    "mixtral": _moe(transformers.MixtralConfig, intermediate_size=16, num_local_experts=8),
    # a dense first layer, a shared expert, group-limited routing, multi-head latent attention
    "deepseek_v3": _moe(transformers.DeepseekV3Config, intermediate_size=64, moe_intermediate_size=16,
                        num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
    # biased, transposed experts; sliding-window layers
    "gpt_oss": _moe(transformers.GptOssConfig, intermediate_size=16, num_local_experts=8, head_dim=8),
}
OTHERS: dict[str, Callable[[], Any]] = {"qwen3": _qwen3, **MOE}   # built by name, not the journey's families


def padded_batch(family: str, batch: int = 8, seed: int = 1) -> dict[str, torch.Tensor]:
    """One batch of ``input_ids`` and ``labels`` (``-100`` past each sample's own length; BERT: only the masked
    positions counted, as a masked-LM collator does)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, SEQ), generator=g)
    labels = ids.clone()
    lengths = torch.randint(1, SEQ + 1, (batch,), generator=g)
    lengths[0] = SEQ
    for i, n in enumerate(lengths.tolist()):
        labels[i, n:] = -100
    if family == "bert-mlm":
        labels[torch.rand(batch, SEQ, generator=g) > 0.4] = -100
        labels[0, 0] = ids[0, 0]   # at least one counted token
    return {"input_ids": ids, "labels": labels}


def build(family: str, seed: int = 0) -> Any:
    """The family's tiny model, seeded, in train mode."""
    torch.manual_seed(seed)
    return {**FAMILIES, **OTHERS}[family]().train()


def on_meta(kind: str, **config: Any) -> Any:
    """``AutoModelForCausalLM`` of ``AutoConfig.for_model(kind, **config)`` on ``meta`` in bfloat16: a model to
    plan from shapes, as ``fxpipe plan hf:KIND --config ...`` builds it."""
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(kind, **config),
                                                             dtype=torch.bfloat16)
