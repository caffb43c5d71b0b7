"""Recomputation per block (``checkpoint="blocks"``, ``"blocks:K"``, ``"selective"``): exact against the whole model
under every schedule (or refused with the reason), keeping less than no recomputation (the share of it the memory
model predicts, against the allocator's count), with the stage's state unchanged, and chosen by ``checkpoint="auto"`` when memory is short."""

from __future__ import annotations

import copy

import pytest
import torch

import fxpipe
from fxpipe.planning.memory_model import predict_worker_memory, recompute_s, stage_bytes
from fxpipe.runtime.execute.memory_probe import allocations

transformers = pytest.importorskip("transformers")
from hf_models import build, padded_batch  # noqa: E402

EST = fxpipe.ProfileOptions(mode="estimate")


def _compile(model, batch, schedule="1f1b", chunks=3, checkpoint="never", memory=None):
    stages = 4 if schedule in ("zb-v", "interleaved-1f1b") else 2
    options = fxpipe.CompileOptions(memory_bytes=None if memory is None else [memory] * 2)
    return fxpipe.compile(model, ["cpu"] * 2, (batch["input_ids"],), example_kwargs={"labels": batch["labels"]},
                          chunks=chunks, schedule=schedule, stages=stages, checkpoint=checkpoint, profile=EST,
                          options=options)


def _assert_exact(pipe, model, reference, batch):
    loss = pipe.step(batch["input_ids"], labels=batch["labels"])
    expected = reference(**batch).loss
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    named = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, named[name].grad, rtol=1e-4, atol=1e-6, msg=name)


# (Llama whole blocks under GPipe: the auto test below; Qwen3 selective and whole blocks on gloo ranks with tensor
# parallelism: tests/test_mesh_tp.py; compiled stages: tests/test_compiled_stages.py)
@pytest.mark.parametrize("family,mode,schedule,chunks", [
    ("llama", "selective", "gpipe", 3), ("llama", "blocks:2", "1f1b", 3), ("llama", "blocks", "interleaved-1f1b", 4),
    ("gpt2", "selective", "interleaved-1f1b", 4), ("t5", "blocks:2", "1f1b", 3)])
def test_per_block_recomputation_trains_as_the_whole_model(family, mode, schedule, chunks):
    model = build(family)
    reference = copy.deepcopy(model)
    batch = padded_batch(family, 7)
    pipe = _compile(model, batch, schedule, chunks, checkpoint=mode)
    recomputed = [name for stage in pipe.stages for name, _ in stage.named_children() if "recomputed_block" in name]
    assert recomputed, "no block was set to recompute"
    _assert_exact(pipe, model, reference, batch)


def _held_bytes(stage, args):
    """Bytes the stage's forward leaves allocated (its outputs and what it keeps for backward), by the allocator."""
    with allocations(torch.device("cpu")) as found:
        out = stage(*args)
    del out
    return found.net_bytes


def test_block_modes_keep_less_and_leave_the_stage_state_alone():
    batch = padded_batch("llama", 8)
    kept, keys, predicted = {}, {}, {}
    for mode in ("never", "selective", "blocks:2", "blocks"):
        pipe = _compile(build("llama"), batch, checkpoint=mode)
        stage = pipe.stages[0]
        ids = batch["input_ids"].requires_grad_(False)
        args = [ids if "input" in name else None for name in pipe.specs[0].inputs]
        if any(a is None for a in args):
            pytest.skip(f"stage 0 reads {pipe.specs[0].inputs}")
        kept[mode] = _held_bytes(stage, args)
        predicted[mode] = stage_bytes(pipe.plan.stages[0], mode).full
        keys[mode] = list(stage.state_dict())
    assert kept["blocks"] < kept["blocks:2"] < kept["never"]
    assert kept["blocks"] < kept["selective"] < kept["never"]
    assert keys["blocks"] == keys["selective"] == keys["never"]
    for mode in ("selective", "blocks:2", "blocks"):   # the share of "never" each keeps, measured and predicted
        measured, model = kept[mode] / kept["never"], predicted[mode] / predicted["never"]
        assert model == pytest.approx(measured, rel=0.35), (mode, measured, model)


