"""The default tensor-parallel plan of the transformer blocks fxpipe recognises, and the checks of a given plan.

A plan maps module paths (``model.named_modules()`` names; a user's may hold ``fnmatch`` patterns such as
``"model.layers.*.mlp.up_proj"``) to torch's parallel styles. The default one shards, in every block it recognises,

- attention: the query/key/value projections column-wise (each rank computes ``heads / tp`` of the heads, so the
  heads, and the key/value heads of grouped-query attention, must divide by ``tp``), the output projection
  row-wise (its partial sums all-reduced);
- MLP: the up (and gate) projections column-wise, the down projection row-wise,

for Llama, Mistral, Qwen2 (``q_proj k_proj v_proj o_proj`` / ``gate_proj up_proj down_proj``), BERT
(``attention.self.query/key/value``, ``attention.output.dense``, ``intermediate.dense``, ``output.dense``) and
GPT-2 (``attn.c_attn`` / ``attn.c_proj``, ``mlp.c_fc`` / ``mlp.c_proj``: Hugging Face ``Conv1D`` layers, whose
weight is ``(in, out)``, sharded on the transposed dimensions by :class:`Conv1DColwise` / :class:`Conv1DRowwise`).

GPT-2's ``c_attn`` computes q, k and v in one layer (weight ``(n_embd, 3 * n_embd)``) and the model splits its
output at the full width (``split(n_embd, dim=2)``). A contiguous column shard would give rank 0 all of q and half
of k: :class:`Conv1DFusedColwise` instead gives rank ``r`` the columns ``[q_r, k_r, v_r]`` (its heads of each), as
torch's ``_StridedShard(1, split_factor=3)``: the parameter keeps the model's name and global ``(n_embd, 3 *
n_embd)`` layout (``full_tensor()``, the optimizer, FSDP2 over it), and DTensor's own rules carry that placement
through ``addmm`` (no communication in the forward; checked with ``CommDebugMode``). The split's recorded size
becomes ``n_embd / tp`` (:mod:`fxpipe.distributed.parallel.local_shapes`). Its bias stays replicated over ``tp``
(each rank adds its columns' part; the gradient is gathered, 3 * n_embd numbers): with a strided bias, FSDP2
(torch 2.15) nests two ``_StridedShard`` s on its one dimension and that DTensor's ``full_tensor()`` is wrong (seen
at dp_shard=2 x tp=2: its local shards right, the gathered gradient misplaced), so the bias is not strided.
``torch.distributed.checkpoint`` (torch 2.15) cannot save a ``_StridedShard`` (its chunks "overlap"):
:mod:`fxpipe.distributed.checkpoint` saves and loads it as the plain ``Shard`` of the same global tensor.
Embeddings, norms and the LM head stay replicated. Everything else is refused with the fix:
``tp_plan={path pattern: style}``.

Column-wise layers give their output as a plain tensor of this rank's heads or features (``use_local_output=True``,
as torchtitan's plans do) and row-wise ones take it sharded on the last dimension and give back a plain, replicated
tensor: between them the model's code runs on plain local tensors, whose recorded shape constants
(``view(b, s, 4, 8)``, ``expand`` to the number of key/value heads, GPT-2's ``split``)
:mod:`fxpipe.distributed.parallel.local_shapes` makes local once at setup (:mod:`fxpipe.distributed.parallel.tp`
says why). A block's column-wise and row-wise layers form a group that must lie in one stage: what crosses a stage
boundary is then always a plain replicated tensor.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from fxpipe.distributed.parallel.module_calls import is_conv1d
from fxpipe.errors import FxpipeError

__all__ = ["TPPlan", "TPPlanError", "Conv1DColwise", "Conv1DFusedColwise", "Conv1DRowwise", "default_tp_plan",
           "given_tp_plan"]


class TPPlanError(FxpipeError, ValueError):
    """A tensor-parallel plan that cannot be applied exactly (the message names the module and the fix);
    ``cause``: the module and what tp does not divide, without a rank's fix (for the planner's own)."""

    def __init__(self, message: str, cause: str | None = None) -> None:
        super().__init__(message)
        self.cause = cause or message


def _distribute_conv1d(style: ColwiseParallel | RowwiseParallel, module: nn.Module, device_mesh,
                       placements: dict[str, Shard | Replicate], output_fn=None):
    """``style`` applied to a ``Conv1D`` with its parameters placed as ``placements`` says (by name), and the
    style's own input and output conversions."""
    def partition(name, mod, mesh):
        for pname, placement in placements.items():
            param = getattr(mod, pname, None)
            if param is not None:
                mod.register_parameter(pname, nn.Parameter(
                    distribute_tensor(param, mesh, [placement], src_data_rank=style.src_data_rank),
                    requires_grad=param.requires_grad))
    return distribute_module(module, device_mesh, partition,
                             lambda mod, inputs, mesh: style._prepare_input_fn(
                                 style.input_layouts, style.desired_input_layouts, mod, inputs, mesh),
                             output_fn or (lambda mod, outputs, mesh: style._prepare_output_fn(
                                 style.output_layouts, style.use_local_output, mod, outputs, mesh)))


