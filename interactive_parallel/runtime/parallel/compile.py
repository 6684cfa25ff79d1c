"""torch.compile of each decoder block, torchtitan's way (its `apply_compile`).

Owns the Plan's `compile` knob on the ranks: every decoder block this rank holds is compiled
in place (`block.compile()`: the module stays where it was, so parameter and state-dict names
gain no `_orig_mod.`), with inductor and `dynamic=False` (a training step's shapes are fixed;
each new shape, such as another sequence length, compiles once more, up to torch's recompile
limit of 8). Blocks, not the whole model: every block has the same code and shapes, so one
graph serves them all (dynamo takes a block's parameters as inputs; measured: one graph for
small-llama's 8), and the embedding, head, loss and the wrappers around them (DDP, FSDP2's
hooks, the pipeline schedule) stay eager. Applied in runtime.layout.parallelize after TP, CP and
activation recomputation and before FSDP/replicate, as torchtitan orders them: TP's DTensor
parameters and collectives are traced into the block; FSDP2's hooks are skipped by dynamo
(its `skip_fsdp_hooks`) and run eagerly around it.

`fullgraph=True` (one graph per block, a break is an error) wherever the block traces whole;
elsewhere the block is compiled in pieces (fullgraph=False), the untraceable part running
eagerly between them: context-parallel attention's collectives (runtime.parallel.cp), the
recomputation hooks of torch's composable `checkpoint` (it returns a context manager dynamo
cannot rebuild), and a mixture of experts' routing counter (runtime.parallel.ep: it asks
autograd whether a backward runs). Each was measured at parity with one eager process
(tests/test_compile.py). Which plans compile at all is decided once, in plan.plan's
`_compile_problems`.

The compile cache: inductor writes its generated code and graphs under TORCHINDUCTOR_CACHE_DIR
(default: the system temporary directory's `torchinductor_<user>`, kept across runs). A
session hands the ranks a directory under its scratch (`compile_cache`), removed at stop; a
plain torchrun process keeps inductor's default (the user's machine, the user's cache).
Knows nothing of the mesh, of training or of the client.
"""
from __future__ import annotations

import os

from torch import nn

from ...plan import Plan


def use_cache_dir(path: str | None) -> None:
    """Point inductor's cache at `path` (None: leave it as it is), before the first compile: inductor
    reads the variable when it first writes, and the rank process is the session's alone."""
    if path:
        os.makedirs(path, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path


def fullgraph(plan: Plan, experts: bool) -> bool:
    """Whether each block traces to one graph under `plan` (see the module docstring)."""
    return plan.cp == 1 and plan.recompute == "none" and not experts


def apply_compile(layers: list[nn.Module], plan: Plan, experts: bool = False) -> None:
    """Compile each of `layers` (this rank's decoder blocks) in place, lazily: the first forward
    traces and compiles. `experts`: the blocks hold MoE layers."""
    import torch
    from torch._inductor import config as inductor_config

    # One compile worker per thread this rank was given: on a small machine every rank is
    # given one, and a pool of compile subprocesses per rank would only fight its peers.
    inductor_config.compile_threads = max(1, min(inductor_config.compile_threads, torch.get_num_threads()))
    for layer in layers:
        layer.compile(fullgraph=fullgraph(plan, experts), dynamic=False)


def eager_blocks(plan: Plan):
    """A context in which compiled blocks run their eager code (torch's `force_eager` stance):
    for decoding, serving and the dry run. Decoding's lengths change every step; measured
    (bench/bench_compile.py --decode):
    a decoding step through the training-compiled blocks (dynamic=False) recompiles at every new
    cache length and fails at torch's recompile limit; compiled with dynamic shapes, the blocks
    still recompile (the cache's layer index and strides are guarded) and a step is no faster
    than eager. So the decode step is not compiled. The stance is process-wide (transformers'
    serving engine runs its own thread), restored on exit."""
    import contextlib

    import torch

    return torch.compiler.set_stance("force_eager") if plan.compile else contextlib.nullcontext()
