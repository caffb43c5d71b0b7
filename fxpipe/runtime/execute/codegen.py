"""One ``torch.fx.GraphModule`` per stage, with explicit inputs and outputs.

Written instead of ``torch.fx.passes.split_module`` because the pipeline needs
two things that pass does not give: a value produced in stage ``a`` and read in
stage ``b > a + 1`` (a skip connection) goes straight to ``b``, not through the
stages between; and each ``Parameter`` belongs to exactly one stage module. A
parameter read by several stages (tied weights) is, with ``copies=True``, read by
the first of them as the model's own and by each later one through its own copy
(:mod:`fxpipe.runtime.boundaries.tied`: gradients summed once per step); with ``copies=False``
it belongs to the first and reaches the others as a value every micro-batch (its
gradient flowing back through autograd), as torch.distributed.pipelining and
asynchronous training need. The stage graphs are built with ``Graph.node_copy``;
the stage modules reference the model's own submodules and parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from fxpipe.errors import FxpipeError
from fxpipe.runtime.boundaries.aliasing import aliases_of, is_inplace, written_buffers, written_inputs
from fxpipe.runtime.boundaries.tied import install_copies, shared_parameter_reads

__all__ = ["StageSpec", "split_graph", "is_inplace", "move_stage"]


@dataclass
class StageSpec:
    index: int
    module: fx.GraphModule
    inputs: list[str]    # names of values this stage reads (graph inputs or earlier stages' outputs)
    outputs: list[str]   # names of values later stages or the model output read


def _protect_mutated_inputs(graph: fx.Graph, root: torch.nn.Module) -> None:
    """Clone every stage input that the stage writes into, before anything reads it.

    The input belongs to the previous stage (autograd may have saved it) and is
    re-read when a checkpointed stage recomputes; writing into it in place would
    corrupt both, so the stage works on its own copy. The write may come through
    any alias of the input (``nn.Identity`` then ``ReLU(inplace=True)``, a view
    then ``add_``: :mod:`fxpipe.runtime.boundaries.aliasing`); an input nothing writes is
    not copied.
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for ph in placeholders:
        aliases = aliases_of([ph], root)
        if not any(aliases.intersection(written_inputs(u, root)) for a in aliases for u in a.users):
            continue
        with graph.inserting_after(placeholders[-1]):
            copy = graph.call_function(torch.clone, (ph,))
        ph.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy)


def _refuse_buffers_updated_across_stages(gm: fx.GraphModule, stage_of: dict[str, int]) -> None:
    """A buffer updated in place must be used in one stage only: stages run micro-batches in an order of
    their own, so a buffer updated in one stage and read or updated in another would hold a value that
    depends on the schedule (a moving average updated by ``mul_`` here and ``add_`` there, a counter read
    downstream), where the model's successive calls give one answer."""
    written = written_buffers(gm)
    by_buffer: dict[str, set[int]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in written:
            users = {u for a in aliases_of([node], gm) for u in [a, *a.users]
                     if u.op not in ("get_attr", "output", "placeholder")}
            by_buffer.setdefault(node.target, set()).update(stage_of[u.name] for u in users)
        elif node.op == "call_module":
            module = gm.get_submodule(node.target)
            if module.training and any(True for _ in module.buffers()):
                by_buffer.setdefault(f"{node.target}.*", set()).add(stage_of[node.name])
    for name, stages in by_buffer.items():
        if len(stages) > 1:
            owner = name.rpartition(".")[0]
            fix = (f"make the module that owns it a leaf (leaf_modules=[{owner!r}]) so its updates stay in one "
                   "stage" if owner else "move the update into a submodule and make that a leaf (leaf_modules=)")
            raise FxpipeError(
                f"buffer {name!r} is updated in place and used in stages {sorted(stages)}: each stage runs the "
                f"micro-batches in its own order, so its value would depend on the schedule; {fix}, or compile "
                "with fewer stages")


def _is_module(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_submodule(target)
    except AttributeError:   # a parameter, a buffer or a constant: not a module
        return False
    return True


def split_graph(gm: fx.GraphModule, stage_of: dict[str, int], num_stages: int, copies: bool = False
                ) -> list[StageSpec]:
    """Split ``gm`` by ``stage_of`` (node name -> stage); placeholders are the pipeline's inputs. With ``copies``
    a parameter several stages read gets a copy in each later one (:mod:`fxpipe.runtime.boundaries.tied`)."""
    nodes = list(gm.graph.nodes)
    compute = [n for n in nodes if n.op not in ("placeholder", "output")]
    missing = [n.name for n in compute if n.name not in stage_of]
    if missing:
        raise ValueError(f"{len(missing)} graph nodes have no stage, e.g. {missing[:3]}")
    for n in compute:
        for u in n.users:
            if u.op != "output" and stage_of[u.name] < stage_of[n.name]:
                raise ValueError(
                    f"node {u.name!r} (stage {stage_of[u.name]}) reads {n.name!r} from a later stage "
                    f"{stage_of[n.name]}: stages must follow the data flow"
                )
    _refuse_buffers_updated_across_stages(gm, stage_of)
    # A buffer is read where it is used, never sent as a value: a stage that updates it in place must update
    # the buffer itself (not a copy of a value), and its recomputation must see it (fxpipe.runtime.backward.recompute).
    # So is a submodule a node reads (torch.export's grad-mode and autocast regions call theirs): a module is
    # code, not a value, and each stage that calls it holds it.
    buffers = {name for name, _ in gm.named_buffers(remove_duplicate=False)}
    local = {n for n in compute if n.op == "get_attr" and (n.target in buffers or _is_module(gm, n.target))}
    # copies=True: a parameter is never sent as a value either: each stage that reads it holds it, the first
    # the model's own, later ones (a tied weight) their copies
    shared = shared_parameter_reads(gm, stage_of) if copies else {}
    if copies:
        local |= {n for n in compute if n.op == "get_attr" and _parameter(gm, n.target) is not None}
    specs = []
    for k in range(num_stages):
        own = [n for n in compute if stage_of[n.name] == k]
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        inputs: list[fx.Node] = []
        reads: list[fx.Node] = []
        for n in own:
            for a in n.all_input_nodes:
                if a in env or a in inputs or a in reads or (a.op != "placeholder" and stage_of[a.name] == k):
                    continue
                (reads if a in local else inputs).append(a)
        for a in inputs:
            env[a] = graph.placeholder(a.name)
        for a in reads:
            env[a] = graph.node_copy(a)
        for n in own:
            if n in local and not any(u.op == "output" or stage_of[u.name] == k for u in n.users):
                continue   # read by later stages only, each of which reads it itself: not held here
            env[n] = graph.node_copy(n, lambda a: env[a])
        outputs = [n for n in own
                   if any(u.op == "output" or (stage_of[u.name] > k and n not in local) for u in n.users)]
        graph.output(tuple(env[n] for n in outputs))
        _protect_mutated_inputs(graph, gm)
        graph.lint()
        module = fx.GraphModule(gm, graph, f"Stage{k}")
        if shared:
            install_copies(module, k, gm, shared)
        specs.append(StageSpec(k, module, [a.name for a in inputs], [n.name for n in outputs]))
    return specs


def _parameter(gm: fx.GraphModule, target: str) -> nn.Parameter | None:
    try:
        return gm.get_parameter(target)
    except AttributeError:   # a buffer, a module or a constant tensor
        return None


def move_stage(spec: StageSpec, device: torch.device) -> None:
    """Put a stage's parameters and buffers on ``device`` (in place, like torchgpipe)."""
    spec.module.to(device)
