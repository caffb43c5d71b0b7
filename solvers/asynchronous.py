"""Orders and bounds of asynchronous 1F1B training: weight stashing (PipeDream), 2BW, stale-synchronous.

A stream of ``M`` micro-batches runs through ``p`` stages in 1F1B order
(:func:`solvers.schedules.worker_orders`) without a flush between mini-batches. The
micro-batches are cut into update *groups* (``groups[j]`` is micro-batch ``j``'s; nondecreasing):
every stage applies one optimizer update after its backward of a group's last micro-batch,
so a stage's *version* is the number of its groups it has finished. The forward of micro-batch
``j`` on a stage uses that stage's version at that moment; its *lag* is
``groups[j] - version``, the updates synchronous training would have applied that it misses.

``staleness=s`` bounds the lag: the forward ``F(k, j)`` waits until stage ``k`` has finished
group ``groups[j] - s - 1``. :func:`async_orders` builds the per-worker orders that respect it
(each worker runs the first operation of its 1F1B order whose local needs are met); with
``s = 0`` and one group per mini-batch it is 1F1B with a flush after every mini-batch, i.e.
synchronous training. :func:`check_orders` runs the orders' dependencies to the end (or
says where they deadlock), so an executor never waits forever on a bad order.

A stage keeps, per micro-batch in flight, the weight version its forward used (its backward
uses it again). Under 1F1B stage ``k`` has ``n = min(p - k + ahead, M)`` micro-batches in flight, on
consecutive indices, so with groups of ``u`` micro-batches they span at most
``1 + ceil((n - 1) / u)`` versions (:func:`stashed_versions`): ``n`` for ``u = 1`` (PipeDream),
2 for ``u >= n - 1`` (PipeDream-2BW's double buffer).
"""

from __future__ import annotations

from solvers.schedules import Op, worker_orders

__all__ = ["ASYNC_MODES", "async_orders", "check_orders", "stashed_versions"]

ASYNC_MODES = ("stash", "2bw", "ssp")


def stashed_versions(stage: int, stages: int, micro_batches: int, update_every: int, ahead: int = 0,
                     staleness: int | None = None) -> int:
    """The most weight versions stage ``stage`` keeps for its in-flight micro-batches (1F1B's ``p - stage``,
    plus ``ahead``), groups of ``update_every``; with a ``staleness`` bound at most ``staleness + 1`` (the
    oldest in-flight group is unfinished, so every version in flight lies within ``staleness`` of it)."""
    if update_every < 1:
        raise ValueError(f"update_every must be at least 1, got {update_every}")
    n = max(1, min(stages - stage + ahead, micro_batches))
    spanned = 1 + -(-(n - 1) // update_every)
    return spanned if staleness is None else min(spanned, staleness + 1)


def _one_f_one_b(k: int, p: int, m: int, ahead: int) -> list[Op]:
    """1F1B's order of stage ``k`` with ``ahead`` more forwards in its warm-up (``ahead=0``: 1F1B's own)."""
    warm = min(p - k - 1 + ahead, m)
    order: list[Op] = [("F", k, i) for i in range(warm)]
    for f in range(warm, m):
        order += [("F", k, f), ("B", k, f - warm)]
    return order + [("B", k, b) for b in range(m - warm, m)]


def async_orders(stages: int, groups: list[int], staleness: int | None, ahead: int = 0) -> list[list[Op]]:
    """Every worker's operations (one stage per worker, 1F1B) with the forwards held back by ``staleness``.

    ``ahead`` lets every stage run that many more forwards ahead of its backwards than 1F1B's ``p - k``
    (stale-synchronous training lets the first stages run ``staleness`` mini-batches ahead; more
    micro-batches in flight, more activations and weight versions kept).

    ``groups[j]`` is micro-batch ``j``'s update group (0, 1, 2, ... in order); ``staleness=None`` holds nothing.
    """
    if groups and (groups[0] != 0 or any(b - a not in (0, 1) for a, b in zip(groups, groups[1:]))):
        raise ValueError("groups must number the micro-batches' update groups 0, 1, 2, ... in order")
    if staleness is not None and staleness < 0:
        raise ValueError(f"staleness must be None or a non-negative integer, got {staleness}")
    m = len(groups)
    last_of: dict[int, int] = {g: j for j, g in enumerate(groups)}   # each group's last micro-batch
    orders = []
    if ahead < 0:
        raise ValueError(f"ahead must be a non-negative integer, got {ahead}")
    worker_orders("1f1b", stages, max(m, 1))   # the shape's checks
    for order in [_one_f_one_b(k, stages, m, ahead) for k in range(stages)]:
        finished = set()   # micro-batches whose F or B this worker has emitted, as (kind, j)
        remaining, out = list(order), []
        while remaining:
            for pos, (kind, k, j) in enumerate(remaining):
                if kind == "B":
                    ready = ("F", j) in finished
                else:
                    needed = groups[j] - staleness - 1 if staleness is not None else -1
                    ready = needed < 0 or ("B", last_of[needed]) in finished
                if ready:
                    break
            else:   # cannot happen for a 1F1B order: the oldest held forward's group is always finishable
                raise ValueError(f"stage {order[0][1]}: no operation can run next; held {remaining[:4]}")
            out.append(remaining.pop(pos))
            finished.add((kind, j))
        orders.append(out)
    return orders


def check_orders(orders: list[list[Op]]) -> None:
    """Run the orders' dependencies (forward from stage ``k - 1``, backward from ``k + 1``, a stage's
    own forward before its backward) to the end; raise ``ValueError`` naming the stuck operations if not."""
    p = len(orders)
    done: set[Op] = set()
    position = [0] * p
    progress = True
    while progress:
        progress = False
        for w in range(p):
            while position[w] < len(orders[w]):
                kind, k, j = orders[w][position[w]]
                needs = [("F", k - 1, j)] if kind == "F" and k > 0 else []
                if kind == "B":
                    needs = [("F", k, j)] + ([("B", k + 1, j)] if k < p - 1 else [("F", p - 1, j)])
                if not all(n in done for n in needs):
                    break
                done.add((kind, k, j))
                position[w] += 1
                progress = True
    stuck = [orders[w][position[w]] for w in range(p) if position[w] < len(orders[w])]
    if stuck:
        raise ValueError(f"the asynchronous order deadlocks: the workers wait at {stuck}")