class Conv1DColwise(ColwiseParallel):
    """``ColwiseParallel`` for a Hugging Face ``Conv1D`` (``y = x @ W + b``, ``W`` of shape ``(in, out)``): the
    output features are ``W``'s dimension 1 and the bias's dimension 0."""

    def _apply(self, module: nn.Module, device_mesh):
        return _distribute_conv1d(self, module, device_mesh, {"weight": Shard(1), "bias": Shard(0)})


class Conv1DFusedColwise(ColwiseParallel):
    """Column-wise for a ``Conv1D`` whose output is ``split`` equal parts side by side (GPT-2's ``c_attn``: q, k,
    v): rank ``r`` holds the columns ``[part_0_r, part_1_r, ...]``, its share of each part, as the weight's
    ``_StridedShard(1, split_factor=split)`` (the model's global layout and name kept); the bias replicated (module
    doc says why). Its output is the plain local ``(..., split * out / (split * tp))`` tensor; anything but that
    placement coming out of the layer is refused, never redistributed."""

    def __init__(self, split: int = 3, **kwargs) -> None:
        super().__init__(**kwargs)
        if not isinstance(split, int) or split < 2:
            raise TPPlanError(f"Conv1DFusedColwise(split={split!r}): split is the number of parts (>= 2) the "
                              "layer's output is split into (3 for q, k, v)")
        self.split = split

    def _apply(self, module: nn.Module, device_mesh):
        if device_mesh.ndim != 1:
            raise TPPlanError("Conv1DFusedColwise shards over a 1-D tp mesh")
        if module.nf % (self.split * device_mesh.size()):
            raise TPPlanError(f"Conv1DFusedColwise: {module.nf} output features are not {self.split} parts that "
                              f"tp={device_mesh.size()} divides")
        placement = _StridedShard(1, split_factor=self.split)

        def output(mod, outputs, mesh):
            want = _StridedShard(outputs.ndim - 1, split_factor=self.split)
            if not isinstance(outputs, DTensor) or tuple(outputs.placements) != (want,):
                raise TPPlanError(f"Conv1DFusedColwise: the layer's output came out as "
                                  f"{getattr(outputs, 'placements', type(outputs).__name__)}, not {want}: the input "
                                  "must be the replicated activations of the whole model")
            return outputs.to_local() if self.use_local_output else outputs
        return _distribute_conv1d(self, module, device_mesh, {"weight": placement, "bias": Replicate()}, output)


class Conv1DRowwise(RowwiseParallel):
    """``RowwiseParallel`` for a Hugging Face ``Conv1D``: ``W`` sharded on its input dimension 0, the bias
    replicated (added once, after the partial sums are reduced)."""

    def _apply(self, module: nn.Module, device_mesh):
        self.desired_input_layouts = (Shard(-1),)
        return _distribute_conv1d(self, module, device_mesh, {"weight": Shard(0), "bias": Replicate()})


