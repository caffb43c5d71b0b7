"""The predicted export of a deep stack of alike layers (fxpipe/frontend/repeats.py): node for node torch.export's
own graph for the Hugging Face families, the whole export where layers differ, and what fxpipe.plan does with it."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import fxpipe
from fxpipe.frontend.capture import capture
from fxpipe.frontend.export import PREDICTED, export_graph
from fxpipe.frontend.fingerprint import graph_fingerprint
from fxpipe.frontend.model_loss import MODEL_LOSS
from fxpipe.frontend.repeats import MIN_LAYERS, _same, layer_stack

DEPTH = MIN_LAYERS + 1
CONFIGS = {
    "llama": dict(num_hidden_layers=DEPTH, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=96, max_position_embeddings=64),
    "gpt2": dict(n_layer=DEPTH, n_embd=32, n_head=4, n_positions=64, vocab_size=96, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
    "qwen2": dict(num_hidden_layers=DEPTH, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=96, max_position_embeddings=64),
}


def _model(kind: str, **overrides) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(kind, use_cache=False, **{**CONFIGS[kind], **overrides})
    return transformers.AutoModelForCausalLM.from_config(config).train()


@pytest.mark.parametrize("kind,labels", [(kind, False) for kind in sorted(CONFIGS)] + [("llama", True)])
def test_the_predicted_graph_is_torch_exports_own_node_for_node(kind, labels):
    """With ``labels=`` the model computes its own loss, which the graph keeps exact over micro-batches
    (``gm.meta[MODEL_LOSS]``), as the CLI plans a language model."""
    model, ids = _model(kind), torch.randint(0, 96, (4, 12))
    kwargs = {"labels": ids.clone()} if labels else {}
    exact = export_graph(model, (ids,), kwargs)
    predicted = export_graph(model, (ids,), kwargs, predict_repeats=True)
    assert PREDICTED not in exact.meta and f"its {DEPTH} layers" in predicted.meta[PREDICTED]
    assert _same(exact.graph, predicted.graph)   # names, operations, targets, arguments, module paths
    assert graph_fingerprint(exact, "export") == graph_fingerprint(predicted, "export")
    own = dict(model.named_parameters())
    assert all(predicted.get_parameter(n) is p for n, p in own.items() if n in dict(predicted.named_parameters()))
    inputs = (ids, ids.clone()) if labels else (ids,)
    for got, want in zip(predicted(*inputs), exact(*inputs)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    if labels:   # its count of the labels the loss takes, read through the predicted graph
        loss = predicted.meta[MODEL_LOSS]
        assert loss.owner is predicted and loss.leaf == exact.meta[MODEL_LOSS].leaf


def test_layers_that_differ_are_exported_whole():
    model = _model("llama")
    model.model.layers[6].self_attn.scaling = 0.5   # one layer computes otherwise: no stack to predict
    assert layer_stack(model) is None
    ids = torch.randint(0, 96, (4, 12))
    gm = export_graph(model, (ids,), predict_repeats=True)
    assert PREDICTED not in gm.meta
    torch.testing.assert_close(gm(ids)[0], model(ids).logits)


class _Layer(nn.Module):
    def __init__(self, index: int, odd_from: int) -> None:
        super().__init__()
        self.layer_idx, self.odd_from = index, odd_from
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.linear(x))
        return x * 2 if self.layer_idx >= self.odd_from else x   # its code, not an attribute, makes it differ


class _Stack(nn.Module):
    def __init__(self, odd_from: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(i, odd_from) for i in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_layer_whose_code_differs_by_the_fourth_fails_the_check_and_is_exported_whole():
    model, x = _Stack(odd_from=3), torch.randn(4, 8)
    gm = export_graph(model, (x,), predict_repeats=True)
    assert PREDICTED not in gm.meta                      # the prediction for 4 layers was not export's graph
    torch.testing.assert_close(gm(x)[0], model(x))


class _BranchesWhenCut(_Stack):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        if len(self.layers) < DEPTH and x.sum() > 0:   # a branch on a value, only in the cut model
            x = x * 2
        return x


def test_a_cut_model_export_cannot_trace_leaves_the_whole_export():
    model, x = _BranchesWhenCut(odd_from=DEPTH), torch.randn(4, 8)
    gm = export_graph(model, (x,), predict_repeats=True)   # was: the cut model's TraceError
    assert PREDICTED not in gm.meta
    torch.testing.assert_close(gm(x)[0], model(x))


def test_past_the_fourth_the_prediction_differs_and_a_rank_would_refuse_the_plan():
    """The limit the module doc states: a layer past the fourth made different by its code alone is predicted
    like the others. Only fxpipe.plan takes the prediction; a process that trains captures the model whole,
    and the fingerprints differ, which PipelineRank refuses (fxpipe/distributed/rank.py)."""
    model, x = _Stack(odd_from=6), torch.randn(4, 8)
    predicted = capture(model, args=(x,), frontend="export", other_mode=False)
    whole = capture(model, args=(x,), frontend="export")
    assert "predicted" in predicted.frontend["reason"]
    assert predicted.fingerprint != whole.fingerprint


def test_fxpipe_plan_predicts_and_its_stages_are_those_of_the_whole_capture():
    with torch.device("meta"):
        config = transformers.AutoConfig.for_model("llama", **{**CONFIGS["llama"], "num_hidden_layers": 12})
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    ids = torch.zeros(4, 64, dtype=torch.long, device="meta")
    plan = fxpipe.plan(model, fxpipe.Devices.preset("h100", 4), (ids,))
    assert "its 12 layers of model.layers predicted" in plan.frontend["reason"]
    whole = capture(model, args=(ids,), other_mode=True)   # what a rank traces
    assert whole.fingerprint == plan.fingerprint
    names = {n.name for n in whole.graph.graph.nodes}
    assert all(node in names for stage in plan.stages for node in stage.nodes)
