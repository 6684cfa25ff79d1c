"""One rank process as every other folder sees it: what it keeps between calls, and how its long
calls meet whoever drives them.

Owns the rank's one global (state: RankState, with the shards it kept across a re-formed group
and a quantized model's full weights), its channel to the driver (channel: records out as they
happen, a stop request in), the faults armed on it (faults), the boundary every long loop crosses
between two steps (boundary) and the warm-up of the heavy imports as the process starts (warm).
The lowest floor but the probes: knows nothing of how process groups are made, of models,
layouts or the jobs run on them, and imports no other runtime folder but runtime.probes (a fault
may fire inside a collective the comm ledger sees).
"""
