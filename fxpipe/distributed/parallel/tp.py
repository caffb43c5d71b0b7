"""Tensor parallelism inside a pipeline stage: this rank's stage modules sharded over the ``tp`` dimension of the
mesh with torch's ``parallelize_module`` (``ColwiseParallel``, ``RowwiseParallel``).

:func:`apply_tp` takes a plan (module path patterns → torch's styles) or derives the default one
(:mod:`fxpipe.distributed.parallel.tp_plans`: attention q/k/v column-wise and its output row-wise, MLP up/gate
column-wise and down row-wise, for Llama, Mistral, Qwen2, GPT-2 and BERT blocks; GPT-2's fused q/k/v ``c_attn``
with each rank's share of q, k and v), and applies it to the layers this
rank's stages call, after the pipeline's split and before data parallelism wraps the stages.

How it stays exact under both front ends
----------------------------------------
torch's styles act through the layer's forward hooks: the input becomes a ``DTensor``, the layer runs on sharded
``DTensor`` weights, the output is converted back. Two things break that in a traced stage:

1. **The layer must be called as a module.** torch.fx keeps ``call_module`` nodes, so a plan by path applies as is.
   ``torch.export`` (the Hugging Face path) records ``aten.linear(x, weight, bias)`` on the weights directly: no
   hook would run. Of the three ways considered — DTensor parameters through the exported ATen ops alone (plain
   activations meet ``DTensor`` weights: torch refuses the mix, and nothing would all-reduce a row-wise layer's
   partial sums), applying TP to the model before capture (the captured graph, its fingerprint and the plan's
   partition would then depend on ``tp`` and on collectives traced into it), and calling the layers as modules
   again — fxpipe does the last: :func:`fxpipe.distributed.parallel.module_calls.restore_module_calls` replaces
   each planned layer's ``aten.linear`` (``aten.addmm`` for GPT-2's ``Conv1D``) by a ``call_module`` of the
   model's own layer. The plan, its partition and the fingerprint are the single-device ones, unchanged.
2. **The head counts a trace recorded.** A traced graph holds the model's shapes as constants: Llama's exported
   graph expands its key/value heads with ``expand(b, 2, 2, s, 8)`` and reshapes to ``(b, 4, s, 8)``, the full
   head counts. torchtitan changes ``n_heads`` per rank before it runs eager code; a recorded graph cannot be
   changed that way. Three ways were weighed:

   a. ``DTensor`` activations between the column-wise and row-wise layers (``use_local_output=False``), so that
      the full shapes stay right and torch's sharding rules do the per-rank arithmetic. Unusable: on this
      2-core CPU machine (torch 2.15) the tiny Llama of the tests, whole on 2 tp ranks, had not ended its first
      forward after 420 s; at 60 s and at 300 s both ranks were busy on the same graph line, the first attention
      op (``_scaled_dot_product_flash_attention_for_cpu``), inside DTensor's sharding propagation, which has no
      rule for it and propagates it through its decomposition, whose ops are decomposed and propagated again
      (``faulthandler.dump_traceback_later``; py-spy was not at hand). Slow beyond use or looping: not told apart.
   b. ``local_map`` around the attention core: fixes the attention op only; every other op between the layers
      would still pay DTensor dispatch per call, and the ``expand``/``view`` constants would still need DTensor.
   c. **Plain local activations (chosen):** column-wise layers give this rank's heads as a plain tensor
      (``use_local_output=True``, as torchtitan's plans do), row-wise layers take it as ``Shard(-1)``, and
      :mod:`fxpipe.distributed.parallel.local_shapes` rewrites, once at setup, every ``view``/``reshape``/
      ``expand`` size between them at the sharded dimension (followed node by node with DTensor's own view rules),
      and GPT-2's ``split`` of its fused q/k/v output, to the local one; an operation it cannot follow exactly is
      refused before any parameter changes. A step then runs the unsharded model's operations on ``1/tp`` of the
      heads plus torch's TP collectives (the row-wise all-reduce, the column-wise input's backward all-reduce): a
      pp=2 × tp=2 step of the tiny Llama of the tests takes 0.5–1.1 s on the shared 2-core machine, exact to float
      rounding.

What crosses a stage boundary is a plain tensor: the default plan's column-wise and row-wise layers of one block
form a group that must lie in one stage (refused otherwise, with the fix), and replicated layers (embeddings,
norms, LM head) give plain tensors. Without sequence parallelism the wire carries the same full tensors as without
``tp``; with it (``pipeline=``, :mod:`fxpipe.distributed.parallel.sequence`) the hidden state crosses on this
rank's sequence shard, the norms between the blocks run on it, and the row-wise layers reduce-scatter into it. Gradients of replicated parameters outside the blocks' sharded part are the same on every tp rank (the row-wise
all-reduce and the column-wise input's backward all-reduce make every activation gradient whole, and
:func:`shard_stages` broadcasts every tensor from tp rank 0 before sharding, so the replicas start equal). A
replicated parameter read *between* a block's column-wise and row-wise layers (a per-head norm's weight: Qwen3's
``q_norm``/``k_norm``) gets from each rank's backward the sum over its own heads only: :func:`sum_partial_grads`
sums those over the tp ranks once a step, after the backward passes, as Megatron's finalize does for its q/k layer
norms. The sharded parameters' gradients are ``DTensor`` s sharded as the parameters.

Status: :class:`fxpipe.distributed.PipelineRank` runs it on a mesh with a ``tp`` dim (``("pp", "tp")``,
``("pp", "dp_shard", "tp")``: FSDP2 over the tensor-parallel stages, both meshes sliced from one root as FSDP2
requires). ``tests/test_mesh_tp.py``: Llama (tied, untied) and GPT-2 (attention and MLP sharded) at pp=2 × tp=2
under GPipe, 1F1B and ZB-H1 and Qwen3 (per-head q/k norms) under 1F1B, and all four at pp=2 × dp_shard=2 × tp=2
(the schedules in turn; each under each with ``FXPIPE_FULL_MESH=1``), train as one process within 1e-5;
``tests/test_tp.py``: GPT-2 at tp=2 (2 processes), its loss, gradients and a checkpoint loaded into a plain model
as one process; ``tests/test_checkpoint_sharded.py``: HSDP over tp (pp=1 × dp_replicate=2 × dp_shard=1 × tp=2),
checkpoints between FSDP2, tp and plain ranks, and ``weights=`` on a ``("pp", "tp")`` mesh, Llama as one process
within 1e-5; a ``"bf16-mixed"`` plan of Llama at pp=2 × tp=2 and pp=2 × dp_shard=2 × tp=2 as one process under
the same policy within bfloat16's tolerance (its restored layers compute with their shards' bfloat16 copies,
:mod:`fxpipe.distributed.parallel.mixed_layers`). Qwen2 and BERT were checked at tp=2 in a
scratch run (forward and gradients as one process), not in a test. The tp group's waits end after ``timeout_s``
(under FSDP2 too: the root mesh's groups are made with it, :mod:`fxpipe.distributed.parallel.bounded`). Not offered: DDP replicas of
tensor-parallel stages, torch.fx-traced graphs whose nodes carry no recorded shapes.
"""

