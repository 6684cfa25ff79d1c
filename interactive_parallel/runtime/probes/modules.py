"""Where a step is in its layout's modules, for the comm causes (probes/causes.py): every module of
a layout named by its path in the model, and hooked so that backward, where no module's frame is
on the stack, knows which module's gradient it is computing; a pipeline stage's p2p ops tagged
with the hop they make.

Owns naming and hooking, once per module (the hooks pass straight through while no step is
traced: `ACTIVE` is empty). Backward's module is the one whose output's gradient node the
autograd engine entered last (a pre-hook on that node), until the gradients of its inputs are
done (a hook on each input hands it back to its parent): a TP style's from_local backward, run
before the input's gradient is complete, is its linear's; an SP block's input gather, run after
its linears' backward, is the block's. Torch's ModTracker does the same with
register_multi_grad_hook, which torch.autograd.grad refuses on a pipeline stage's leaf input (the
zero-bubble schedules' split backward fails). Costs a Python call per module call and per
module in backward while traced, and the module call's slow path (its hooks) always:
bench/bench_probes.py. Knows nothing of collectives or records.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

ACTIVE: list = []
"""The step's tracer (probes/causes.Tracer) while one is traced: its `backward_module` and `p2p` are set here."""
NAMES: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()
"""Module -> its path in the model (the root by its class, a pipeline stage's own module as `stage i`)."""


def instrument(par) -> None:
    """Name every module of the layout and hook it (once per module), and tag its pipeline
    stages' p2p ops."""
    stages = getattr(par, "stages", None) or []
    roots = [par.raw] + [s for s in stages if s not in NAMES]
    if getattr(par, "cp_model", None) is not None:
        roots.append(par.cp_model)
    for root in roots:
        if getattr(root, "_ip_causes", False):
            continue
        top = _root_name(par, root)
        ranks = {"": top}  # path in root -> the name of the nearest module that runs (not a container)
        for path, module in root.named_modules():
            parent = ranks[path.rsplit(".", 1)[0] if "." in path else ""] if path else ""
            name = NAMES.get(module) or (path if path else top)
            ranks[path] = parent if isinstance(module, (nn.ModuleList, nn.ModuleDict)) else name
            if module not in NAMES:
                NAMES[module] = name
                _hooks(module, name, parent)
        root._ip_causes = True
    if getattr(par, "schedule", None) is not None:
        from .pipeline import schedule_stages

        for stage in schedule_stages(par.schedule):
            _tag_stage(stage)


def _root_name(par, root: nn.Module) -> str:
    """The model by its class, as transformers names it (FSDP2 and replicate subclass it: FSDPLlama...;
    a StageModule over all of it too, under context parallel); a pipeline stage's own module by
    its index."""
    index = getattr(root, "stage_index", None)
    if root is not par.raw and index is not None and getattr(par, "stages", None):
        return f"stage {index}"
    return next(c for c in type(par.raw).__mro__ if not c.__module__.startswith("torch.")).__name__


def _tensors(out: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors in a module's inputs or outputs (tuples, lists, dicts: a ModelOutput), 3 deep."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = tuple(out.values())
    if not isinstance(out, (list, tuple)) or depth > 2:
        return []
    found = []
    for x in out:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple, dict)):
            found += _tensors(x, depth + 1)
    return found


def _hooks(module: nn.Module, name: str, parent: str) -> None:
    """Around a module's forward: its inputs' gradients leave it for `parent` in backward (hooks on
    the inputs as given, before any pre-hook of its own converts them: a TP style's from_local
    backward is still the module's), its output's gradient node enters it (a pre-hook on the node
    of the output as returned, after its own hooks: a TP style's redistribute backward is the
    module's). A node is hooked once each way: by the outermost module taking it (a decoder layer's
    input is its norm's too) and the innermost returning it (a block's last linear's output is
    the block's too)."""
    def entered(_grads):
        if ACTIVE:
            ACTIVE[-1].backward_module = name

    def left(_grad):
        if ACTIVE:
            ACTIVE[-1].backward_module = parent

    def pre(_module, args, kwargs):
        if not ACTIVE or torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return
        if torch._C._current_graph_task_id() == -1:
            ACTIVE[-1].backward_module = ""  # a forward: the last backward's module is over
        for t in _tensors(args) + (_tensors(kwargs) if kwargs else []):
            if not t.requires_grad:
                continue
            node = t.grad_fn
            if node is None or "ip_left" not in node.metadata:  # the outermost module taking it
                if node is not None:
                    node.metadata["ip_left"] = parent
                t.register_hook(left)  # runs before its producer's node pre-hooks (`entered`)

    def post(_module, _args, out):
        if not ACTIVE or torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return
        for t in _tensors(out):
            node = t.grad_fn
            if node is None or "ip_module" in node.metadata:
                continue
            node.metadata["ip_module"] = name
            node.register_prehook(entered)

    module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
    module.register_forward_hook(post)


_P2P_METHODS = {"get_fwd_send_ops": (1, "activations"), "get_fwd_recv_ops": (-1, "activations"),
                "get_bwd_send_ops": (-1, "gradients"), "get_bwd_recv_ops": (1, "gradients")}


def _tag_stage(stage) -> None:
    """Wrap a pipeline stage's get_*_ops once: each P2POp's tensor is named by the hop it makes."""
    if getattr(stage, "_ip_causes", False):
        return
    for method, (step, what) in _P2P_METHODS.items():
        orig = getattr(stage, method, None)
        if orig is not None:
            setattr(stage, method, _tagging(stage, orig, step, what, method.endswith("send_ops")))
    stage._ip_causes = True


def _tagging(stage, orig, step: int, what: str, sends: bool):
    def tagged(*args, **kwargs):
        ops = orig(*args, **kwargs)
        if ACTIVE:
            s = stage.stage_index
            a, b = (s, s + step) if sends else (s + step, s)
            for op in ops or ():
                t = getattr(op, "tensor", None)
                if isinstance(t, torch.Tensor):
                    ACTIVE[-1].p2p[id(t)] = (f"pipeline stage {a} -> {b}", what, t)
        return ops

    return tagged