@dataclass
class TPPlan:
    """Module path → style; the groups of paths that must lie in one stage; what stays replicated and why."""

    styles: dict[str, ParallelStyle]
    groups: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: once applied: the replicated parameters (model names) that meet one rank's heads inside a block, whose
    #: gradients each step sums over the tp ranks (:func:`fxpipe.distributed.parallel.local_shapes.partial_parameters`)
    summed: list[str] = field(default_factory=list)
    #: once applied: whether the activations between the blocks run on sequence shards
    #: (:mod:`fxpipe.distributed.parallel.sequence`)
    sequence_parallel: bool = False


def _colwise(module: nn.Module) -> ParallelStyle:
    return (Conv1DColwise if is_conv1d(module) else ColwiseParallel)(use_local_output=True)


def _rowwise(module: nn.Module) -> ParallelStyle:
    return (Conv1DRowwise if is_conv1d(module) else RowwiseParallel)(input_layouts=Shard(-1))


def _out_features(module: nn.Module) -> int:
    return module.nf if is_conv1d(module) else module.out_features


def _linear(module: nn.Module, *names: str) -> list[nn.Module] | None:
    found = [getattr(module, n, None) for n in names]
    return found if all(isinstance(m, nn.Linear) or (m is not None and is_conv1d(m)) for m in found) else None


def _heads(module: nn.Module, *names: str) -> int | None:
    config = getattr(module, "config", None)
    for name in names:
        for owner in (module, config):
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int):
                return value
    return None


def _divisible(path: str, what: str, count: int | None, tp: int) -> None:
    if count is None:
        raise TPPlanError(f"{path}: fxpipe cannot find its number of {what} to check that tp={tp} divides it; "
                          "pass tp_plan={path pattern: style} for this model")
    if count % tp:
        cause = f"{path} has {count} {what}, which tp={tp} does not divide"
        raise TPPlanError(f"{cause}: tensor parallelism shards whole heads and features; use a tp that divides "
                          f"{count}, or pass tp_plan=... that leaves this module replicated", cause)