from __future__ import annotations

import datetime
from typing import Any, Sequence

import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from fxpipe.distributed.parallel.fsdp import broadcast_states, repoint
from fxpipe.distributed.parallel.local_shapes import localisation, localise_shapes
from fxpipe.distributed.parallel.module_calls import called_modules, restore_module_calls
from fxpipe.distributed.parallel.sequence import (SequenceSharding, apply_sequence_parallel, partial_styles,
                                                 read_parameters, sequence_sharded)
from fxpipe.distributed.parallel.tp_plans import (Conv1DFusedColwise, TPPlan, TPPlanError, default_tp_plan,
                                                  given_tp_plan)

__all__ = ["apply_tp", "locate_tp_layers", "shard_stages", "sum_partial_grads", "tp_mesh_of", "TPPlanError"]


def _reads(gm: nn.Module, path: str) -> bool:
    """Whether ``gm`` holds parameters of the layer at ``path`` (called as a module or read directly)."""
    try:
        sub = gm.get_submodule(path)
    except AttributeError:
        return False
    return any(True for _ in sub.parameters())


def apply_tp(stage_modules: Sequence[nn.Module], tp_mesh: Any, tp_plan: dict[str, ParallelStyle] | None = None,
             *, model: nn.Module, pipeline: tuple[Sequence[nn.Module], Sequence[int]] | None = None) -> TPPlan:
    """Shard the layers that ``stage_modules`` (this rank's stage graph modules) call over the 1-D ``tp_mesh``.

    ``tp_plan`` maps ``model.named_modules()`` path patterns to torch's styles; ``None`` derives the default
    (module doc). ``model`` is the model the stages were split from (its layers are the ones called again as
    modules in an exported graph; their parameters become the ``DTensor`` s). ``pipeline`` (every stage module of
    the plan in pipeline order, and the indices of ``stage_modules`` among them) adds sequence parallelism
    (:mod:`fxpipe.distributed.parallel.sequence`); ``None``: none. Everything is checked before any parameter
    changes: a layer a stage reads without calling it, a block cut by a stage boundary, head counts or a sequence
    ``tp`` does not divide raise :class:`TPPlanError` naming the fix. Returns the plan applied."""
    tp = tp_mesh.size()
    plan = default_tp_plan(model, tp) if tp_plan is None else given_tp_plan(model, tp_plan)
    colwise, rowwise = _kinds(plan)
    located = locate_tp_layers(stage_modules, plan, model)
    # every graph checked (and refused) before any parameter changes
    fused = {p: s.split for p, s in plan.styles.items() if isinstance(s, Conv1DFusedColwise)}
    walks = [localisation(gm, colwise, rowwise, tp, fused) if isinstance(gm, fx.GraphModule) else ({}, set())
             for gm in stage_modules]
    edits = [w[0] for w in walks]
    sequence, own = _sequence(pipeline, plan, rowwise, tp, model)
    reads = [w[1] | (read_parameters(gm, sequence.sharded[own[k]]) if sequence.active else set())
             for k, (gm, w) in enumerate(zip(stage_modules, walks))]
    plan.summed = _summed(stage_modules, reads, model)
    plan.sequence_parallel = sequence.active
    styles = partial_styles(plan.styles, rowwise) if sequence.active else plan.styles
    for k, gm in enumerate(stage_modules):
        mine = {p: s for p, s in styles.items() if located.get(p) == k}
        if mine:
            parallelize_module(gm, tp_mesh, mine)
        if edits[k]:
            localise_shapes(gm, edits[k])
        if sequence.active:
            apply_sequence_parallel(gm, sequence.sharded[own[k]], sequence.length, colwise, rowwise, tp, tp_mesh,
                                    last=own[k] == len(sequence.sharded) - 1)
    return plan


