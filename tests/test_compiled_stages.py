"""Compiled stages (:mod:`fxpipe.runtime.execute.compiled`): ``fxpipe.compile(torch.compile(model))`` compiles every
stage module with the model's torch.compile options, and the pipeline computes what the eager model computes
(outputs, loss, gradients within float tolerance) under every schedule that can run compiled stages, with
and without checkpointing; the zero-bubble schedules are refused with the reason, and ``schedule="auto"``
leaves them out; uneven micro-batches recompile a stage once, not every step; the plan records the options
and the compile time, apart from the stage times.

Inductor compiles on this machine's CPU (its C++ backend): one small pipeline is compiled once per module
(``cnn_pipe``) and stepped under every schedule and checkpoint mode; the Hugging Face models are slow tests.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.planning.plan import Plan
from fxpipe.runtime.execute.compiled import options_of
from models import SkipCNN

TOL = dict(rtol=1e-4, atol=1e-5)   # inductor reorders float sums: not bit-equal to eager


def _counted() -> int:
    import torch._dynamo.utils

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _reference(model: nn.Module, x: torch.Tensor, target: torch.Tensor, chunks: int):
    """The eager model's outputs, mean loss and gradients over the micro-batches the pipeline makes."""
    model.zero_grad(set_to_none=True)
    outs, loss = [], 0.0
    for xs, ts in zip(x.tensor_split(chunks), target.tensor_split(chunks)):
        out = model(xs)
        part = F.mse_loss(out, ts) * len(xs) / len(x)
        part.backward()
        outs.append(out.detach())
        loss = loss + part.detach()
    grads = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return torch.cat(outs), loss, grads


@pytest.fixture(scope="module")
def cnn_pipe():
    """A CNN whose stem output skips to the last stage, in 4 compiled stages on 2 CPU workers (interleaved:
    the same pipeline steps as gpipe and 1f1b too), and an eager copy of the model."""
    torch.manual_seed(0)
    model = SkipCNN()
    eager = copy.deepcopy(model)
    x = torch.randn(8, 3, 8, 8)
    pipe = fxpipe.compile(torch.compile(model), ["cpu", "cpu"], (x,), chunks=4, stages=4,
                          schedule="interleaved-1f1b", virtual_stages=2, profile="estimate")
    return pipe, model, eager


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_compiled_stages_compute_the_eager_model_under_every_schedule(cnn_pipe, checkpoint):
    pipe, model, eager = cnn_pipe
    assert pipe.compiled == {"backend": "inductor"}
    assert all(getattr(s.module, "_compiled_call_impl", None) is not None for s in pipe.specs)
    pipe.checkpoint = checkpoint   # torch.utils.checkpoint around the compiled stage recomputes it
    x, target = torch.randn(8, 3, 8, 8), torch.randn(8, 5)
    want_out, want_loss, want_grads = _reference(eager, x, target, 4)
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        model.zero_grad(set_to_none=True)
        loss, out = pipe.step(x, target, F.mse_loss, schedule=schedule, return_outputs=True)
        torch.testing.assert_close(out, want_out, **TOL)
        torch.testing.assert_close(loss, want_loss, **TOL)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, want_grads[name], **TOL, msg=f"{schedule} {checkpoint} {name}")
    torch.testing.assert_close(pipe(x).detach(), eager(x).detach(), **TOL)   # the training graphs: no compile
    model.zero_grad(set_to_none=True)


@pytest.mark.slow
def test_uneven_micro_batches_and_a_smaller_last_batch_recompile_once_not_every_step(cnn_pipe):
    """8 samples make micro-batches of 2, and a last batch of 10 makes 3, 3, 2, 2: the first micro-batch of
    another size compiles each stage once more, its batch dimension dynamic (dynamo's automatic dynamic
    shapes), and the steps after that compile nothing, whichever size comes. (A micro-batch of one sample
    compiles once more: dynamo specialises size 1.)"""
    pipe, model, eager = cnn_pipe
    pipe.checkpoint = "never"
    batches = [torch.randn(n, 3, 8, 8) for n in (8, 10)]
    for x in batches:   # every size once
        pipe.step(x, torch.randn(len(x), 5), F.mse_loss, schedule="1f1b")
    before = _counted()
    for _ in range(2):
        for x in batches:
            target = torch.randn(len(x), 5)
            _, _, want = _reference(eager, x, target, 4)
            model.zero_grad(set_to_none=True)
            pipe.step(x, target, F.mse_loss, schedule="1f1b")
            for name, param in model.named_parameters():
                torch.testing.assert_close(param.grad, want[name], **TOL)
    assert _counted() == before, "a step of a size seen before compiled again"


