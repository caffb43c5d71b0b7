"""The mixture-of-experts layers of a model, found from its structure (not from model names).

An expert layer is what expert parallelism (``Layout.ep``) shards and what the cost model charges as experts. It is
found as Hugging Face transformers writes every mixture of experts since its experts interface
(``@use_experts_implementation``: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, gpt-oss, GLM-4-MoE, ...) and as
torchtitan's ``GroupedExperts`` stores them: **stacked experts**, one module whose own parameters all have the
experts first (``gate_up_proj`` of ``(E, 2I, H)``, ``down_proj`` of ``(E, H, I)``, biases of ``(E, out)``), beside a
**router**, a sibling module whose weight is ``(E, H)``, and called as ``experts(hidden_states, top_k_index,
top_k_weights)`` (tokens ``(T, H)``, each token's chosen experts and their weights ``(T, k)``) returning ``(T, H)``:
the sum over a token's ``k`` experts of its weight times the expert's output. That call is what lets the experts be
sharded without knowing the model: each rank computes its own experts on the tokens sent to them.

Experts kept as a ``ModuleList`` of one class beside a router are found too, as :attr:`ExpertLayer.stacked`
``False``: their block's own forward loops over them, so which tokens reach which expert is that forward's code,
not a call fxpipe can dispatch; :func:`shardable` refuses them, naming the layer and the convention that would
shard.

:func:`refuse_router_loss` refuses a model that adds its routers' load-balancing loss to its own
(``output_router_logits=True``, transformers' ``load_balancing_loss_func``): that loss is ``E`` times the sum over
experts of two means over the whole batch's tokens (the share of tokens routed to the expert, its mean router
probability), a product no sum over micro-batches reproduces, so a pipeline would train on another loss.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

__all__ = ["ExpertLayer", "ExpertsError", "find_experts", "refuse_router_loss", "shardable"]


class ExpertsError(ValueError):
    """A model whose experts fxpipe cannot shard, with why and what would."""


@dataclass(frozen=True)
class ExpertLayer:
    """One mixture-of-experts layer: ``path`` of its experts module, ``num_experts``, the ``router``'s path, the
    experts' own parameters (``params``, experts first), ``stacked`` (one module holding every expert) or not (a
    ``ModuleList``), and the bytes-free shape facts the cost model reads: ``top_k`` (experts per token, where
    the router or the config says it) and ``expert_params`` (parameters of one expert)."""

    path: str
    num_experts: int
    router: str
    params: tuple[str, ...]
    stacked: bool
    top_k: int | None
    expert_params: int


def _stacked_experts(module: nn.Module) -> int | None:
    """The experts count of a stacked experts module (module docstring), else ``None``."""
    own = list(module.named_parameters(recurse=False))
    if not own or any(p.dim() < 2 for _, p in own) or not any(p.dim() >= 3 for _, p in own):
        return None
    counts = {p.shape[0] for _, p in own}
    if len(counts) != 1 or any(True for c in module.children() if any(True for _ in c.parameters())):
        return None
    try:
        arity = len([p for p in inspect.signature(module.forward).parameters.values()
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
    except (TypeError, ValueError):
        return None
    count = counts.pop()
    return count if count >= 2 and arity in (3, 0) else None


def _listed_experts(module: nn.Module) -> int | None:
    """The experts count of a ``ModuleList`` of one class of modules with parameters, else ``None``."""
    if not isinstance(module, nn.ModuleList) or len(module) < 2:
        return None
    kinds = {type(m) for m in module}
    if len(kinds) != 1 or not any(True for _ in module[0].parameters()):
        return None
    return len(module)


def _router(parent: nn.Module, name: str, count: int) -> str | None:
    """The sibling of ``name`` in ``parent`` whose weight is ``(count, hidden)``: the router."""
    for sibling_name, sibling in parent.named_children():
        weight = getattr(sibling, "weight", None)
        if sibling_name != name and isinstance(weight, nn.Parameter) and weight.dim() == 2 and \
                weight.shape[0] == count:
            return sibling_name
    return None


def _top_k(parent: nn.Module, router: nn.Module, model: nn.Module) -> int | None:
    for holder in (router, parent):
        for attr in ("top_k", "num_experts_per_tok", "k"):
            value = getattr(holder, attr, None)
            if isinstance(value, int) and value >= 1:
                return value
    value = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    return value if isinstance(value, int) else None


def find_experts(model: nn.Module) -> list[ExpertLayer]:
    """Every mixture-of-experts layer of ``model`` (module docstring), in module order."""
    found = []
    for parent_path, parent in model.named_modules():
        for name, child in parent.named_children():
            count = _stacked_experts(child)
            stacked = count is not None
            count = count if stacked else _listed_experts(child)
            router = _router(parent, name, count) if count else None
            if router is None:
                continue
            path = f"{parent_path}.{name}" if parent_path else name
            params = tuple(n for n, _ in child.named_parameters(recurse=stacked is False))
            size = sum(p.numel() for p in child.parameters()) // count
            found.append(ExpertLayer(path, count, f"{parent_path}.{router}" if parent_path else router, params,
                                     stacked, _top_k(parent, getattr(parent, router), model), size))
    return found


def shardable(model: nn.Module) -> dict[str, int]:
    """The stacked expert layers of ``model`` (path -> experts), for expert parallelism; :class:`ExpertsError`
    naming a layer kept as a ``ModuleList`` (module docstring) and what would shard it."""
    layers = find_experts(model)
    listed = [layer for layer in layers if not layer.stacked]
    if listed:
        layer = listed[0]
        raise ExpertsError(
            f"the {layer.num_experts} experts of {layer.path} are a ModuleList its block's forward loops over, so "
            "which tokens reach which expert is that code's, not a call fxpipe can dispatch to other ranks: store "
            "them stacked (one module whose parameters have the experts first, called as experts(hidden_states, "
            "top_k_index, top_k_weights), transformers' @use_experts_implementation convention), or leave ep out")
    return {layer.path: layer.num_experts for layer in layers}


def refuse_router_loss(model: nn.Module, kwargs: dict | None = None) -> None:
    """:class:`ExpertsError` for a mixture of experts asked to return its routers' load-balancing loss (module
    docstring), naming why and the fix; nothing otherwise."""
    config = getattr(model, "config", None)
    asked = (kwargs or {}).get("output_router_logits", getattr(config, "output_router_logits", False))
    if asked is not True or not find_experts(model):
        return
    raise ExpertsError(
        "the model adds its routers' load-balancing loss (output_router_logits=True), a product of two means over "
        "the whole batch's tokens (each expert's share of the tokens times its mean router probability) that no "
        "sum over micro-batches reproduces: a pipeline would train on another loss. Train with "
        "config.output_router_logits=False (the language-model loss, exact), or add the routers' loss outside the "
        "pipeline")
