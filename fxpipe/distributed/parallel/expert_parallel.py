"""Expert parallelism: each mixture-of-experts layer's experts sharded over ``ep`` ranks that exchange their tokens.

As in torchtitan and Megatron-Core, ``ep`` borrows data-parallel ranks (:class:`solvers.layout.Layout`): the
``dp`` ranks of a pipeline stage, in their replica-major order, form ``dp / ep`` groups of ``ep`` adjacent ranks.
Each rank of an ep group keeps ``E / ep`` consecutive experts of every layer its stages hold (the slices of the
model's stacked parameters; :mod:`fxpipe.frontend.experts`) and computes its own share of the batch as a data
replica does. An experts call (:mod:`.expert_calls` makes the stage graph call the module) then runs as
:class:`ExpertShard` does, the way torchtitan's ``ExpertParallel`` style does with ``all_to_all_single``:

1. *dispatch*: each (token, chosen expert) pair, in expert order, is sent to the rank holding that expert, with
   its routing weight (one all-to-all of the counts, then of the tokens and weights, differentiable);
2. the rank's own experts run on what it received, through the experts module's own forward (whichever
   implementation transformers chose: grouped_mm, batched_mm or eager), each pair as a token of one expert;
3. *combine*: the weighted outputs go back to their tokens' ranks (all-to-all) and each token sums its ``k``
   experts' outputs, as the unsharded module sums them.

Nothing is dropped and nothing is padded (no capacity factor): the routing is the model's. The backward runs the
same exchanges in reverse (autograd through the all-to-alls), so each expert's gradient sums the contributions of
every token that reached it from any rank of the group.

The expert parameters stay plain tensors of this rank's experts (the optimizer steps them as any other): data
parallelism leaves them out (DDP ignores them, FSDP2 too) and :class:`ExpertGrads` reduces them, summed over the
``dp / ep`` ranks holding the same experts and divided as data parallelism divides the rest; on a sharded mesh
with several such ranks FSDP2 shards them over those ranks instead (:mod:`.expert_fsdp`). For checkpoints each
is described as the ``DTensor`` it is a piece of (:func:`global_view`: ``Shard(0)`` over the ep group, replicated
over the rest), so ``torch.distributed.checkpoint`` stores the model's whole expert tensors under their names and
any other mesh reads them back. Every collective of a stage runs on a process group of its own, so that stages
of one rank never interleave theirs.
"""

from __future__ import annotations

import copy
import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from fxpipe.distributed.parallel.expert_calls import EXPERT_SHARD, restore_expert_calls
from fxpipe.distributed.parallel.fsdp import repoint
from fxpipe.frontend.experts import ExpertsError, shardable
from fxpipe.frontend.precision import compute_copy
from solvers.layout import refusal

__all__ = ["EXPERT_SHARD", "ExpertGrads", "ExpertShard", "ShardOf", "apply_expert_parallel", "global_shape",
           "global_view", "own_view"]


@dataclass(frozen=True)
class ShardOf:
    """What an expert shard is a piece of: experts ``rank * (total / ep)`` on of ``total``, over the ep group's
    ``mesh`` (a 1-D ``DeviceMesh``; 2-D ``(ep, peers)`` where FSDP2 shards it further, :mod:`.expert_fsdp`)."""

    rank: int
    ep: int
    total: int
    mesh: Any


def _group_mesh(group: Any, device_type: str) -> Any:
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh.from_group(group, "cpu" if device_type == "meta" else device_type, mesh_dim_names=("ep",))


def _exchange(values: torch.Tensor, send: list[int], receive: list[int], group: Any) -> torch.Tensor:
    """``values`` (rows in ``send``'s order) exchanged over ``group``; differentiable."""
    out = all_to_all_single_autograd(values.contiguous(), receive, send, group)
    return out.wait() if hasattr(out, "wait") else out