@pytest.mark.slow
def test_split_backward_schedules_are_refused_with_the_reason(cnn_pipe):
    pipe, model, _ = cnn_pipe
    x = torch.randn(8, 3, 8, 8)
    for schedule in ("zb-h1", "zb-v"):
        with pytest.raises(fxpipe.FxpipeError, match=r"compiled backward computes the input and the weight "
                                                     r"gradients together.*use '1f1b' or 'interleaved-1f1b'"):
            pipe.step(x, torch.randn(8, 5), F.mse_loss, schedule=schedule)
        with pytest.raises(fxpipe.FxpipeError, match="zero-bubble"):   # before anything is traced
            fxpipe.compile(torch.compile(SkipCNN()), ["cpu", "cpu"], (x,), schedule=schedule, profile="estimate")


@pytest.mark.slow
def test_the_refusal_is_torchs_a_compiled_backward_does_not_run_twice(cnn_pipe, monkeypatch):
    """What a zero-bubble schedule would do with compiled stages: its weight pass runs the stage's compiled
    backward again, which torch refuses (pytorch/pytorch#161904). If this test fails, torch has learnt it and
    the refusal can go."""
    import fxpipe.runtime.execute.pipeline as pipeline

    pipe, model, _ = cnn_pipe
    pipe.checkpoint = "never"
    monkeypatch.setattr(pipeline, "refuse_split_backward", lambda schedule, compiled: None)
    with pytest.raises(fxpipe.StageError, match="retain_graph"):
        pipe.step(torch.randn(8, 3, 8, 8), torch.randn(8, 5), F.mse_loss, schedule="zb-v")
    model.zero_grad(set_to_none=True)


@pytest.mark.slow
def test_auto_schedule_leaves_the_split_backward_out_and_the_plan_records_the_compilation(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    x, target = torch.randn(8, 8), torch.randn(8, 4)
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (x,), options=fxpipe.CompileOptions(compile_stages={"fullgraph": True}))
    tried = {row["schedule"] for row in pipe.plan.solver["search"]}
    assert tried == {"gpipe", "1f1b", "interleaved-1f1b"} and pipe.plan.schedule in tried
    assert pipe.compiled == {"fullgraph": True}
    # the stages were timed compiled (effort="fast" included) and their compile time kept apart
    assert pipe.plan.profile["stage_profile"]
    record = pipe.plan.compiled
    assert record["options"] == {"backend": "inductor", "fullgraph": True}
    assert len(record["stage_compile_s"]) == len(pipe.plan.stages) and record["compile_s"] > 0
    assert "compiled stages: torch.compile(backend='inductor', fullgraph=True); compile" in pipe.plan.summary()
    before = _counted()
    loss = pipe.step(x, target, F.mse_loss)   # the refinement's compiled stages are the pipeline's
    want = sum(F.mse_loss(model(a), b) * len(a) / 8 for a, b in zip(x.tensor_split(pipe.chunks),
                                                                     target.tensor_split(pipe.chunks)))
    torch.testing.assert_close(loss, want.detach(), **TOL)
    assert _counted() == before or pipe.chunks > 1 and 8 % pipe.chunks   # only an uneven split compiles again
    pipe.plan.save(tmp_path / "plan.json")
    assert fxpipe.load_plan(tmp_path / "plan.json").compiled == record
    older = pipe.plan.to_dict()
    del older["compiled"]   # a plan saved before compiled stages: eager
    assert Plan.from_dict(older).compiled is None


