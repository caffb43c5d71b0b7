"""Exact dynamic programme over contiguous stages of a topological order.

Search space: the nodes in ``problem.order`` are cut into ``p`` contiguous,
non-empty stages (``p`` is ``problem.stages`` or, when that is null, every
value from 1 to the number of devices), and each stage runs on its own device:
any injective stage-to-device mapping (topology-aware placement, up to
:data:`MAX_EXACT_PLACEMENT_DEVICES` devices), or stage ``k`` on device ``k``
with ``placement=False``. With ``max_replicas > 1`` (format version 2) a stage
may instead take a run of consecutive devices of the hierarchical device order
as a replica group. Within that space the programme returns a solution with
the smallest *reference* iteration time ``sum t_s + (m - 1) max t_s`` that
meets the schedule-aware memory limit, exactly, for any link matrix, device
speeds and skip connections — or, when ``time_limit_s`` stops it first, its
best plan with a proven lower bound (``optimal: false``, ``gap``).

The searches run cheapest first, each one's optimum bounding the next: stage
``k`` on device ``k``, the hierarchical device order, a local search over the
mapping alternated with exact cutting, replica runs, then every mapping under
a best-link relaxation that skips stage counts which cannot win. The anchors'
plans seed the incumbent (their quadratic partitioners only up to
:data:`ANCHOR_SEED_LIMIT`), so no anchor partitioner beats the result. With
placement, ``time_limit_s`` bounds the whole search: the stage-``k``-on-device-``k``
search may take 80 % of it, the placement searches the rest.

Why a label-setting DP rather than the textbook ``(position, stage)`` table:
a stage's time includes its outgoing transfers, one per *later stage* that
consumes a tensor, so it depends on cuts that are made after the stage is
closed, and the objective mixes a sum with a maximum. A state here is
``(cut position, stages so far, pending senders)`` where the pending senders
are the nodes before the cut whose consumers lie after it, with their stage.
Each state keeps the Pareto set of labels ``(sum of stage times, max of
finished stage times, times of stages that can still grow)``; a label is
dropped only when another is no worse in every coordinate, which keeps the
search exact. Two bounds prune it: every stage of an optimal plan takes at
most ``UB / m`` (because ``T >= m max t_s``), and a label whose lower bound
already exceeds the incumbent ``UB`` is dropped; a label's lower bound counts the
slowest stage the rest must still have (``Tables.suffix_bottleneck``: compute and the
transfers every stage pays over the fastest link). Every complete plan's slowest stage
takes at least that long, so a label's own maximum is raised to it: labels that differ
only below it collapse into one. A third bound takes the rest's sum and slowest stage
together (:mod:`solvers.dp.completion`): for each cap on the rest's slowest stage, the
least sum of stages that meet it, every tensor crossing a cut paid for — on a 3000-node
residual chain it leaves thousands of labels where the separate bounds left millions.
Placement states are kept one per orbit of the topology's symmetries
(:mod:`solvers.dp.symmetry`, or the tree of link classes of :mod:`solvers.dp.hierarchy`
for large hierarchical groups). For chains and the short
skips of residual networks the pending set holds one or two nodes, so the
search is close to the quadratic DP; long skips (U-Net) enlarge it.
"""

from solvers.dp.bounds import min_peak_bytes
from solvers.dp.search import MAX_EXACT_PLACEMENT_DEVICES, solve_dp
from solvers.dp.tables import device_classes, stage_counts

__all__ = ["solve_dp", "stage_counts", "min_peak_bytes", "device_classes", "MAX_EXACT_PLACEMENT_DEVICES"]
