"""What ``fxpipe.compile`` checks before anything runs: the devices, the arguments, a loaded plan.

Every check raises with a message that names what is wrong and how to fix it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from fxpipe.errors import PlanMismatchError
from fxpipe.frontend.capture import Captured
from fxpipe.options import ProfileOptions
from fxpipe.planning.lowering import device_memory_bytes
from fxpipe.planning.plan import Plan
from fxpipe.runtime.pipeline import CHECKPOINT_MODES
from solvers.schedules import SCHEDULES, check_schedule

__all__ = ["check_arguments", "check_plan", "memory_limits", "parse_devices", "worker_devices"]


def parse_devices(devices: Sequence[str | torch.device]) -> list[torch.device]:
    """Validate device strings; ``["cpu", "cpu"]`` means two CPU workers."""
    if isinstance(devices, (str, torch.device)) or not devices:
        raise ValueError(f"devices must be a non-empty list such as ['cpu', 'cpu'] or ['cuda:0', 'cuda:1'], got {devices!r}")
    out = []
    for d in devices:
        try:
            dev = torch.device(d)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"{d!r} is not a torch device string ('cpu', 'cuda:0', ...): {exc}") from exc
        if dev.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = dev.index if dev.index is not None else 0
            if index >= count:
                raise ValueError(f"device {str(d)!r} does not exist: this machine has {count} CUDA device(s)")
            dev = torch.device("cuda", index)
        elif dev.type != "cpu":
            raise ValueError(f"device {str(d)!r}: fxpipe runs stages on 'cpu' and 'cuda' devices")
        out.append(dev)
    return out


def check_arguments(checkpoint: str, schedule: str, virtual_stages: int | None, plan: Plan | None,
                    profile: ProfileOptions, loss_fn: Callable | None, example_target: Any) -> int:
    """Refuse arguments that cannot go together; return ``v``, the stages per device (1 unless interleaved)."""
    if checkpoint not in CHECKPOINT_MODES and checkpoint != "auto":
        raise ValueError(f"checkpoint must be one of {', '.join(CHECKPOINT_MODES)} or 'auto', got {checkpoint!r}")
    if checkpoint == "auto" and plan is not None:
        raise ValueError("checkpoint='auto' is a planning choice; a loaded plan= keeps the modes it was made with "
                         "(pass its checkpoint or compile without plan=)")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not supported by the embedded executor; use one of {SCHEDULES}")
    if virtual_stages is not None and schedule != "interleaved-1f1b":
        raise ValueError(f"virtual_stages={virtual_stages} needs schedule='interleaved-1f1b' (got {schedule!r})")
    v = (virtual_stages or 2) if schedule == "interleaved-1f1b" else 1
    if v < 1:
        raise ValueError(f"virtual_stages must be at least 1, got {v}")
    if (loss_fn is None) != (example_target is None):
        raise ValueError("pass loss_fn and example_target together (the loss and a full batch's target, used to "
                         "measure the last stage's memory), or neither")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable as loss_fn(output, target), got {loss_fn!r}")
    if plan is not None and profile.calibrate:
        raise ValueError("calibrate=True re-plans from a profile; it cannot refine a loaded plan= "
                         "(compile with example_inputs instead)")
    return v


def worker_devices(devices: list[torch.device], schedule: str, v: int, stages: int | None,
                   chunks: int) -> list[torch.device]:
    """The devices that run workers: all of them, or for interleaved 1F1B ``stages / v`` of them."""
    if v == 1:
        return devices
    workers = stages // v if stages is not None else len(devices)
    if stages is not None and (stages % v or workers > len(devices)):
        raise ValueError(f"interleaved-1f1b with virtual_stages={v} needs stages = {v} x the devices used "
                         f"(at most {v * len(devices)}), got stages={stages}")
    check_schedule(schedule, v * workers, workers, chunks)
    return devices[:workers]


def check_plan(plan: Plan, captured: Captured, model: nn.Module, devices: list[torch.device],
               chunks: int | None) -> None:
    """Refuse a loaded plan made for another model, other devices, other chunks or the other mode."""
    if plan.fingerprint != captured.fingerprint:
        raise PlanMismatchError(
            f"the plan was made for another model ({plan.model}, fingerprint {plan.fingerprint[:12]}) "
            f"but this {type(model).__name__} traces to fingerprint {captured.fingerprint[:12]}; "
            "compile without plan= to make a new one"
        )
    if [str(d) for d in devices] != [str(torch.device(d)) for d in plan.devices]:
        raise PlanMismatchError(f"the plan was made for devices {plan.devices}, got {[str(d) for d in devices]}")
    if chunks is not None and chunks != plan.chunks:
        raise PlanMismatchError(f"the plan was made for chunks={plan.chunks}, got chunks={chunks}")
    if plan.traced_training != model.training and captured.mode_dependent:
        raise PlanMismatchError("the plan was made in the other train/eval mode of this mode-dependent model")


def memory_limits(devices: list[torch.device], v: int,
                  memory_bytes: Sequence[float] | None) -> list[float]:
    """Each worker device's memory for the planner: the user's override or what the device has."""
    mem = list(memory_bytes) if memory_bytes is not None else device_memory_bytes(devices)
    if len(mem) < len(devices) or (len(mem) > len(devices) and v == 1):
        raise ValueError(f"memory_bytes has {len(mem)} entries for {len(devices)} devices")
    return mem
