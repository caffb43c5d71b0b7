"""``fxpipe.plan`` for language models: Hugging Face models on ``meta`` captured through the compile's front end
(torch.export), costed at the dtype they train in (bfloat16 rooflines, mixed precision's optimizer memory),
attention as the GPU's fused kernel, ``schedule``/``chunks``/``checkpoint`` searched by default, and the CLI's
``hf:TYPE`` models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
import fxpipe.cli.hf
from fxpipe.__main__ import main
from fxpipe.cost.devices import PRESETS
from fxpipe.cost.optimizer_state import optimizer_state_factor, training_dtype
from fxpipe.cost.profile import profile_graph

transformers = pytest.importorskip("transformers")

TINY = {
    "llama": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128),
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=256),
    "qwen2": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128),
}


def meta_model(kind: str, dtype: torch.dtype = torch.bfloat16, **overrides) -> nn.Module:
    config = transformers.AutoConfig.for_model(kind, **{**TINY[kind], **overrides})
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def tokens(batch: int, seq: int) -> torch.Tensor:
    return torch.zeros(batch, seq, dtype=torch.long, device="meta")


@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2"])
def test_a_hugging_face_model_on_meta_is_planned_through_export_in_bfloat16(kind):
    model = meta_model(kind)
    plan = fxpipe.plan(model, fxpipe.Devices.preset("h100", 2), (tokens(4, 64),))
    assert all(p.is_meta for p in model.parameters())
    assert plan.frontend["name"] == "export"          # fx cannot trace it: the same front end choice as compile
    assert plan.profile["dtype"] == "bfloat16" and plan.profile["mode"] == "analytic"
    unique = sum(p.numel() * p.element_size() for p in model.parameters())   # tied embeddings counted once
    assert sum(s.param_bytes for s in plan.stages) == unique
    # schedule="auto", chunks="auto" and checkpoint="auto" are the defaults: the search's rows are in the plan
    rows = plan.solver["search"]
    assert {r["schedule"] for r in rows} >= {"gpipe", "1f1b", "zb-h1"} and {r["chunks"] for r in rows} >= {1, 2, 4}
    chosen = [r for r in rows if r["chosen"]]
    assert len(chosen) == 1 and (chosen[0]["schedule"], chosen[0]["chunks"]) == (plan.schedule, plan.chunks)
    assert chosen[0]["iteration_s"] == pytest.approx(plan.predicted["iteration_s"])
    assert plan.checkpoint == "auto" and all(s.checkpoint in ("never", "except_last", "always") for s in plan.stages)


def test_bfloat16_is_costed_at_its_rate_and_mixed_precision_memory():
    """The same model in float32 and bfloat16 on an H100, each as built (precision fp32 and bf16): bfloat16's
    matmuls run at the tensor-core rate and its activations are half the bytes; Adam keeps what the run keeps, its
    moments in the parameter's dtype (fp32: 4 + 4 + 8 bytes; bf16: 2 + 2 + 4)."""
    shape = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=16,
                 max_position_embeddings=1024)
    own = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    plans = {dtype: fxpipe.plan(meta_model("llama", dtype, **shape), fxpipe.Devices.preset("h100", 2),
                                (tokens(8, 1024),), schedule="1f1b", chunks=2, stages=2,
                                options=fxpipe.CompileOptions(precision=own[dtype]))
             for dtype in (torch.float32, torch.bfloat16)}
    fp32, bf16 = plans[torch.float32], plans[torch.bfloat16]
    assert fp32.stage_of() == bf16.stage_of()
    assert sum(s.fwd_s for s in bf16.stages) < 0.5 * sum(s.fwd_s for s in fp32.stages)
    assert bf16.predicted["iteration_s"] < 0.5 * fp32.predicted["iteration_s"]
    assert sum(s.act_bytes for s in bf16.stages) < 0.6 * sum(s.act_bytes for s in fp32.stages)
    assert fp32.problem["optimizer_state_factor"] == 3.0 and bf16.problem["optimizer_state_factor"] == 3.0
    params = sum(p.numel() for p in meta_model("llama", **shape).parameters())
    for plan, each in ((fp32, 16), (bf16, 8)):
        held = sum(w.param_bytes for w in fxpipe.planning.memory_model.predict_worker_memory(plan))
        assert held == pytest.approx(each * params)
    assert "params (bf16)" in bf16.memory_table() and "params (fp32)" in fp32.memory_table()