def test_compile_options_name_what_torch_compile_takes():
    for bad, match in [({"fullgrpah": True}, "'fullgrpah', which torch.compile does not take"),
                       ("yes", "must be True, False, None or a dict"),
                       ({"backend": "no-such-backend"}, "torch.compile refuses it"),
                       ({"mode": "max-autotune", "options": {"max_autotune": True}}, "torch.compile refuses it")]:
        with pytest.raises(ValueError, match=match):
            fxpipe.CompileOptions(compile_stages=bad)
    module = nn.Linear(2, 2)

    def mine(gm, example_inputs):
        return gm
    assert options_of(torch.compile(module)) == {"backend": "inductor"}
    assert options_of(torch.compile(module, fullgraph=True, dynamic=False, options={"max_autotune": True})) == {
        "backend": "inductor", "options": {"max_autotune": True}, "fullgraph": True, "dynamic": False}
    assert options_of(torch.compile(module, mode="max-autotune-no-cudagraphs"))["options"]["max_autotune"] is True
    assert options_of(torch.compile(module, backend="aot_eager")) == {"backend": "aot_eager"}
    assert options_of(torch.compile(module, backend=mine)) == {"backend": mine}


def test_compile_stages_false_runs_a_compiled_model_eagerly():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    pipe = fxpipe.compile(torch.compile(model), ["cpu", "cpu"], (torch.randn(4, 4),), chunks=2, stages=2,
                          schedule="zb-h1", profile="estimate", options=fxpipe.CompileOptions(compile_stages=False))
    assert pipe.compiled is None and pipe.plan.compiled is None
    assert all(getattr(s.module, "_compiled_call_impl", None) is None for s in pipe.specs)
    assert "compiled stages" not in pipe.plan.summary()