def test_the_memory_and_time_model_orders_the_modes():
    pipe = _compile(build("llama"), padded_batch("llama", 8))
    st = pipe.plan.stages[0]
    assert st.blocks and all(b["act_bytes"] > 0 and b["fwd_s"] > b["kept_fwd_s"] >= 0 for b in st.blocks)
    full = {mode: stage_bytes(st, mode).full for mode in ("never", "selective", "blocks:2", "blocks")}
    assert full["blocks"] < full["blocks:2"] < full["never"] and full["blocks"] < full["selective"] < full["never"]
    m = pipe.plan.chunks
    seconds = {mode: recompute_s(st, mode, m) for mode in ("never", "selective", "blocks:2", "blocks", "always")}
    assert seconds["never"] == 0 < seconds["selective"] < seconds["blocks"] <= seconds["always"]
    assert seconds["blocks:2"] < seconds["blocks"]
    charged = _compile(build("llama"), padded_batch("llama", 8), checkpoint="blocks").plan   # the time as run
    assert [s.nodes for s in charged.stages] == [s.nodes for s in pipe.plan.stages]
    assert charged.predicted["iteration_s"] > pipe.plan.predicted["iteration_s"]


def test_auto_chooses_a_block_mode_when_whole_stages_do_not_fit_and_the_plan_runs_and_is_charged():
    batch = padded_batch("llama", 8)
    roomy = _compile(build("llama"), batch, schedule="gpipe", chunks=4, checkpoint="auto").plan
    peak = {mode: max(w.peak_bytes for w in predict_worker_memory(roomy, checkpoint=mode))
            for mode in ("never", "except_last", "blocks")}
    assert peak["blocks"] < min(peak["never"], peak["except_last"])
    model = build("llama")
    reference = copy.deepcopy(model)
    pipe = _compile(model, batch, schedule="gpipe", chunks=4, checkpoint="auto",
                    memory=(peak["blocks"] + min(peak["never"], peak["except_last"])) / 2)
    modes = [st.checkpoint for st in pipe.plan.stages]
    assert any(mode.startswith("blocks") or mode == "selective" for mode in modes), modes
    assert pipe.plan.predicted["iteration_s"] > roomy.predicted["iteration_s"]   # the recomputation is charged
    assert [st.checkpoint for st in fxpipe.Plan.from_dict(pipe.plan.to_dict()).stages] == modes
    _assert_exact(pipe, model, reference, batch)


@pytest.mark.parametrize("mode", ["selective", "blocks", "blocks:2"])
def test_per_block_modes_under_a_split_backward_are_refused_with_the_reason_and_auto_leaves_those_schedules_out(mode):
    """torch's checkpointing recomputes a block once per backward call; a split backward makes two, and held the
    first one's recomputation until the weight pass (refuse_with_schedule's measurement): refused, naming the
    whole-stage modes and the schedules that run per-block recomputation."""
    batch = padded_batch("llama", 8)
    with pytest.raises(ValueError, match=f"checkpoint='{mode}' cannot run under zb-h1.*checkpoint='always'"):
        _compile(build("llama"), batch, schedule="zb-h1", checkpoint=mode)
    pipe = _compile(build("llama"), batch, schedule="auto", checkpoint=mode)
    assert pipe.plan.schedule not in ("zb-h1", "zb-v")
    before = [p.detach().clone() for p in pipe.parameters()]
    with pytest.raises(ValueError, match=f"checkpoint='{mode}' cannot run under zb-h1"):
        pipe.step(batch["input_ids"], labels=batch["labels"], schedule="zb-h1")
    assert all(p.grad is None and torch.equal(p, b) for p, b in zip(pipe.parameters(), before))


def test_a_spelling_of_blocks_that_is_not_one_is_refused():
    batch = padded_batch("llama", 8)
    with pytest.raises(ValueError, match="'blocks:K'"):
        _compile(build("llama"), batch, checkpoint="blocks:0")


def test_ranks_run_the_recomputation_the_plan_was_made_with():
    """A rank's default (``PipelineRank(checkpoint=None)``) is the plan's mode: a plan made with
    ``checkpoint="blocks"`` (or ``"never"``) runs so under ``fxpipe.launch``, not torchgpipe's ``except_last``."""
    from fxpipe.planning.memory_model import planned_mode
    plan = _compile(build("llama"), padded_batch("llama", 8), checkpoint="blocks").plan
    assert planned_mode(plan) == "blocks"
    for mode in ("never", "always", "selective"):
        plan.checkpoint = mode
        assert planned_mode(plan) == mode
    plan.checkpoint = "auto"
    assert planned_mode(plan) == "except_last"   # no stage records a choice (a plan from before the choice)
    for st, mode in zip(plan.stages, ("selective", "never")):
        st.checkpoint = mode
    assert planned_mode(plan) == "auto"          # each stage runs its own
