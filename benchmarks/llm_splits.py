"""Why fxpipe exists, for language models: its plan against torchtitan's default LLM split and an even split of
the layers, on the same runtime and the same model.

torchtitan's split (``generate_llm_fqn_per_model_part``, written here from its description): the embedding
and the output (norm + head) each count as one layer; the ``layers + 2`` effective layers are shared as evenly
as possible over the stages, the remainder one each to the first stages; the first stage's share holds the
embedding and one layer fewer, the last stage's the output and one layer fewer. The even split gives every stage
``layers / stages`` layers (the remainder to the first stages), the embedding to the first and the output to the
last. Neither looks at what the layers, the embedding or the head cost, which is what fxpipe solves for: with a
large vocabulary the head is worth many layers.

Measured: Hugging Face ``LlamaForCausalLM`` and ``GPT2LMHeadModel``, 16 layers of width 256, vocabularies of
4096 and 32000, 16 sequences of 128 tokens, on 2 CPU workers of this machine with one intra-op thread each
(each worker a processor of its own, as each stage has a GPU of its own; ``--threads``), 1F1B with 4
micro-batches.
fxpipe's plan is ``compile(model, ["cpu", "cpu"], (ids,), schedule="1f1b", chunks=4, stages=2)``; the other
splits are that plan with its nodes re-assigned at their layer boundary, compiled with ``plan=`` (the same
runtime, schedule and micro-batches). Steps are interleaved, one of each per round; the ratio is the median over
rounds of (split's step / fxpipe's step in the same round), with the smallest and largest in brackets.

Simulated: Llama-3-8B-shaped (32 layers, 4096 wide) and GPT-2-XL-shaped (48 layers, 1600 wide) models in
bfloat16 on 8 and 16 H100s, 32 sequences per step. fxpipe's plan is ``fxpipe.plan``'s with nothing set
(schedule, micro-batches and checkpointing searched); torchtitan's and the even split are costed by the same
planner on the same analytic costs with that plan's schedule, micro-batches, stage count (two stages per GPU for
ZB-V, as torchtitan's virtual stages) and stage devices (``Planner.costed``), and every plan's step is the same
simulator's. "torchtitan, 1F1B" is torchtitan's defaults: its split over one stage per GPU in order, 1F1B, the
same micro-batches. "plan s" is the capture and costs (once per model) + the search.

    flock /tmp/fxpipe-bench.lock python benchmarks/llm_splits.py [--rounds 7] [--skip-cpu] [--skip-gpu]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
import solvers
from fxpipe.analytic import cost_model, planner_for
from fxpipe.planning.auto import plan_auto
from fxpipe.planning.planner import module_path
from solvers.schedule_search import chunk_choices
from solvers.simulate import simulate_solution

SEED = 0


def torchtitan_layers(layers: int, stages: int, input_weight: int = 1, output_weight: int = 1) -> list[int]:
    """Transformer layers per stage of torchtitan's default LLM split (module doc)."""
    effective = layers + input_weight + output_weight
    base, extra = divmod(effective, stages)
    shares = [base + (1 if s < extra else 0) for s in range(stages)]
    shares[0] -= input_weight
    shares[-1] -= output_weight
    if min(shares) < 0 or sum(shares) != layers:
        raise ValueError(f"torchtitan's split cannot share {layers} layers over {stages} stages")
    return shares


