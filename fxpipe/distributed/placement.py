"""Which process runs which stage: the plan's placement (node, device), not the order of ranks.

Every stage of a plan names its host (``stage.node``) and its device's index in ``plan.devices``
(``stage.device_index``; ``-1`` in an older plan: its worker, in stage order). The devices a plan uses on one
node are numbered in order of their index: that number is the ``LOCAL_RANK`` of the process that runs them.
Each process says where it is — its node (``FXPIPE_NODE``, set by ``fxpipe.launch --plan-node``, else torchrun's
``GROUP_RANK``: with a c10d rendezvous, the order in which hosts joined) and ``LOCAL_RANK`` — and one
``all_gather_object`` tells every rank the others', so stage ``k`` runs on the rank at ``(node_k, local_k)``
whatever global rank torchrun gave it. Without torchrun's variables a process is on node 0 with its rank as
local rank (``torch.multiprocessing`` on one machine). One pipeline of a mesh (a ``pp`` group of some of the
processes) runs the plan's devices on its members in order.

A plan names the devices it was made for (``cuda:3`` of an H100 preset), which need not be the ones a process
has: :func:`rank_devices` says where this process runs a stage planned on one of them (the planned device where the
process has it, its own GPU where the plan's index is past its node's GPUs, the CPU where it has no GPU: a plan
made for GPUs runs on gloo CPU processes, as a laptop or CI checks it).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.errors import PlanMismatchError
from fxpipe.planning.plan import Plan
from solvers.schedules import stage_worker

__all__ = ["plan_slots", "where_am_i", "stage_ranks", "rank_devices", "rank_device_type", "world_mismatch"]


def plan_slots(plan: Plan) -> list[tuple[int, int]]:
    """``(node, local index)`` of every stage's device."""
    workers = plan.workers
    # several stages per device (interleaved, ZB-V): the solver's device i (one per stage) is the schedule's
    # worker of stage i (i % workers interleaved, the V for ZB-V)
    def device(k: int, index: int) -> int:
        if index < 0:
            return stage_worker(plan.schedule, k, workers)
        return stage_worker(plan.schedule, index, workers) if plan.virtual_stages > 1 else index
    slot = [(st.node, device(k, st.device_index)) for k, st in enumerate(plan.stages)]
    local: dict[tuple[int, int], int] = {}
    for node in sorted({n for n, _ in slot}):
        for i, index in enumerate(sorted({d for n, d in slot if n == node})):
            local[(node, index)] = i
    return [(node, local[(node, index)]) for node, index in slot]


def where_am_i(rank: int) -> tuple[int, int]:
    """This process's ``(node, local rank)``: ``FXPIPE_NODE`` (``fxpipe.launch --plan-node``) or torchrun's
    ``GROUP_RANK``, and ``LOCAL_RANK``; else ``(0, rank)``."""
    node = int(os.environ.get("FXPIPE_NODE", os.environ.get("GROUP_RANK", "0")))
    if "LOCAL_RANK" in os.environ:
        return node, int(os.environ["LOCAL_RANK"])
    return node, rank


def world_mismatch(plan: Plan, world: int) -> PlanMismatchError | None:
    """The error for a process group of ``world`` processes that one pipeline of ``plan`` does not fill: it names
    every fix, running copies of the pipeline as a mesh among them where ``world`` is a multiple of its workers."""
    w = plan.workers
    if world == w:
        return None
    mesh = (f", or run {world // w} copies of the pipeline as a mesh (PipelineRank(..., mesh='dp_shard={world // w}'"
            f"), python -m fxpipe.launch --mesh dp_shard={world // w}: FSDP2 over the copies; dp_replicate="
            f"{world // w}: DDP)"
            if world % w == 0 and world > w else "")
    return PlanMismatchError(f"the plan runs {len(plan.stages)} stages on {w} workers but the process group has "
                             f"{world} processes: start one process per worker (torchrun --nproc-per-node {w} on "
                             f"one node), or plan for {world} devices{mesh}")


