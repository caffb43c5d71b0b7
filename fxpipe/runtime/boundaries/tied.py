"""Tied weights: a Parameter that several stages read gets a copy on each of those stages, summed once per step.

A weight read by more than one stage (GPT-2's ``wte``/``lm_head``, Llama with ``tie_word_embeddings``, a module
called from two stages) used to live in the first stage that reads it and cross to the others as a value every
micro-batch, its gradient back every micro-batch. Here, as Megatron-LM's embedding group and DeepSpeed's
``ds_pipe_replicated`` do, each reading stage holds its own copy and the gradients are summed once per step:

- The *primary* is the user's ``Parameter`` (what ``model.parameters()`` and the user's optimizer see); it stays in
  the first stage that reads it. Every later stage that reads it gets a :class:`TiedCopy`, a submodule of that
  stage module only, holding a ``Parameter`` of its own on that stage's device (so no ``Parameter`` object is in
  two stage modules, and each stage computes with a weight on its own device).
- ``pipe.step``: the stages compute with their copies; after the step each copy's gradient is added into the
  primary's ``.grad`` and cleared (:meth:`TiedWeights.reduce`), so the optimizer sees the parameter once, with
  the whole model's gradient. (Over ``torch.distributed`` every owning rank keeps its copy as its own parameter
  and the copies' gradients are all-reduced over the owners: :mod:`fxpipe.distributed.tied`.)
- Before every ``pipe.step`` and ``pipe(x)`` (:meth:`TiedWeights.prepare`) a copy whose primary changed since
  it was last refreshed (the optimizer stepped it: its version counter moved, or its checksum did, for a write
  through ``.data``) is refreshed from the primary, so no forward reads a stale copy. A copy written by anything
  else (an optimizer over a stage module's own parameters) that no longer equals its primary is refused with
  :class:`TiedWeightsDiverged` before anything runs.
- ``pipe(x)`` with gradients on reads the primary itself (``primary.to(device)``, differentiable), so that a
  plain ``loss.backward()`` reaches ``model.parameters()`` as the unpartitioned model's would (also when a
  checkpointed stage recomputes in that backward); without gradients it reads the refreshed copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.fx as fx
from torch import nn

from fxpipe.errors import FxpipeError

__all__ = ["TiedCopy", "TiedWeights", "TiedWeightsDiverged", "Tie", "shared_parameter_reads", "install_copies",
           "checksum"]


class TiedWeightsDiverged(FxpipeError):
    """A stage's copy of a tied parameter no longer equals the parameter: something updated one copy only."""


class TiedCopy(nn.Module):
    """Stage ``stage``'s own copy of the parameter ``name`` (whose primary lives in stage ``primary_stage``);
    its stage graph calls it where the model read the parameter."""

    def __init__(self, primary: nn.Parameter, name: str, stage: int, primary_stage: int, root: nn.Module) -> None:
        super().__init__()
        self.weight = nn.Parameter(primary.detach().clone(), requires_grad=primary.requires_grad)
        self.name, self.stage, self.primary_stage = name, stage, primary_stage
        self._root = (root,)   # a tuple: the traced model is not a submodule of the stage
        self.through_primary = False   # pipe(x) with gradients: read the primary (see the module docstring)

    def primary(self) -> torch.Tensor:
        """The parameter this copies, as the traced model holds it now."""
        return self._root[0].get_parameter(self.name)

    def forward(self) -> torch.Tensor:
        if self.through_primary and torch.is_grad_enabled():
            primary = self.primary()
            if primary.requires_grad and primary.device.type != "meta":
                return primary.to(self.weight.device)
        return self.weight

    def extra_repr(self) -> str:
        return f"{self.name!r} of stage {self.primary_stage}, {tuple(self.weight.shape)}"


def shared_parameter_reads(gm: fx.GraphModule, stage_of: dict[str, int]) -> dict[int, tuple[str, list[int]]]:
    """Per Parameter (by id) that ``get_attr`` nodes of stages ``stage_of`` assigns read in more than one stage:
    its first name in graph order and the stages that read it, lowest first (the first is the primary's)."""
    names: dict[int, str] = {}
    stages: dict[int, set[int]] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            param = gm.get_parameter(str(node.target))
        except AttributeError:   # a buffer, a constant or a module
            continue
        readers = {stage_of[u.name] for u in node.users if u.op != "output"}
        if any(u.op == "output" for u in node.users):
            readers.add(stage_of[node.name])
        names.setdefault(id(param), str(node.target))
        stages.setdefault(id(param), set()).update(readers)
    return {key: (names[key], sorted(found)) for key, found in stages.items() if len(found) > 1}


