"""Why each collective of a step happened: the module that issued it, the op that needed it and,
for a DTensor redistribute, its placements before and after and whether it was implicit.

Owns reading a collective's cause at the moment it is issued (probes/comms.py's kernel hands each
noted CommRecord to the step's `Tracer.annotate`). Everything is read off the Python stack of
the issuing call, so nothing runs per aten op:
- module: the innermost `nn.Module._call_impl` frame (a module's forward and its hooks: a TP
  style's redistribute runs in its linear's forward hook), named by its path in the model
  (`model.layers.3.self_attn.o_proj`; the root by its class). In backward no module frame exists:
  there it is the module whose gradient the engine is computing (probes/modules.py's hooks),
  and nothing outside the engine counts (what called backward did not issue it). A wrapper's collective
  names the wrapper instead: FSDP2's parameter group (`fsdp unit model.layers.3`, `replicate
  unit ...` for torch's FSDP2-based replicate), DDP's comm hook and its GradBucket (`ddp bucket
  2`), transformers' expert-parallel dispatch or combine (`ep dispatch layer 5`), a pipeline
  stage's p2p op (the stage's get_*_ops are tagged: `pipeline stage 1 -> 2`).
- needed_by: the aten op DTensor was dispatching (`aten.mm`; the `op_call` of its dispatch or
  of a custom handler, such as loss_parallel's `aten.nll_loss_forward`); `redistribute` for an
  explicit `.redistribute()` (TP styles' hooks) and `redistribute (backward)` for its gradient;
  `from_local (backward)` for the gradient `DTensor.from_local` promises (colwise TP's input
  gradient); for a wrapper what it was doing (FSDP's `unshard`, `post_backward`; DDP's
  `bucket all-reduce`; a stage's `activations` or `gradients`); else this package's function
  that issued it (`cp.cp_attention`).
- placements: one collective per mesh dim a redistribute changes, read from
  `redistribute_local_tensor`'s own loop: `S(0) -> R on tp`; implicit when DTensor's sharding
  propagation chose it (`OpDispatcher.redistribute_local_args` on the stack), the distinction
  torch's DebugMode records (its `is_explicit`), here without a dispatch mode.
- phase: forward, backward (the autograd engine is running: recomputation included) or
  optimizer.
Why not torch's own trackers: ModTracker (CommDebugMode's module tracker) breaks the zero-bubble
pipeline schedules (probes/modules.py); DebugMode is a TorchDispatchMode, which runs Python for
every aten op of the step (bench/bench_probes.py measures what this tracing costs instead). Knows nothing of how ops are seen (probes/comms.py)
or recorded (probes/ledger.py); reads torch's internals by their names (torch 2.13), and a
frame it does not know is passed over (a cause left empty, never an error).
"""
from __future__ import annotations

import contextlib
import os
import re
from types import CodeType
from typing import Any

import torch
from torch import nn

from .modules import ACTIVE, NAMES, instrument

ENABLED = [True]

# What a frame is, by its code object (classified once per code object: `_role`).
CALL, REDIS, IMPLICIT, EXPLICIT_FWD, EXPLICIT_BWD, FROM_LOCAL_BWD, OPCALL, FSDP, DDP, EP, PIPE, OPTIM, OWN, ENGINE = \
    range(14)
_ROLES: dict[CodeType, int | None] = {}
_TORCH = os.path.dirname(torch.__file__) + os.sep
_TENSOR = os.path.join(_TORCH, "distributed", "tensor") + os.sep
_RUNTIME = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_NOT_OWN = tuple(_RUNTIME + d + os.sep for d in ("probes", "client"))
"""The runtime's own frames that issue nothing: the probes, and the dry run's machinery around a step."""
_NAMED = {"redistribute_local_tensor": REDIS, "OpDispatcher.redistribute_local_args": IMPLICIT,
          "Redistribute.forward": EXPLICIT_FWD, "Redistribute.backward": EXPLICIT_BWD,
          "NestedRedistribute.forward": EXPLICIT_BWD, "_FromTorchTensor.backward": FROM_LOCAL_BWD}
_EP_METHODS = ("_dispatch_tokens", "_uniform_dispatch", "_combine_tokens")
_BACKWARD = ("post_backward", "bucket all-reduce")
"""Wrappers' gradient work, in backward also where a pipeline schedule runs it after the engine."""


