"""What crosses each stage boundary, in bytes, with and without boundary compression.

The planner charges a value that crosses a cut with the bytes its codec sends (:func:`charged_bytes`: the
float outputs that carry gradients encoded, other tensors as they are) plus the codec's measured time,
turned into bytes at the links' typical bandwidth (the solver's transfer cost is bytes over bandwidth).
:func:`boundary_table` is each boundary of a plan, before and after compression, which
``plan.summary()`` prints (``plan.predicted["boundaries"]``).
"""

from __future__ import annotations

from typing import Any, Mapping

from fxpipe.compression_spec import BoundaryCodec, CodecSpec, check_compression

__all__ = ["sent_bytes", "charged_bytes", "boundary_table", "codecs_by_stage"]


def sent_bytes(cost: Any, spec: CodecSpec | None) -> float:
    """Bytes a node's output puts on the wire under ``spec`` (``None``: as produced)."""
    if spec is None:
        return float(cost.output_bytes)
    floats = [(tuple(shape), int(size)) for shape, size in cost.float_outputs]
    raw = sum(size * _numel(shape) for shape, size in floats)
    return float(cost.output_bytes - raw + sum(spec.sent_bytes(shape, size) for shape, size in floats))


def charged_bytes(costs: Mapping[str, Any], codec: BoundaryCodec, codec_s_per_byte: float,
                  bandwidth_Bps: float) -> dict[str, float]:
    """Per node: the bytes a cut after it costs (the mean of the two directions, as the solver charges an
    edge's bytes each way), and the codecs' time per raw byte counted as bytes at ``bandwidth_Bps``."""
    out = {}
    for name, c in costs.items():
        raw = sum(int(size) * _numel(tuple(shape)) for shape, size in c.float_outputs)
        both = sent_bytes(c, codec.forward) + sent_bytes(c, codec.backward)
        out[name] = both / 2 + codec_s_per_byte * raw * bandwidth_Bps
    return out


def codecs_by_stage(compression: Any, stages: int) -> dict[int, BoundaryCodec]:
    """``CompileOptions.compression`` as a codec per producing stage (those of a dict, or every stage)."""
    checked = check_compression(compression)
    if checked is None:
        return {}
    if isinstance(checked, BoundaryCodec):
        return {k: checked for k in range(stages)}
    return {k: c for k, c in checked.items() if k < stages}


def boundary_table(gm: Any, costs: Mapping[str, Any], stage_of: Mapping[str, int],
                   codecs: Mapping[int, BoundaryCodec]) -> list[dict[str, Any]]:
    """Per stage that sends values to later stages, per micro-batch: the bytes as produced (``bytes``, each
    way), and as sent forward (``forward_bytes``) and back (``backward_bytes``, the gradients)."""
    rows: dict[int, dict[str, Any]] = {}
    for node in gm.graph.nodes:
        k = stage_of.get(node.name)
        if k is None or node.op in ("get_attr", "placeholder") or node.name not in costs:
            continue
        if any(stage_of.get(u.name, k) != k for u in node.users):
            codec = codecs.get(k)
            row = rows.setdefault(k, {"stage": k, "codec": codec.name if codec else "",
                                      "bytes": 0.0, "forward_bytes": 0.0, "backward_bytes": 0.0})
            row["bytes"] += float(costs[node.name].output_bytes)
            row["forward_bytes"] += sent_bytes(costs[node.name], codec.forward if codec else None)
            row["backward_bytes"] += sent_bytes(costs[node.name], codec.backward if codec else None)
    return [rows[k] for k in sorted(rows)]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