def _slot(name: str) -> str:
    return "fxpipe_tied_" + name.replace(".", "_")


def _unhold(module: fx.GraphModule, target: str, gm: fx.GraphModule) -> None:
    """Remove the attribute ``target`` that ``fx.GraphModule`` copied into ``module`` for a ``get_attr``, and the
    empty containers it made for its path; a real module of the model on that path is refused."""
    *prefix, attr = target.split(".")
    owners: list[nn.Module] = [module]
    for part in prefix:
        owners.append(getattr(owners[-1], part))
    for depth, owner in enumerate(owners[1:], 1):
        if type(owner) is not nn.Module:   # the model's own module, called by this stage: it holds the primary
            path = ".".join(prefix[:depth])
            raise FxpipeError(f"stage module {module.__class__.__name__} calls {path!r}, which holds the tied parameter "
                              f"{target!r} that an earlier stage reads too: make {path!r} part of traced code (not "
                              "a leaf module) or untie the weight")
    delattr(owners[-1], attr)
    for parent, part, child in reversed(list(zip(owners[:-1], prefix, owners[1:]))):
        if child._modules or child._parameters or child._buffers:
            break
        delattr(parent, part)


def install_copies(module: fx.GraphModule, stage: int, gm: fx.GraphModule,
                   shared: dict[int, tuple[str, list[int]]]) -> None:
    """In stage ``stage``'s module, every ``get_attr`` of a shared parameter whose primary is another stage's
    becomes a call of this stage's :class:`TiedCopy` of it (one per parameter, whatever names it is read by)."""
    graph = module.graph
    copies: dict[int, str] = {}
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        try:
            param = gm.get_parameter(str(node.target))
        except AttributeError:
            continue
        if id(param) not in shared or shared[id(param)][1][0] == stage:
            continue
        name, readers = shared[id(param)]
        if id(param) not in copies:
            copies[id(param)] = _slot(name)
            if hasattr(module, _slot(name)):
                raise FxpipeError(f"stage {stage} already has an attribute {_slot(name)!r}: rename it in the model")
            module.add_submodule(_slot(name), TiedCopy(param, name, stage, readers[0], gm))
        with graph.inserting_before(node):
            read = graph.call_module(copies[id(param)])
        read.meta = dict(node.meta)
        node.replace_all_uses_with(read)
        graph.erase_node(node)
        _unhold(module, str(node.target), gm)
    if copies:
        graph.lint()
        module.recompile()
    held = [n for n, p in module.named_parameters(remove_duplicate=False)
            if id(p) in shared and shared[id(p)][1][0] != stage]
    if held:
        raise FxpipeError(f"stage {stage} still holds the tied parameter {held[0]!r} of an earlier stage; "
                          "make the module that owns it part of traced code (not a leaf) or untie the weight")


