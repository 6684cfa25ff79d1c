"""Inference on a laid-out model: decoding, serving and quantization.

Owns the KV-cached forward under every layout (decode), the decoding loop over a batch of prompts
(generate), continuous batching by our scheduler or by transformers' own engine (serve,
serve_transformers, and the request records both grow, serve_records) and torchao quantization
with its way back (quantize). Knows nothing of training, of checkpoints or of the long call that
frames a serving call (runtime.loop: a loop here crosses the rank's Boundary it is handed);
imports the layout, the model, runtime.parallel, the probes and the rank.
"""
