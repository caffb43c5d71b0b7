"""On-disk cache of node costs, so that a second compile of the same model does not re-profile.

An entry is keyed by everything a cost depends on: the graph fingerprint (op
structure and parameter shapes), the device (and the GPU's name), the
micro-batch's shapes and dtypes, the profile mode and its settings (with
``"measure"``, whether nodes are timed alone or in whole-graph runs), the
number of intra-op threads, whether (and with which ``torch.compile`` options) the stages are compiled, and
the fxpipe and torch versions. The key is
stored inside the entry and compared in full on load, and the entry must cover
exactly the graph's nodes: anything else — another version, another graph, a
truncated or hand-edited file — is a miss, and the model is profiled again
(never a stale cost). Files are plain JSON written atomically.

The directory is ``$FXPIPE_CACHE_DIR`` or ``~/.cache/fxpipe/profiles``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from fxpipe.cost.graph_timing import default_timing
from fxpipe.cost.profile import NodeCost

__all__ = ["ProfileCache", "profile_key", "default_cache_dir", "CACHE_FORMAT"]

CACHE_FORMAT = "fxpipe-profile/2"   # 2: NodeCost.float_outputs
log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    env = os.environ.get("FXPIPE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "fxpipe" / "profiles"


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype), "device": value.device.type}
    return repr(value)


def _option(value: Any) -> Any:
    """A ``torch.compile`` option as a stable JSON value: a backend given as a callable by its qualified name
    (its ``repr`` holds an address that changes between processes, so the entry would never be read again)."""
    if callable(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


COST_MODEL = 3   # bump when what a profile measures changes (3: view bytes, inputs not activations, savers)


def profile_key(fingerprint: str, device: torch.device, micro_inputs: tuple, mode: str, warmup: int,
                repeats: int, spec_name: str | None = None,
                compiled: dict[str, Any] | None = None, timing: str | None = None) -> dict[str, Any]:
    """Everything the costs depend on, as a JSON-able dict. ``compiled`` is the ``torch.compile`` keyword
    arguments the stages are compiled with (``None``: eager stages); a plan for compiled stages never reads the
    costs recorded for eager ones, nor those of other compile options (a ``mode`` or ``backend`` changes what the
    stage-timing rounds measure, and what a later cost model may measure per node). ``timing``: how
    ``"measure"`` times the nodes, ``None`` for the device's default; the key holds the choice made (``None``
    in the other modes, which time nothing), so node-timed costs are never read for graph timing."""
    from fxpipe._version import __version__

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "fingerprint": fingerprint, "device": str(device), "device_name": name,
        "inputs": [_describe(v) for v in tree_flatten(list(micro_inputs))[0]],
        "mode": mode, "warmup": warmup, "repeats": repeats, "spec": spec_name,
        "threads": torch.get_num_threads(), "fxpipe": __version__, "torch": torch.__version__,
        "cost_model": COST_MODEL,
        "timing": (timing or default_timing(device)) if mode == "measure" else None,
        "compiled": None if compiled is None else {k: _option(v) for k, v in sorted(compiled.items())},
    }


class ProfileCache:
    """Load and store node costs under a key from :func:`profile_key`."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()

    def path(self, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return self.directory / f"{digest}.json"

    def load(self, key: dict[str, Any], gm: fx.GraphModule) -> dict[str, NodeCost] | None:
        path = self.path(key)
        if not path.exists():
            return None
        try:
            doc = json.loads(path.read_text())
            if doc.get("format") != CACHE_FORMAT or doc.get("key") != key:
                log.info("profile cache %s was written for another key; profiling again", path)
                return None
            names = {n.name for n in gm.graph.nodes}
            if set(doc["costs"]) != names:
                log.info("profile cache %s does not cover this graph's nodes; profiling again", path)
                return None
            fields = {f.name for f in dataclasses.fields(NodeCost)}
            return {name: NodeCost(**{k: v for k, v in c.items() if k in fields}) for name, c in doc["costs"].items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("profile cache %s is unreadable (%s); profiling again", path, exc)
            return None

    def store(self, key: dict[str, Any], costs: dict[str, NodeCost]) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        doc = {"format": CACHE_FORMAT, "key": key, "costs": {n: dataclasses.asdict(c) for n, c in costs.items()}}
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
        return path