def even_layers(layers: int, stages: int) -> list[int]:
    base, extra = divmod(layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def layers_per_stage(stage_nodes: list[list[str]], paths: dict[str, str], prefix: str, layers: int) -> list[int]:
    """How many of the ``layers`` blocks each stage holds (a block cut inside counts in the stage it starts in)."""
    stage_of = {n: s for s, nodes in enumerate(stage_nodes) for n in nodes}
    order = [n for nodes in stage_nodes for n in nodes]
    counts = [0] * len(stage_nodes)
    for k in range(layers):
        counts[stage_of[next(n for n in order if _in_layer(paths.get(n, ""), prefix, k))]] += 1
    return counts


def _in_layer(path: str, prefix: str, k: int) -> bool:
    return path == f"{prefix}.{k}" or path.startswith(f"{prefix}.{k}.")


def forced_stages(order: list[str], paths: dict[str, str], prefix: str, shares: list[int]) -> list[list[str]]:
    """``order`` cut so that stage ``s + 1`` starts at the first node of its first layer."""
    layers = sum(shares)
    after_last = 1 + max(i for i, n in enumerate(order) if _in_layer(paths.get(n, ""), prefix, layers - 1))
    starts, first = [], 0
    for share in shares[:-1]:   # a last stage of no layer holds what follows them: the norm and the head
        first += share
        starts.append(after_last if first == layers else
                      next(i for i, n in enumerate(order) if _in_layer(paths.get(n, ""), prefix, first)))
    bounds = [0] + starts + [len(order)]
    return [order[a:b] for a, b in zip(bounds, bounds[1:])]


# ----------------------------------------------------------------------------------------- the models
def hf_model(kind: str, layers: int, width: int, vocab: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
             **extra: Any) -> nn.Module:
    import transformers
    if kind == "llama":
        shape = dict(num_hidden_layers=layers, hidden_size=width, num_attention_heads=extra.pop("heads", width // 64),
                     num_key_value_heads=extra.pop("kv_heads", max(1, width // 256)),
                     intermediate_size=extra.pop("intermediate", 4 * width),
                     max_position_embeddings=extra.pop("positions", 4096))
    else:
        shape = dict(n_layer=layers, n_embd=width, n_head=max(1, width // 64), n_positions=extra.pop("positions", 1024),
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config = transformers.AutoConfig.for_model(kind, vocab_size=vocab, use_cache=False, **shape, **extra)
    torch.manual_seed(SEED)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


PREFIX = {"llama": "model.layers", "gpt2": "transformer.h"}
NAME = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}


def paths_of(graph: Any) -> dict[str, str]:
    return {n.name: module_path(n) for n in graph.graph.nodes}


# ----------------------------------------------------------------------------------------- measured
def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def cpu_row(kind: str, vocab: int, rounds: int) -> list[str]:
    from fxpipe.frontend.capture import capture

    layers, stages, chunks = 16, 2, 4
    model = hf_model(kind, layers, 256, vocab).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (16, 128), generator=g)
    target = torch.randint(0, vocab, (16, 128), generator=g)
    started = time.perf_counter()
    pipes = {"fxpipe": fxpipe.compile(model, ["cpu"] * stages, (ids,), schedule="1f1b", chunks=chunks, stages=stages)}
    compile_s = time.perf_counter() - started
    plan = pipes["fxpipe"].plan
    paths = paths_of(capture(model, (), None, "auto", (ids,), other_mode=False).graph)
    order = [n for st in plan.stages for n in st.nodes]
    prefix = PREFIX[kind]
    splits = {"fxpipe": layers_per_stage([st.nodes for st in plan.stages], paths, prefix, layers),
              "torchtitan": torchtitan_layers(layers, stages), "even": even_layers(layers, stages)}
    same = {}
    for name in ("torchtitan", "even"):
        twin = next((other for other in pipes if splits[other] == splits[name]), None)
        if twin is not None:
            same[name] = twin
            continue
        forced = copy.deepcopy(plan)
        for st, nodes in zip(forced.stages, forced_stages(order, paths, prefix, splits[name])):
            st.nodes, st.checkpoint = nodes, ""
        pipes[name] = fxpipe.compile(model, ["cpu"] * stages, (ids,), plan=forced)
    times: dict[str, list[float]] = {name: [] for name in pipes}
    for name, pipe in pipes.items():   # a warm-up step each
        pipe.step((ids,), target, loss_fn)
    for _ in range(rounds):
        for name, pipe in pipes.items():
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            pipe.step((ids,), target, loss_fn)
            times[name].append(time.perf_counter() - t0)
    for name, twin in same.items():
        times[name] = times[twin]
    row = [NAME[kind], str(vocab), f"{compile_s:.0f}"]
    for name in ("fxpipe", "torchtitan", "even"):
        ratios = sorted(t / f for t, f in zip(times[name], times["fxpipe"]))
        spread = "" if name == "fxpipe" or name in same else f" ({ratios[0]:.2f}-{ratios[-1]:.2f})"
        row += ["/".join(map(str, splits[name])), f"{statistics.median(times[name]):.3f}",
                f"{statistics.median(ratios):.2f}x" + (" (same cuts)" if name in same else spread)]
    return row


# ----------------------------------------------------------------------------------------- simulated
def simulated_s(plan: fxpipe.Plan) -> float:
    """The plan's iteration on the schedule's simulator (what the auto search compares plans on)."""
    problem = solvers.Problem.from_dict(plan.problem)
    solution = solvers.Solution([solvers.Stage(list(st.nodes), list(devices))
                                 for st, devices in zip(plan.stages, plan.solver["stage_devices"])])
    return simulate_solution(problem, solution, plan.schedule, workers=plan.workers,
                             recompute_share=plan.predicted.get("recompute_share", 0.0)).iteration_s


def gpu_rows(kind: str, shape: dict[str, Any], vocabs: list[int], counts: list[int], batch: int,
             seq: int) -> list[list[str]]:
    rows = []
    for vocab in vocabs:
        layers = shape["layers"]
        model = hf_model(kind, device="meta", dtype=torch.bfloat16, vocab=vocab, **shape)
        ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        started = time.perf_counter()
        # what fxpipe.plan does, once for both device counts: capture and cost (a sequence per micro-batch, which
        # is also what fxpipe.plan costs at for 8 or 16 GPUs and 32 sequences), then its search per count
        costed = cost_model(model, (ids,), fxpipe.Devices.preset("h100", 1).specs[0], batch)
        cost_s = time.perf_counter() - started
        paths = paths_of(costed.captured.graph)
        for n in counts:
            devices = fxpipe.Devices.preset("h100", "0:0-7" if n == 8 else f"0:0-7,1:0-{n - 9}")
            started = time.perf_counter()
            search = plan_auto(planner_for(costed, devices, schedule="gpipe"), costed.costs, costed.profiled,
                               chunk_choices(costed.most, n), overhead_s=costed.spec.launch_s)
            search_s = time.perf_counter() - started
            default = search.plan
            stages = len(default.stages)
            order = [x for st in default.stages for x in st.nodes]
            modes = _modes(default)
            results = {"fxpipe": (simulated_s(default), layers_per_stage([st.nodes for st in default.stages], paths,
                                                                          PREFIX[kind], layers), modes)}
            for name, shares in (("torchtitan", torchtitan_layers(layers, stages)),
                                 ("even", even_layers(layers, stages))):
                like = copy.deepcopy(default)   # the same schedule, micro-batches, stage devices and planner
                for st, nodes in zip(like.stages, forced_stages(order, paths, PREFIX[kind], shares)):
                    st.nodes = nodes
                try:
                    forced = search.planner.costed(search.costs, like)
                    results[name] = (simulated_s(forced), shares, _modes(forced))
                except MemoryError:
                    results[name] = (None, shares, "")
            # torchtitan's defaults: its split, one stage per GPU in order, 1F1B, the same micro-batches
            planner = planner_for(costed, devices, schedule="1f1b", stages=n)
            like = planner.plan(costed.costs)   # a 1F1B plan of n stages to re-assign
            order_1f1b = [x for st in like.stages for x in st.nodes]
            shares = torchtitan_layers(layers, n)
            for k, (st, nodes) in enumerate(zip(like.stages, forced_stages(order_1f1b, paths, PREFIX[kind], shares))):
                st.nodes = nodes
                like.solver["stage_devices"][k] = [f"{k}:{torch.device(devices.ids[k])}"]
            try:
                titan = planner.costed(costed.costs, like)
                results["torchtitan 1F1B"] = (simulated_s(titan), shares, _modes(titan))
            except MemoryError:
                results["torchtitan 1F1B"] = (None, shares, "")
            fx_s = results["fxpipe"][0]
            row = [NAME[kind], str(vocab), f"{n} H100", f"{cost_s:.0f}+{search_s:.0f}",
                   f"{default.schedule}, {default.chunks}, {modes}"]
            for name in ("fxpipe", "torchtitan", "even", "torchtitan 1F1B"):
                seconds, shares, mode = results[name]
                text = "/".join(map(str, shares))
                # a split that must checkpoint where fxpipe's did not is not charged its recomputation: it says so
                other = f", {mode}" if mode != modes else ""
                cell = "does not fit" if seconds is None else f"{seconds:.3f}" + (
                    "" if name == "fxpipe" else f" ({seconds / fx_s:.2f}x{other})")
                row += [cell] if name == "torchtitan 1F1B" else [text if len(shares) <= 8 else _short(text), cell]
            rows.append(row)
            print("  ".join(row), file=sys.stderr, flush=True)
    return rows


def _modes(plan: fxpipe.Plan) -> str:
    return ",".join(sorted({st.checkpoint or plan.checkpoint for st in plan.stages}))


def _short(shares: str) -> str:
    parts = shares.split("/")
    return "/".join(parts[:2] + ["…"] + parts[-2:]) if len(parts) > 5 else shares


def table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="timed steps of each split (interleaved)")
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--skip-gpu", action="store_true")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads per CPU worker (default 1: each worker a processor of its own, as "
                             "each stage has its own GPU; with 2 threads two workers share both processors, and "
                             "whichever is busy uses both, which hides the balance of the split)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.skip_cpu:
        print(f"Measured: 2 CPU workers ({args.threads} intra-op thread each), 16 layers of width 256, 16 x 128 "
              f"tokens, 1F1B, 4 micro-batches; median of {args.rounds} interleaved steps; {os.cpu_count()} "
              f"processors, load average {os.getloadavg()[0]:.1f}")
        rows = [cpu_row(kind, vocab, args.rounds) for kind in ("llama", "gpt2") for vocab in (4096, 32000)]
        print(table(["model", "vocab", "compile s", "fxpipe layers", "s/step", "", "torchtitan layers", "s/step",
                     "vs fxpipe", "even layers", "s/step", "vs fxpipe"], rows))
        print()
    if not args.skip_gpu:
        print("Simulated: bfloat16 on H100s (fxpipe.plan's analytic costs and simulator), 32 sequences per step; "
              "fxpipe's default plan (schedule, micro-batches, checkpointing searched) and the other splits with "
              "its schedule, micro-batches, stage count and GPUs")
        rows = gpu_rows("llama", dict(layers=32, width=4096, intermediate=14336, heads=32, kv_heads=8),
                        [128256, 32000], [8, 16], 32, 4096)
        rows += gpu_rows("gpt2", dict(layers=48, width=1600), [50257, 8192], [8, 16], 32, 1024)
        print(table(["model", "vocab", "GPUs", "plan s", "schedule, chunks, ckpt", "fxpipe layers", "s/step",
                     "torchtitan layers", "s/step", "even layers", "s/step", "torchtitan, 1F1B"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
