"""Scaled dot-product attention as a GPU runs it, for the ``"analytic"`` profile.

On a GPU, ``F.scaled_dot_product_attention`` dispatches to a fused kernel (flash or memory-efficient
attention) that keeps for backward only its inputs, its output and one log-sum-exp per query row. Under
``FakeTensorMode`` on the planning machine it would take the math path instead, which saves the
``heads x sequence x sequence`` attention weights: 2 GiB per layer for a Llama-3-8B-shaped layer on two
4096-token sequences in bfloat16, where the fused kernel saves 64 MiB. The analytic profile therefore runs an
attention node as ``aten._scaled_dot_product_efficient_attention`` (the kernel that takes any mask; a boolean
mask becomes the additive bias it saves, as the GPU dispatcher converts it), whose shapes, FLOPs and saved
tensors are those of the GPU's kernel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import torch.fx as fx

__all__ = ["ATTENTION", "is_attention", "fused_attention"]

ATTENTION = (torch.ops.aten.scaled_dot_product_attention.default, torch.ops.aten.scaled_dot_product_attention,
            F.scaled_dot_product_attention)
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def is_attention(node: fx.Node) -> bool:
    """Whether ``node`` calls scaled dot-product attention (torch.export's ATen node or fx's functional call)."""
    return node.op == "call_function" and node.target in ATTENTION


def fused_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``F.scaled_dot_product_attention(*args, **kwargs)`` computed by the memory-efficient kernel (module doc);
    inputs it cannot take (not ``batch x heads x sequence x features``) go to the plain call."""
    bound = dict(zip(_NAMES, args))
    bound.update(kwargs)
    query, key, value = bound["query"], bound["key"], bound["value"]
    mask, scale = bound.get("attn_mask"), bound.get("scale")
    if any(t.dim() != 4 for t in (query, key, value)):
        return F.scaled_dot_product_attention(*args, **kwargs)
    if bound.get("enable_gqa") and key.shape[1] != query.shape[1]:   # the kernel takes equal heads: repeat them
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, float("-inf"))
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, mask, True, float(bound.get("dropout_p", 0.0)), bool(bound.get("is_causal", False)),
        scale=scale)
    return out[0]
