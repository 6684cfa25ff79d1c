"""What runs in the client's own process with no peers: the runtime's code simulated, or written
out for later, never run on ranks.

Owns the dry run (dryrun: a plan laid over a virtual mesh of any size on torch's fake process
group, with the layout's and training's own code), the schedule preview (schedule_preview:
torch's pipeline schedule simulated over mock stages) and the torchrun script export (export:
the text of a standalone script). cluster/ imports them on first use; no rank calls them. Knows
nothing of ipyparallel, sessions or live ranks.
"""
