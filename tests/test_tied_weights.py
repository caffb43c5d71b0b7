"""Tied weights: each Parameter object lives in exactly one stage module, and its gradient is the model's,
whether tied by assignment (``head.proj.weight = emb.weight``), read functionally
(``F.linear(h, self.emb.weight)``), tied into a module the user made a leaf, or read under two names (the
torch.export front end). A parameter that several stages read has a copy on each of them
(fxpipe.runtime.boundaries.tied):
pipe.step sums the copies' gradients into the model's once per step, the copies follow the optimizer's updates,
a copy updated apart is refused, and the planner charges the tie once per step."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from equivalence import assert_same_step, max_relative_error
from fxpipe.runtime.boundaries.tied import TiedCopy, TiedWeightsDiverged

EST = fxpipe.ProfileOptions(mode="estimate")


class Head(nn.Module):
    def __init__(self, emb: nn.Embedding, untraceable: bool = False):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(8), nn.Linear(8, 16, bias=False)
        self.proj.weight = emb.weight
        self.untraceable = untraceable

    def forward(self, h):
        if self.untraceable and h.sum() > 0:   # control flow on a value: fx cannot trace it
            h = h * 2
        return self.proj(self.norm(h))


class LM(nn.Module):
    def __init__(self, untraceable: bool = False):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
        self.head = Head(self.emb, untraceable)

    def forward(self, ids):
        return self.head(self.body(self.emb(ids)))


class FunctionalLM(LM):
    def forward(self, ids):
        return F.linear(self.body(self.emb(ids)), self.emb.weight)


class InsideLeaf(nn.Module):
    """The tie is inside the leaf only: the leaf stays whole."""

    def __init__(self):
        super().__init__()
        self.inner = LM()
        self.out = nn.Linear(16, 4)

    def forward(self, ids):
        return self.out(self.inner(ids))


def _owners(pipe) -> list[int]:
    every = [id(p) for spec in pipe.specs for p in spec.module.parameters()]
    return every


@pytest.mark.parametrize("cls,leaves", [(LM, [Head]), (LM, ["head"]), (LM, []), (FunctionalLM, [])])
def test_a_tied_parameter_lives_in_one_stage_module_and_gets_the_models_gradient(cls, leaves):
    torch.manual_seed(0)
    model = cls()
    ids = torch.randint(0, 16, (6, 5))
    built = []

    def factory():
        built.append(fxpipe.compile(model, ["cpu"] * 3, (ids,), chunks=3, stages=3, profile=EST,
                                    options=fxpipe.CompileOptions(leaf_modules=leaves)))
        return built[-1]
    assert_same_step(model, factory, (ids,), chunks=3)
    every = _owners(built[0])
    assert len(every) == len(set(every)), "a Parameter object belongs to two stage modules"
    assert every.count(id(model.emb.weight)) == 1


def test_a_tie_inside_a_leaf_keeps_the_leaf_whole():
    model = InsideLeaf()
    ids = torch.randint(0, 16, (4, 5))
    pipe = fxpipe.compile(model, ["cpu"] * 2, (ids,), chunks=2, profile=EST,
                          options=fxpipe.CompileOptions(leaf_modules=["inner"]))
    assert any(n.op == "call_module" and n.target == "inner" for s in pipe.specs for n in s.module.graph.nodes)


def test_an_untraceable_leaf_sharing_a_parameter_outside_it_is_refused_with_the_fix():
    model = LM(untraceable=True)
    ids = torch.randint(0, 16, (4, 5))
    with pytest.raises(fxpipe.TraceError) as info:
        fxpipe.compile(model, ["cpu"] * 2, (ids,), profile=EST, options=fxpipe.CompileOptions(leaf_modules=[Head],
                       frontend="fx"))
    msg = str(info.value)
    assert "'head' is a leaf but holds a Parameter that code outside it reads too" in msg
    assert "untie the weight" in msg and "h.sum() > 0" in msg


# ---------------------------------------------------------------- a copy per stage, summed once per step

SCHEDULES = {"gpipe": 4, "1f1b": 4, "zb-h1": 4, "zb-v": 2, "interleaved-1f1b": 2}   # schedule -> workers
FORMS = {"module": (LM, {}), "functional": (FunctionalLM, {}),
         "leaf traced through": (LM, {"options": fxpipe.CompileOptions(leaf_modules=[Head])}),
         "export": (LM, {"options": fxpipe.CompileOptions(frontend="export")}),
         "export functional": (FunctionalLM, {"options": fxpipe.CompileOptions(frontend="export")})}


def _lm_loss(out, target):
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def _train_beside(pipe, model, twin, ids, target, loss_fn, lr, steps=3, **step_kwargs):
    """``steps`` AdamW steps of ``pipe`` (over ``model``'s parameters) and of ``twin`` unpartitioned; each step's
    pair (pipeline loss, twin's loss)."""
    mine, theirs = (torch.optim.AdamW(m.parameters(), lr=lr) for m in (model, twin))
    losses = []
    for _ in range(steps):
        loss = pipe.step(ids, target, loss_fn, **step_kwargs)
        mine.step()
        mine.zero_grad()
        want = loss_fn(twin(ids), target)
        want.backward()
        theirs.step()
        theirs.zero_grad()
        losses.append((loss, want))
    return losses


def _cut(model, inputs, schedule="gpipe", stages=4, chunks=4, **kwargs) -> fxpipe.Pipeline:
    """``stages`` stages of near-equal node counts (the first holds the embedding, the last the head), on the
    schedule's workers: a plan is made, its nodes dealt out again, and the model compiled on it."""
    workers = SCHEDULES[schedule] if stages == 4 else stages
    v = {"virtual_stages": 2} if schedule == "interleaved-1f1b" else {}
    devices = ["cpu"] * workers
    planned = fxpipe.compile(model, devices, inputs, stages=stages, chunks=chunks, schedule=schedule, profile=EST,
                             **v, **kwargs)
    plan = copy.deepcopy(planned.plan)
    del planned
    order = [n for st in plan.stages for n in st.nodes]
    bounds = [round(len(order) * k / stages) for k in range(stages + 1)]
    for st, start, end in zip(plan.stages, bounds, bounds[1:]):
        st.nodes, st.checkpoint = order[start:end], ""
    return fxpipe.compile(model, devices, inputs, plan=plan, **kwargs)


def _in_one_stage_module_each(pipe) -> None:
    every = [id(p) for spec in pipe.specs for p in spec.module.parameters()]
    assert len(every) == len(set(every)), "a Parameter object belongs to two stage modules"


@pytest.mark.parametrize("form", list(FORMS))
def test_every_tying_form_puts_a_copy_on_the_reading_stage_and_each_parameter_in_one_stage_module(form):
    cls, kwargs = FORMS[form]
    torch.manual_seed(0)
    model = cls()
    ids = torch.randint(0, 16, (8, 5))
    pipe = _cut(model, (ids,), **kwargs)
    _in_one_stage_module_each(pipe)
    assert [(t.stages, t.name.endswith("weight")) for t in pipe.tied] == [([0, 3], True)]
    assert [k for k, spec in enumerate(pipe.specs)
            if any(p is model.emb.weight for p in spec.module.parameters())] == [0]
    copies = [m for m in pipe.stages[3].modules() if isinstance(m, TiedCopy)]
    assert len(copies) == 1 and copies[0].weight is not model.emb.weight
    assert copies[0].weight.device == pipe.devices[3] and torch.equal(copies[0].weight, model.emb.weight)
    assert not any(isinstance(m, TiedCopy) for k in range(3) for m in pipe.stages[k].modules())
    # pipe.step: the model's gradient, the tie's included, in the model's parameter; the copy keeps none
    target = torch.randint(0, 16, (8, 5))
    model.zero_grad(set_to_none=True)
    _lm_loss(model(ids), target).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}   # functional: no head
    model.zero_grad(set_to_none=True)
    pipe.step(ids, target, _lm_loss)
    for n, p in model.named_parameters():
        assert (p.grad is None) == (n not in want), n
        assert n not in want or max_relative_error(p.grad, want[n]) <= 1e-5, n
    assert copies[0].weight.grad is None
    assert sum(1 for p in pipe.parameters() if p.grad is not None) == len(want)


def test_a_tie_inside_a_leaf_has_no_copy():
    model = InsideLeaf()
    ids = torch.randint(0, 16, (4, 5))
    pipe = fxpipe.compile(model, ["cpu"] * 2, (ids,), chunks=2, profile=EST,
                          options=fxpipe.CompileOptions(leaf_modules=["inner"]))
    assert not pipe.tied
    _in_one_stage_module_each(pipe)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("form", ["module", "functional"])
def test_tied_weights_train_like_the_model_for_three_adamw_steps(schedule, form):
    """The user's own loop: an optimizer over model.parameters(), pipe.step, optimizer.step."""
    cls, kwargs = FORMS[form]
    torch.manual_seed(0)
    model = cls()
    twin = copy.deepcopy(model)
    ids, target = torch.randint(0, 16, (8, 5)), torch.randint(0, 16, (8, 5))
    pipe = _cut(model, (ids,), schedule, **kwargs)
    assert [t.stages for t in pipe.tied] == [[0, 3]]
    for step, (loss, want) in enumerate(_train_beside(pipe, model, twin, ids, target, _lm_loss, 1e-2)):
        assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item()), step
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-5), n
    with torch.no_grad():   # the copy followed the optimizer: the call reads the updated weight
        assert torch.allclose(pipe(ids), twin(ids), rtol=0, atol=1e-5)