def test_optimizer_state_per_parameter():
    assert [optimizer_state_factor(o, torch.float32) for o in ("none", "sgd", "momentum", "adam")] == [0, 1, 2, 3]
    assert [optimizer_state_factor(o, torch.bfloat16) for o in ("none", "sgd", "momentum", "adam")] == [0, 1, 2, 3]
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 400).to(torch.bfloat16))
    assert training_dtype(model) == torch.bfloat16      # the dtype holding most parameter bytes
    with pytest.raises(ValueError, match="optimizer must be one of"):
        optimizer_state_factor("lion", torch.float32)


class Attention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_attention_is_costed_as_the_fused_kernel_a_gpu_runs():
    """The math path would save the 2 x 8 x 1024 x 1024 attention weights (32 MiB in bf16); the fused kernel saves
    its inputs (here the graph's inputs, not activations), its output, one float32 log-sum-exp per query row and
    its two int64 RNG scalars."""
    gm = fxpipe.trace(Attention())
    q, k, v = (torch.empty(2, 8, 1024, 64, dtype=torch.bfloat16, device="meta", requires_grad=True) for _ in range(3))
    costs = profile_graph(gm, (q, k, v), torch.device("cpu"), mode="analytic", spec=PRESETS["h100"][0])
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    one = 2 * 8 * 1024 * 64 * 2
    assert costs[node.name].act_bytes == one + 2 * 8 * 1024 * 4 + 2 * 8
    assert costs[node.name].flops == 4 * 2 * 8 * 1024 * 1024 * 64


def test_keyword_inputs_and_the_front_end_are_compiles():
    model = meta_model("llama")
    ids = tokens(4, 32)
    mask = torch.ones(4, 32, dtype=torch.long, device="meta")
    plan = fxpipe.plan(model, fxpipe.Devices.preset("a100", 2), (ids,), example_kwargs={"attention_mask": mask},
                       schedule="gpipe", chunks=2)
    assert plan.frontend["name"] == "export" and "keyword" in plan.frontend["reason"] and plan.chunks == 2
    with pytest.raises(fxpipe.TraceError, match="torch.fx cannot trace"):
        fxpipe.plan(model, fxpipe.Devices.preset("a100", 2), (ids,), options=fxpipe.CompileOptions(frontend="fx"))