class ExpertShard(nn.Module):
    """This rank's ``E / ep`` experts of one layer, called as the experts module is, with the tokens of the
    whole ep group dispatched to them and combined back (module docstring). Its parameters have the experts
    module's names, shaped ``(E / ep, ...)``."""

    def __init__(self, experts: nn.Module, rank: int, ep: int, group: Any, mixed: bool = False) -> None:
        super().__init__()
        names = [n for n, _ in experts.named_parameters(recurse=False)]
        total = next(experts.parameters()).shape[0]
        self.total, self.local, self.rank, self.ep = total, total // ep, rank, ep
        lo = rank * self.local
        local = copy.copy(experts)   # the module's forward and settings, over this rank's experts only
        local._parameters = {}
        mesh = _group_mesh(group, next(experts.parameters()).device.type)
        for name in names:
            full = getattr(experts, name)
            param = nn.Parameter(full.detach()[lo: lo + self.local].clone(), requires_grad=full.requires_grad)
            setattr(param, EXPERT_SHARD, ShardOf(rank, ep, total, mesh))
            self.register_parameter(name, param)
            local._parameters[name] = param
        if hasattr(local, "num_experts"):
            local.num_experts = self.local
        object.__setattr__(self, "_experts", local)   # not a submodule: its parameters are this module's
        self._group, self._mixed = group, mixed

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        chosen = top_k_index.reshape(-1)
        owner = torch.div(chosen, self.local, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=self.ep)
        receive_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(receive_counts, send_counts, group=self._group)
        send, receive = send_counts.tolist(), receive_counts.tolist()
        pairs = torch.arange(tokens, device=chosen.device).repeat_interleave(k)[order]
        hidden = _exchange(hidden_states[pairs], send, receive, self._group)
        weights = _exchange(top_k_weights.reshape(-1)[order], send, receive, self._group)
        local_ids = torch.empty(sum(receive), dtype=chosen.dtype, device=chosen.device)
        dist.all_to_all_single(local_ids, (chosen[order] - owner[order] * self.local).contiguous(), receive, send,
                               group=self._group)
        out = self._local_experts(hidden, local_ids.unsqueeze(-1), weights.unsqueeze(-1))
        back = _exchange(out, receive, send, self._group)
        unsorted = torch.empty_like(order)
        unsorted[order] = torch.arange(order.numel(), device=order.device)
        return back[unsorted].view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


    def _local_experts(self, *args: torch.Tensor) -> torch.Tensor:
        """This rank's experts on what it received, with the parameters this module holds now (FSDP2's unsharded
        ones inside its forward, :mod:`.expert_fsdp`); under bf16-mixed through their bfloat16 copies."""
        params = {name: compute_copy(p) if self._mixed else p for name, p in self.named_parameters()}
        return torch.func.functional_call(self._experts, params, args)


@dataclass
class ExpertParallel:
    """What :func:`apply_expert_parallel` did: the layers sharded, this rank's place (``rank`` of ``ep`` in its
    group), the ranks holding the same experts (``peers``, a group to reduce over) and the shards' parameters."""

    layers: list[str] = field(default_factory=list)
    rank: int = 0
    ep: int = 1
    peers: Any = None
    params: list[nn.Parameter] = field(default_factory=list)
    modules: list[nn.Module] = field(default_factory=list)   # the ExpertShard s
    group: Any = None   # an ep group of this rank (each stage has its own; the same ranks)


def _groups(grid: list[list[int]], ep: int, stages: list[int], timeout_s: float) -> tuple[int, dict[int, Any], Any]:
    """This rank's place in its ep group, the group of each of its stages, and its expert peers' group."""
    flat = [r for row in grid for r in row]
    me = flat.index(dist.get_rank())
    timeout = datetime.timedelta(seconds=timeout_s)
    block = flat[me - me % ep: me - me % ep + ep]
    per_stage = {k: dist.new_group(block, timeout=timeout, use_local_synchronization=True) for k in stages}
    peers = flat[me % ep::ep]
    return me % ep, per_stage, dist.new_group(peers, timeout=timeout, use_local_synchronization=True)


def apply_expert_parallel(stages: Any, dims: Any, grid: list[list[int]], timeout_s: float) -> ExpertParallel:
    """Shard the experts of ``stages``' (:class:`fxpipe.distributed.stages.RankStages`) own modules over ``dims.ep``
    ranks of the data-parallel ``grid`` (module docstring); nothing where ``dims.layout.ep`` is 1.
    ``ValueError`` naming the layer where an ep does not divide its experts, or the model has none to shard."""
    ep = dims.layout.ep
    if ep == 1:
        return ExpertParallel()
    try:
        experts = shardable(stages.model)
    except ExpertsError as exc:
        raise ValueError(f"ep={ep}: {exc}") from None
    found = refusal(dims.layout, experts=experts, runtime=True)
    if found is not None:
        raise ValueError(found.message)
    rank, groups, peers = _groups(grid, ep, list(stages.own), timeout_s)
    done = ExpertParallel(rank=rank, ep=ep, peers=peers)
    try:
        for k in stages.own:
            _shard_stage(stages, k, experts, done, groups[k])
        failed = ""
    except ValueError as exc:
        failed = f"{type(exc).__name__}: {exc}"
    _agree(failed)
    _broadcast(done, grid, ep)
    return done


