"""Calibration, rank side: matmuls, elementwise chains, collectives and pipelines timed as a step
runs them.

Owns the measurements behind Session.calibrate (calibrate), the pipeline and core-sharing ones
(calibrate_pipeline) and what they share: a timer that waits for the device, the groups a mesh
makes of the world (measure). Needs a process group, not a layout: knows nothing of layouts,
training or inference (its model steps build their own small models through runtime.model),
nor of the fit the client makes of the samples (plan/calibration.py).
"""
