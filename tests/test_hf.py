"""Hugging Face transformers built from small configs (random weights, nothing downloaded) compile through
the torch.export front end into pipelines whose stages hold transformer blocks, and compute the model:
outputs (the ModelOutput's own type), gradients of pipe.step under every schedule, the tied embedding's
gradient, keyword inputs (an attention mask) and uneven batches."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from equivalence import max_relative_error

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 128, 12


def build(name: str, layers: int = 4, inner: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB, use_cache=False)
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, n_positions=64, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, n_inner=inner, **small)
        model = transformers.GPT2LMHeadModel(config)
    elif name == "bert":
        config = transformers.BertConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4,
                                         intermediate_size=inner, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0, num_labels=3, vocab_size=VOCAB)
        model = transformers.BertForSequenceClassification(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=inner, max_position_embeddings=64,
                                          **small)
        model = transformers.LlamaForCausalLM(config)
    return model


def blocks_of(model: torch.nn.Module) -> torch.nn.ModuleList:
    return {"GPT2LMHeadModel": lambda m: m.transformer.h, "BertForSequenceClassification": lambda m: m.bert.encoder.layer,
            "LlamaForCausalLM": lambda m: m.model.layers}[type(model).__name__](model)


def uneven(name: str, layers: int, heavy: int) -> torch.nn.Module:
    """``layers`` blocks of which block ``heavy`` has an MLP eight times as wide: blocks of unequal cost."""
    model, wide = build(name, layers), build(name, layers, inner=512)
    blocks_of(model)[heavy] = blocks_of(wide)[heavy]
    return model


def batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(size)
    ids = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    mask = torch.ones(size, SEQ, dtype=torch.long)
    mask[1, SEQ - 4:] = 0    # one padded sample: the mask must reach the attention
    return ids, mask


def loss_fn(out, target):
    """Mean over samples of equal weight (every sample has SEQ tokens): exact under reduction='mean'."""
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def target_for(name: str, ids: torch.Tensor) -> torch.Tensor:
    return ids.remainder(3)[:, 0] if name == "bert" else ids.roll(-1, dims=1)


def compile_hf(model, workers: int, ids, mask, chunks: int, schedule: str = "gpipe"):
    return fxpipe.compile(model, ["cpu"] * workers, (ids,), example_kwargs={"attention_mask": mask},
                          chunks=chunks, stages=workers, schedule=schedule,
                          profile=fxpipe.ProfileOptions(mode="estimate"))


BLOCK = re.compile(r"^(.*\.(h|layer|layers)\.\d+)(\.|$)")


def block_stages(pipe) -> list[set[str]]:
    """Per stage, the transformer blocks (``...layer.3`` / ``...h.3``) some of its operations belong to."""
    found = []
    for spec in pipe.specs:
        blocks = set()
        for node in spec.module.graph.nodes:
            for path, _ in (node.meta.get("nn_module_stack") or {}).values():
                hit = BLOCK.match(str(path))
                if hit:
                    blocks.add(hit.group(1))
        found.append(blocks)
    return found


def assert_cut_between_blocks(pipe, blocks: int) -> None:
    """Every block's operations in one stage, and the summary names each cut by module paths of which none
    lies inside a block."""
    stages = block_stages(pipe)
    where = {b: [k for k, s in enumerate(stages) if b in s] for s in stages for b in s}
    assert len(where) == blocks and all(len(ks) == 1 for ks in where.values()), where
    summary = pipe.plan.summary()
    assert f"kept whole: {blocks} blocks" in summary and "cut inside blocks" not in summary, summary
    cuts = next(line for line in summary.splitlines() if line.startswith("stage boundaries: "))
    for cut in cuts.removeprefix("stage boundaries: ").split("; "):
        before, after = cut.split(" | ")
        for side in (before, after):
            hit = BLOCK.match(side)
            assert hit is None or hit.group(1) == side, (side, summary)   # a block's path, never inside one
    for a, b in zip(stages, stages[1:]):   # block-to-block cuts are named "…h.1 | …h.2"
        if a and b:
            assert f"{max(a, key=_index)} | {min(b, key=_index)}" in cuts, (a, b, cuts)


def _index(block: str) -> int:
    return int(block.rsplit(".", 1)[1])


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
@pytest.mark.parametrize("workers", [2, 4])
def test_eval_outputs_match_and_stages_hold_blocks(name, workers):
    model = build(name).eval()
    ids, mask = batch(7)    # uneven: 7 samples in 4 micro-batches
    pipe = compile_hf(model, workers, ids, mask, chunks=4)
    assert pipe.plan.frontend["name"] == "export" and "keyword" in pipe.plan.frontend["reason"]
    assert "front end: export" in pipe.plan.summary() and "stage boundaries:" in pipe.plan.summary()
    stages = block_stages(pipe)
    assert len(stages) == workers and sum(1 for s in stages if s) >= 2, stages
    assert_cut_between_blocks(pipe, 4)
    with torch.no_grad():
        got = pipe(ids, attention_mask=mask)
        want = model(ids, attention_mask=mask)
    assert type(got) is type(want)
    assert max_relative_error(got.logits, want.logits) <= 1e-5
    # the mask is an input, not a constant: another mask gives the model's other answer
    other = mask.clone()
    other[0, SEQ - 6:] = 0
    with torch.no_grad():
        assert max_relative_error(pipe(ids, attention_mask=other).logits,
                                  model(ids, attention_mask=other).logits) <= 1e-5


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_blocks_of_unequal_cost_on_3_workers_are_cut_between(name):
    model = uneven(name, 6, heavy=2).eval()
    ids, mask = batch(5)
    pipe = compile_hf(model, 3, ids, mask, chunks=2)
    assert_cut_between_blocks(pipe, 6)
    with torch.no_grad():
        assert max_relative_error(pipe(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits) <= 1e-5


def test_zb_h1_on_4_workers_gradients_match_full_batch():
    model = build("llama", layers=6).train()
    ids, mask = batch(8)
    target = target_for("llama", ids)
    pipe = compile_hf(model, 4, ids, mask, chunks=4, schedule="zb-h1")
    assert_cut_between_blocks(pipe, 6)
    model.zero_grad(set_to_none=True)
    loss_fn(model(ids, attention_mask=mask), target).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    pipe.step((ids,), target, loss_fn, kwargs={"attention_mask": mask}, schedule="zb-h1")
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    assert_same_gradients(got, want)


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_step_gradients_match_full_batch(name, schedule):
    model = build(name).train()
    ids, mask = batch(6)
    target = target_for(name, ids)
    pipe = compile_hf(model, 2, ids, mask, chunks=4, schedule=schedule)   # 6 in 4: uneven micro-batches
    model.zero_grad(set_to_none=True)
    want_loss = loss_fn(model(ids, attention_mask=mask), target)
    want_loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    loss = pipe.step((ids,), target, loss_fn, kwargs={"attention_mask": mask}, schedule=schedule)
    assert abs(loss.item() - want_loss.item()) <= 1e-5 * abs(want_loss.item())
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    assert_same_gradients(got, want)


def assert_same_gradients(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float = 1e-4) -> None:
    """Each gradient within ``rtol`` of its own largest element; a gradient that is zero but for rounding
    (attention's key bias: softmax ignores it) is judged against a millionth of the largest gradient."""
    floor = 1e-6 * max(w.abs().max().item() for w in want.values())
    errors = {n: (got[n] - want[n]).abs().max().item() / max(want[n].abs().max().item(), floor) for n in want}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= rtol, (worst, errors[worst])


def test_tied_embedding_lives_in_one_stage_and_gets_the_models_gradient():
    model = build("gpt2").train()
    assert model.lm_head.weight is model.transformer.wte.weight
    ids, mask = batch(4)
    pipe = compile_hf(model, 4, ids, mask, chunks=2)
    owners = [k for k, spec in enumerate(pipe.specs)
              if any(p is model.lm_head.weight for p in spec.module.parameters())]
    assert len(owners) == 1, owners
    every = [id(p) for spec in pipe.specs for p in spec.module.parameters()]
    assert len(every) == len(set(every)), "a Parameter object belongs to two stage modules"
    target = target_for("gpt2", ids)
    model.zero_grad(set_to_none=True)
    loss_fn(model(ids, attention_mask=mask), target).backward()
    want = model.transformer.wte.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    pipe.step((ids,), target, loss_fn, kwargs={"attention_mask": mask})
    assert max_relative_error(model.transformer.wte.weight.grad, want) <= 1e-5


def test_called_with_another_structure_is_refused():
    model = build("gpt2").eval()
    ids, mask = batch(4)
    pipe = compile_hf(model, 2, ids, mask, chunks=2)
    with pytest.raises(TypeError, match="compiled for inputs structured as"):
        pipe(ids, mask)    # positional: GPT-2's second argument is past_key_values, not the mask


def test_fx_front_end_refuses_keyword_inputs_with_the_fix():
    model = build("gpt2").eval()
    ids, mask = batch(4)
    with pytest.raises(ValueError, match="frontend='export'"):
        fxpipe.compile(model, ["cpu"] * 2, (ids,), example_kwargs={"attention_mask": mask},
                       profile=fxpipe.ProfileOptions(mode="estimate"), options=fxpipe.CompileOptions(frontend="fx"))


def test_a_graph_module_or_exported_program_is_partitioned_as_given():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))
    x = torch.randn(6, 8)
    want = model(x)
    program = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim.AUTO},))
    for given in (torch.fx.symbolic_trace(model), program):
        pipe = fxpipe.compile(given, ["cpu", "cpu"], (x,), chunks=3, stages=2,
                              profile=fxpipe.ProfileOptions(mode="estimate"))
        assert pipe.plan.frontend["name"] == "given"
        assert "partitioned as given" in pipe.plan.summary()
        owned = {id(p) for spec in pipe.specs for p in spec.module.parameters()}
        assert owned == {id(p) for p in model.parameters()}    # the model's own objects, no copies
        model.zero_grad(set_to_none=True)
        out = pipe(x)
        assert max_relative_error(out, want) <= 1e-6
        out.sum().backward()
        assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("leaves", ["class", "path"])