def _sequence(pipeline: tuple[Sequence[nn.Module], Sequence[int]] | None, plan: TPPlan, rowwise: set[str], tp: int,
              model: nn.Module) -> tuple[SequenceSharding, list[int]]:
    """Which nodes of every stage run on sequence shards (none without ``pipeline``), and this rank's stages'
    indices. The other ranks' stage graphs call their planned layers as modules too, to be read alike."""
    if pipeline is None:
        return SequenceSharding(), []
    graphs, own = pipeline
    for k, gm in enumerate(graphs):
        if k not in own and isinstance(gm, fx.GraphModule):
            restore_module_calls(gm, model, plan.styles)
    return sequence_sharded(graphs, rowwise, tp), list(own)


def _summed(stage_modules: Sequence[nn.Module], reads: list[set[str]], model: nn.Module) -> list[str]:
    """The model's names of the trainable parameters that the stage graphs read between a block's layers
    (``reads``: each stage's targets, :func:`~fxpipe.distributed.parallel.local_shapes.partial_parameters`)."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    found = set()
    for gm, targets in zip(stage_modules, reads):
        for target in targets:
            owner, _, attr = target.rpartition(".")
            param = gm.get_submodule(owner)._parameters.get(attr) if owner or attr else None
            if isinstance(param, nn.Parameter) and param.requires_grad and id(param) in names:
                found.add(names[id(param)])
    return sorted(found)


def sum_partial_grads(params: Sequence[nn.Parameter], group: Any) -> None:
    """Sum over the tp ranks the gradients of ``params`` (this rank's of those ``TPPlan.summed`` names; a
    DTensor's local shard under FSDP2, sharded alike on every tp rank): once a step, after the backward passes."""
    for param in params:
        grad = param.grad
        if grad is not None:
            dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=group)


