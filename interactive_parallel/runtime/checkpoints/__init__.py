"""A layout's state on disk and from one layout to the next: saved, kept, carried, restored, exported.

Owns saving and loading under any plan through torch.distributed.checkpoint (checkpoint), the
raw-bytes storage re-plans and snapshots write to scratch (rawfiles), directories that appear
whole or not at all (atomic_dir), where a new layout's state comes from (recovery: the seed, the
layout it replaces, kept shards, a snapshot), a re-plan's staging (replan) and the transformers
directory `from_pretrained` loads (hf_export). Sits above training and inference: rebuilding a
layout makes its optimizer and first puts a quantized model back to full precision. Knows
nothing of the client or of the long calls.
"""
