"""The mesh problem: a chain of model pieces on ``world`` identical devices split as pp × dp × tp, and its cost model.

A language model is a chain of pieces (the embedding, each transformer block, the head and loss) with
figures per sample: forward and backward seconds on one device, parameter bytes, activation bytes saved
for the backward, the bytes crossing a cut after each piece, and per piece the tensor-parallel collectives
its forward makes (a transformer block: two, after attention and after the MLP, each of the hidden state's
size; the backward makes as many). The devices form nested levels of links, innermost first: the islands
of the fastest links (NVLink inside a node), then the network between nodes (:class:`Level`).

A mesh (a :class:`solvers.layout.Layout` of the search's shape: :meth:`~solvers.layout.Layout.of`) puts ``tp`` innermost (consecutive ranks, which must lie inside one island), then
``dp`` and ``pp`` in either order (``order="pp-dp-tp"``: pp outermost, as torchtitan's mesh; ``"dp-pp-tp"``:
dp outermost); a dimension's collectives run at the slowest link of the block of ranks it spans.
What each part is charged (:func:`stage_figures`, :func:`dp_sync_s`):

* compute: a piece's forward and backward per sample × the micro-batch's samples / ``tp`` (plus the fixed
  per-micro-batch launch time, not divided), the backward again plus the forward when recomputing; a piece
  tensor parallelism does not shard (``Piece.tp_sharded`` false: fxpipe's runtime shards the blocks only, and runs
  the embedding and the head whole on every tp rank) is not divided by ``tp``, in time, parameters, states and
  activations;
* tensor parallel: per piece and micro-batch ``tp_collectives`` all-reduces (or, with sequence parallelism,
  reduce-scatter + all-gather pairs: the same bytes on a ring) of ``tp_bytes`` × samples in the forward and
  as many in the backward, ring time ``2 (t - 1) / t × bytes / bandwidth`` at the ``tp`` island's link,
  not overlapped with compute;
* the pipeline: a value crossing a cut goes forward and its gradient back, each charged to both stages
  (as :mod:`solvers.score`), at the ``pp`` dimension's link; with sequence parallelism each rank sends its
  ``1 / tp`` of what a tensor-parallel piece sends on; what the first piece makes for every later one
  (``broadcast_bytes``: attention masks, rotary tables) the first stage sends each later stage directly;
* data parallel once per step: ``replicate`` all-reduces the gradients (``2 (d - 1) / d`` × bytes);
  ``shard`` (FSDP2, one unit per repeated block and the stage's root for the rest, as fxpipe's runtime shards:
  :mod:`fxpipe.distributed.parallel.fsdp`) all-gathers the parameters and reduce-scatters the gradients
  (``(d - 1) / d`` × bytes each) block by block, at the ``dp`` dimension's link: each block's gather overlaps
  the compute before it, so what stands before the first forward is the gather of the root's parameters (the
  pieces that are not blocks) and of the first block (:func:`gathered_first`); each block's reduce-scatter
  starts as its last backward of the step ends and overlaps the backwards of the blocks before it, so what
  stands after the last backward is the root's and the first block's, and whatever the others take beyond that
  backward (under a split backward, every reduce-scatter stands after the last weight pass); without a pipeline
  (``pp=1``) the blocks are gathered again for every micro-batch's forward and backward, charged where they
  take longer than the compute they overlap;
* memory per device (:func:`state_bytes`): parameters and gradients of its stages / ``tp`` (kept whole on
  each dp rank through the step; without a pipeline, FSDP2's blocks / ``dp`` but two), the optimizer's state /
  ``tp`` and, sharded, / ``dp``; activations / ``tp`` (with sequence
  parallelism; without it ``replicated_act_bytes`` stay whole, Korthikanti et al. 2022, table 2) times the
  schedule's micro-batches in flight (:func:`solvers.schedules.inflight`), or, recomputing, each in-flight
  micro-batch's stage input plus one micro-batch's activations. Interleaved stages share a device's memory
  equally, as the pipeline planner gives them.

Left out: compute efficiency lost to narrower matrices under tensor parallelism, overlap of the
collectives with compute (all charged exposed but the data-parallel sync, which :mod:`solvers.mesh_search`
overlaps with the pipeline's drain when it simulates), contention of several dimensions on one link,
workspace buffers and allocator fragmentation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from solvers.errors import InvalidProblemError
from solvers.layout import DP_MODES, ORDERS, Layout, refusal
from solvers.experts import Experts, expert_degrees, expert_extra_s, held_bytes, sharded_optimizer_bytes
from solvers.mesh_held import stage_held, stage_inflight
from solvers.schedules import SCHEDULES, stage_worker, stages_per_worker

__all__ = ["DP_MODES", "MODES", "ORDERS", "Level", "MeshProblem", "Piece", "StageFigures", "allreduce_s",
           "dp_sync_s", "expert_counts", "gather_s", "gathered_first", "reduced_after_s", "regather_s", "state_bytes", "mesh_shapes", "stage_figures", "stage_held"]



@dataclass(frozen=True)
class Piece:
    """One piece of the chain; times and activation bytes per sample, at one device's speed."""

    name: str
    fwd_s: float
    bwd_s: float
    param_bytes: float = 0.0
    act_bytes: float = 0.0
    fixed_s: float = 0.0               # per micro-batch forward time that does not scale (the backward: twice)
    tp_collectives: int = 0            # activation-sized collectives per forward (as many in the backward)
    tp_bytes: float = 0.0              # per sample: the size of each
    replicated_act_bytes: float = 0.0  # per sample: activations tensor parallel keeps whole without sequence par.
    block: bool = False                # a repeated block: per-block recomputation checkpoints it on its own
    selective_share: float = 1.0       # the share of a block's forward selective recomputation runs again
    tp_sharded: bool = True            # tensor parallelism divides it (else it runs whole on every tp rank)
    selective_kept_bytes: float = 0.0  # per sample: the outputs selective recomputation keeps (matmuls, attention)
    work_bytes: float = 0.0            # per sample: a backward's transient, an operation's output and its gradient
    loss_bytes: float = 0.0            # per sample: the loss's transient on the piece making the model's output
    experts: Experts | None = None     # its mixture-of-experts layers (solvers.experts), sharded by ``ep``