def test_leaf_modules_with_the_export_front_end_are_kept_whole(leaves):
    """``leaf_modules`` under torch.export keep each listed module's operations in one stage, as fx does by not
    tracing into it: the blocks as a class, or an MLP and a block by path (blocks themselves not kept whole
    by default here, so only the leaves constrain the cuts)."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    model = build("gpt2", layers=6).train()
    ids, mask = batch(6)
    kept = [GPT2Block] if leaves == "class" else ["transformer.h.1.mlp", "transformer.h.4"]
    pipe = fxpipe.compile(model, ["cpu"] * 4, (ids,), example_kwargs={"attention_mask": mask}, chunks=3,
                          stages=4, profile=fxpipe.ProfileOptions(mode="estimate"),
                          options=fxpipe.CompileOptions(keep_blocks_whole=False, leaf_modules=kept))
    assert pipe.plan.frontend["name"] == "export" and "leaf_modules kept whole" in pipe.plan.frontend["reason"]
    summary = pipe.plan.summary()
    assert "also in one stage: " in summary and "blocks (" not in summary, summary
    paths = [f"transformer.h.{i}" for i in range(6)] if leaves == "class" else kept
    stages = [{str(path) for node in spec.module.graph.nodes
               for path, _ in (node.meta.get("nn_module_stack") or {}).values()} for spec in pipe.specs]
    for path in paths:
        holding = [k for k, s in enumerate(stages) if path in s]
        assert len(holding) == 1, (path, holding, summary)
    target = target_for("gpt2", ids)
    model.zero_grad(set_to_none=True)
    want_loss = loss_fn(model(ids, attention_mask=mask), target)
    want_loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    loss = pipe.step((ids,), target, loss_fn, kwargs={"attention_mask": mask}, schedule="1f1b")
    assert abs(loss.item() - want_loss.item()) <= 1e-5 * abs(want_loss.item())
    assert_same_gradients({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, want)


def test_leaf_modules_naming_no_submodule_is_refused_with_the_fix():
    model = build("gpt2").eval()
    ids, mask = batch(4)
    with pytest.raises(ValueError, match=r"leaf_modules names \['transformer.h.9'\].*not submodules.*'transformer.h.0'"):
        fxpipe.compile(model, ["cpu"] * 2, (ids,), example_kwargs={"attention_mask": mask},
                       profile=fxpipe.ProfileOptions(mode="estimate"),
                       options=fxpipe.CompileOptions(leaf_modules=["transformer.h.9"]))


def _lm(config_class, model_class, **sizes):
    """A causal LM of ``config_class`` at test size with every other setting the config's default but
    dropout (so ``use_cache=True``: the model returns a generation cache)."""
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return model_class(config_class(vocab_size=VOCAB, num_hidden_layers=4, num_attention_heads=4, **sizes))
    return make


DEFAULT_CONFIG_LMS = {
    # OPT's default dropout of 0.1 draws other masks for micro-batches than for the batch: off, to compare
    "opt": _lm(transformers.OPTConfig, transformers.OPTForCausalLM, hidden_size=32, ffn_dim=64,
               word_embed_proj_dim=32, max_position_embeddings=64, dropout=0.0),
    "gpt_neox": _lm(transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM, hidden_size=32,
                    intermediate_size=64, max_position_embeddings=64),
    "mistral": _lm(transformers.MistralConfig, transformers.MistralForCausalLM, hidden_size=32, num_key_value_heads=2,
                   intermediate_size=64, max_position_embeddings=64),
    # Falcon's attention writes into a mask in place (aten.masked_fill_): profiled alone, that node's input
    # is a leaf that requires grad, which the profiler must clone first
    "falcon": _lm(transformers.FalconConfig, transformers.FalconForCausalLM, hidden_size=32),
    "mixtral": _lm(transformers.MixtralConfig, transformers.MixtralForCausalLM, hidden_size=32, num_key_value_heads=2,
                   intermediate_size=64, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2),
}


@pytest.mark.parametrize("name", sorted(DEFAULT_CONFIG_LMS))
def test_causal_lms_with_their_default_config_compile_by_default_and_train_exactly(name):
    """``fxpipe.compile(model, devices, (ids,))`` and nothing else, on causal LMs as their configs make them:
    the generation cache their outputs carry (``use_cache=True``) is off in the pipeline only, and the
    step's loss and gradients are the model's."""
    model = DEFAULT_CONFIG_LMS[name]().train()
    assert model.config.use_cache
    ids, _ = batch(4)
    target = ids.roll(-1, dims=1)
    model.zero_grad(set_to_none=True)
    want_loss = loss_fn(model(ids), target)
    want_loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (ids,))
    assert "config.use_cache=False" in pipe.plan.frontend["reason"], pipe.plan.frontend
    assert model.config.use_cache   # the model itself is as it was
    loss = pipe.step((ids,), target, loss_fn)
    assert abs(loss.item() - want_loss.item()) <= 1e-5 * abs(want_loss.item())
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    assert_same_gradients(got, want)
    model.eval()
    with torch.no_grad():
        out, reference = pipe(ids), model(ids)
    assert reference.past_key_values is not None and out.past_key_values is None
    assert max_relative_error(out.logits, reference.logits) <= 1e-5


def test_use_cache_given_as_a_keyword_is_what_is_traced():
    """The cache is turned off only when the caller did not say: ``use_cache=False`` passed is kept as passed
    (no note), and ``use_cache=True`` passed is refused by torch.export with the fix named."""
    model = DEFAULT_CONFIG_LMS["mistral"]().eval()
    ids, _ = batch(4)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (ids,), example_kwargs={"use_cache": False}, chunks=2,
                          profile=fxpipe.ProfileOptions(mode="estimate"))
    assert "use_cache" not in pipe.plan.frontend["reason"]
    with torch.no_grad():
        assert max_relative_error(pipe(ids, use_cache=False).logits, model(ids).logits) <= 1e-5
    with pytest.raises(fxpipe.TraceError, match="use_cache=False for Hugging Face models"):
        fxpipe.compile(model, ["cpu", "cpu"], (ids,), example_kwargs={"use_cache": True}, chunks=2,
                       profile=fxpipe.ProfileOptions(mode="estimate"))
    assert model.config.use_cache