def tp_mesh_of(mesh: Any, timeout_s: float, *, from_root: bool) -> Any:
    """This rank's 1-D ``("tp",)`` mesh of ``mesh`` (dims named as :class:`ParallelDims` names them). With
    ``from_root`` the slice ``mesh["tp"]`` (FSDP2 composes with TP only over slices of one root mesh; its waits
    end after the root's groups' timeout: :class:`fxpipe.distributed.PipelineRank` makes it ``timeout_s``); otherwise a group whose waits end after ``timeout_s``."""
    if from_root:
        return mesh["tp"]
    from torch.distributed.device_mesh import DeviceMesh
    names, coordinate = tuple(mesh.mesh_dim_names), mesh.get_coordinate()
    ranks = mesh.mesh[tuple(slice(None) if n == "tp" else coordinate[i] for i, n in enumerate(names))]
    group = dist.new_group([int(r) for r in ranks], timeout=datetime.timedelta(seconds=timeout_s),
                           use_local_synchronization=True)
    return DeviceMesh.from_group(group, mesh.device_type, mesh_dim_names=("tp",))


def shard_stages(stage_modules: Sequence[nn.Module], tp_mesh: Any, tp_plan: dict[str, ParallelStyle] | None, *,
                 model: nn.Module, holders: Sequence[nn.Module] = (),
                 pipeline: tuple[Sequence[nn.Module], Sequence[int]] | None = None) -> TPPlan:
    """:func:`apply_tp` on a pipeline rank: every parameter and buffer of ``stage_modules`` first broadcast from
    tp rank 0 (the replicated ones must be equal on every tp rank), then the ``DTensor`` parameters put wherever
    ``holders`` (the model, the traced graph) held the ones they replace."""
    group = tp_mesh.get_group()
    broadcast_states(stage_modules, dist.get_global_rank(group, 0), group)
    before = [dict(m.named_parameters()) for m in stage_modules]
    plan = apply_tp(stage_modules, tp_mesh, tp_plan, model=model, pipeline=pipeline)
    repoint(holders, {id(old[name]): new for old, m in zip(before, stage_modules)
                      for name, new in m.named_parameters() if new is not old.get(name)})
    return plan


def _kinds(plan: TPPlan) -> tuple[set[str], set[str]]:
    """The plan's column-wise and row-wise layer paths; :class:`TPPlanError` for a style whose output between them
    would not be a plain local tensor (the module doc says why)."""
    colwise, rowwise = set(), set()
    for path, style in plan.styles.items():
        if isinstance(style, ColwiseParallel):
            if not style.use_local_output:
                raise TPPlanError(f"tp_plan's {path}: ColwiseParallel(use_local_output=False) keeps a DTensor between "
                                  "the layers, which a traced stage runs too slowly (tp.py's doc); use "
                                  "ColwiseParallel() (plain local outputs: fxpipe makes the graph's sizes local)")
            colwise.add(path)
        elif isinstance(style, RowwiseParallel):
            rowwise.add(path)
        else:
            raise TPPlanError(f"tp_plan's {path}: {type(style).__name__} is not supported on pipeline stages; use "
                              "ColwiseParallel() and RowwiseParallel() (sequence parallelism is fxpipe's own: on by "
                              "default, 'sp=0' in the mesh turns it off)")
    return colwise, rowwise


def locate_tp_layers(stage_modules: Sequence[nn.Module], plan: TPPlan, model: nn.Module) -> dict[str, int]:
    """Which of ``stage_modules`` calls each layer of ``plan`` (an exported stage's layers called as modules again
    first); :class:`TPPlanError` where a stage reads a planned layer's parameters without calling it or a stage
    boundary cuts one of the plan's groups. Changes no parameter."""
    located: dict[str, int] = {}
    for k, gm in enumerate(stage_modules):
        if isinstance(gm, fx.GraphModule):
            restore_module_calls(gm, model, plan.styles)
            calls = called_modules(gm)
        else:
            calls = {p for p, _ in gm.named_modules()}
        for path in plan.styles:
            if path in calls:
                located[path] = k
            elif _reads(gm, path):
                raise TPPlanError(
                    f"stage module {k} reads the parameters of {path} without calling it as a module (a layer "
                    "tensor parallelism can shard is an nn.Linear, or a Hugging Face Conv1D, called as such): leave "
                    "it out of tp_plan")
    for group in plan.groups:
        stages = {located.get(p) for p in group}
        if len(stages) > 1 and stages != {None}:
            where = ", ".join(f"{p} in {'another rank' if located.get(p) is None else f'stage {located[p]}'}"
                              for p in group)
            raise TPPlanError(
                f"a stage boundary cuts the tensor-parallel block {group[0].rpartition('.')[0]} ({where}): the wire "
                "would carry a sharded value; plan with its layers in one stage (cuts between blocks, e.g. "
                "CompileOptions(leaf_modules=[TheBlockClass])) or pass tp_plan=... without this block")
    return located
