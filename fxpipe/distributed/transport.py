"""The executor's transport over torch.distributed: one process per rank, point-to-point between them.

:class:`P2P` is :class:`fxpipe.runtime.boundaries.transport.Transport` (so :func:`fxpipe.runtime.execute.step.run_step`, the one
schedule interpreter, runs unchanged on each rank) where a value or gradient whose other end is a stage of
this rank; where it is another rank's it goes through ``torch.distributed.isend``/``irecv`` (gloo on CPUs,
NCCL on GPUs), straight from the producing rank to the consuming one: a skip connection from the first stage
to the last is one message, relayed by no rank in between, and so is its gradient.

With boundary compression (``PipelineRank(options=CompileOptions(compression=...))``) a
value or gradient goes over the wire as its codec's payload (an int8 tensor and its scales, top-k's values and
indices, a half-precision copy) and is decoded by the receiver, which knows the payload's shapes from the value's
(:func:`fxpipe.runtime.boundaries.compression.payload_layout`): the bytes moved are the compressed ones, and the step is
the in-process executor's compressed step (top-k's error-feedback residuals are kept by the sending rank).

On GPUs the data goes over NCCL, which ignores tags and matches the sends from one rank to another with
that rank's receives in the order both were posted. Two ranks post the messages of different values in their
own schedules' orders, which differ (a value and a skip from the same stage, stages interleaved), so each
channel (a value and the stage that reads it) has a process group of its own, made at the first step, within
which its two ranks post in the same order. Where even that does not hold
(:func:`fxpipe.distributed.wire.nccl_order_hazard`: the loss reading a value from another rank) the channels
are gloo groups, through host memory, whose tags match messages exactly, and a warning says why.

Sends never block (the schedule's receives are what orders the ranks, as the in-process executor's waits
do). Each rank ends a step by sending every peer its status; a rank whose operation failed sends it at
once, and the others, which hear statuses while they wait (:mod:`fxpipe.distributed.waiting`), end their
step with an error naming that rank, stage, micro-batch and pass instead of waiting for data that will not
come. Every wait has a deadline (``timeout_s``), so a dead peer is an error too, never a hang. After a
failure the transport refuses further steps (messages of the failed step may still be in flight): restart
the processes. Statuses go through a gloo group of their own (made here, collectively: every rank constructs
its ``P2P`` at the same point); the channels' groups have ``timeout_s`` as their timeout.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from fxpipe.distributed.waiting import PeerFailed, Receiver, Statuses, lost
from fxpipe.distributed.wire import (MAX_TENSORS, STATUS_BYTES, STATUS_TAG, Header, decode_header, encode_header,
                                     encode_status, header_of, signature, tag, nccl_order_hazard)
from fxpipe.errors import FxpipeError
from fxpipe.runtime.execute.codegen import StageSpec
from fxpipe.runtime.boundaries.compression import Payload, decode, payload_layout
from fxpipe.runtime.execute.step import StepFailure
from fxpipe.runtime.boundaries.streams import DeviceStreams, Event
from fxpipe.runtime.boundaries.transport import LOSS, Transport

__all__ = ["P2P"]

log = logging.getLogger("fxpipe")


class P2P(Transport):
    """Stages of rank ``stage_rank[k]``; this process is rank ``rank`` of ``group`` (default: the world)."""

    remote = True

    def __init__(self, rank: int, stage_rank: list[int], group: Any = None, timeout_s: float = 300.0) -> None:
        self.rank, self.stage_rank, self.timeout_s = rank, stage_rank, timeout_s
        self.peers = sorted(set(stage_rank) - {rank})
        self.headers: dict[tuple[int, str], Header] = {}   # (channel, input signature) -> the value's header
        self.broken: str | None = None
        backend = dist.get_backend(group)
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        # Within a sub-group (a pipeline of a pp x dp mesh) only its members make these groups, each pipeline
        # its own at once: local synchronisation names a group by its ranks, not by a count every rank shares.
        local = self.sub_group = group is not None
        self.backend, self.gpu_wire = backend, False
        # one group per channel, made by its two ranks at the first step (begin): NCCL pairs a rank's receives
        # with another's sends in posting order, which is the same on both sides within one channel
        self.lanes: dict[int, Any] = {}
        self.control = dist.new_group(self.ranks, timeout=datetime.timedelta(days=7), backend="gloo",
                                      use_local_synchronization=local)
        self.receiver = Receiver()
        # called once this rank's own operations of a step are over (argument: whether one failed), before it
        # hears how the other ranks' steps ended: pp x dp all-reduces a stage's gradients there, overlapped
        # with the stages that are still draining (fxpipe.distributed.mesh)
        self.when_local_done: Callable[[bool], None] | None = None

    def local(self, stage: int) -> bool:
        return self.stage_rank[-1 if stage == LOSS else stage] == self.rank

    def workers(self, count: int) -> list[int]:
        # a rank is one worker of the schedule: the one of its first stage (stage s runs on worker s, or s % workers
        # interleaved), whatever its rank number (the plan's placement decides which rank that is)
        return [min(k for k, r in enumerate(self.stage_rank) if r == self.rank)]

    def _global(self, rank: int) -> int:
        return self.ranks[rank]

    def begin(self, specs: list[StageSpec], devices: list[torch.device], streams: DeviceStreams,
              micro_inputs: list[dict[str, Any]], output_names: list[str]) -> None:
        if self.broken is not None:
            raise FxpipeError(f"an earlier step failed ({self.broken}); messages of that step may still be in "
                              "flight, so this process group cannot run another: restart the processes (torchrun "
                              "does when the script exits with the error)")
        super().begin(specs, devices, streams, micro_inputs, output_names)
        self.channels = {(name, c): n for n, (name, c) in enumerate(   # numbered alike on every rank
            (name, c) for name in sorted(self.readers) for c in self.readers[name]
            if self._rank(self.producer[name]) != self._rank(c))}
        if not self.lanes:
            self._make_lanes()
        self.signatures = [signature(mb) for mb in micro_inputs]
        self.first = {s: self.signatures.index(s) for s in self.signatures}   # who carries a new header
        self.layout: dict[tuple[str, int], list[tuple[int, torch.Tensor]]] = {}   # grads a producer awaits
        # works with the tensors they read, kept to the step's end (gloo says a send is done only when waited for)
        self.sending: list[tuple[Any, torch.Tensor]] = []
        self.statuses = Statuses(self.peers, self._status_receive, self._global)

    def _make_lanes(self) -> None:
        """A process group per channel, made by every rank in channel order. NCCL where the posting order within
        a channel is the same on both sides, gloo (through host memory) otherwise."""
        unordered = nccl_order_hazard(list(self.channels), self.producer, self.stage_rank)
        self.gpu_wire = self.backend == "nccl" and unordered is None
        if self.backend == "nccl" and unordered is not None:
            log.warning("values cross between ranks through host memory (gloo), not NCCL: NCCL matches messages "
                        "by order alone, and in this plan %s, so sender and receiver may order them differently",
                        unordered)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        for channel in sorted(self.channels.values()):
            # of every rank of the pipeline, not the channel's two: torch names groups by a counter that a rank
            # outside a group does not advance, so two-rank groups would leave the ranks' counters apart and a
            # later group (the user's too) would wait forever; NCCL connects only the pairs that exchange data
            self.lanes[channel] = dist.new_group(self.ranks, timeout=timeout, use_local_synchronization=self.sub_group,
                                                 backend="nccl" if self.gpu_wire else "gloo")

    def _rank(self, stage: int) -> int:
        return self.stage_rank[-1 if stage == LOSS else stage]

    def _status_receive(self, peer: int) -> tuple[Any, torch.Tensor]:
        buf = torch.empty(STATUS_BYTES, dtype=torch.uint8)
        return dist.irecv(buf, self._global(peer), self.control, tag=STATUS_TAG), buf

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().contiguous()
        return t if self.gpu_wire or t.device.type == "cpu" else t.cpu()

    def _send(self, t: torch.Tensor, to: int, message: int, group: Any) -> None:
        t = self._wire(t)
        try:
            work = dist.isend(t, self._global(to), group, tag=message)
        except RuntimeError as exc:   # gloo: the connection to ``to`` closed (the process is gone)
            raise self._lost(to, exc) from exc
        self.sending.append((work, t))

    def _lost(self, peer: int, exc: BaseException) -> PeerFailed:
        """The error naming ``peer``, whose connection failed under a send or receive; heard as its status too."""
        status = lost(self._global(peer), exc)
        self.statuses.hear(peer, status)
        return PeerFailed(status)

    def _receive(self, like: tuple[tuple[int, ...], torch.dtype], device: torch.device, src: int,
                 message: int, group: Any) -> tuple[Any, torch.Tensor]:
        on = device if self.gpu_wire else torch.device("cpu")
        buf = torch.empty(like[0], dtype=like[1], device=on)
        return dist.irecv(buf, self._global(src), group, tag=message), buf

    @staticmethod
    def _part(n: int) -> int:
        if n >= MAX_TENSORS + 2:
            raise ValueError(f"a value crossing ranks needs more than {MAX_TENSORS} messages (its tensors, or their "
                             "compressed parts): cut the stages elsewhere, or compress fewer boundaries")
        return n

    def _send_parts(self, tensors: list[tuple[torch.Tensor, tuple[Any, ...]]], producer: int, to: int, channel: int,
                    backward: bool, i: int) -> None:
        """Each tensor (with its compression key) as itself, or as its boundary codec's payload, one message a part."""
        part, raw, sent = 2, 0, 0
        for t, key in tensors:
            packed = (self.compression.pack(producer, key, t)
                      if self.compression is not None and (backward or t.requires_grad) else None)
            pieces = [t] if packed is None else list(packed[1].tensors.values())
            for piece in pieces:
                self._send(piece, to, tag(channel, backward, i, self._part(part)), self.lanes[channel])
                part += 1
            raw += t.numel() * t.element_size()
            sent += sum(piece.numel() * piece.element_size() for piece in pieces)
        with self.lock:
            self.moved["raw"] += raw
            self.moved["sent"] += sent

    def _receive_parts(self, metas: list[tuple[tuple[int, ...], torch.dtype, bool]], producer: int,
                       device: torch.device, src: int, channel: int, backward: bool, i: int,
                       what: str) -> list[torch.Tensor]:
        """The tensors :meth:`_send_parts` sends for ``metas`` (shape, dtype, whether the sender compresses it when
        its boundary has a codec), decoded."""
        posted, wanted = [], []
        part = 2
        for shape, dtype, compressible in metas:
            spec = self.compression.spec(producer, backward, dtype) \
                if self.compression is not None and compressible else None
            layout = [("", shape, dtype)] if spec is None else payload_layout(spec, shape, dtype)
            for _, piece_shape, piece_dtype in layout:
                posted.append(self._receive((piece_shape, piece_dtype), device, src,
                                            tag(channel, backward, i, self._part(part)), self.lanes[channel]))
                part += 1
            wanted.append((spec, shape, dtype, [name for name, _, _ in layout]))
        got = iter(self._wait(posted, what, src) if posted else [])
        out = []
        for spec, shape, dtype, names in wanted:
            pieces = {name: next(got) for name in names}
            out.append(pieces[""] if spec is None else decode(spec, Payload(pieces, torch.Size(shape), dtype)))
        return out

    # ------------------------------------------------------------------ values
    def publish(self, k: int, i: int, outs: dict[str, Any], ready: Event) -> None:
        super().publish(k, i, outs, ready)
        for name, value in outs.items():
            flat = tree_flatten(value)[0]
            self.layout[(name, i)] = [(pos, t) for pos, t in enumerate(flat)
                                      if isinstance(t, torch.Tensor) and t.requires_grad]
            for c in self.readers[name]:
                if (name, c) not in self.channels:
                    continue
                channel, to = self.channels[(name, c)], self._rank(c)
                key = (channel, self.signatures[i])
                if key not in self.headers:
                    self.headers[key] = header_of(value)
                    data = encode_header(self.headers[key])
                    self._send(torch.tensor([data.numel()], dtype=torch.int64), to, tag(channel, False, i, 0),
                               self.lanes[channel])
                    self._send(data, to, tag(channel, False, i, 1), self.lanes[channel])
                self._send_parts([(t, ("F", name, c, i, pos)) for pos, t in enumerate(flat)
                                  if isinstance(t, torch.Tensor)], k, to, channel, False, i)
            if self.unread.get((i, name)) == 0:   # no reader here: nothing to keep beyond the producer's outs
                self.envs[i].pop(name, None)

    def fetch(self, name: str, consumer: int, i: int, device: torch.device) -> tuple[Any, Event]:
        if self.local(self.producer[name]):
            return super().fetch(name, consumer, i, device)
        channel, src = self.channels[(name, consumer)], self._rank(self.producer[name])
        what = f"value {name!r} of micro-batch {i} from rank {self._global(src)} (stage {self.producer[name]})"
        key = (channel, self.signatures[i])
        if key not in self.headers:   # sent with the first micro-batch of this signature
            j = self.first[self.signatures[i]]
            length = self._wait([self._receive(((1,), torch.int64), device, src, tag(channel, False, j, 0),
                                               self.lanes[channel])], what, src)
            data = self._wait([self._receive(((int(length[0].item()),), torch.uint8), device, src,
                                             tag(channel, False, j, 1), self.lanes[channel])], what, src)
            self.headers[key] = decode_header(data[0].cpu())
        header = self.headers[key]
        got = self._receive_parts([(m.shape, getattr(torch, m.dtype), m.requires_grad) for _, m in header.tensors()],
                                  self.producer[name], device, src, channel, False, i, what)
        leaves = [t.to(device).requires_grad_(m.requires_grad) for t, (_, m) in zip(got, header.tensors())]
        return header.build(leaves), None

    # ------------------------------------------------------------------ gradients
    def send_grads(self, name: str, consumer: int, i: int, value: Any, ready: Event) -> None:
        if self.local(self.producer[name]):
            return super().send_grads(name, consumer, i, value, ready)
        channel, to = self.channels[(name, consumer)], self._rank(self.producer[name])
        wanted = [(pos, t) for pos, t in enumerate(tree_flatten(value)[0])
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        # an unreached leaf sends zeros: the producer awaits every one
        self._send_parts([(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf), ("B", name, consumer, i, pos))
                          for pos, leaf in wanted], self.producer[name], to, channel, True, i)

    def received(self, k: int, i: int) -> dict[str, dict[int, torch.Tensor]]:
        got = super().received(k, i)
        device = self.devices[k]
        for name in self.specs[k].outputs:
            layout = self.layout.pop((name, i), [])
            for c in self.readers.get(name, []):
                if (name, c) not in self.channels or not layout:
                    continue
                channel, src = self.channels[(name, c)], self._rank(c)
                what = f"gradient of {name!r} of micro-batch {i} from rank {self._global(src)} ({'the loss' if c == LOSS else f'stage {c}'})"
                grads = self._receive_parts([(tuple(t.shape), t.dtype, True) for _, t in layout], k, device, src,
                                            channel, True, i, what)
                for (pos, t), g in zip(layout, grads):
                    g = g.to(t.device)
                    by_pos = got.setdefault(name, {})
                    by_pos[pos] = g if pos not in by_pos else by_pos[pos] + g
        return got

    # ------------------------------------------------------------------ waiting, the end of a step
    def _wait(self, posted: list[tuple[Any, torch.Tensor]], what: str, src: int) -> list[torch.Tensor]:
        """The buffers of ``posted`` receives (from ``src``) once all have landed; a peer's failure, ``src``'s
        connection closing (its process gone: :func:`fxpipe.distributed.waiting.lost` names it) or the deadline
        raises."""
        try:
            self.receiver.wait([work for work, _ in posted], f"{what} (rank {self._global(self.rank)})",
                               self.timeout_s, self.statuses.failure)
        except RuntimeError as exc:   # gloo's receive failed: the connection to src reset or closed
            raise self._lost(src, exc) from exc
        return [buf for _, buf in posted]

    def end(self, failure: Any, result: Callable[[], Any]) -> tuple[Any, Any]:
        """Tell every peer how this rank's step ended, hear theirs; the step's root failure and its result."""
        mine = None
        if failure is not None:
            mine = {"stage": failure.stage, "micro_batch": failure.micro_batch, "kind": failure.kind,
                    "error": f"{type(failure.exc).__name__}: {failure.exc}",
                    "remote": isinstance(failure.exc, PeerFailed)}
        out = result() if failure is None else None
        for peer in self.peers:
            try:
                self._send(encode_status({"rank": self._global(self.rank), "failure": mine, "result": out}), peer,
                           STATUS_TAG, self.control)
            except PeerFailed:   # that peer is gone: heard as its status, the root of the failure
                pass
        if self.when_local_done is not None:
            self.when_local_done(failure is not None)
        got, silent = self.statuses.collect(self.timeout_s)
        roots = [s for _, s in sorted(got.items()) if s["failure"] is not None and not s["failure"]["remote"]]
        if roots and (mine is None or mine["remote"]):   # the rank where it started, not where it was noticed
            f = roots[0]["failure"]
            failure = StepFailure(f["stage"], f["micro_batch"], f["kind"], PeerFailed(roots[0]))
        elif silent and failure is None:
            failure = StepFailure(-1, -1, "step", TimeoutError(
                f"rank {self._global(self.rank)} waited {self.timeout_s:g} s for ranks {silent} to end the step"))
        if failure is None and any(s["failure"] is not None for s in got.values()):
            failure = StepFailure(-1, -1, "step", PeerFailed(next(s for s in got.values() if s["failure"])))
        if failure is None:
            self.receiver.wait([work for work, _ in self.sending], "the peers to receive this rank's messages",
                               self.timeout_s, lambda: None)
            self.sending = []
            found = [s["result"] for s in got.values() if s["result"] is not None]
            return None, out if out is not None else (found[0] if found else None)
        self.broken = str(failure)
        return failure, None