def checksum(t: torch.Tensor) -> tuple[float, float]:
    """Sum and Euclidean norm in float64, computed where ``t`` lives (no copy of it is made); of this process's
    shard for a ``DTensor`` (FSDP2: owners on other stages hold the same shard of their copy)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    with torch.no_grad():
        both = torch.stack([torch.sum(t, dtype=torch.float64), torch.linalg.vector_norm(t, dtype=torch.float64)])
    a, b = both.tolist()
    return float(a), float(b)


@dataclass
class Tie:
    """One parameter several stages read: its primary's stage and name, and the other stages' copies."""

    name: str
    primary_stage: int
    copies: list[TiedCopy]
    primary_of: Callable[[], torch.Tensor]
    # what the copies were last refreshed from: the primary's object, version and checksum, and each copy's version
    synced: tuple[int, int, tuple[float, float]] | None = None
    copy_versions: dict[int, int] = field(default_factory=dict)

    @property
    def stages(self) -> list[int]:
        return [self.primary_stage, *(c.stage for c in self.copies)]


class TiedWeights:
    """The pipeline's tied parameters: refreshed before a forward, their copies' gradients summed after a step.

    ``local(stage)`` says which stages run in this process (all of them, or a rank's); only those stages' copies
    are refreshed and reduced here, into the *representative* of each tie here: the primary where its stage is
    local, else the first local copy (over torch.distributed, that rank's own parameter)."""

    def __init__(self, modules: list[nn.Module], local: Callable[[int], bool] = lambda k: True) -> None:
        found: dict[str, list[TiedCopy]] = {}
        for module in modules:
            for sub in module.modules():
                if isinstance(sub, TiedCopy):
                    found.setdefault(sub.name, []).append(sub)
        self.local = local
        self.ties = [Tie(name, copies[0].primary_stage, sorted(copies, key=lambda c: c.stage), copies[0].primary)
                     for name, copies in sorted(found.items())]

    def __bool__(self) -> bool:
        return bool(self.ties)

    def __iter__(self) -> Iterator[Tie]:
        return iter(self.ties)

    def representative(self, tie: Tie) -> torch.Tensor | None:
        """This process's tensor of ``tie`` that the optimizer steps (``None`` where no stage here reads it)."""
        if self.local(tie.primary_stage):
            return tie.primary_of()
        mine = [c for c in tie.copies if self.local(c.stage)]
        return mine[0].weight if mine else None

    def followers(self, tie: Tie) -> list[TiedCopy]:
        """The local copies other than the representative: refreshed from it, their gradients added into it."""
        mine = [c for c in tie.copies if self.local(c.stage)]
        return mine if self.local(tie.primary_stage) else mine[1:]

    def replicas(self) -> set[int]:
        """Ids of the copies that are not their tie's representative here (excluded from ``parameters()``)."""
        return {id(c.weight) for tie in self.ties for c in self.followers(tie)}

    def read_primary(self, on: bool) -> None:
        """``pipe(x)`` with gradients reads the primaries (``on``); ``pipe.step`` reads the copies."""
        for tie in self.ties:
            for c in tie.copies:
                c.through_primary = on

    def prepare(self) -> None:
        """Refresh every local copy whose representative changed since; refuse one written by anything else.
        Raises :class:`TiedWeightsDiverged` before anything is updated."""
        stale = []
        for tie in self.ties:
            rep = self.representative(tie)
            followers = self.followers(tie)
            if rep is None or not followers:
                continue
            if rep.device.type == "meta":
                continue
            for c in followers:
                seen = tie.copy_versions.get(id(c.weight))
                if seen is not None and c.weight._version != seen and not _equal(c.weight, rep):
                    raise TiedWeightsDiverged(
                        f"the copy of tied parameter {tie.name!r} in stage {c.stage} was changed apart from the "
                        f"parameter itself (stage {tie.primary_stage}), so the two no longer agree: something updated "
                        f"one copy only, e.g. an optimizer over a stage module's own parameters. Step the optimizer "
                        f"over model.parameters() or pipe.parameters() (copies carry no gradient after pipe.step), "
                        f"and write weights into the model's parameter; pipe.tied.refresh() copies the parameter "
                        f"over its copies again")
            state = (id(rep), rep._version)
            if tie.synced is None or tie.synced[:2] != state or any(id(c.weight) not in tie.copy_versions
                                                                     for c in followers):
                stale.append((tie, rep, followers, None))
            else:
                sums = checksum(rep)   # a write through .data leaves the version counter as it was
                if sums != tie.synced[2]:
                    stale.append((tie, rep, followers, sums))
        for tie, rep, followers, sums in stale:
            self._refresh(tie, rep, followers, sums)

    def refresh(self) -> None:
        """Copy every representative over its local copies now (after writing into a copy on purpose)."""
        for tie in self.ties:
            rep, followers = self.representative(tie), self.followers(tie)
            if rep is not None and followers and rep.device.type != "meta":
                self._refresh(tie, rep, followers, None)

    def _refresh(self, tie: Tie, rep: torch.Tensor, followers: list[TiedCopy], sums: tuple[float, float] | None
                 ) -> None:
        with torch.no_grad():
            for c in followers:
                c.weight.copy_(rep)
        tie.synced = (id(rep), rep._version, sums if sums is not None else checksum(rep))
        tie.copy_versions = {id(c.weight): c.weight._version for c in followers}

    def reduce(self) -> None:
        """Add every local copy's gradient into its representative's and clear it: the once-per-step sum."""
        with torch.no_grad():
            for tie in self.ties:
                rep = self.representative(tie)
                if rep is None:
                    continue
                for c in self.followers(tie):
                    g = c.weight.grad
                    if g is None:
                        continue
                    c.weight.grad = None
                    g = g.to(rep.device)
                    rep.grad = g if rep.grad is None else rep.grad.add_(g)

    def clear(self) -> None:
        """Drop the copies' gradients (a failed step)."""
        for tie in self.ties:
            for c in self.followers(tie):
                c.weight.grad = None


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    with torch.no_grad():
        return bool(torch.equal(a, b.to(a.device)))
