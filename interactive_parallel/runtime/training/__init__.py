"""Training a laid-out model: one optimizer step, its data, and its check against one process.

Owns the step (train: accumulation, precision, AdamW and the StepRecord), the DTensor-aware fp16
gradient scaler (scaler), the data (data: the package's additions or the user's text, one
deterministic global batch per step) and the comparison with a single-process reference
(verify). Knows nothing of inference, of checkpoints or of the long call that loops over steps
(runtime.loop); imports the layout, the model, runtime.parallel and the probes.
"""