def stage_ranks(plan: Plan, rank: int, world: int, group: Any = None) -> list[int]:
    """The rank in ``group`` that runs each stage (collective: every rank calls it once).

    ``group`` a part of the processes (the ``pp`` dimension of a mesh: one of several pipelines, its other ranks
    data or tensor parallel copies): its members run the plan's devices in their order, the first member the
    first device (node, then index). Their ``LOCAL_RANK`` s are those of the whole mesh, not the plan's."""
    slots = plan_slots(plan)
    if group is not None and dist.get_world_size(group) < dist.get_world_size():
        wanted = sorted(set(slots))
        if len(wanted) != world:
            raise PlanMismatchError(f"the plan places its stages on {len(wanted)} devices but the mesh's pp "
                                    f"dimension has {world} ranks: make the mesh's pp size {len(wanted)}")
        return [wanted.index(s) for s in slots]
    here: list[Any] = [None] * world
    if dist.get_backend(group) != "gloo":   # NCCL would exchange through whichever GPU is current: use the CPU
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        group = dist.new_group(ranks, backend="gloo")
    dist.all_gather_object(here, where_am_i(rank), group=group)
    at = {tuple(w): r for r, w in enumerate(here)}
    wanted = sorted(set(slots))
    if len(at) != world or set(at) != set(wanted):
        nodes = sorted({n for n, _ in wanted})
        per_node = ", ".join(f"node {n}: {sum(1 for m, _ in wanted if m == n)}" for n in nodes)
        raise PlanMismatchError(
            f"the plan places its stages on {len(wanted)} devices ({per_node} processes) but the processes are at "
            f"(node, local rank) {sorted(at) if len(at) == world else here}: start "
            f"torchrun --nnodes {len(nodes)} with that many processes on each node (--node-rank = the plan's node)")
    return [at[s] for s in slots]


def rank_devices(planned: list[str]) -> list[torch.device]:
    """Where this process runs each stage the plan put on ``planned`` (module doc), one per stage. An accelerator
    the process lacks (a CUDA plan on a machine without CUDA) gives the CPU, with one warning that says so: the
    step computes the same, and the plan's times and memory are those of the devices it was made for. An
    accelerator index past the process's devices (a plan made for 8 GPUs of a node, run where
    ``CUDA_VISIBLE_DEVICES`` leaves each process one) gives the process's own ``LOCAL_RANK`` device."""
    out, missing = _where(planned)
    if missing:
        warnings.warn(f"the plan puts stages on {', '.join(sorted(set(missing)))}, which this process does not "
                      "have: they run on the cpu (the plan's times and memory are those of the devices it was "
                      "made for)", UserWarning, stacklevel=2)
    return out


def rank_device_type(planned: list[str]) -> str:
    """The device type this process runs the plan's stages on (:func:`rank_devices`, without its warning):
    ``"cuda"`` where it runs any on a GPU (its process group then takes NCCL and its mesh is a CUDA mesh),
    else ``"cpu"``."""
    return "cuda" if any(d.type == "cuda" for d in _where(planned)[0]) else "cpu"


def _where(planned: list[str]) -> tuple[list[torch.device], list[str]]:
    """:func:`rank_devices` and the planned devices this process lacks."""
    out, missing = [], []
    for name in planned:
        device = torch.device(name)
        backend = getattr(torch, device.type, None) if device.type not in ("cpu", "meta") else None
        if backend is None:
            out.append(device)
        elif not backend.is_available():
            missing.append(str(device))
            out.append(torch.device("cpu"))
        elif device.index is None or device.index < backend.device_count():
            out.append(device)
        else:
            out.append(_own_device(device, backend.device_count()))
    return out, missing


def _own_device(device: torch.device, count: int) -> torch.device:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= count:
        raise PlanMismatchError(f"the plan puts a stage on {device}, but this process (LOCAL_RANK {local}) sees "
                                f"{count} {device.type} device(s): start one process per device of the plan on each "
                                f"node, or set CUDA_VISIBLE_DEVICES so that each process sees its own")
    return torch.device(device.type, local)
