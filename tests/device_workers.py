"""Rank-side bodies of the device-path tests (module level, so spawned ranks can import them).

What a GPU run needs that a CPU run can show: every tensor handed to a collective is on the
group's device, the pipeline's fp16 loss is scaled before the scaler unscales, and the
optimizer settings of a GPU run work under every layout. Knows nothing of pytest.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

import interactive_parallel.runtime as runtime_pkg
from interactive_parallel.plan import PRESETS, Plan
from interactive_parallel.records import GenerateOptions

SMALL = dict(batch_size=8, seq_len=32)


FACTORIES = (torch.tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.rand, torch.randn,
             torch.randint, torch.eye, torch.linspace)
RUNTIME = str(Path(runtime_pkg.__file__).parent)


class _TensorsOnMeta(TorchFunctionMode):
    """A tensor that code under `roots` builds without naming a device lands on meta (tensors
    torch and transformers build keep their defaults): on a GPU it would land on the CPU
    instead of the group's device."""

    def __init__(self, roots: tuple[str, ...]):
        super().__init__()
        self.roots = roots

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(self.roots):
                kwargs = dict(kwargs, device="meta")
        return func(*args, **kwargs)


@contextlib.contextmanager
def tensors_off_device(*also: str):
    """Runtime tensors (and those of files `also`) built without a device go to meta, and a
    collective handed one raises (runtime.probes.comms.expect_device): a CPU run fails where
    an NCCL group would."""
    from interactive_parallel.runtime.probes.comms import expect_device

    with expect_device("cpu"), _TensorsOnMeta((RUNTIME, *also)):
        yield


def _forgets_the_device() -> None:
    """What runtime/training/verify.py's global_loss did before it named the group's device."""
    import torch.distributed as dist

    t = torch.tensor([1.0, 1.0], dtype=torch.float64)
    dist.all_reduce(t)


def every_collective_on_the_group_device(rank: int, plans: list[dict]) -> dict:
    """Train, verify, generate, agree to stop, run the doctor and re-plan (DCP) under each plan
    with tensors off the device by default; {plan: what ran}."""
    from interactive_parallel.runtime import api
    from interactive_parallel.runtime.groups import doctor
    from interactive_parallel.runtime.rank import channel, state
    from interactive_parallel.runtime.training.verify import global_loss

    out = {}
    try:  # the check itself: the mistake it exists for is caught, naming the device
        with tensors_off_device(__file__):
            _forgets_the_device()
        out["control"] = "not caught"
    except RuntimeError as exc:
        out["control"] = str(exc)
    api.load_model(PRESETS["tiny-llama"])
    for fields in plans:
        plan = Plan(**fields, **SMALL)
        ran = []
        with tensors_off_device():
            api.apply_plan(plan)
            par = state.get().parallel
            rec = api.train(1)[0]
            ran.append(("train", rec.loss))
            ran.append(("global_loss", global_loss(par, rec.loss)))
            ran.append(("verify", api.verify().ok))
            ran.append(("generate", api.generate(["12+35="], 2, GenerateOptions()).texts))
            channel.set_stop_source(lambda: False)
            try:
                ran.append(("agree_stop", channel.agree_stop(par.device)))
            finally:
                channel.set_stop_source(None)
            ran.append(("doctor", doctor.check(nbytes=1 << 12).error))
            ran.append(("carry", api.apply_plan(plan).state))  # the same plan again, through DCP
        out[plan.describe()] = ran
    state.get().reset_model()
    return out


def pipeline_scaling(rank: int) -> dict:
    """pp=2: full gradients of one batch without a scaler, and with one at scale 1024 after
    unscale_ (fp32 arithmetic: the power-of-two scale is exact, so they must agree)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from interactive_parallel.runtime.layout.parallelize import parallelize
    from interactive_parallel.runtime.training.train import forward_backward, local_batch, make_optimizer
    from interactive_parallel.runtime.training.verify import global_loss, zero_grads

    par = parallelize(PRESETS["tiny-llama"], Plan(pp=2, microbatches=2, **SMALL))
    batch = local_batch(par, 0)
    loss = global_loss(par, forward_backward(par, batch))
    plain = par.full_grads()
    zero_grads(par)
    opt = make_optimizer(par)
    scaler = ShardedGradScaler("cpu", init_scale=1024.0)
    scaled_loss = global_loss(par, forward_backward(par, batch, scaler))
    scaler.unscale_(opt)
    unscaled = par.full_grads()
    return {"loss": loss, "scaled_loss": scaled_loss, "plain": plain, "unscaled": unscaled}


def train_losses(rank: int, preset: str, fields: dict, steps: int, foreach: bool | None = None) -> dict:
    """Global loss per step, and the final weights, of `steps` steps under `fields` (precision
    and all: the scaler is make_scaler's), optimizer from make_optimizer(par, foreach)."""
    from interactive_parallel.runtime.layout.parallelize import parallelize
    from interactive_parallel.runtime.training.train import make_optimizer, make_scaler, train_step
    from interactive_parallel.runtime.training.verify import global_loss

    plan = Plan(**fields)
    par = parallelize(PRESETS[preset], plan)
    opt, scaler = make_optimizer(par, foreach), make_scaler(plan)
    losses = [global_loss(par, train_step(par, opt, s, scaler=scaler).loss) for s in range(steps)]
    return {"losses": losses, "weights": par.full_state_dict(), "groups": len(opt.param_groups),
            "scaler": type(scaler).__name__, "scale": scaler.get_scale() if scaler else None}


def optimizer_settings(rank: int, configs: list[tuple[str, dict]], steps: int) -> dict:
    """{label: (foreach=False run, foreach=True run)} for each plan."""
    return {label: (train_losses(rank, "tiny-llama", fields, steps, False),
                    train_losses(rank, "tiny-llama", fields, steps, True)) for label, fields in configs}
