"""The parallelism room: how a pipeline's stages compose with data and tensor parallelism on one ``DeviceMesh``.

:mod:`~fxpipe.distributed.parallel.dims` says the degrees (:class:`ParallelDims`: ``pp``, ``dp_replicate``,
``dp_shard``, ``tp``), checks them against the world and the plan, builds the named mesh and reads one back;
:mod:`~fxpipe.distributed.parallel.fsdp` shards each transformer block of this rank's stage modules, then each
stage module, with FSDP2 (``fully_shard``) over the data-parallel dims and reduce-scatters their gradients once
per step, each block's as its last backward of the step ends;
:mod:`~fxpipe.distributed.parallel.ddp` replicates them with ``DistributedDataParallel`` and all-reduces once
per step; :mod:`~fxpipe.distributed.parallel.tp` (with :mod:`~fxpipe.distributed.parallel.tp_plans` and
:mod:`~fxpipe.distributed.parallel.module_calls`) derives and applies a tensor-parallel plan to a rank's stage
modules (:mod:`~fxpipe.distributed.parallel.local_shapes` makes a traced stage's recorded head counts local).
:mod:`~fxpipe.distributed.parallel.apply` applies each to a rank's stages, tensor then data parallelism, and
:mod:`~fxpipe.distributed.parallel.replicas` runs a data-parallel replica's step (its share of the batch, the
losses and token counts combined over the replicas); :class:`fxpipe.distributed.PipelineRank` composes them.
"""

from fxpipe.distributed.parallel.dims import DATA_PARALLEL, MESH_DIMS, ParallelDims

__all__ = ["DATA_PARALLEL", "MESH_DIMS", "ParallelDims"]
