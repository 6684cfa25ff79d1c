"""Laying a model out under a plan on this rank: the parallelisms composed in one fixed order.

Owns the order (parallelize: pipeline split, then TP, EP, CP, recomputation, compile and
FSDP/replicate, each applied by runtime.parallel beside it), the handle of the result
(parallelized: which module to call, this rank's slice of the batch, full weights when asked),
the seeded values written into each rank's shards (initialize), where a local tensor sits in
the logical one (pieces) and what a layout will get wrong, read from its placements before a
step (lint). Knows nothing of what a layout is then used for (training, inference,
checkpoints, calibration) or of the client; imports the model, the groups and runtime.parallel.
"""