def _shard_stage(stages: Any, k: int, experts: dict[str, int], done: ExpertParallel, group: Any) -> None:
    """Stage ``k``'s experts called as :class:`ExpertShard` s holding this rank's experts, put wherever the model
    and the traced graph held the parameters they replace."""
    made: dict[str, ExpertShard] = {}

    def shard(path: str, mixed: bool) -> ExpertShard:
        made[path] = ExpertShard(stages.model.get_submodule(path), done.rank, done.ep, group, mixed)
        return made[path]

    restore_expert_calls(stages.specs[k].module, list(experts), shard)
    for path, module in made.items():
        old = stages.model.get_submodule(path)
        repoint([stages.model, stages.pipe._graph[0]], {id(getattr(old, n)): p for n, p in module.named_parameters()})
        done.layers.append(path)
        done.params.extend(module.parameters())
        done.modules.append(module)
        done.group = group


def _agree(failed: str) -> None:
    """Every rank raises where one could not shard its stages' experts (the others would wait for it in their
    first step's all-to-all): the messages exchanged over the world."""
    messages: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(messages, failed)
    bad = [(r, m) for r, m in enumerate(messages) if m]
    if bad:
        rank, message = bad[0]
        raise ValueError(f"expert parallelism: rank {rank}: {message}")


def _broadcast(done: ExpertParallel, grid: list[list[int]], ep: int) -> None:
    """The shards made equal over the ranks holding the same experts (from the first of them), as data
    parallelism makes the rest equal over its replicas."""
    flat = [r for row in grid for r in row]
    src = flat[flat.index(dist.get_rank()) % ep]
    with torch.no_grad():
        for p in done.params:
            dist.broadcast(p.data, src=src, group=done.peers)


class ExpertGrads:
    """The data-parallel reducer of the rest (``data``) and the expert shards' own reduction after it: summed
    over the ranks that hold the same experts and divided by ``dp``, as DDP and FSDP2 average the rest (each
    rank's gradients weigh its share of the batch ``dp`` times, :mod:`.replicas`)."""

    def __init__(self, data: Any, experts: ExpertParallel, dp: int) -> None:
        self.data, self.experts, self.dp = data, experts, dp
        self.reduces_in_backward = getattr(data, "reduces_in_backward", False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["data"], name)

    def begin(self, split: bool = False) -> None:
        self.data.begin(split)

    def reduce(self) -> None:
        self.data.reduce()
        for p in self.experts.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.dp > self.experts.ep:
                dist.all_reduce(p.grad, group=self.experts.peers)
            p.grad.div_(self.dp)


def global_view(t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``t`` (an expert shard ``param``, or a tensor shaped like it: an optimizer moment) as the ``DTensor`` it is
    a piece of (``Shard(0)`` over the ep group; sharded by FSDP2 over its peers, :mod:`.expert_fsdp`, then
    ``Shard(0)`` over them too), sharing its storage, so that a checkpoint holds the model's whole expert tensor;
    anything else as it is."""
    shard = getattr(param, EXPERT_SHARD, None)
    if shard is None or not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(param.shape):
        return t
    from torch.distributed.tensor import DTensor, Shard
    local = t.to_local() if isinstance(t, DTensor) else t
    shape = (shard.total, *t.shape[1:])
    return DTensor.from_local(local, shard.mesh, [Shard(0)] * shard.mesh.ndim, run_check=False,
                              shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())


def own_view(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A tensor read back in :func:`global_view`'s layout as ``param`` lays it out: an expert shard's plain local
    piece, or FSDP2's ``DTensor`` over the peers; anything else as it is."""
    from torch.distributed.tensor import DTensor
    if getattr(param, EXPERT_SHARD, None) is None or not isinstance(value, DTensor):
        return value
    if not isinstance(param, DTensor):
        return value.to_local()
    return DTensor.from_local(value.to_local(), param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def global_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The whole tensor's shape of an expert shard; any other tensor's own."""
    shard = getattr(param, EXPERT_SHARD, None)
    return tuple(param.shape) if shard is None else (shard.total, *param.shape[1:])
