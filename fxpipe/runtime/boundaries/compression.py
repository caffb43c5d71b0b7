"""Compressed stage boundaries: codecs for what crosses between stages, and their per-boundary state.

A codec turns a float tensor into a :class:`Payload` (what would be sent: its tensors' bytes are the
bytes moved) and back: ``fp16``/``bf16`` (a cast), ``int8`` (``round(x / scale)`` with one float32 scale
per tensor or per channel, ``scale = max|x| / 127``; optionally stochastic rounding, unbiased), ``topk:R``
(the ``ceil(R * n)`` largest magnitudes with their int32 indices). For gradients, top-k keeps what it did
not send as an error-feedback residual, added to the next gradient of the same boundary, consumer,
micro-batch slot and position (the next step's), so over steps the sum of what was sent is the sum of the
gradients minus the last residual: nothing is lost, only delayed (gradients are summed into the weights,
so a delayed part still arrives). Forward activations get no residual: each is a new value, not a term of
a sum, and a residual carried over (``x`` summed over steps, ``1 - R`` of it unsent) grows without bound.
A residual whose shape no longer matches (a smaller last batch) is dropped.

:class:`BoundaryCompression` is one pipeline's: which codec each boundary (the values a stage sends to
other stages) uses, the residuals, and a lock (workers encode concurrently). The in-process transport
(:mod:`fxpipe.runtime.boundaries.transport`) applies it to forward activations that require gradients and to the
gradients sent back; integer tensors (ids, masks) and values that need no gradient pass untouched. Between
processes (:mod:`fxpipe.distributed.transport`) the payload's tensors are what goes over the wire, and the
receiver, which knows the value's shape, allocates them from :func:`payload_layout`. The
gradient is straight-through: the consumer's gradient with respect to the decoded value is sent back.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Hashable, Mapping

import torch
import torch.fx

from fxpipe.compression_spec import BoundaryCodec, CodecSpec, check_compression

__all__ = ["Payload", "encode", "decode", "payload_layout", "BoundaryCompression", "crossing_stages", "codec_seconds_per_byte"]


@dataclass
class Payload:
    """An encoded tensor: the tensors that would be sent, and the shape and dtype to decode to."""

    tensors: dict[str, torch.Tensor]
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _channel_dims(t: torch.Tensor, per_channel: bool) -> tuple[int, ...]:
    """The dimensions one scale covers: all (per tensor), or all but dimension 1 (per channel)."""
    if per_channel and t.dim() > 1:
        return tuple(d for d in range(t.dim()) if d != 1)
    return tuple(range(t.dim()))


def encode(spec: CodecSpec, t: torch.Tensor, residual: torch.Tensor | None = None,
           generator: torch.Generator | None = None) -> tuple[Payload, torch.Tensor | None]:
    """``t`` encoded by ``spec``, and for top-k the new residual (``residual`` added to ``t`` first)."""
    t = t.detach()
    if spec.kind in ("fp16", "bf16"):
        return Payload({"x": t.to(torch.float16 if spec.kind == "fp16" else torch.bfloat16)}, t.shape, t.dtype), None
    if spec.kind == "int8":
        x = t.float()
        dims = _channel_dims(x, spec.per_channel)
        amax = x.abs().amax(dim=dims, keepdim=True) if x.dim() else x.abs()
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))   # an all-zero channel: any scale
        y = x / scale
        if spec.stochastic:   # round up with probability = the fraction: E[q] = y
            noise = torch.rand(y.shape, generator=generator, device="cpu").to(y.device)
            q = torch.floor(y + noise)
        else:
            q = torch.round(y)
        return Payload({"q": q.clamp_(-127, 127).to(torch.int8), "scale": scale.float()}, t.shape, t.dtype), None
    flat = t.reshape(-1)
    if residual is not None:
        flat = flat + residual
    k = spec.kept(flat.numel())
    index = flat.abs().topk(k, sorted=False).indices
    values = flat[index]
    left = flat.index_fill(0, index, 0)   # what was not sent, exactly: values + left == flat
    return Payload({"values": values, "index": index.to(torch.int32)}, t.shape, t.dtype), left


def payload_layout(spec: CodecSpec, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The tensors :func:`encode` makes of a ``shape``/``dtype`` tensor, in the order a wire sends them: what a
    receiver in another process allocates before the payload arrives (the shapes depend on nothing else)."""
    if spec.kind in ("fp16", "bf16"):
        return [("x", tuple(shape), torch.float16 if spec.kind == "fp16" else torch.bfloat16)]
    if spec.kind == "int8":
        dims = set(_channel_dims(torch.empty(shape, device="meta"), spec.per_channel))
        scale = tuple(1 if d in dims else n for d, n in enumerate(shape))
        return [("q", tuple(shape), torch.int8), ("scale", scale, torch.float32)]
    k = spec.kept(int(torch.Size(shape).numel()))
    return [("values", (k,), dtype), ("index", (k,), torch.int32)]


def decode(spec: CodecSpec, payload: Payload) -> torch.Tensor:
    """The tensor ``payload`` stands for, in its original shape and dtype."""
    got = payload.tensors
    if spec.kind in ("fp16", "bf16"):
        return got["x"].to(payload.dtype)
    if spec.kind == "int8":
        return (got["q"].float() * got["scale"]).to(payload.dtype).reshape(payload.shape)
    values = got["values"]
    out = torch.zeros(payload.shape.numel(), dtype=values.dtype, device=values.device)
    out[got["index"].long()] = values
    return out.reshape(payload.shape).to(payload.dtype)


