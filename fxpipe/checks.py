"""What ``fxpipe.compile`` checks before anything runs: the devices, the arguments, a loaded plan.

Every check raises with a message that names what is wrong and how to fix it.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn

from fxpipe.cost.device_names import EXAMPLE, is_device_names, parse_device_names
from fxpipe.errors import PlanMismatchError
from fxpipe.frontend.batch_dims import LEAF_DIMS
from fxpipe.frontend.capture import Captured
from fxpipe.options import CompileOptions, ProfileOptions, stage_compile_kwargs
from fxpipe.planning.lowering import device_memory_bytes
from fxpipe.planning.memory_model import CHECKPOINT_SPELLINGS, block_mode, is_checkpoint_mode, refuse_with_schedule
from fxpipe.planning.plan import Plan
from fxpipe.runtime.boundaries.aliasing import written_buffers
from fxpipe.runtime.execute.compiled import options_of
from fxpipe.runtime.execute.microbatch import BatchLayout, batch_size_of
from solvers.schedules import REGISTRY, SCHEDULES, check_schedule, get_schedule

__all__ = ["auto_schedules", "batch_layout", "check_arguments", "check_batch", "check_call", "check_plan", "check_plan_layout", "compiled_model", "memory_limits",
           "parse_devices", "stage_compilation", "unwrap_compiled", "warn_batch_norm", "worker_devices"]

log = logging.getLogger("fxpipe")


def _optimized(model: Any) -> bool:
    """Whether ``model`` is ``torch.compile``'s ``OptimizedModule`` (dynamo imported only for such a model)."""
    if type(model).__name__ != "OptimizedModule" or not isinstance(getattr(model, "_orig_mod", None), nn.Module):
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(model, OptimizedModule)


def compiled_model(model: Any) -> tuple[Any, dict[str, Any] | None]:
    """The module that ``torch.compile`` wrapped and the ``torch.compile`` options it was given
    (:func:`fxpipe.runtime.execute.compiled.options_of`); ``(model, None)`` for any other model.

    An ``OptimizedModule`` has no forward of its own to trace (``*args, **kwargs``), and profiling it would
    time dynamo's compilation as the model's first operations. Its ``_orig_mod`` holds the same parameters,
    so the pipeline trains the user's model all the same, and its stages are compiled with those options.
    """
    if not _optimized(model):
        return model, None
    return model._orig_mod, options_of(model)