@dataclass(frozen=True)
class Level:
    """Blocks of ``size`` units of the level inside (devices for the first), joined by this link."""

    size: int
    bandwidth_Bps: float
    latency_s: float = 0.0
    name: str = ""


@dataclass
class MeshProblem:
    pieces: list[Piece]
    cut_bytes: list[float]        # per sample: what crosses a cut after piece i (len(pieces) - 1 entries)
    levels: list[Level]           # innermost first; the product of their sizes is the world
    memory_bytes: float           # per device
    batch: int                    # samples in one step, over all dp replicas
    grad_factor: float = 1.0      # gradient bytes per parameter byte
    optimizer_factor: float = 6.0  # optimizer bytes (master copy, moments) per parameter byte
    speed: float = 1.0            # the devices' speed relative to the one the times are for
    schedules: tuple[str, ...] = SCHEDULES
    dp_modes: tuple[str, ...] = DP_MODES
    orders: tuple[str, ...] = ORDERS
    sequence_parallel: bool = True
    weight_share: float = 0.5     # of a backward, the weight-gradient pass (zero-bubble schedules)
    virtual_stages: int = 2       # interleaved-1f1b's stages per device
    most_micro_batches: int | None = None   # at most this many per step (default: the local batch)
    micro_batch_counts: tuple[int, ...] = ()  # only these (per dp replica); empty: powers of two and the whole
    fixed: list[Layout] = field(default_factory=list)   # only these meshes (empty: every shape)
    runnable_only: bool = True   # the search enumerates only layouts fxpipe's runtime runs (solvers.layout.refusal)
    broadcast_bytes: float = 0.0  # per sample: what the first piece sends each later stage (masks, rotary tables)
    tp_refused: tuple[int, ...] = ()   # tp degrees the runtime cannot shard this model over (its heads, features)

    def __post_init__(self) -> None:
        if not self.pieces:
            raise InvalidProblemError("the mesh problem has no pieces")
        if len(self.cut_bytes) != len(self.pieces) - 1:
            raise InvalidProblemError(f"cut_bytes has {len(self.cut_bytes)} entries for {len(self.pieces)} pieces; "
                                      "it needs one per cut between consecutive pieces")
        if not self.levels or any(lv.size < 1 or lv.bandwidth_Bps <= 0 for lv in self.levels):
            raise InvalidProblemError("levels must be at least one level of positive size and bandwidth")
        if self.batch < 1 or self.memory_bytes <= 0:
            raise InvalidProblemError(f"batch ({self.batch}) and memory_bytes ({self.memory_bytes}) must be positive")
        unknown = [s for s in self.schedules if s not in SCHEDULES] + [d for d in self.dp_modes if d not in DP_MODES]
        if unknown:
            raise InvalidProblemError(f"unknown schedule or dp mode {unknown[0]!r}; expected one of "
                                      f"{', '.join(SCHEDULES + DP_MODES)}")

    @property
    def world(self) -> int:
        return math.prod(lv.size for lv in self.levels)

    def link(self, size: int, stride: int) -> Level | None:
        """The slowest level a group of ``size`` ranks ``stride`` apart spans (None for one rank)."""
        if size == 1:
            return None
        span, block = size * stride, 1
        for lv in self.levels:
            block *= lv.size
            if span <= block:
                return lv
        return self.levels[-1]

    def links(self, mesh: Layout) -> dict[str, Level | None]:
        """The link each dimension of ``mesh`` crosses."""
        t, d, p = mesh.tp, mesh.dp, mesh.pp
        dp_stride, pp_stride = (t, t * d) if mesh.order == "pp-dp-tp" else (t * p, t)
        return {"tp": self.link(t, 1), "dp": self.link(d, dp_stride), "pp": self.link(p, pp_stride)}

    def ep_link(self, mesh: Layout) -> Level | None:
        """The link ``mesh``'s ``ep`` groups span: consecutive data-parallel ranks, as the runtime groups them."""
        return self.link(mesh.ep, mesh.tp if mesh.order == "pp-dp-tp" else mesh.tp * mesh.pp)

    def ep_speed(self, mesh: Layout) -> tuple[float, float]:
        """(bandwidth, latency) of :meth:`ep_link` (infinite and none: one rank, nothing sent)."""
        link = self.ep_link(mesh)
        return (float("inf"), 0.0) if link is None else (link.bandwidth_Bps, link.latency_s)