class BoundaryCompression:
    """One pipeline's compressed boundaries: a codec per producing stage, the top-k residuals, the bytes.

    ``codecs[k]`` compresses what stage ``k`` sends to other stages (and the gradients sent back to it)."""

    def __init__(self, codecs: Mapping[int, BoundaryCodec], seed: int = 0) -> None:
        self.codecs = dict(codecs)
        self.residuals: dict[Hashable, torch.Tensor] = {}
        # the micro-batch slot of each micro-batch index of the run under way, where the two differ (an
        # AsyncTrainer stream numbers its micro-batches across mini-batches); None: the index is the slot
        self.slots: list[int] | None = None
        self.lock = threading.Lock()
        self.generator = torch.Generator().manual_seed(seed)   # stochastic rounding, apart from the model's RNG

    @classmethod
    def of(cls, value: object, boundaries: list[int]) -> "BoundaryCompression | None":
        """``CompileOptions.compression`` for a plan whose stages in ``boundaries`` send values to other stages;
        ``ValueError`` for a dict that names a stage that sends nothing on."""
        checked = check_compression(value)
        if checked is None:
            return None
        if isinstance(checked, BoundaryCodec):
            return cls({k: checked for k in boundaries})
        wrong = sorted(set(checked) - set(boundaries))
        if wrong:
            raise ValueError(f"compression names boundaries after stage(s) {wrong}, but this plan's boundaries are "
                             f"after stages {boundaries} (key k is the boundary between stage k and the stages "
                             f"after it): use those keys, or one codec name for every boundary")
        return cls(checked)

    @classmethod
    def of_stages(cls, value: object, specs: list[Any], output_arg: Any) -> "BoundaryCompression | None":
        """:meth:`of` for a pipeline's stages ``specs`` whose model output is the fx argument ``output_arg``."""
        outputs: list[str] = []
        torch.fx.node.map_arg(output_arg, lambda n: outputs.append(n.name) or n)
        return cls.of(value, crossing_stages(specs, outputs))

    def codec(self, stage: int) -> BoundaryCodec | None:
        return self.codecs.get(stage)

    def spec(self, stage: int, backward: bool, dtype: torch.dtype) -> CodecSpec | None:
        """The codec of a ``dtype`` tensor crossing stage ``stage``'s boundary (``backward``: a gradient coming
        back), or ``None`` when it crosses as it is (no codec that way, or not a float)."""
        both = self.codecs.get(stage)
        spec = None if both is None else both.backward if backward else both.forward
        return spec if spec is not None and dtype.is_floating_point else None

    def send(self, stage: int, key: tuple[Any, ...], t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """What the receiver of ``t`` (sent across stage ``stage``'s boundary; ``key[0]``: ``"F"`` forward,
        ``"B"`` a gradient back) gets, and the bytes sent."""
        packed = self.pack(stage, key, t)
        if packed is None:
            return t, t.numel() * t.element_size()
        spec, payload = packed
        return decode(spec, payload).requires_grad_(t.requires_grad), payload.nbytes

    def pack(self, stage: int, key: tuple[Any, ...], t: torch.Tensor) -> tuple[CodecSpec, Payload] | None:
        """``t`` encoded for stage ``stage``'s boundary (``key`` as :meth:`send`'s; top-k gradients add and keep
        their residual), or ``None`` when it crosses as it is."""
        spec = self.spec(stage, key[0] == "B", t.dtype)
        if spec is None:
            return None
        feedback = spec.kind == "topk" and key[0] == "B"
        if feedback and self.slots is not None:   # key: ("B", value, consumer, micro-batch, position)
            key = key[:3] + (self.slots[key[3]],) + key[4:]
        with self.lock:
            residual = self.residuals.pop(key, None) if feedback else None
        if residual is not None and residual.shape != (t.numel(),):
            residual = None   # another shape (a smaller last batch): it cannot be added
        if spec.stochastic:
            with self.lock:   # one generator for every worker
                payload, left = encode(spec, t, residual, self.generator)
        else:
            payload, left = encode(spec, t, residual)
        if feedback and left is not None:
            with self.lock:
                self.residuals[key] = left
        return spec, payload


def crossing_stages(specs: list[Any], output_names: list[str]) -> list[int]:
    """The stages that send values to other stages (to a later stage, or to the loss beside the last one)."""
    read = {name for spec in specs for name in spec.inputs}
    last = len(specs) - 1
    return [k for k, spec in enumerate(specs)
            if any(name in read and name not in spec.inputs for name in spec.outputs)
            or (k != last and any(name in output_names for name in spec.outputs))]


def codec_seconds_per_byte(spec: CodecSpec, device: torch.device, numel: int = 1 << 18, repeats: int = 3) -> float:
    """The time one encode and decode by ``spec`` takes per raw byte of a float32 tensor on ``device`` (the
    fastest of ``repeats``, on 1 MiB by default): the planner adds it to a compressed boundary's transfer."""
    t = torch.randn(numel // 256, 256, device=device, generator=None)
    best = float("inf")
    for _ in range(repeats + 1):   # the first is a warm-up
        start = time.perf_counter()
        payload, _ = encode(spec, t)
        decode(spec, payload)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best / (t.numel() * t.element_size())