def default_tp_plan(model: nn.Module, tp: int) -> TPPlan:
    """The default plan of ``model`` for ``tp`` ranks (module doc), or :class:`TPPlanError` naming why not."""
    plan = TPPlan({})
    seen_attention_like = []
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        if (layers := _linear(module, "q_proj", "k_proj", "v_proj", "o_proj")) is not None:
            _divisible(path, "attention heads", _heads(module, "num_attention_heads", "num_heads"), tp)
            kv = _heads(module, "num_key_value_heads", "num_kv_heads")
            _divisible(path, "key/value heads", kv, tp)
            names = [f"{prefix}{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        elif (layers := _linear(module, "gate_proj", "up_proj", "down_proj")) is not None:
            names = [f"{prefix}{n}" for n in ("gate_proj", "up_proj", "down_proj")]
        elif (type(module).__name__.endswith("Layer") and _linear(getattr(getattr(module, "attention", None), "self", None) or nn.Module(), "query", "key", "value")
              and _linear(getattr(getattr(module, "attention", None), "output", None) or nn.Module(), "dense")):
            attention = module.attention.self   # a BERT-style layer: attention.self.{query,key,value}, ...
            _divisible(f"{prefix}attention.self", "attention heads",
                       _heads(attention, "num_attention_heads", "num_heads"), tp)
            att = [f"{prefix}attention.self.{n}" for n in ("query", "key", "value")] + [f"{prefix}attention.output.dense"]
            layers = [model.get_submodule(n) for n in att]
            _add(plan, att, layers, tp)
            if _linear(getattr(module, "intermediate", None) or nn.Module(), "dense") and \
                    _linear(getattr(module, "output", None) or nn.Module(), "dense"):
                mlp = [f"{prefix}intermediate.dense", f"{prefix}output.dense"]
                _add(plan, mlp, [model.get_submodule(n) for n in mlp], tp)
            continue
        elif type(module).__name__ == "GPT2MLP" and (layers := _linear(module, "c_fc", "c_proj")) is not None:
            names = [f"{prefix}c_fc", f"{prefix}c_proj"]
        elif (layers := _linear(module, "c_attn", "c_proj")) is not None and all(map(is_conv1d, layers)):
            if getattr(module, "is_cross_attention", False) or hasattr(module, "q_attn"):
                plan.notes.append(f"{path}: replicated (cross-attention: c_attn computes only k and v)")
                continue
            _divisible(path, "attention heads", _heads(module, "num_heads", "n_head", "num_attention_heads"), tp)
            c_attn, c_proj = layers
            if c_attn.nf != 3 * c_proj.nf or c_attn.nx != c_proj.nf:
                plan.notes.append(f"{path}: replicated (c_attn's {c_attn.nf} outputs are not q, k, v of width "
                                  f"{c_proj.nf})")
                continue
            _divisible(f"{prefix}c_attn", "output features of each of q, k and v", c_proj.nf, tp)
            plan.styles[f"{prefix}c_attn"] = Conv1DFusedColwise(3, use_local_output=True)
            plan.styles[f"{prefix}c_proj"] = _rowwise(c_proj)
            plan.groups.append([f"{prefix}c_attn", f"{prefix}c_proj"])
            continue
        else:
            if _linear(module, "query", "key", "value") or _linear(module, "q", "k", "v"):
                seen_attention_like.append(f"{path} ({type(module).__name__})")
            continue
        _add(plan, names, layers, tp)
    if not plan.styles:
        found = f" (attention-like modules: {', '.join(seen_attention_like[:3])})" if seen_attention_like else ""
        raise TPPlanError(f"fxpipe recognises no transformer block in {type(model).__name__}{found}: its default "
                          "tensor-parallel plan covers Llama, Mistral, Qwen2, GPT-2 and BERT blocks; pass "
                          "tp_plan={'path.pattern.*.up': ColwiseParallel(), ...}")
    return plan


def tp_refusal(model: nn.Module, tp: int) -> str | None:
    """Why the default plan cannot shard ``model`` over ``tp`` ranks (:class:`TPPlanError`'s cause), ``None``
    where it can: what the planner asks before it plans a mesh with ``tp`` (the runtime asks the same)."""
    try:
        default_tp_plan(model, tp)
    except TPPlanError as exc:
        return exc.cause
    return None


def _add(plan: TPPlan, names: list[str], layers: list[nn.Module], tp: int) -> None:
    """The last layer of ``names`` row-wise, the others column-wise; one group."""
    for name, layer in zip(names[:-1], layers[:-1]):
        _divisible(name, "output features", _out_features(layer), tp)
        plan.styles[name] = _colwise(layer)
    plan.styles[names[-1]] = _rowwise(layers[-1])
    plan.groups.append(list(names))


def given_tp_plan(model: nn.Module, tp_plan: dict[str, ParallelStyle]) -> TPPlan:
    """A user's plan with its patterns matched against ``model``'s module paths; every pattern must match a layer.
    Its groups are unknown: one that a stage boundary cuts is the user's to avoid (module doc)."""
    if not isinstance(tp_plan, dict) or not all(isinstance(s, ParallelStyle) for s in tp_plan.values()):
        raise TPPlanError("tp_plan must be a dict of module path patterns to torch.distributed.tensor.parallel "
                          f"styles (ColwiseParallel, RowwiseParallel, SequenceParallel), got {tp_plan!r}")
    paths = [p for p, _ in model.named_modules() if p]
    styles: dict[str, ParallelStyle] = {}
    for pattern, style in tp_plan.items():
        matched = [p for p in paths if fnmatch.fnmatchcase(p, pattern)]
        if not matched:
            raise TPPlanError(f"tp_plan's {pattern!r} matches no module of {type(model).__name__}: name modules "
                              "by their model.named_modules() paths (e.g. 'model.layers.*.mlp.up_proj')")
        for p in matched:
            styles[p] = style
    return TPPlan(styles)
