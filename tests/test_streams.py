"""fxpipe.runtime.boundaries.streams: no-ops on CPU; on a GPU, copies ordered by events and kept alive by record_stream.

The GPU tests run wherever torch sees a GPU (skipped on the CPU-only CI machine).
"""

import pytest
import torch
from torch import nn

import fxpipe
from equivalence import max_relative_error
from fxpipe.runtime.boundaries.streams import DeviceStreams

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_cpu_streams_do_nothing_and_move_returns_the_same_tensors():
    streams = DeviceStreams([torch.device("cpu")] * 2)
    a, b = torch.randn(3), torch.randn(2, 2)
    value = {"x": (a, [b, 7]), "y": None}
    moved, event = streams.move(value, torch.device("cpu"), ready=None)
    assert event is None
    assert moved["x"][0] is a and moved["x"][1][0] is b and moved["x"][1][1] == 7 and moved["y"] is None
    assert streams.record(torch.device("cpu")) is None
    with streams.computing(torch.device("cpu")):
        streams.wait(torch.device("cpu"), [None, None])
    assert streams.compute == {} and streams.copy == {}


@cuda
def test_copy_to_gpu_is_ordered_by_its_event():
    device = torch.device("cuda:0")
    streams = DeviceStreams([device])
    host = torch.arange(1 << 20, dtype=torch.float32)
    with streams.computing(device):
        moved, event = streams.move((host,), device)
        assert event is not None
        streams.wait(device, [event])
        total = moved[0].sum()
    assert total.item() == host.sum().item()


def _reused_while_read(device: torch.device, streams: DeviceStreams, recorded: bool) -> bool:
    """Copy a block in on the copy stream, read it on the busy compute stream, drop it, allocate the same size on
    the copy stream: whether that allocation got the block back. ``recorded=False`` drops ``record_stream`` (the
    control: the allocator then hands the block out at once, so the check can see a reuse)."""
    host = torch.randn(1 << 22)
    with streams.computing(device):
        if recorded:
            (moved,), event = streams.move((host,), device)
        else:
            with torch.cuda.stream(streams.copy[device]):
                moved = host.to(device, non_blocking=True)
            event = streams.copy[device].record_event()
        streams.wait(device, [event])
        torch.cuda._sleep(1_000_000_000)        # keep the compute stream busy (about 0.5 s) ...
        reader = moved * 2                      # ... then read the copy on it
        pointer = moved.data_ptr()
        del moved
        busy = not streams.compute[device].query()
        with torch.cuda.stream(streams.copy[device]):   # the stream that allocated it
            fresh = torch.empty(1 << 22, device=device)
        assert busy, "the compute stream finished before the allocation: nothing was tested"
        reused = fresh.data_ptr() == pointer
    torch.cuda.synchronize()
    assert torch.equal(reader.cpu(), host * 2)
    return reused


@cuda
def test_record_stream_keeps_a_copy_from_being_reused_while_the_compute_stream_reads_it():
    """It failed once on an H200 (the block was handed out again). Not the runtime: ``moved * 2`` was the first
    launch of that kernel in the process, and CUDA's lazy module loading may synchronise the context to load
    it, so the 0.1 s sleep had ended, the compute stream was idle and the block was free by the time it was
    allocated again (a reuse that is correct). The kernels are now loaded before the sleep, the sleep is longer,
    and the test checks that the stream is still busy at the allocation, and that without ``record_stream``
    the block *is* reused at once (so the check can fail)."""
    device = torch.device("cuda:0")
    streams = DeviceStreams([device])
    warm = torch.randn(1 << 22, device=device)
    torch.cuda._sleep(1000)
    (warm * 2).sum().item()                     # load the kernels now, not while the stream sleeps
    assert _reused_while_read(device, streams, recorded=False)
    assert not _reused_while_read(device, streams, recorded=True)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers[0](x)
        return self.head(self.layers[3](self.layers[2](self.layers[1](h)) + h))   # a skip across stages


def _gpu_layouts() -> list[list[str]]:
    if not torch.cuda.is_available():
        return []
    layouts = [["cuda:0", "cuda:0"], ["cpu", "cuda:0"], ["cuda:0", "cpu"]]
    if torch.cuda.device_count() >= 2:
        layouts.append(["cuda:0", "cuda:1"])
    return layouts


@cuda
@pytest.mark.parametrize("devices", _gpu_layouts())
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_step_and_call_on_gpus_equal_the_unpartitioned_model(devices, schedule):
    torch.manual_seed(0)
    model = _MLP()
    x, target = torch.randn(16, 32), torch.randint(0, 5, (16,))
    reference = _MLP()
    reference.load_state_dict(model.state_dict())
    loss = nn.functional.cross_entropy(reference(x), target)
    loss.backward()
    pipe = fxpipe.compile(model, devices, (x,), chunks=4, stages=2, schedule=schedule, checkpoint="except_last",
                          profile="estimate")
    got = pipe.step(x, target, nn.functional.cross_entropy)
    assert abs(got.item() - loss.item()) <= 1e-5 * abs(loss.item())
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert max_relative_error(p.grad.cpu(), q.grad) <= 1e-5, name
    with torch.no_grad():
        assert max_relative_error(pipe(x).cpu(), reference(x)) <= 1e-5