def stage_compilation(options: CompileOptions, from_model: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ``torch.compile`` keyword arguments of the stages: ``CompileOptions.compile_stages`` when given
    (``False``: eager), else the compiled model's own (:func:`compiled_model`), else ``None`` (eager)."""
    if options.compile_stages is None:
        return from_model
    if options.compile_stages is False and from_model is not None:
        log.info("a torch.compile'd model with compile_stages=False: its stages run eagerly")
    return stage_compile_kwargs(options.compile_stages)


def unwrap_compiled(model: Any) -> Any:
    """For :func:`fxpipe.plan`: the module that ``torch.compile`` wrapped, with a warning; ``model`` otherwise."""
    if not _optimized(model):
        return model
    warnings.warn(f"fxpipe got a torch.compile'd module: it plans the module torch.compile wrapped "
                  f"({type(model._orig_mod).__name__}, model._orig_mod, the same parameters), its operations "
                  "costed as eager ones; pass the module itself to silence this", UserWarning, stacklevel=3)
    return model._orig_mod


def parse_devices(devices: Sequence[str | torch.device]) -> list[torch.device]:
    """Validate device strings; ``["cpu", "cpu"]`` means two CPU workers, ``"0:0-3"`` (OneFlow-style: node 0,
    GPUs 0 to 3; :mod:`fxpipe.cost.device_names`) four GPUs of this machine."""
    if isinstance(devices, str) and is_device_names(devices) or (
            isinstance(devices, (list, tuple)) and devices and is_device_names(devices)):
        named = parse_device_names(devices if isinstance(devices, str) else ",".join(devices))
        nodes = sorted({node for node, _ in named})
        if len(nodes) > 1:
            raise ValueError(
                f"devices {devices!r} are on {len(nodes)} nodes, but fxpipe.compile runs the pipeline in this one "
                "process: plan for them with fxpipe.plan(model, fxpipe.Devices.preset('h100', "
                f"{','.join(devices) if not isinstance(devices, str) else devices!r}), example_inputs), save the plan "
                "and run it with torchrun ... -m fxpipe.launch on every node")
        devices = [d for _, d in named]
    if isinstance(devices, (str, torch.device)) or not devices:
        raise ValueError(f"devices must be a non-empty list such as ['cpu', 'cpu'] or ['cuda:0', 'cuda:1'], or "
                         f"OneFlow-style names such as {EXAMPLE}; got {devices!r}")
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


def check_call(model: Any, example_inputs: Any, devices: Sequence[str | torch.device],
               chunks: int | str | None) -> tuple[Any, dict[str, Any] | None, tuple | None, list[torch.device], bool]:
    """``fxpipe.compile``'s first checks: the model (a ``torch.compile``'d one unwrapped, with its options), the
    example inputs as a tuple (one tensor alone is ``(x,)``), the devices, and whether ``chunks`` is ``"auto"``."""
    if not isinstance(model, (nn.Module, torch.export.ExportedProgram)):
        raise TypeError(f"fxpipe.compile needs an nn.Module (or a torch.fx.GraphModule or torch.export."
                        f"ExportedProgram), got {type(model).__name__}")
    model, compiled_as = compiled_model(model)   # torch.compile(model, **opts): its module, and opts
    if isinstance(example_inputs, list):
        raise TypeError("example_inputs must be a tuple of the forward's positional arguments (one tensor alone "
                        "is taken as (x,)), got a list: pass tuple(...) if it holds the arguments, or ([...],) if "
                        "the forward takes one list")
    on_meta = [n for n, t in (model.named_parameters() if isinstance(model, nn.Module) else [])
               if t.device.type == "meta"]
    if on_meta:
        raise ValueError(f"the model's parameters are on the meta device (no values: {on_meta[0]!r}"
                         f"{f' and {len(on_meta) - 1} more' if len(on_meta) > 1 else ''}), and fxpipe.compile runs "
                         "the model to profile it: materialise them first (model.to_empty(device='cpu'), then "
                         "load_state_dict or initialise); to plan it without values use fxpipe.plan(model, "
                         "fxpipe.Devices.preset(...), example_inputs), and to run it build it on meta under "
                         "fxpipe.distributed.PipelineRank(..., weights=...), which materialises each rank's stages")
    devs = parse_devices(devices)
    if chunks is not None and chunks != "auto" and (isinstance(chunks, bool) or not isinstance(chunks, int)
                                                    or chunks < 1):
        raise ValueError(f"chunks must be a positive integer or 'auto' (the planner picks), got {chunks!r}")
    example_inputs = example_inputs if isinstance(example_inputs, tuple) or example_inputs is None else (
        example_inputs,)
    return model, compiled_as, example_inputs, devs, chunks is None or chunks == "auto"


def check_batch(example_inputs: Sequence[Any], layout: BatchLayout, gm: fx.GraphModule, chunks: Any,
                auto_chunks: bool) -> tuple[int, list[int]]:
    """The example batch's size and each input's batch dimension; refused when it cannot be split into
    ``chunks`` micro-batches."""
    dims = layout.input_dims([n.target for n in gm.graph.nodes if n.op == "placeholder"])
    dims = dims[:len(example_inputs)] + [0] * (len(example_inputs) - len(dims))
    batch = batch_size_of(list(example_inputs), dims)
    if batch == 0 or not auto_chunks and chunks > batch:
        wanted = "" if auto_chunks else f" {chunks}"
        raise ValueError(f"example_inputs hold a batch of {batch} samples (along the batch dimension "
                         f"{sorted(set(dims))}), which cannot be split into{wanted} micro-batches; use a batch of "
                         f"at least{wanted or ' 1'} samples (the batch the pipeline will train on)"
                         + (f" or chunks <= {batch}" if batch and not auto_chunks else ""))
    return batch, dims


def check_arguments(checkpoint: str, schedule: str, virtual_stages: int | None, plan: Plan | None,
                    profile: ProfileOptions) -> int:
    """Refuse arguments that cannot go together; return ``v``, the stages per device (1 unless interleaved)."""
    if not is_checkpoint_mode(checkpoint) and checkpoint != "auto":
        raise ValueError(f"checkpoint must be one of {CHECKPOINT_SPELLINGS} or 'auto', got {checkpoint!r}")
    if schedule not in SCHEDULES and schedule != "auto":
        raise ValueError(f"schedule {schedule!r} is not supported by the embedded executor; use 'auto' (the "
                         f"default: the planner picks) or one of {SCHEDULES}")
    refuse_with_schedule(checkpoint, schedule)
    record = None if schedule == "auto" else get_schedule(schedule)
    if virtual_stages is not None and (record is None or record.placement != "looped"):
        looped = " or ".join(repr(n) for n, r in REGISTRY.items() if r.placement == "looped")
        raise ValueError(f"virtual_stages={virtual_stages} needs schedule={looped} (got {schedule!r})")
    v = 1 if record is None else record.stages_per_worker(virtual_stages or 2)
    if v < 1:
        raise ValueError(f"virtual_stages must be at least 1, got {v}")
    if plan is not None and profile.calibrate:
        raise ValueError("calibrate=True re-plans from a profile; it cannot refine a loaded plan= "
                         "(compile with example_inputs instead)")
    return v


def worker_devices(devices: list[torch.device], schedule: str, v: int, stages: int | None,
                   chunks: int | None) -> list[torch.device]:
    """The devices that run workers: all of them, or for ``v`` stages per worker (interleaved 1F1B, ZB-V)
    ``stages / v`` of them."""
    if v == 1:
        return devices
    workers = stages // v if stages is not None else len(devices)
    if stages is not None and (stages % v or workers > len(devices)):
        raise ValueError(f"{schedule} with {v} stages per device needs stages = {v} x the devices used "
                         f"(at most {v * len(devices)}), got stages={stages}")
    check_schedule(schedule, v * workers, workers, workers if chunks is None else chunks)   # None: chosen later
    return devices[:workers]


def check_plan(plan: Plan, captured: Captured, model: nn.Module, devices: list[torch.device],
               chunks: int | None) -> None:
    """Refuse a loaded plan made for another model, other devices, other chunks or the other mode."""
    if plan.fingerprint != captured.fingerprint:
        raise PlanMismatchError(captured.dtype_mismatch(plan.profile.get("dtype")) or
            f"the plan was made for another model ({plan.model}, fingerprint {plan.fingerprint[:12]}) "
            f"but this {type(model).__name__} traces to fingerprint {captured.fingerprint[:12]}; "
            "compile without plan= to make a new one"
        )
    if [str(d) for d in devices] != [str(torch.device(d)) for d in plan.devices]:
        raise PlanMismatchError(f"the plan was made for devices {plan.devices}, got {[str(d) for d in devices]}")
    if chunks is not None and chunks != plan.chunks:
        raise PlanMismatchError(f"the plan was made for chunks={plan.chunks}, got chunks={chunks}")
    if plan.traced_training != model.training and captured.depends_on_mode():
        raise PlanMismatchError("the plan was made in the other train/eval mode of this mode-dependent model")


def check_plan_layout(plan: Plan, layout: BatchLayout, options: CompileOptions) -> None:
    """Refuse batch dimensions given in ``options`` that differ from those a loaded plan was made for (without
    any, the plan's are used)."""
    if options.batch_dim == 0 and options.output_batch_dim is None and options.target_batch_dim is None:
        return
    planned, arguments = BatchLayout.of(plan.batch_dims), list(layout.inputs)
    if (planned.input_dims(arguments), planned.output, planned.target) != \
            (layout.input_dims(arguments), layout.output, layout.target):
        raise PlanMismatchError(f"the plan was made for batch dimensions {planned.to_dict()} but options give "
                                f"{layout.to_dict()}; compile without plan= to plan for this layout, or drop batch_dim")


def memory_limits(devices: list[torch.device], v: int,
                  memory_bytes: Sequence[float] | None) -> list[float]:
    """Each worker device's memory for the planner: the user's override or what the device has."""
    mem = list(memory_bytes) if memory_bytes is not None else device_memory_bytes(devices)
    if len(mem) < len(devices) or (len(mem) > len(devices) and v == 1):
        raise ValueError(f"memory_bytes has {len(mem)} entries for {len(devices)} devices")
    return mem


def batch_layout(options: CompileOptions, gm: fx.GraphModule) -> BatchLayout:
    """``options.batch_dim`` (one number, a sequence or a dict) as a :class:`BatchLayout` by forward argument."""
    arguments = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    dims = options.batch_dim
    if gm.meta.get(LEAF_DIMS) is not None:    # torch.export resolved them to its placeholders (one per leaf)
        inputs = dict(zip(arguments, gm.meta[LEAF_DIMS]))
    elif isinstance(dims, int):
        inputs = {a: dims for a in arguments}
    elif isinstance(dims, Mapping):
        unknown = sorted(set(dims) - set(arguments))
        if unknown:
            raise ValueError(f"batch_dim names {unknown}, which are not arguments of the model's forward "
                             f"{arguments}")
        inputs = {a: dims.get(a, 0) for a in arguments}
    else:
        if len(dims) > len(arguments):
            raise ValueError(f"batch_dim gives {len(dims)} dimensions for the {len(arguments)} forward arguments "
                             f"{arguments}")
        inputs = {a: (list(dims)[i] if i < len(dims) else 0) for i, a in enumerate(arguments)}
    common = set(inputs.values())
    output = options.output_batch_dim if options.output_batch_dim is not None else (
        common.pop() if len(common) == 1 else 0)
    target = options.target_batch_dim if options.target_batch_dim is not None else output
    return BatchLayout(inputs, output, target)


def most_micro_batches(model: nn.Module, batch: int) -> int:
    """The most micro-batches ``chunks="auto"`` makes of a batch of ``batch`` samples: one sample each, or
    two where a BatchNorm is in train mode (statistics over one sample normalise it away, and a 1x1 map
    of one sample is an error: "Expected more than 1 value per channel when training")."""
    training_norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules())
    return max(1, batch // 2) if training_norm else batch


def warn_batch_norm(model: nn.Module, chunks: int, deferred: bool = False) -> None:
    """Warn once when a train-mode BatchNorm meets micro-batches: each micro-batch is normalised by its own
    statistics (as in torchgpipe), so the output and gradients differ from one full-batch step's."""
    found = [name or type(model).__name__ for name, m in model.named_modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    if chunks <= 1 or not found:
        return
    shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
    warnings.warn(
        f"train-mode BatchNorm ({shown}) with chunks={chunks}: each micro-batch is normalised by its own "
        "statistics, so outputs and gradients differ from one full-batch step's (pipe.step is not a full-batch "
        "backward for these layers). Use the BatchNorm in eval mode, chunks=1, or GroupNorm/LayerNorm, which do "
        "not mix samples" + ("" if deferred else "; options=fxpipe.CompileOptions(deferred_batch_norm=True) at "
                             "least keeps the running statistics those of a full batch"), UserWarning, stacklevel=3)


def _power_iteration_buffers(module: nn.Module, prefix: str) -> list[str]:
    """The buffers spectral normalisation updates at every train-mode call of ``module`` (a leaf to fx):
    ``parametrizations.spectral_norm``'s ``_u``/``_v`` and the older ``utils.spectral_norm`` hook's
    ``<name>_u``/``<name>_v``."""
    from torch.nn.utils.parametrizations import _SpectralNorm
    from torch.nn.utils.spectral_norm import SpectralNorm

    found = []
    for name, sub in module.named_modules(prefix=prefix):
        if isinstance(sub, _SpectralNorm) and sub.training:
            found += [f"{name}._u", f"{name}._v"]
        for hook in sub._forward_pre_hooks.values():
            if isinstance(hook, SpectralNorm) and sub.training:
                found += [f"{name}.{hook.name}_u", f"{name}.{hook.name}_v"]
    return found


def warn_buffer_updates(gm: fx.GraphModule, chunks: int, model: nn.Module) -> None:
    """Warn once when the graph itself updates buffers in place (a step counter, a moving average, spectral
    norm's power iteration) and a batch runs as ``chunks > 1`` micro-batches: each update then runs once per
    micro-batch, where the unpartitioned model runs it once per batch. Buffers of leaf modules are left to
    their own checks, and so are a BatchNorm's where torch.export took it apart (:func:`warn_batch_norm`)."""
    leaves = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    norms = {name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    updated = sorted({b for b in written_buffers(gm) if not any(b.startswith(leaf + ".") for leaf in leaves)
                      and b.rpartition(".")[0] not in norms}
                     | {b for leaf in leaves for b in _power_iteration_buffers(gm.get_submodule(leaf), leaf)})
    if chunks <= 1 or not updated:
        return
    shown = ", ".join(updated[:5]) + (f" and {len(updated) - 5} more" if len(updated) > 5 else "")
    warnings.warn(
        f"the model's forward updates buffer(s) {shown} in place, and with chunks={chunks} each update runs "
        f"once per micro-batch ({chunks} times per batch) where the model runs it once per call, so they end "
        "elsewhere than after a full-batch call (a counter counts micro-batches; a moving average moves "
        f"{chunks} times). Use chunks=1 if their values must be the model's", UserWarning, stacklevel=3)


def auto_schedules(compiled: dict[str, Any] | None, checkpoint: str = "auto") -> tuple[str, ...]:
    """The schedules ``schedule="auto"`` tries: all, but those with a split backward for compiled stages
    (:func:`fxpipe.runtime.execute.compiled.refuse_split_backward` says why) and for a per-block ``checkpoint``
    (``"blocks"``, ``"blocks:K"``, ``"selective"``: :func:`fxpipe.planning.memory_model.refuse_with_schedule`)."""
    split = compiled is not None or block_mode(checkpoint) is not None
    return tuple(s for s in SCHEDULES if not (split and get_schedule(s).split_backward))
