"""The model: a transformers causal LM as every layout runs it, before any layout.

Owns building it from a ModelSpec (models), its family's facts derived from transformers
(families: read by family_facts, checked on a small copy by family_check), its tokenizer
(tokenizer), the stage module that runs part or all of it the model's own way (stage), its
losses (loss: token cross-entropy; router_loss: the experts' load-balancing loss) and whether a
forward is a recomputation (recomputed). Knows nothing of meshes, process groups or
parallelisms, and imports no other runtime folder: runtime.parallel applies those to what it
builds.
"""
