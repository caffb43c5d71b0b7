"""Mixture-of-experts layers found from a model's structure, and what fxpipe refuses of them, before anything runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.frontend.experts import ExpertsError, find_experts, shardable
from hf_models import MOE, build, padded_batch

pytest.importorskip("transformers")


class _ListedMoE(nn.Module):
    """Experts kept as a ModuleList, routed by the block's own loop (as many hand-written MoE layers are)."""

    def __init__(self, width: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        best = self.gate(x).argmax(-1, keepdim=True)
        return sum(torch.where(best == e, expert(x), 0.0) for e, expert in enumerate(self.experts))


@pytest.mark.parametrize("family", sorted(MOE))
def test_every_familys_experts_are_found_from_its_structure_with_their_router_and_counts(family):
    model = build(family)
    layers = find_experts(model)
    config = model.config
    moe_layers = config.num_hidden_layers - getattr(config, "first_k_dense_replace", 0)
    assert len(layers) == moe_layers and all(layer.stacked for layer in layers)
    for layer in layers:
        experts = model.get_submodule(layer.path)
        assert layer.num_experts == 8 and layer.top_k == 2
        assert model.get_submodule(layer.router).weight.shape[0] == 8
        assert layer.expert_params * 8 == sum(p.numel() for p in experts.parameters())
    assert shardable(model) == {layer.path: 8 for layer in layers}
    assert find_experts(build("llama")) == [] and shardable(build("llama")) == {}


def test_experts_in_a_module_list_are_found_and_refused_for_sharding_naming_the_convention():
    model = nn.Sequential(_ListedMoE())
    (layer,) = find_experts(model)
    assert (layer.path, layer.router, layer.stacked, layer.num_experts) == ("0.experts", "0.gate", False, 4)
    with pytest.raises(ExpertsError, match=r"the 4 experts of 0.experts are a ModuleList .* store them stacked"):
        shardable(model)


def test_the_routers_load_balancing_loss_is_refused_before_anything_is_traced_naming_the_fix():
    model = build("qwen3_moe")
    model.config.output_router_logits = True
    batch = padded_batch("qwen3_moe", 4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    why = r"output_router_logits=True.*no sum over micro-batches reproduces.*config.output_router_logits=False"
    with pytest.raises(ExpertsError, match=why):
        fxpipe.compile(model, ["cpu"] * 2, (batch["input_ids"],), example_kwargs={"labels": batch["labels"]})
    with pytest.raises(ExpertsError, match=why):
        fxpipe.plan(model, fxpipe.Devices.preset("h100", 2), (batch["input_ids"],))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    model.config.output_router_logits = False
    pipe = fxpipe.compile(model, ["cpu"] * 2, (batch["input_ids"],), example_kwargs={"labels": batch["labels"]},
                          profile=fxpipe.ProfileOptions(mode="estimate"))
    want = model(**batch).loss
    assert abs(float(pipe.step(batch["input_ids"], labels=batch["labels"])) - float(want)) <= 1e-5 * float(want)
