"""A directory of checkpoints published atomically: a process killed while one is written never leaves it to resume.

``publish(root, step, write, meta)`` (collective: every rank calls it) has every rank write its part of the
checkpoint of ``step`` into ``root/.partial-step-<step>/`` (``write(path)``, e.g. :func:`fxpipe.distributed.
checkpoint.save`, which returns on every rank only once every rank's files and the metadata are on disk), then
rank 0 alone writes ``meta`` (``fxpipe-step.json``) beside them, renames the directory to ``root/step-<step>/``
and, last, points ``root/latest`` at it (a temporary file replaced by ``os.replace``: a reader sees the old
pointer or the new, never half of one). Every file and directory is fsync'd before the step that makes it
visible. So ``latest`` only ever names a directory that was complete before it was named; a kill at any
moment (while the ranks write, between the rename and the pointer, while the pointer is written) leaves the
previous checkpoint the one :func:`latest` returns. Partial directories (of a killed attempt) are removed by
the next publish, before anyone writes; published ones older than the last ``keep`` are removed after the
pointer moved.

Written by hand because ``torch.distributed.checkpoint`` writes in place (its ``.metadata`` last, but a
reader of a directory does not know a write was under way) and keeps no notion of "the last complete one";
torchtitan's checkpointer does the same with ``step-N`` folders. With several hosts ``root`` must be a
shared file system (rank 0 renames what every rank wrote), as ``torch.distributed.checkpoint`` needs anyway.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable

import torch.distributed as dist

__all__ = ["publish", "latest", "LATEST", "META"]

LATEST = "latest"
META = "fxpipe-step.json"
PARTIAL = ".partial-"


def _name(step: int) -> str:
    return f"step-{step:08d}"


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(path: str) -> None:
    for folder, _, files in os.walk(path):
        for name in files:
            _fsync(os.path.join(folder, name))
        _fsync(folder)


def publish(root: str, step: int, write: Callable[[str], None], meta: dict[str, Any] | None = None,
            keep: int = 2) -> str:
    """Write the checkpoint of ``step`` with ``write(directory)`` on every rank, then publish it as
    ``root/step-<step>`` and point ``root/latest`` at it (rank 0). Returns the published directory."""
    if keep < 1:
        raise ValueError(f"keep={keep}: keep at least the checkpoint just published (keep=1)")
    rank = dist.get_rank() if dist.is_initialized() else 0
    partial, final = os.path.join(root, PARTIAL + _name(step)), os.path.join(root, _name(step))
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):   # a killed attempt's partial checkpoints: never read, removed now
            if name.startswith(PARTIAL):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()   # nobody writes before the stale partial directories are gone
    write(partial)
    if rank != 0:
        return final
    _write_json(os.path.join(partial, META), {"step": step, **(meta or {})})
    _fsync_tree(partial)
    if os.path.exists(final):   # published by an attempt killed before it moved the pointer: not the latest
        current = latest(root)
        if current is not None and os.path.abspath(current[0]) == os.path.abspath(final):
            raise FileExistsError(f"{final} is the latest checkpoint; publishing step {step} again would replace "
                                  "the one a restart resumes from")
        shutil.rmtree(final)
    os.rename(partial, final)
    _fsync(root)
    pointer = os.path.join(root, f".{LATEST}.tmp")
    _write_json(pointer, {"step": step, "path": _name(step)})
    os.replace(pointer, os.path.join(root, LATEST))   # the moment the checkpoint becomes the one resumed from
    _fsync(root)
    published = sorted(n for n in os.listdir(root) if n.startswith("step-") and n != _name(step))
    for name in published[:max(0, len(published) - (keep - 1))]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return final


def latest(root: str) -> tuple[str, dict[str, Any]] | None:
    """The last published checkpoint under ``root`` (its directory and the ``meta`` it was published with, with
    ``step``), or ``None`` where none was. A directory written by :func:`fxpipe.distributed.checkpoint.save`
    straight into ``root`` (no ``latest``) is returned as it is, its meta read from ``fxpipe-launch.json``."""
    pointer = os.path.join(root, LATEST)
    if os.path.exists(pointer):
        with open(pointer) as f:
            name = json.load(f)["path"]
        path = os.path.join(root, name)
        if not os.path.exists(os.path.join(path, META)):
            raise FileNotFoundError(f"{pointer} names {name}, which is not a complete checkpoint (no {META}): "
                                    "the directory was changed by hand; point it at a step-* directory that has one")
        with open(os.path.join(path, META)) as f:
            return path, json.load(f)
    legacy = os.path.join(root, "fxpipe-launch.json")
    if os.path.exists(legacy) and os.path.exists(os.path.join(root, ".metadata")):
        with open(legacy) as f:
            return root, {"step": json.load(f)["steps"]}
    return None