def test_two_stages_share_a_tie_and_train_like_the_model():
    torch.manual_seed(0)
    model = LM()
    twin = copy.deepcopy(model)
    ids, target = torch.randint(0, 16, (8, 5)), torch.randint(0, 16, (8, 5))
    pipe = _cut(model, (ids,), stages=2)
    assert [t.stages for t in pipe.tied] == [[0, 1]]
    _train_beside(pipe, model, twin, ids, target, _lm_loss, 1e-2)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-5), n


def test_the_call_never_reads_a_stale_copy():
    """After an optimizer step, a load_state_dict, or a write through .data (which leaves the version counter as
    it was), pipe(x) computes with the model's weight; with gradients on, loss.backward() reaches it."""
    torch.manual_seed(0)
    model = LM()
    ids, target = torch.randint(0, 16, (8, 5)), torch.randint(0, 16, (8, 5))
    pipe = _cut(model, (ids,))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    pipe.step(ids, target, _lm_loss)
    opt.step()
    with torch.no_grad():
        assert torch.equal(pipe(ids), model(ids))
        model.emb.weight.data.mul_(2.0)
        assert torch.equal(pipe(ids), model(ids))
    model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})
    with torch.no_grad():
        assert torch.equal(pipe(ids), model(ids))
    model.zero_grad(set_to_none=True)
    _lm_loss(model(ids), target).backward()
    want = model.emb.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    _lm_loss(pipe(ids), target).backward()
    assert max_relative_error(model.emb.weight.grad, want) <= 1e-5
    assert all(c.weight.grad is None for t in pipe.tied for c in t.copies)


