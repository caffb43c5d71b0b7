"""What a boundary-compression name means, without torch: parsing and the bytes a codec sends.

``CompileOptions(compression=...)`` takes a name — ``"fp16"``, ``"bf16"``, ``"int8"`` (optionally
``"int8:channel"`` for one scale per channel, ``":stochastic"`` for stochastic rounding, in either order), or
``"topk:R"`` with ``0 < R <= 1`` the share of elements kept — for both directions, or ``"FORWARD/BACKWARD"``
(``"int8/topk:0.01"``: activations in int8, gradients top-k; ``"fp32"`` leaves a direction exact); or a dict
of such names by producing stage (the boundary after that stage). :func:`parse_codec` checks a name and :meth:`CodecSpec.sent_bytes` is what a
codec puts on the wire for a float tensor, which the planner's transfer cost and ``plan.summary()`` read; the
codecs themselves are :mod:`fxpipe.runtime.boundaries.compression`. Lives at the base of the data flow because the
options (checked when made), the planner and the runtime all read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["CODEC_NAMES", "BoundaryCodec", "CodecSpec", "parse_boundary", "parse_codec", "check_compression"]

CODEC_NAMES = ("fp16", "bf16", "int8", "topk:R")
_ALLOWED = ("'fp16', 'bf16', 'int8' (also 'int8:channel', 'int8:stochastic', 'int8:channel:stochastic') or "
            "'topk:R' with 0 < R <= 1 (e.g. 'topk:0.01')")
SCALE_BYTES = 4      # one float32 scale (per tensor, or per channel)
INDEX_BYTES = 4      # a top-k index is sent as int32
VALUE_BYTES = 4      # a top-k value is sent in the tensor's own (float32) precision


@dataclass(frozen=True)
class CodecSpec:
    """One codec: ``kind`` is ``"fp16"``, ``"bf16"``, ``"int8"`` or ``"topk"``."""

    name: str
    kind: str
    ratio: float = 1.0            # topk: the share of elements kept
    per_channel: bool = False     # int8: one scale per channel (dimension 1; one scale for a 1-d tensor)
    stochastic: bool = False      # int8: round up with probability equal to the fraction (unbiased)

    def kept(self, numel: int) -> int:
        """Top-k: the elements sent of a tensor of ``numel`` (at least one)."""
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def sent_bytes(self, shape: tuple[int, ...], element_bytes: int = 4) -> int:
        """Bytes this codec sends for a float tensor of ``shape`` (``element_bytes`` per element uncompressed)."""
        numel = math.prod(shape)
        if self.kind in ("fp16", "bf16"):
            return 2 * numel
        if self.kind == "int8":
            channels = shape[1] if self.per_channel and len(shape) > 1 else 1
            return numel + SCALE_BYTES * channels
        return self.kept(numel) * (INDEX_BYTES + element_bytes)

    def ratio_of(self, raw_bytes: float, element_bytes: int = 4) -> float:
        """Sent over raw bytes for a 1-d float tensor of ``raw_bytes`` (the planner knows bytes, not shapes)."""
        numel = max(1, int(raw_bytes // element_bytes))
        return self.sent_bytes((numel,), element_bytes) / (numel * element_bytes)


def parse_codec(name: Any) -> CodecSpec:
    """The codec ``name`` names; ``ValueError`` naming the allowed names otherwise."""
    if not isinstance(name, str):
        raise ValueError(f"compression must be a codec name ({_ALLOWED}) or a dict of them by stage, got {name!r}")
    parts = name.strip().lower().split(":")
    if parts[0] in ("fp16", "bf16") and len(parts) == 1:
        return CodecSpec(name, parts[0])
    if parts[0] == "int8" and set(parts[1:]) <= {"channel", "stochastic"} and len(set(parts[1:])) == len(parts) - 1:
        return CodecSpec(name, "int8", per_channel="channel" in parts, stochastic="stochastic" in parts)
    if parts[0] == "topk" and len(parts) == 2:
        try:
            ratio = float(parts[1])
        except ValueError:
            ratio = float("nan")
        if not 0.0 < ratio <= 1.0:   # nan fails too
            raise ValueError(f"compression {name!r}: the top-k ratio must be a number in (0, 1] (the share of "
                             f"elements sent, e.g. 'topk:0.01'), got {parts[1]!r}")
        return CodecSpec(name, "topk", ratio=ratio)
    raise ValueError(f"unknown compression {name!r}: use one of {_ALLOWED}, or None for exact boundaries")


@dataclass(frozen=True)
class BoundaryCodec:
    """What one boundary uses each way: the forward activations' codec and the gradients' (``None``: exact)."""

    name: str
    forward: CodecSpec | None
    backward: CodecSpec | None


def parse_boundary(name: Any) -> BoundaryCodec:
    """A codec name for both directions, or ``"FORWARD/BACKWARD"`` (each a codec name or ``"fp32"``: exact)."""
    if isinstance(name, str) and "/" in name:
        parts = name.split("/")
        if len(parts) != 2:
            raise ValueError(f"compression {name!r}: one '/' at most, between the forward activations' codec and "
                             f"the gradients' (e.g. 'int8/topk:0.01'); each of {_ALLOWED} or 'fp32' (exact)")
        fwd, bwd = (None if p.strip().lower() == "fp32" else parse_codec(p) for p in parts)
        return BoundaryCodec(name, fwd, bwd)
    codec = parse_codec(name)
    return BoundaryCodec(name, codec, codec)


def check_compression(value: Any) -> dict[int, BoundaryCodec] | BoundaryCodec | None:
    """``CompileOptions.compression`` checked: ``None``, one codec for every boundary, or codecs by stage."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        out = {}
        for stage, name in value.items():
            if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
                raise ValueError(f"compression as a dict maps a stage index (the boundary after that stage: "
                                 f"0 is between stages 0 and 1) to a codec name, got key {stage!r}")
            out[stage] = parse_boundary(name)
        return out
    return parse_boundary(value)