def _role(code: CodeType) -> int | None:
    role = _ROLES.get(code, -1)
    if role != -1:
        return role
    path, qual = code.co_filename, code.co_qualname
    role = None
    if qual == "Module._call_impl" and path.endswith(os.path.join("nn", "modules", "module.py")):
        role = CALL
    elif qual == "_engine_run_backward" and path.endswith(os.path.join("autograd", "graph.py")):
        role = ENGINE
    elif path.startswith(_TENSOR):
        role = _NAMED.get(qual, OPCALL if "op_call" in code.co_varnames else None)
    elif "_fully_shard" in path and qual.startswith("FSDPParamGroup."):
        role = FSDP
    elif code.co_name in _EP_METHODS:
        role = EP
    elif "bucket" in code.co_varnames[:code.co_argcount]:
        role = DDP
    elif path.startswith(os.path.join(_TORCH, "distributed", "pipelining")):
        role = PIPE
    elif path.startswith(os.path.join(_TORCH, "optim")):
        role = OPTIM
    elif path.startswith(_RUNTIME) and not path.startswith(_NOT_OWN):
        role = OWN
    _ROLES[code] = role
    return role


def _op_name(op: Any) -> str:
    packet = getattr(op, "_overloadpacket", None)
    return str(packet if packet is not None else op)


def _short(p: Any) -> str:
    """A placement as DTensor prints it (S(0), R, P(sum)), a Partial's subclass by its prefix and
    reduce op only (MaskPartial: MaskP(sum))."""
    text = str(p)
    op = getattr(p, "reduce_op", None)
    return f"{text.split('(')[0]}({op})" if op is not None and "(" in text else text


def _placements(local: dict) -> str:
    """`current -> target on <mesh dim>` of the transform redistribute_local_tensor is in."""
    current, target, i = local.get("current"), local.get("target"), local.get("i")
    mesh = local.get("mesh_to_use", local.get("device_mesh"))
    if current is None or target is None or i is None or mesh is None:
        a, b = local.get("current_spec"), local.get("target_spec")
        if a is None or b is None:
            return ""
        return f"{', '.join(map(_short, a.placements))} -> {', '.join(map(_short, b.placements))}"
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return f"{_short(current)} -> {_short(target)} on {names[i] if i < len(names) else i}"


def _node_name(name: str) -> str:
    """An autograd node's name as the op it differentiates: GeneratedBackwardFor__c10d_functional_
    all_to_all_single_defaultBackward -> all_to_all_single (backward)."""
    op = re.sub(r"^GeneratedBackwardFor__?(c10d_functional_)?|(_default)?Backward\d*$", "", name)
    return f"{op} (backward)"


class Cause:
    """What one walk of the stack found (innermost first for each field)."""

    __slots__ = ("module", "wrapper", "op", "wrapper_op", "own", "placements", "implicit", "redistribute", "phase")

    def __init__(self):
        self.module = self.wrapper = self.op = self.wrapper_op = self.own = self.placements = self.phase = ""
        self.implicit = False
        self.redistribute = False


def read(frame) -> Cause:
    """The cause of a collective issued at `frame` (see the module docstring)."""
    c = Cause()
    f = frame
    while f is not None:
        role = _role(f.f_code)
        if role == ENGINE:
            break  # what called backward did not issue it: the autograd engine ran it
        if role is not None:
            _take(c, role, f)
        f = f.f_back
    return c


def _take(c: Cause, role: int, f) -> None:  # noqa: C901 - one branch per role
    if role == CALL:
        if not c.module:
            owner = f.f_locals.get("self")
            c.module = NAMES.get(owner, "") if isinstance(owner, nn.Module) else ""
    elif role == REDIS:
        c.redistribute = True
        if not c.placements:
            c.placements = _placements(f.f_locals)
    elif role == IMPLICIT:
        c.implicit = True
        if not c.op:
            info = f.f_locals.get("op_info")
            c.op = _op_name(info.schema.op) if info is not None and info.schema is not None else ""
    elif role in (EXPLICIT_FWD, EXPLICIT_BWD, FROM_LOCAL_BWD):
        c.op = c.op or {EXPLICIT_FWD: "redistribute", EXPLICIT_BWD: "redistribute (backward)",
                        FROM_LOCAL_BWD: "from_local (backward)"}[role]
    elif role == OPCALL:
        if not c.op:
            op = f.f_locals.get("op_call")
            c.op = _op_name(op) if op is not None else ""
    elif role == FSDP:
        _fsdp(c, f)
    elif role == DDP:
        bucket = f.f_locals.get("bucket")
        if not c.wrapper and isinstance(bucket, torch.distributed.GradBucket):
            c.wrapper, c.wrapper_op = f"ddp bucket {bucket.index()}", "bucket all-reduce"
    elif role == EP:
        owner = f.f_locals.get("self")
        if not c.wrapper and owner is not None:
            what = "combine" if f.f_code.co_name == "_combine_tokens" else "dispatch"
            c.wrapper, c.wrapper_op = f"ep {what} layer {getattr(owner, 'layer', '?')}", what
    elif role == PIPE:
        if not c.module and not c.wrapper:  # a schedule around a stage's forward is not the issuer
            c.wrapper, c.wrapper_op = "pipeline", f.f_code.co_name.strip("_")
    elif role == OPTIM:
        c.phase = "optimizer"
    elif role == OWN and not c.own:
        c.own = f"{os.path.splitext(os.path.basename(f.f_code.co_filename))[0]}.{f.f_code.co_qualname}"