def test_a_copy_updated_apart_is_refused_before_anything_is_updated():
    torch.manual_seed(0)
    model = LM()
    ids, target = torch.randint(0, 16, (8, 5)), torch.randint(0, 16, (8, 5))
    pipe = _cut(model, (ids,))
    pipe.step(ids, target, _lm_loss)
    model.zero_grad(set_to_none=True)
    copy_ = next(c for t in pipe.tied for c in t.copies)
    with torch.no_grad():
        copy_.weight.add_(0.1)   # as an optimizer over pipe.stages[3].parameters() would, given a gradient
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    diverged = copy_.weight.detach().clone()
    for run in (lambda: pipe.step(ids, target, _lm_loss), lambda: pipe(ids)):
        with pytest.raises(TiedWeightsDiverged) as info:
            run()
        msg = str(info.value)
        assert "copy of tied parameter 'emb.weight' in stage 3 was changed apart from the parameter itself" in msg
        assert "model.parameters()" in msg and "pipe.tied.refresh()" in msg
        assert all(p.grad is None and torch.equal(p, before[n]) for n, p in model.named_parameters())
        assert torch.equal(copy_.weight, diverged)
    pipe.tied.refresh()   # the fix the message names: the parameter over its copies
    with torch.no_grad():
        assert torch.equal(pipe(ids), model(ids))


def test_asynchronous_training_sends_the_tied_weight_as_a_value_and_trains_synchronously_at_staleness_zero():
    torch.manual_seed(1)
    model = LM()
    twin = copy.deepcopy(model)
    ids, target = torch.randint(0, 16, (16, 5)), torch.randint(0, 16, (16, 5))
    batches = [(ids[i:i + 8], target[i:i + 8]) for i in (0, 8)]
    pipes = [_cut(m, (ids[:8],), "1f1b") for m in (model, twin)]
    assert [t.stages for t in pipes[0].tied] == [[0, 3]]
    fxpipe.AsyncTrainer(pipes[0], lambda ps: torch.optim.SGD(ps, lr=0.5), mode="ssp", staleness=0).train(
        batches, _lm_loss)
    opt = torch.optim.SGD(twin.parameters(), lr=0.5)
    for xb, yb in batches:
        pipes[1].step(xb, yb, _lm_loss)
        opt.step()
        opt.zero_grad()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), name


