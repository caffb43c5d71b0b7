"""The parallelism room: how a pipeline's stages compose with data and tensor parallelism on one ``DeviceMesh``.

:mod:`~fxpipe.distributed.parallel.dims` says the degrees (:class:`ParallelDims`: ``pp``, ``dp_replicate``,
``dp_shard``, ``tp``), checks them against the world and the plan, builds the named mesh and reads one back;
:mod:`~fxpipe.distributed.parallel.fsdp` shards each of this rank's stage modules with FSDP2 (``fully_shard``)
over the data-parallel dims and reduce-scatters their gradients once per step;
:mod:`~fxpipe.distributed.parallel.ddp` replicates them with ``DistributedDataParallel`` and all-reduces once
per step. :class:`fxpipe.distributed.mesh.MeshPipelineRank` composes them: tensor parallelism first (where a
``tp`` dim exists), then data parallelism, as torchtitan does.
"""

from fxpipe.distributed.parallel.dims import DATA_PARALLEL, MESH_DIMS, ParallelDims

__all__ = ["DATA_PARALLEL", "MESH_DIMS", "ParallelDims"]