def mesh_shapes(problem: MeshProblem) -> list[Layout]:
    """Every pp × dp × tp = world with tp inside the innermost level and pp at most the pieces; each dp mode and
    order where they differ (dp = 1: one; pp or dp = 1: one order), of those fxpipe's runtime runs
    (:func:`solvers.layout.refusal`; no ``tp`` of ``problem.tp_refused``) unless ``problem.runnable_only`` is
    off."""
    if problem.fixed:
        return list(problem.fixed)
    world, island = problem.world, problem.levels[0].size
    refused = set(problem.tp_refused) if problem.runnable_only else set()
    out = []
    for t in (k for k in range(1, island + 1) if island % k == 0 and world % k == 0 and k not in refused):
        for p in (k for k in range(1, world // t + 1) if (world // t) % k == 0):
            d = world // (t * p)
            if p > len(problem.pieces) or problem.batch % d:
                continue
            for mode, order, e in ((m, o, e) for m in (problem.dp_modes if d > 1 else problem.dp_modes[:1])
                                   for o in (problem.orders if d > 1 and p > 1 else problem.orders[:1])
                                   for e in expert_degrees(expert_counts(problem), d, t)):
                shape = Layout.of(p, d, t, mode, order, ep=e)
                if not (problem.runnable_only and refusal(shape)):
                    out.append(shape)
    return out


def expert_counts(problem: MeshProblem) -> set[int]:
    """The expert counts of the problem's mixture-of-experts layers (empty: a dense model, no ``ep`` searched)."""
    return {n for piece in problem.pieces if piece.experts is not None for n in piece.experts.counts}


def allreduce_s(nbytes: float, n: int, link: Level | None) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` ranks (a reduce-scatter and an all-gather)."""
    return 0.0 if link is None or n < 2 else 2 * gather_s(nbytes, n, link)


def gather_s(nbytes: float, n: int, link: Level | None) -> float:
    """Ring all-gather (or reduce-scatter) of ``nbytes`` in all over ``n`` ranks."""
    if link is None or n < 2:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth_Bps + (n - 1) * link.latency_s


@dataclass
class StageFigures:
    """Per piece, for one mesh and micro-batch size: what :mod:`solvers.mesh_search` cuts."""

    fwd_s: list[float]        # per micro-batch, tensor-parallel collectives included
    bwd_s: list[float]        # per micro-batch, recomputation included
    weight_s: list[float]     # the weight-gradient share of bwd_s
    state_bytes: list[float]  # parameters, gradients, optimizer state per device
    param_bytes: list[float]  # parameters per device (what data parallel moves)
    act_bytes: list[float]    # per micro-batch per device
    cut_s: list[float]        # one way, one micro-batch, over the pp link: a cut after piece i
    cut_bytes: list[float]    # per micro-batch per device: what a cut after piece i keeps
    kept_bytes: list[float] = field(default_factory=list)   # per micro-batch, from forward to backward, in the mode
    rebuilt_bytes: float = 0.0   # block modes: the largest recomputed block's activations, rebuilt in a backward
    broadcast_s: float = 0.0     # one way, one micro-batch: the first stage's send to each later stage
    work_bytes: float = 0.0      # the largest piece's backward transient (an operation's output and its gradient)
    loss_bytes: float = 0.0      # the loss's transient, on the stage holding the last piece


MODES = ("never", "always", "blocks", "blocks:2", "selective")
"""A stage's recomputation in the search, as :mod:`fxpipe.runtime` runs it (the names of
:func:`fxpipe.planning.memory_model.block_mode`; the plan's spelling, :data:`solvers.layout.RECOMPUTATION`)."""


def stage_figures(problem: MeshProblem, mesh: Layout, samples: int, mode: str = "never",
                  split: bool = False) -> StageFigures:
    """The pieces' figures on ``mesh`` for micro-batches of ``samples`` samples (module docstring) under the
    recomputation ``mode`` (:data:`MODES`): ``"always"`` adds each piece's forward to its backward; ``"blocks"``
    each block's (a micro-batch keeps the block's input in place of its activations), ``"blocks:2"`` the blocks' at
    even positions in the model, ``"selective"`` the share of a block's forward that is not a matrix product or
    attention (``Piece.selective_share``; their outputs kept besides the input). Under a ``split`` backward
    (zero-bubble schedules) no per-block mode runs (:func:`fxpipe.planning.memory_model.refuse_with_schedule`)."""
    if mode not in MODES or (split and mode not in ("never", "always")):
        raise InvalidProblemError(f"recomputation {mode!r} is not one of {MODES} (under a split backward: never or "
                                  "stages only)")
    links, t, speed = problem.links(mesh), mesh.tp, problem.speed
    sp = problem.sequence_parallel
    states = state_bytes(problem, mesh, max(1, round(problem.batch / (mesh.dp * samples))), split, mode)
    # with sequence parallelism what a tensor-parallel piece sends on is its sequence shard
    cut_bytes = [c * samples / (t if sp and piece.tp_sharded else 1)
                 for c, piece in zip(problem.cut_bytes, problem.pieces)]
    fwd, bwd, weight, params, acts, kept, rebuilt = [], [], [], [], [], [], [0.0]
    position = -1   # the block's position in the model
    ep_speed = problem.ep_speed(mesh)
    for x, piece in enumerate(problem.pieces):
        position += piece.block
        d = t if piece.tp_sharded else 1   # a piece tensor parallelism leaves whole runs whole on every tp rank
        tp_s = piece.tp_collectives * allreduce_s(piece.tp_bytes * samples, t, links["tp"])
        more_f, more_b = expert_extra_s(piece.experts, samples, mesh.ep, *ep_speed, speed)
        f = piece.fwd_s * samples / (d * speed) + piece.fixed_s + tp_s + more_f
        whole = piece.replicated_act_bytes if not sp and piece.tp_sharded else 0.0
        act = ((piece.act_bytes - whole) / d + whole) * samples
        again, keeps = _recomputed(mode, piece, position, f, act, cut_bytes[x - 1] if x > 0 else 0.0,
                                   piece.selective_kept_bytes * samples / d)
        if again and piece.block and mode != "always":
            rebuilt.append(act - (keeps - (cut_bytes[x - 1] if x > 0 else 0.0)))
        fwd.append(f)
        bwd.append(piece.bwd_s * samples / (d * speed) + 2 * piece.fixed_s + tp_s + again + more_b)
        # the weight pass's share of the backward proper, its launches too (half the kernels are weight gradients:
        # the node-level costing's split, solvers.simulate.weight_shares)
        weight.append(problem.weight_share * (piece.bwd_s * samples / (d * speed) + 2 * piece.fixed_s))
        params.append(held_bytes(piece.param_bytes, piece.experts, mesh.ep) / d)
        acts.append(act)
        kept.append(keeps)
    link = links["pp"]
    cut_s = [0.0 if link is None else c / link.bandwidth_Bps + link.latency_s for c in cut_bytes]
    sent = problem.broadcast_bytes * samples   # made by the first piece, whole on every tp rank
    broadcast_s = 0.0 if link is None or not sent else sent / link.bandwidth_Bps + link.latency_s
    work = max(piece.work_bytes * samples / (t if piece.tp_sharded else 1) for piece in problem.pieces)
    loss = problem.pieces[-1].loss_bytes * samples
    return StageFigures(fwd, bwd, weight, states, params, acts, cut_s, cut_bytes, kept, max(rebuilt), broadcast_s,
                        work, loss)


def state_bytes(problem: MeshProblem, mesh: Layout, micro_batches: int, split: bool = False,
                mode: str = "never") -> list[float]:
    """Per piece, the bytes of parameters, gradients and optimizer state a device holds at its peak (module
    docstring): each piece's parameters and gradients whole through the step and its optimizer state / ``dp``
    under FSDP2 (``shard``), all of them whole under ``replicate``; without a pipeline (``pp=1``, no split backward)
    FSDP2 reshards each block after its passes, so a block's parameters count / ``dp`` (its gradients too where
    one micro-batch's backward reduces them as it goes; over several they accumulate whole until the last), with
    two blocks unsharded at a time (the one running and the one gathered next), charged to the first block, or, where
    the whole stage is recomputed (``mode="always"``), every block (its recomputation gathers them all)."""
    shard = mesh.dp_mode == "shard" and mesh.dp > 1
    dp, grad, opt = mesh.dp, problem.grad_factor, problem.optimizer_factor
    whole = 1.0 + grad + opt / (dp if shard else 1)
    resharded = shard and mesh.pp == 1 and not split
    block = (1.0 + opt) / dp + grad * (1.0 / dp if micro_batches == 1 else 1.0)
    params = [held_bytes(piece.param_bytes, piece.experts, mesh.ep) / (mesh.tp if piece.tp_sharded else 1)
              for piece in problem.pieces]
    out = [b * (block if resharded and piece.block else whole)
           + (opt * sharded_optimizer_bytes(piece.experts, mesh.ep, dp) if shard else 0.0)
           for b, piece in zip(params, problem.pieces)]
    blocks = [x for x, piece in enumerate(problem.pieces) if piece.block]
    if resharded and blocks:
        sizes = [params[x] for x in blocks]
        out[blocks[0]] += (sum(sizes) if mode == "always" else 2 * max(sizes)) * (1.0 + grad)
    return out


def _recomputed(mode: str, piece: Piece, position: int, f: float, act: float, entering: float,
                selective: float) -> tuple[float, float]:
    """(forward seconds recomputed, bytes a micro-batch keeps from forward to backward) of one piece under
    ``mode`` (:func:`stage_figures`; ``"always"``: the whole forward, and what the stage keeps is its input)."""
    if mode == "always":
        return f, act
    if mode == "never" or not piece.block or (mode == "blocks:2" and position % 2):
        return 0.0, act
    if mode == "selective":
        return f * piece.selective_share, entering + selective
    return f, entering


def dp_sync_s(problem: MeshProblem, mesh: Layout, param_bytes: float,
              first_bytes: float | None = None) -> tuple[float, float]:
    """(before the first forward, after the last backward): data parallel's per-step collectives for a device
    holding ``param_bytes`` of parameters (gradients of the same bytes), of which FSDP2 gathers ``first_bytes``
    (default all) before its first operation (:func:`gathered_first`)."""
    link = problem.links(mesh)["dp"]
    if mesh.dp_mode == "shard":
        first = param_bytes if first_bytes is None else min(first_bytes, param_bytes)
        return gather_s(first, mesh.dp, link), gather_s(param_bytes * problem.grad_factor, mesh.dp, link)
    return 0.0, allreduce_s(param_bytes * problem.grad_factor, mesh.dp, link)


def gathered_first(problem: MeshProblem, param_bytes: list[float], a: int, i: int) -> float:
    """The parameter bytes FSDP2 gathers before the first operation of the stage of pieces ``a:i``: its root's (the
    pieces that are not repeated blocks) and its first block's; each later block's gather overlaps the compute of
    the blocks before it."""
    blocks = [x for x in range(a, i) if problem.pieces[x].block]
    root = sum(param_bytes[x] for x in range(a, i) if not problem.pieces[x].block)
    return root + (param_bytes[blocks[0]] if blocks else 0.0)


def reduced_after_s(problem: MeshProblem, mesh: Layout, param_bytes: list[float], a: int, i: int, backward_s: float,
                    split: bool) -> float:
    """The seconds of data parallel's gradient reduction that stand after the last backward (weight pass) of the
    stage of pieces ``a:i``, whose last backward takes ``backward_s``: the whole reduction but under FSDP2 without
    a split backward, where only the root's and the first block's reduce-scatter do, with what the other blocks'
    take beyond that backward (module docstring)."""
    whole = sum(param_bytes[a:i])
    if mesh.dp_mode != "shard" or mesh.dp == 1 or split:
        return dp_sync_s(problem, mesh, whole)[1]
    link = problem.links(mesh)["dp"]
    last = gathered_first(problem, param_bytes, a, i)
    rest = gather_s((whole - last) * problem.grad_factor, mesh.dp, link)
    return gather_s(last * problem.grad_factor, mesh.dp, link) + max(0.0, rest - backward_s)


def regather_s(problem: MeshProblem, mesh: Layout, block_bytes: float, compute_s: float) -> float:
    """Without a pipeline (``pp=1``), the seconds a micro-batch's forward or backward (``compute_s``) waits for the
    all-gathers of its blocks (``block_bytes``, resharded after each pass): what they take beyond the compute
    they overlap."""
    if mesh.dp_mode != "shard" or mesh.dp == 1 or mesh.pp > 1:
        return 0.0
    return max(0.0, gather_s(block_bytes, mesh.dp, problem.links(mesh)["dp"]) - compute_s)


def budget(problem: MeshProblem, schedule: str, pp: int) -> tuple[int, float]:
    """(stages, memory per stage) of ``schedule`` on ``pp`` devices."""
    v = stages_per_worker(schedule, problem.virtual_stages) if pp > 1 else 1
    return v * pp, problem.memory_bytes / v


def owner(schedule: str, stage: int, pp: int) -> int:
    return stage_worker(schedule, stage, pp)