def test_the_planner_charges_a_tied_weight_once_per_step():
    """A tied weight's edge costs its bytes over the micro-batches (its gradient once per step), and the plan lists
    it with its bytes per step sent as a value against one all-reduce."""
    from fxpipe.planning.lowering import build_problem
    from fxpipe.planning.topology import links_for_devices
    from fxpipe.planning.tied_cost import tied_weights
    from fxpipe.cost.profile import profile_graph
    from fxpipe.frontend.trace import trace
    torch.manual_seed(0)
    model = LM()
    ids = torch.randint(0, 16, (8, 5))
    pipe = _cut(model, (ids,))
    gm = trace(model, ())
    costs = profile_graph(gm, (ids[:2],), torch.device("cpu"), mode="estimate")
    devices = [torch.device("cpu")] * 4
    problem = build_problem(gm, costs, devices, links_for_devices(devices), 4, [1e12] * 4)
    weight = model.emb.weight.numel() * 4
    edges = {(e.src, e.dst): e.bytes for e in problem.edges}
    assert edges[("emb_weight", "linear")] == weight / 4 and edges[("emb_weight", "embedding")] == weight / 4
    assert edges[("embedding", "body_0_0")] == costs["embedding"].output_bytes   # a value: every micro-batch
    rows = tied_weights(gm, costs, pipe.plan.stage_of(), 4)
    assert rows == [{"name": "emb.weight", "bytes": weight, "stages": [0, 3], "charged_stage": 0,
                     "sent_per_step_bytes": 2 * 4 * weight, "all_reduce_per_step_bytes": 2 * weight}]


# ---------------------------------------------------------------- Hugging Face models tied by their configs

def _hf(name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":   # tied by default
        config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, n_positions=32, n_inner=64, vocab_size=64,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
        model = transformers.GPT2LMHeadModel(config)
        assert model.lm_head.weight is model.transformer.wte.weight
    else:
        config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=32, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32,
                                          vocab_size=64, use_cache=False, tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(config)
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _logits_loss(out, target):
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_tied_embeddings_train_like_the_model_on_2_and_4_stages(name):
    """GPT2LMHeadModel and LlamaForCausalLM(tie_word_embeddings=True) through the torch.export front end: the
    embedding and LM head in different stages, three AdamW steps of every schedule as the unpartitioned model's."""
    model = _hf(name)
    twin, initial = copy.deepcopy(model), copy.deepcopy(model.state_dict())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (8, 10), generator=g)
    target = ids.roll(-1, 1)
    runs = [(4, "gpipe", ["gpipe", "1f1b", "zb-h1"]), (2, "zb-v", ["zb-v"]),
            (2, "interleaved-1f1b", ["interleaved-1f1b"]), (2, "gpipe", ["gpipe", "1f1b"])]
    for workers, planned, schedules in runs:
        stages = 2 if (workers, planned) == (2, "gpipe") else 4
        v = {"virtual_stages": 2} if planned == "interleaved-1f1b" else {}
        model.load_state_dict(initial)
        pipe = fxpipe.compile(model, ["cpu"] * workers, (ids,), chunks=4, stages=stages, schedule=planned,
                              profile=EST, **v)
        _in_one_stage_module_each(pipe)
        assert [len(t.stages) for t in pipe.tied] == [2], (planned, [t.stages for t in pipe.tied])
        for schedule in schedules:
            for m in (model, twin):   # the same start for every schedule (the copies follow the model's load)
                m.load_state_dict(initial)
            _train_beside(pipe, model, twin, ids, target, _logits_loss, 1e-3, schedule=schedule)
            for (n, p), q in zip(model.named_parameters(), twin.parameters()):
                assert torch.allclose(p, q, rtol=0, atol=1e-5), (stages, schedule, n, (p - q).abs().max().item())


# ---------------------------------------------------------------- over torch.distributed (2 gloo processes)

def _skip_tied() -> nn.Module:
    from models import SkipTied
    torch.manual_seed(0)
    return SkipTied(vocab=11, width=8, depth=6)


def _token_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 11, (7, 4), generator=g), torch.randint(0, 11, (7, 4), generator=g)) for _ in range(3)]


