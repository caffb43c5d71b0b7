"""fxpipe on torch.distributed: one process per pipeline worker, the same plan and the same executor.

``PipelineRank(plan, model_fn=..., loss_fn=..., weights=...)`` builds this rank's stages (with ``weights``, on
``meta``, loading only its own tensors: :mod:`~fxpipe.distributed.materialise`, :mod:`~fxpipe.distributed.weights`)
on the process the plan places them on (:mod:`~fxpipe.distributed.placement`); ``stage.step(x, y)`` trains one
batch (:mod:`fxpipe.distributed.rank`). ``python -m fxpipe.launch`` runs it under torchrun. Values cross ranks point-to-point (:mod:`fxpipe.distributed.transport`,
message format in :mod:`fxpipe.distributed.wire`); :mod:`fxpipe.distributed.checkpoint` saves and resumes it with
``torch.distributed.checkpoint``, :mod:`fxpipe.distributed.snapshots` publishes checkpoints atomically (a
rank killed mid-save never leaves a half-written one to resume from); :func:`clip_grad_norm_` clips by the norm over all ranks;
:mod:`fxpipe.distributed.torch_pipelining` hands a plan's stages to torch.distributed.pipelining;
:class:`PipelineRank` with ``mesh=`` (by default the plan's) runs pp × dp × tp on a ``DeviceMesh``, dp replicated
(DDP), sharded (FSDP2) or both (HSDP), each parallelism applied in :mod:`fxpipe.distributed.parallel`
(:class:`ParallelDims` builds the mesh).
"""

from fxpipe.distributed import checkpoint, snapshots, torch_pipelining
from fxpipe.distributed.clip import clip_grad_norm_
from fxpipe.distributed.parallel import ParallelDims
from fxpipe.distributed.rank import PipelineRank
from fxpipe.distributed.transport import P2P
from fxpipe.distributed.waiting import PeerFailed

__all__ = ["P2P", "ParallelDims", "PeerFailed", "PipelineRank", "checkpoint", "clip_grad_norm_",
           "snapshots", "torch_pipelining"]