def _fsdp(c: Cause, f) -> None:
    group = f.f_locals.get("self")
    if c.wrapper.startswith(("fsdp", "replicate")) or group is None:
        return
    modules = getattr(group, "modules", ()) or ()
    name = NAMES.get(modules[0], "") if modules else ""
    name = name or getattr(group, "_module_fqn", "") or ""
    kind = "replicate" if type(getattr(group, "mesh_info", None)).__name__ == "DDPMeshInfo" else "fsdp"
    c.wrapper, c.wrapper_op = f"{kind} unit {name}".rstrip(), f.f_code.co_name


class Tracer:
    """The causes of one step's collectives on this rank."""

    def __init__(self):
        self.backward_module = ""
        self.phase = ""  # set by `phase`: what the runtime says it is doing
        self.issuer = ""  # set by `issuer`: the module the runtime acts for outside any forward
        self.p2p: dict[int, tuple[str, str, torch.Tensor]] = {}  # id(tensor) -> (stage label, what, tensor)

    def annotate(self, rec, kind: str, tensors: list[torch.Tensor], frame) -> None:
        """Fill `rec`'s cause fields from the stack at `frame` (the issuing kernel's). Never raises:
        a stack it cannot read leaves the cause empty, and the collective runs as it would."""
        try:
            self._annotate(rec, kind, tensors, frame)
        except Exception:  # noqa: BLE001 - inside a collective's kernel: a cause is not worth a failed step
            pass

    def _annotate(self, rec, kind: str, tensors: list[torch.Tensor], frame) -> None:
        c = read(frame)
        in_backward = torch._C._current_graph_task_id() != -1
        module, needed = c.wrapper or c.module, c.op or c.wrapper_op or c.own
        phase = c.phase or self.phase or ("backward" if in_backward or c.wrapper_op in _BACKWARD else "forward")
        if kind in ("send", "recv") and tensors and id(tensors[0]) in self.p2p:
            module, needed, _ = self.p2p[id(tensors[0])]
            phase = "backward" if needed == "gradients" else "forward"
        if in_backward and not module:
            module = self.backward_module
        module = module or self.issuer
        if in_backward and not needed:  # a C++ autograd formula's collective: its node names it
            node = torch._C._current_autograd_node()
            needed = _node_name(node.name()) if node is not None else ""
        rec.module, rec.needed_by, rec.phase = module, needed, phase
        if c.redistribute:
            rec.placements, rec.implicit = c.placements, c.implicit


@contextlib.contextmanager
def phase(name: str):
    """Collectives issued inside are in phase `name` (the runtime's gradient sync after backward)."""
    tracer = ACTIVE[-1] if ACTIVE else None
    if tracer is None:
        yield
        return
    before, tracer.phase = tracer.phase, name
    try:
        yield
    finally:
        tracer.phase = before


@contextlib.contextmanager
def issuer(module: str):
    """Collectives issued inside, outside any module's forward, are `module`'s (the runtime
    reducing a parameter's gradient for it)."""
    tracer = ACTIVE[-1] if ACTIVE else None
    if tracer is None:
        yield
        return
    before, tracer.issuer = tracer.issuer, module
    try:
        yield
    finally:
        tracer.issuer = before


class tracing:
    """`with tracing(par):` the step's collectives get their causes (a no-op when disabled)."""

    def __init__(self, par):
        self.tracer = Tracer() if ENABLED[0] else None
        if self.tracer is not None:
            instrument(par)

    def __enter__(self) -> "Tracer | None":
        if self.tracer is not None:
            ACTIVE.append(self.tracer)
        return self.tracer

    def __exit__(self, *exc) -> None:
        if self.tracer is not None:
            ACTIVE.remove(self.tracer)
            self.tracer.p2p.clear()
