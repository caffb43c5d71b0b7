"""Step 6, closing the loop: measure the compiled pipeline and plan again on what was measured.

Stages timed whole (:mod:`~fxpipe.refine.stage_profile`) or in training steps
(:mod:`~fxpipe.refine.calibrate`) scale the node costs, and :mod:`~fxpipe.refine.rounds` re-plans until
the cuts stop moving; :mod:`~fxpipe.refine.stage_memory` measures each stage's memory for the memory
model; :mod:`~fxpipe.refine.contention` measures how CPU workers slow each other. These run the runtime,
so they sit after it in the flow. Imports everything below.
"""
