"""A costed graph and its devices as the mesh search's problem (:class:`solvers.mesh.MeshProblem`).

The graph becomes a chain of pieces in the solver's order (:func:`fxpipe.planning.lowering.solver_order`):
each repeated block (:func:`fxpipe.planning.blocks.repeated_blocks`: a transformer's layers) is one piece,
and each run of operations between blocks (the embedding and the masks and rotary tables before the first
layer, the norm, head and loss after the last) another. Per piece, per sample: forward and backward seconds
less the per-node launch time (which does not scale with the micro-batch: :mod:`fxpipe.cost.rescale`),
parameter and saved-activation bytes; per cut between pieces, the bytes of every value crossing it (the
hidden state, and the masks and rotary tables every layer reads). Tensor parallelism is charged as Megatron-LM
runs it (Shoeybi et al. 2019; Korthikanti et al. 2022): a block makes two collectives of its hidden state's
size in its forward (after attention and after the MLP) and two in its backward; without sequence parallelism five
hidden-state-sized activations of each block stay whole on every tp rank (Korthikanti et al., table 2: the
``10 s b h`` bytes of a layer's ``34 s b h`` that tensor parallelism alone does not divide). The pieces outside
the blocks are charged as fxpipe's runtime runs them, whole on every tp rank (``Piece.tp_sharded`` false: the
default tensor-parallel plan shards the blocks' layers, not the embedding or the head; Megatron-LM's
vocabulary-parallel embedding and head are not run), with no collective of their own; the all-gather of the hidden
state before the head under sequence parallelism (one, forward only, against four all-reduce-sized collectives
a block) is left out.

The devices become levels of links (:func:`levels_of`): the islands of the fastest link class inside a node
(NVLink on an H100 box: all 8; PIX pairs on a PCIe box), the blocks of each slower class inside the node
(the PHB quads, the SYS halves of a two-socket box), then the network between nodes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch.fx as fx

from fxpipe.cost.devices import Devices
from fxpipe.cost.expert_costs import as_experts
from fxpipe.planning.block_figures import kept_by_selective
from fxpipe.planning.blocks import repeated_blocks
from fxpipe.planning.lowering import solver_order
from fxpipe.planning.topology import link_class_bandwidth
from solvers.mesh import Level, Piece

__all__ = ["chain_pieces", "levels_of", "pipeline_ranks", "with_experts"]

_RANK = ["NV", "PIX", "PXB", "PHB", "NODE", "SYS", "HOST", "NET"]   # fastest first (NV# by its count)


def chain_pieces(gm: fx.GraphModule, costs: dict[str, Any], samples: int, launch_s: float
                 ) -> tuple[list[Piece], list[float], float, list[list[str]]]:
    """(pieces, bytes per sample crossing each cut, bytes per sample the first piece sends every later stage,
    each piece's node names) of ``gm`` costed on micro-batches of ``samples`` samples. A value the first piece
    makes and pieces past the next read (a transformer's attention mask and rotary tables, read by every layer)
    goes from the first stage to each later stage that reads it, as the runtime sends it and the node-level
    costing charges it (:func:`solvers.score.score_assignment`): the first stage sends it once per later stage,
    not once per cut (``MeshProblem.broadcast_bytes``)."""
    blocks = repeated_blocks(gm)
    block_of = {name: path for path, names in blocks.items() for name in names}
    order = [n for n in solver_order(gm) if n.name in costs]
    groups: list[tuple[str | None, list[fx.Node]]] = []
    for n in order:
        key = block_of.get(n.name)
        if groups and groups[-1][0] == key:
            groups[-1][1].append(n)
        else:
            groups.append((key, [n]))
    piece_of = {n.name: i for i, (_, members) in enumerate(groups) for n in members}
    crossing = [0.0] * (len(groups) - 1)   # bytes over the cut after piece i
    broadcast = 0.0
    for n in order:
        if n.op == "get_attr":   # a parameter read in a later piece (tied): a copy there, not a transfer
            continue
        last = max((piece_of[u.name] for u in n.users if u.name in piece_of), default=piece_of[n.name])
        if piece_of[n.name] == 0 and last > 1:
            broadcast += costs[n.name].output_bytes
            continue
        for i in range(piece_of[n.name], last):
            crossing[i] += costs[n.name].output_bytes
    cuts = [c / samples for c in crossing]
    pieces = []
    for i, (key, members) in enumerate(groups):
        c = [costs[n.name] for n in members]
        fixed = sum(min(x.fwd_s, launch_s) for x in c)
        fixed_b = sum(min(x.bwd_s, 2 * launch_s) for x in c)
        if key is not None:   # a block: two collectives of its output (the hidden state) each way
            calls = [n for n in members if n.op == "call_function" or n.op == "call_module"]
            hidden = costs[calls[-1].name].output_bytes / samples if calls else 0.0
            collectives, replicated = 2, 5 * hidden
        else:   # run whole on every tp rank (module docstring): no collective of its own
            hidden, collectives, replicated = 0.0, 0, 0.0
        pieces.append(Piece(
            name=key or _span(members), fwd_s=max(0.0, sum(x.fwd_s for x in c) - fixed) / samples,
            bwd_s=max(0.0, sum(x.bwd_s for x in c) - fixed_b) / samples,
            param_bytes=float(sum(x.param_bytes for x in c)), act_bytes=sum(x.act_bytes for x in c) / samples,
            fixed_s=max(fixed, fixed_b / 2), tp_collectives=collectives, tp_bytes=hidden,
            replicated_act_bytes=min(replicated, sum(x.act_bytes for x in c) / samples), block=key is not None,
            selective_share=_selective_share(gm, members, costs), tp_sharded=key is not None,
            selective_kept_bytes=sum(costs[n.name].output_bytes for n in members if kept_by_selective(gm, n))
            / samples,
            # as the node-level model charges a stage (fxpipe.planning.planner): an operation's output and its
            # gradient on top of a backward; on the piece making the model's output, the loss's two of it
            work_bytes=2 * max((x.output_bytes for x in c), default=0) / samples,
            loss_bytes=2 * sum(costs[n.name].output_bytes for n in members if any(u.op == "output" for u in n.users))
            / samples))
    return pieces, cuts, broadcast / samples, [[n.name for n in members] for _, members in groups]


def with_experts(pieces: list[Piece], piece_nodes: Sequence[Sequence[str]], regions: Sequence[Any],
                 samples: float) -> list[Piece]:
    """``pieces`` with their experts regions (:class:`fxpipe.cost.expert_costs.ExpertRegion`, costed on micro-batches
    of ``samples`` samples) as :class:`solvers.experts.Experts` per sample, on the piece holding each region's
    charged (last) node."""
    where = {n: i for i, names in enumerate(piece_nodes) for n in names}
    found: dict[int, list[Any]] = {}
    for r in regions:
        if r.nodes and r.nodes[-1] in where:
            found.setdefault(where[r.nodes[-1]], []).append(r)
    out = list(pieces)
    for i, rs in found.items():
        out[i] = dataclasses.replace(out[i], experts=as_experts(rs, samples))
    return out


def _selective_share(gm: fx.GraphModule, members: list[fx.Node], costs: dict[str, Any]) -> float:
    """The share of a piece's forward seconds the selective mode recomputes (all but matrix products, attention)."""
    total = sum(costs[n.name].fwd_s for n in members)
    again = sum(costs[n.name].fwd_s for n in members if not kept_by_selective(gm, n))
    return again / total if total > 0 else 1.0


def _span(members: list[fx.Node]) -> str:
    calls = [n.name for n in members if n.op not in ("get_attr", "placeholder")] or [members[0].name]
    return f"{calls[0]}..{calls[-1]}" if len(calls) > 1 else calls[0]


def _rank(cls: str) -> tuple[int, int]:
    """Sort key of a link class, fastest first."""
    if cls.startswith("NV"):
        return (0, -int(cls[2:] or 0))
    return (_RANK.index(cls) if cls in _RANK else len(_RANK), 0)


def _bandwidth(devices: Devices, cls: str) -> tuple[float, float]:
    bw, lat = link_class_bandwidth(cls)
    return devices.bandwidth_Bps.get(cls, bw), lat


def levels_of(devices: Devices) -> list[Level]:
    """The link levels of ``devices``, innermost first; refuses devices the mesh search cannot model (not all
    of one kind, nodes of different sizes, islands of the fastest class that do not tile a node)."""
    n = len(devices)
    if len({s.name for s in devices.specs}) > 1:
        raise ValueError("the mesh search plans identical devices; these are "
                         f"{sorted({s.name for s in devices.specs})}: plan a pipeline (mesh=None) instead")
    nodes = devices.nodes
    if any(b < a for a, b in zip(nodes, nodes[1:])):
        raise ValueError("list the devices node by node (all of node 0, then node 1, ...) for a mesh")
    per_node = [nodes.count(k) for k in sorted(set(nodes))]
    if len(set(per_node)) > 1:
        raise ValueError(f"the nodes hold {per_node} devices; a mesh needs the same number on each node")
    size = per_node[0]
    levels: list[Level] = []
    block = 1
    for cls in sorted({c for c in devices.link_classes[0][1:size]}, key=_rank):   # fastest first
        within = 1 + sum(1 for j in range(1, size) if _rank(devices.link_classes[0][j]) <= _rank(cls))
        for i in range(size):   # every device's devices at least this fast: the aligned block holding it
            start = i - i % within
            fast = {j for j in range(size) if j != i and _rank(devices.link_classes[i][j]) <= _rank(cls)}
            if within <= block or size % within or fast != set(range(start, start + within)) - {i}:
                raise ValueError(f"the devices linked by {cls} or faster do not form equal blocks of consecutive "
                                 "devices; give the mesh search devices ordered island by island")
        levels.append(Level(within // block, *_bandwidth(devices, cls), name=cls))
        block = within
    if not levels:
        levels.append(Level(1, 1e12, 0.0, "X"))
    if n > size:
        levels.append(Level(n // size, *_bandwidth(devices, "NET"), name="NET"))
    return levels


def pipeline_ranks(pp: int, dp: int, tp: int, order: str) -> list[int]:
    """The devices of the pipeline that holds rank 0: its stage ``k`` on the ``k``-th."""
    step = tp * dp if order == "pp-dp-tp" else tp
    return [k * step for k in range(pp)]