def test_a_split_backward_schedule_is_refused_before_anything_is_traced():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    for schedule in ("zb-h1", "zb-v"):
        with pytest.raises(fxpipe.FxpipeError, match=rf"schedule '{schedule}' splits each stage's backward.*"
                                                     "compiled backward computes the input and the weight"):
            fxpipe.compile(torch.compile(model), ["cpu", "cpu"], (torch.randn(4, 4),), schedule=schedule)
        with pytest.raises(fxpipe.FxpipeError, match="use '1f1b' or 'interleaved-1f1b'"):
            fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(4, 4),), schedule=schedule,
                           options=fxpipe.CompileOptions(compile_stages=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_transformers_in_compiled_stages_train_as_the_eager_model(name):
    """GPT-2 and Llama (2 blocks, random weights) through the torch.export front end, in 2 compiled stages
    under 1F1B, each block recomputed inside the compiled stage (GPT-2 selectively, keeping its matrix products:
    torch.compile traces torch's selective checkpoint contexts; Llama whole blocks): the loss and every gradient
    are the eager model's (the whole-stage modes: the CNN's tests above)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=16, n_inner=64, vocab_size=64,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=64, max_position_embeddings=16,
                                          vocab_size=64, use_cache=False)
        model = transformers.LlamaForCausalLM(config)
    eager = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 8))
    target = ids.roll(-1, dims=1)

    def loss_fn(out, t):
        return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), t.reshape(-1))
    pipe = fxpipe.compile(torch.compile(model), ["cpu", "cpu"], (ids,), chunks=2, stages=2, schedule="1f1b",
                          profile="estimate", checkpoint="selective" if name == "gpt2" else "blocks")
    assert pipe.compiled is not None and pipe.plan.frontend["name"] == "export"
    assert any("recomputed_block" in n for stage in pipe.stages for n, _ in stage.named_children())
    loss = pipe.step(ids, target, loss_fn)
    want = sum(loss_fn(eager(a), b) / 2 for a, b in zip(ids.tensor_split(2), target.tensor_split(2)))
    want.backward()
    torch.testing.assert_close(loss, want.detach(), **TOL)
    grads = dict(eager.named_parameters())
    for n, q in model.named_parameters():
        torch.testing.assert_close(q.grad, grads[n].grad, **TOL, msg=n)


def _compiled_ranks(rank: int, world: int, plan_json: str, batches: list, compile_stages) -> dict:
    """On each rank: the plan's stages of this rank (compiled as ``compile_stages`` or the plan say), three SGD
    steps under 1F1B, the last batch smaller; the losses and this rank's parameters."""
    import json

    from fxpipe.distributed import PipelineRank
    plan = fxpipe.Plan.from_dict(json.loads(plan_json))
    torch.manual_seed(0)
    stage = PipelineRank(plan, SkipCNN, F.cross_entropy, timeout_s=120,
                         options=fxpipe.CompileOptions(compile_stages=compile_stages))
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    losses = []
    for x, y in batches:
        loss = stage.step(x, y)
        losses.append(None if loss is None else loss.item())
        opt.step()
        opt.zero_grad()
    plan.schedule = "zb-h1"
    try:
        PipelineRank(plan, SkipCNN, F.cross_entropy, options=fxpipe.CompileOptions(compile_stages=compile_stages))
        refused = ""
    except fxpipe.FxpipeError as exc:
        refused = str(exc)
    return {"losses": losses, "compiled": stage.pipe.compiled, "refused": refused,
            "params": {n: p.detach().clone() for n, p in stage.named_parameters()}}


@pytest.mark.slow
def test_pipeline_ranks_compile_their_stages_as_the_plan_says():
    """Two processes (gloo), each compiling its own stage as the plan records (``plan.compiled``), train as the
    eager model; a zero-bubble plan with compiled stages is refused before anything is built."""
    from distributed_run import run_ranks
    from forced_cuts import compile_with_cuts

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 5, (n,), generator=g)) for n in (6, 6, 4)]
    torch.manual_seed(0)
    plan = copy.deepcopy(compile_with_cuts(SkipCNN(), (batches[0][0],), ["convs_2"], chunks=2,
                                           schedule="1f1b").plan)
    plan.compiled = {"options": {"backend": "inductor"}}
    results = run_ranks(2, _compiled_ranks, plan.to_json(), batches, None, deadline_s=600)
    assert all("ok" in r for r in results), [r.get("trace") for r in results]
    assert all(r["ok"]["compiled"] == {"backend": "inductor"} for r in results)
    assert all("schedule 'zb-h1' splits each stage's backward" in r["ok"]["refused"] for r in results)
    torch.manual_seed(0)
    model = SkipCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for (x, y), got in zip(batches, results[1]["ok"]["losses"]):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(torch.tensor(got), loss.detach(), **TOL)
    params = {n: t for r in results for n, t in r["ok"]["params"].items()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(params[n], p.detach(), **TOL, msg=n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_compiled_stages_on_a_gpu_compute_the_eager_model():
    """Inductor's Triton kernels on the stages' compute streams (:mod:`fxpipe.runtime.boundaries.streams`): both
    stages on
    the first GPU, 1F1B with the first stage recomputed, an uneven last batch; loss and gradients are the eager
    model's."""
    torch.manual_seed(0)
    model = SkipCNN().cuda()
    eager = copy.deepcopy(model)
    x = torch.randn(8, 3, 8, 8, device="cuda")
    pipe = fxpipe.compile(torch.compile(model), ["cuda:0", "cuda:0"], (x,), chunks=4, stages=2, schedule="1f1b",
                          checkpoint="except_last")
    assert pipe.compiled == {"backend": "inductor"} and pipe.plan.compiled["compile_s"] > 0
    for n in (8, 6):
        x, target = torch.randn(n, 3, 8, 8, device="cuda"), torch.randn(n, 5, device="cuda")
        want_out, want_loss, want_grads = _reference(eager, x, target, 4)
        model.zero_grad(set_to_none=True)
        loss, out = pipe.step(x, target, F.mse_loss, return_outputs=True)
        torch.testing.assert_close(out, want_out, **TOL)
        torch.testing.assert_close(loss, want_loss, **TOL)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, want_grads[name], **TOL, msg=name)


def test_asynchronous_training_swaps_weight_versions_into_compiled_stages():
    """AsyncTrainer runs each micro-batch on the weight version its forward saw, swapped into the stage module
    for the operation: compiled stages read the swapped tensors (dynamo lifts parameters as graph inputs) and
    train as eager ones. The aot_eager backend (dynamo and AOT autograd, no code generation) keeps it fast."""
    from test_asynchronous import Chain, _batches

    weights = []
    for stages in (False, {"backend": "aot_eager"}):
        torch.manual_seed(0)
        model = Chain(3)
        pipe = fxpipe.compile(model, ["cpu"] * 3, (torch.ones(4, 3, dtype=torch.float64),), chunks=2, stages=3,
                              schedule="1f1b", profile="estimate", options=fxpipe.CompileOptions(compile_stages=stages))
        trainer = fxpipe.AsyncTrainer(pipe, lambda ps: torch.optim.SGD(ps, lr=0.05), mode="stash")
        trainer.train(_batches(5), lambda out, t: out.mean())
        weights.append([q.detach().clone() for q in model.parameters()])
    assert pipe.compiled == {"backend": "aot_eager"}
    for a, b in zip(*weights):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