def test_a_plan_made_from_shapes_runs_under_compile():
    """The plan fxpipe.plan makes for two CPU workers described by numbers is the one compile takes for the real
    model (the same capture, the same fingerprint), and the pipeline computes the model."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("llama", use_cache=False, **TINY["llama"])
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 256, (4, 16))
    spec = PRESETS["a100"][0]
    devices = fxpipe.Devices([spec, spec], [["X", "HOST"], ["HOST", "X"]], ids=["cpu", "cpu"])
    plan = fxpipe.plan(model, devices, (ids,), schedule="1f1b", chunks=2, stages=2,
                       options=fxpipe.CompileOptions(precision="fp32"))
    assert plan.layout.precision == "fp32"   # the model's own, asked for
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (ids,), plan=plan)
    assert len(pipe.plan.stages) == 2
    torch.testing.assert_close(pipe(ids).logits, model(ids).logits)
    mixed = fxpipe.plan(model, devices, (ids,), schedule="1f1b", chunks=2, stages=2)   # an A100's default
    pipe = fxpipe.compile(model, ["cpu", "cpu"], (ids,), plan=mixed)   # the plan says its precision
    assert pipe.plan.layout.precision == "bf16-mixed"
    params = {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}   # one process under the policy
    with torch.no_grad():
        torch.testing.assert_close(pipe(ids).logits, torch.func.functional_call(model, params, (ids,)).logits)


def fxpipe_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_cli_plans_a_language_model_from_its_config(tmp_path, capsys):
    path = tmp_path / "llama.plan.json"
    code, out, err = fxpipe_cli(capsys, "plan", "hf:llama", "--config",
                                "num_hidden_layers=3,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
                                "num_key_value_heads=2,vocab_size=512,tie_word_embeddings=true",
                                "--seq-len", "32", "--batch", "4", "--devices", "h100x2", "-o", str(path))
    assert code == 0, err
    assert "fxpipe plan for LlamaForCausalLM" in out and "params (fp32)" in out and "schedule search" in out
    assert "precision: bf16-mixed" in out   # the default for a preset computing bfloat16 faster: from_config's float32
    plan = fxpipe.load_plan(path)
    assert plan.profile["dtype"] == "float32" and plan.layout.precision == "bf16-mixed" and plan.batch_size == 4
    config = transformers.AutoConfig.for_model("llama", **{**TINY["llama"], "num_hidden_layers": 3,
                                                           "vocab_size": 512, "tie_word_embeddings": True})
    params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    assert sum(s.param_bytes for s in plan.stages) == 4 * params   # float32, the tied embedding once
    code, out, err = fxpipe_cli(capsys, "plan", "hf:llama", "--config", "num_hidden_layers=2,hidden_size=64,"
                                "intermediate_size=128,num_attention_heads=4,num_key_value_heads=2,vocab_size=512",
                                "--seq-len", "32", "--batch", "4", "--devices", "v100x2", "-q", "-o", str(path))
    assert code == 0 and "precision:" not in out, err   # a V100 computes bfloat16 at float32's rate
    assert fxpipe.load_plan(path).layout.precision == "fp32"
    code, out, err = fxpipe_cli(capsys, "plan", "hf:gpt2", "--config", "n_layer=2,n_embd=64,n_head=4,vocab_size=300",
                                "--seq-len", "16", "--batch", "2", "--devices", "a100x2", "--precision", "bf16-mixed",
                                "--schedule", "gpipe", "--chunks", "2", "-q", "-o", str(path))
    assert code == 0, err
    assert "GPT2LMHeadModel" in out and "params (fp32)" in out and "precision: bf16-mixed" in out
    plan = fxpipe.load_plan(path)   # a float32 model (from_config's) launches it
    assert plan.layout.precision == "bf16-mixed" and plan.profile["dtype"] == "float32"


def test_config_takes_a_key_the_model_reads_with_a_default(tmp_path, capsys):
    """``head_dim``: Qwen3-MoE's default config has no such attribute (the attention reads
    ``getattr(config, "head_dim", hidden_size // heads)``), yet Qwen3-30B-A3B's is 128 beside hidden 2048 / 32 heads."""
    config = ("num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2,"
              "num_experts=4,num_experts_per_tok=2,moe_intermediate_size=32,vocab_size=256,head_dim=32")
    path = tmp_path / "moe.plan.json"
    code, out, err = fxpipe_cli(capsys, "plan", "hf:qwen3_moe", "--config", config, "--seq-len", "16", "--batch", "4",
                                "--devices", "h100x1", "-q", "-o", str(path))
    assert code == 0, err
    made = transformers.AutoConfig.for_model("qwen3_moe", **fxpipe.cli.hf.parse_config(config))
    params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(made).parameters())
    assert made.head_dim == 32 and sum(s.param_bytes for s in fxpipe.load_plan(path).stages) == 4 * params
    code, out, err = fxpipe_cli(capsys, "plan", "hf:qwen3_moe", "--config", "head_dims=32", "--devices", "h100x1")
    assert code == 2 and "did you mean head_dim" in err, err


@pytest.mark.parametrize("args, words", [
    (("hf:llama", "--config", "num_hidden_layer=2"), ("--config num_hidden_layer", "did you mean num_hidden_layers")),
    (("hf:llama", "--config", "num_hidden_layers"), ("is not KEY=VALUE", "--config num_hidden_layers=32")),
    (("hf:lama",), ("no model type 'lama'", "did you mean llama")),
    (("hf:llama", "--seq-len", "100000"), ("longer than the model's", "max_position_embeddings")),
    (("hf:llama", "--input-shape", "3,32,32"), ("takes token ids", "--seq-len")),
    (("resnet18", "--config", "num_hidden_layers=2"), ("--config sets a Hugging Face config", "hf:llama")),
])
def test_bad_language_model_arguments_are_one_line_naming_the_fix(capsys, args, words):
    code, out, err = fxpipe_cli(capsys, "plan", *args, "--devices", "h100x2")
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, err
