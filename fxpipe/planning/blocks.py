"""Which operations of a traced graph belong together in one stage: repeated blocks and kept-whole modules.

A model's repeated blocks (the layers of a transformer, the blocks of a ResNet or ViT stage) are the
children of one container (an ``nn.ModuleList`` or ``nn.Sequential``: paths ``<container>.<index>``)
that are at least two, of one class, and called one after the other (each child's operations read the
previous child's): the experts of a mixture-of-experts layer are of one class too but run side by side,
and are not blocks. Where blocks nest (a Swin stage of blocks in a list of stages), an operation belongs
to its innermost block. Each block's operations, found from the ``nn_module_stack`` metadata both front
ends record, form one group the planner keeps in one stage (:mod:`solvers.together`), so that a decoder
of ``L`` blocks is cut between blocks although the solver sees every operation.

The user's own kept-whole modules (``leaf_modules`` with torch.export) are grouped the same way by
:mod:`fxpipe.frontend.kept_whole`.
"""

from __future__ import annotations

import re

import torch.fx as fx

from fxpipe.frontend.kept_whole import module_stack, operations, with_parameters

__all__ = ["repeated_blocks"]

_INDEX = re.compile(r"^(?:(.*)\.)?(\d+)$")   # <container>.<index>, or <index> in the model itself


def _reads(later: list[fx.Node], earlier: set[fx.Node]) -> bool:
    """Some node of ``later`` depends on a node of ``earlier``."""
    seen: set[fx.Node] = set()
    todo = [a for n in later for a in n.all_input_nodes]
    while todo:
        n = todo.pop()
        if n in earlier:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def repeated_blocks(gm: fx.GraphModule) -> dict[str, list[str]]:
    """Block module path -> the names of its operations (and the parameters only it reads), in graph order."""
    ops = operations(gm)
    children: dict[str, dict[int, set[str]]] = {}     # container -> index -> classes seen
    members: dict[str, list[fx.Node]] = {}            # child path -> its operations
    for node in ops:
        for _, path, cls in module_stack(node):
            hit = _INDEX.match(path)
            if hit:
                children.setdefault(hit.group(1) or "", {}).setdefault(int(hit.group(2)), set()).add(cls)
                members.setdefault(path, []).append(node)
    blocks: set[str] = set()
    for container, kids in children.items():
        classes = set().union(*kids.values())
        if len(kids) < 2 or len(classes) != 1:
            continue
        paths = [f"{container}.{i}" if container else str(i) for i in sorted(kids)]
        if all(_reads(members[b], set(members[a])) for a, b in zip(paths, paths[1:])):
            blocks.update(paths)
    groups: dict[str, list[str]] = {}
    for node in ops:
        inner = [path for _, path, _ in module_stack(node) if path in blocks]
        if inner:
            groups.setdefault(inner[-1], []).append(node.name)
    return with_parameters(gm, groups)
