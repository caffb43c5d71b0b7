"""Module hooks that a traced graph does not call: refused (backward) or warned about (forward).

``module.register_forward_hook(fn)`` (and the pre-hook and backward-hook kinds) are called by
``nn.Module.__call__``. Tracing calls every module it traces through once, so a forward hook runs once at
trace time: what it does to the values is recorded in the graph, but the pipeline never calls it again
(a hook that saves activations or counts calls sees nothing). A backward hook is not recorded at all, and
one that returns new gradients would leave the pipeline computing other gradients than the model. Only a
module the graph calls as itself (an fx ``call_module`` node: a leaf, as ``nn.Linear`` is for fx, or one
named in ``leaf_modules``) runs its hooks, and its submodules' hooks, on every call.

Hooks defined in torch, Hugging Face transformers or timm (spectral norm's power iteration, weight norm,
``enable_input_require_grads``) act on values only, which the graph keeps: they are left alone.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch.fx as fx
from torch import nn

__all__ = ["check_module_hooks"]

_LIBRARIES = ("torch.", "transformers.", "timm.", "torchvision.")


def _user_hooks(hooks: dict[int, Callable[..., Any]]) -> list[str]:
    names = []
    for hook in hooks.values():
        target = getattr(hook, "__func__", hook)
        home = getattr(target, "__module__", None) or type(target).__module__ or ""
        if not (home + ".").startswith(_LIBRARIES):
            names.append(getattr(target, "__qualname__", type(target).__qualname__))
    return names


def check_module_hooks(gm: fx.GraphModule, model: nn.Module) -> None:
    """Raise ``ValueError`` for a user's backward hook on a module the graph does not call as itself; warn
    once for such forward hooks (module doc)."""
    called = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    backward: list[str] = []
    forward: list[str] = []
    for name, module in model.named_modules():
        if any(name == leaf or name.startswith(leaf + ".") for leaf in called):
            continue   # runs as written inside a leaf: its hooks are called
        where = name or "the model itself"
        backward += [f"{where} ({hook})" for hook in _user_hooks({**module._backward_hooks,
                                                                    **module._backward_pre_hooks})]
        forward += [f"{where} ({hook})" for hook in _user_hooks({**module._forward_pre_hooks,
                                                                   **module._forward_hooks})]
    if backward:
        raise ValueError(
            f"backward hook(s) on {', '.join(backward)}: the traced graph does not call these modules as "
            "themselves, so the pipeline would never call the hooks (and a hook that changes gradients would "
            "leave it computing other gradients than the model); compile with "
            "options=fxpipe.CompileOptions(frontend='fx', leaf_modules=[...]) naming those modules (a leaf runs "
            "as written, hooks included), or remove the hooks before compiling")
    if forward:
        warnings.warn(
            f"forward hook(s) on {', '.join(forward[:5])}{' and more' if len(forward) > 5 else ''} ran once "
            "while the model was traced: what they do to values is in the graph, but the pipeline will not call "
            "them (a hook that saves activations or counts calls sees nothing). Make those modules leaves "
            "(fxpipe.CompileOptions(frontend='fx', leaf_modules=[...])) if the hooks must run", UserWarning,
            stacklevel=3)