def _adamw_ranks(rank: int, world: int, plan_json: str, diverge: bool) -> dict:
    """Three AdamW steps over stage.parameters(); with ``diverge`` rank 1 then moves its copy of the tied weight
    and steps once more."""
    import json
    from fxpipe.distributed import PipelineRank
    stage = PipelineRank(fxpipe.Plan.from_dict(json.loads(plan_json)), _skip_tied, _lm_loss, timeout_s=60)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    losses = []
    for x, y in _token_batches():
        loss = stage.step(x, y)
        losses.append(None if loss is None else loss.item())
        opt.step()
        opt.zero_grad()
    found = {"losses": losses, "params": {n: p.detach().clone() for n, p in stage.named_parameters()},
             "counted_elsewhere": sorted(n for n, p in stage.named_parameters()
                                         if getattr(p, "fxpipe_counted_elsewhere", False))}
    if diverge:
        if rank == 1:
            with torch.no_grad():
                dict(stage.named_parameters())["emb.weight"].add_(0.01)
        before = {n: p.detach().clone() for n, p in stage.named_parameters()}
        x, y = _token_batches()[0]
        try:
            stage.step(x, y)
            found["refused"] = None
        except TiedWeightsDiverged as exc:
            found["refused"] = str(exc)
        found["untouched"] = all(torch.equal(p, before[n]) and p.grad is None for n, p in stage.named_parameters())
    return found


def _two_rank_plan() -> fxpipe.Plan:
    from forced_cuts import compile_with_cuts
    x = _token_batches()[0][0]
    return copy.deepcopy(compile_with_cuts(_skip_tied(), (x,), ["blocks_3_0"], chunks=3).plan)


@pytest.mark.slow
def test_on_two_ranks_the_tied_weight_is_each_ranks_and_trains_like_one_process_with_adamw():
    from distributed_run import run_ranks
    plan = _two_rank_plan()
    results = run_ranks(2, _adamw_ranks, plan.to_json(), False)
    errors = [r["trace"] for r in results if "ok" not in r]
    assert not errors, errors[0]
    model = _skip_tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    want_losses = []
    for x, y in _token_batches():
        loss = _lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want_losses.append(loss.item())
    got = [r["ok"] for r in results]
    assert [n for n in got[0]["params"] if n in got[1]["params"]] == ["emb.weight"]   # held by both ranks
    assert torch.equal(got[0]["params"]["emb.weight"], got[1]["params"]["emb.weight"])
    assert got[0]["counted_elsewhere"] == [] and got[1]["counted_elsewhere"] == ["emb.weight"]   # clipping counts once
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got[1]["losses"], want_losses)), got[1]["losses"]
    params = {**got[0]["params"], **got[1]["params"]}
    assert set(params) == {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        assert torch.allclose(params[n], p.detach(), rtol=0, atol=1e-5), n


@pytest.mark.slow
def test_on_two_ranks_copies_that_diverged_are_refused_on_every_rank_before_anything_is_updated():
    from distributed_run import run_ranks
    results = run_ranks(2, _adamw_ranks, _two_rank_plan().to_json(), True)
    errors = [r["trace"] for r in results if "ok" not in r]
    assert not errors, errors[0]
    for r in results:
        msg = r["ok"]["refused"]
        assert msg is not None and "the copies of tied parameter 'emb.weight' on ranks 0 and 1 differ" in msg
        assert "step it with the same optimizer over stage.parameters()" in msg and "nothing was updated" in msg
        assert r["ok"]["untouched"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("devices", [["cpu", "cuda:0"], ["cuda:0", "cpu", "cpu", "cuda:0"]])
def test_each_stage_computes_with_the_tied_weight_on_its_own_device(devices):
    """The copy is on the reading stage's device (before, each stage's .to(device) moved the one Parameter)."""
    torch.manual_seed(0)
    model = LM()
    twin = copy.deepcopy(model)
    ids, target = torch.randint(0, 16, (8, 5)), torch.randint(0, 16, (8, 5))
    pipe = fxpipe.compile(model, devices, (ids,), chunks=4, stages=len(devices), profile=EST)
    _in_one_stage_module_each(pipe)
    assert all(p.device == pipe.devices[k] for k, s in enumerate(pipe.specs) for p in s.module.parameters())
    assert [t.stages for t in pipe.tied] == [[0, len(devices) - 1]]
    _train_beside(pipe, model, twin, ids, target, _lm_loss, 1e-2)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.allclose(p.cpu(), q, rtol=0, atol=1e-4), n
    with torch.no_grad():
        assert torch.allclose(pipe(ids).cpu(), twin(ids), rtol=0, atol=1e-4)
