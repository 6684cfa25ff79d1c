"""Whether the forward running now is a recomputation: autograd re-running it inside a backward.

Owns that one question, which every hook that counts what a forward did must ask so as not to
count a recomputed forward twice under activation recomputation (full or selective): the
router's load-balancing loss (runtime.model.router_loss), the tensor-parallel gathers
(runtime.parallel.tp) and the experts' token counter (runtime.parallel.ep). It sits with the
model, the lowest of them. Knows nothing of how recomputation is applied (runtime.parallel.ac)
or of which hooks ask.
"""
from __future__ import annotations


def in_backward() -> bool:
    """Whether autograd is running a backward now: a forward seen then is a recomputation (full or
    selective), which hooks that count what a forward did must not count twice."""
    import torch

    return torch._C._current_graph_task_id() != -1
