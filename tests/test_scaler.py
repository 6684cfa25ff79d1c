"""runtime.training.scaler.DTensorGradScaler on 2 gloo ranks: torch's ShardedGradScaler refuses a
model whose gradients mix DTensors and plain tensors (tp leaves the norms plain); ours
unscales it exactly (DTensors of two meshes, plain and sparse gradients in one optimizer),
an inf in one rank's shard skips the step and backs off the scale on both ranks, and
train_step under tp2 with our scaler matches the run without one (fp32: the plan refuses
fp16 on a CPU, and a power-of-two scale is exact in fp32).

The rank bodies live here (module level, so the spawned ranks can import them); one group
runs them all, as spawning costs more than the checks.
"""
from __future__ import annotations

import pytest
import torch

from interactive_parallel.plan import PRESETS, Plan

from mp_harness import run_ranks

pytestmark = pytest.mark.multirank

SCALE = 2.0 ** 16
PARITY_TOL = 1e-5
PARITY_PLAN = dict(tp=2, batch_size=2, seq_len=16)
STEPS = 2
MIXED = "mixed torch.Tensor and DTensor"


def _model(seed: int):
    """Linear colwise on one mesh, a plain Linear, Linear rowwise on another mesh, a sparse
    Embedding: every kind of gradient our plans hand one optimizer. No forward runs."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))["dp"]
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 4), nn.Embedding(6, 4, sparse=True))
    parallelize_module(model[0], tp, ColwiseParallel())
    parallelize_module(model[2], dp, RowwiseParallel())
    return model


def _set_scaled_grads(model, seed: int) -> dict[str, torch.Tensor]:
    """Each parameter's gradient set to SCALE x a seeded tensor (the same on every rank);
    returns the full unscaled gradients (dense)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    expected = {}
    for name, p in model.named_parameters():
        full = torch.randn(p.shape, generator=g)
        if isinstance(p, DTensor):
            p.grad = distribute_tensor(full * SCALE, p.device_mesh, p.placements)
        elif name.startswith("3."):
            # Duplicate rows: the values the scaler unscales are not the dense gradient's.
            idx = torch.tensor([[1, 4, 1]])
            vals = torch.randn(3, p.shape[1], generator=g)
            p.grad = torch.sparse_coo_tensor(idx, vals * SCALE, p.shape)
            full = torch.sparse_coo_tensor(idx, vals, p.shape).to_dense()
        else:
            p.grad = full * SCALE
        expected[name] = full
    return expected


def _dense(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    t = t.full_tensor() if isinstance(t, DTensor) else t
    return t.to_dense() if t.is_sparse else t


def _torch_refuses(rank: int) -> dict:
    """What torch's own ShardedGradScaler does with the mixed model, and with DTensors only."""
    import torch.distributed as dist
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.distributed.tensor import DTensor

    out = {}
    for label, keep in (("mixed", lambda p: True), ("dtensors-two-meshes", lambda p: isinstance(p, DTensor))):
        model = _model(0)
        _set_scaled_grads(model, 1)
        scaler = ShardedGradScaler("cpu", process_group=dist.group.WORLD)
        scaler.scale(torch.ones(()))
        opt = torch.optim.SGD([p for p in model.parameters() if keep(p)], lr=0.1)
        try:
            scaler.unscale_(opt)
            out[label] = None
        except RuntimeError as e:
            out[label] = str(e)
    return out


def _ours_unscales(rank: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from interactive_parallel.runtime.training.scaler import DTensorGradScaler

    model = _model(0)
    expected = _set_scaled_grads(model, 1)
    scaler = DTensorGradScaler("cpu", process_group=dist.group.WORLD)
    scaler.scale(torch.ones(()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.unscale_(opt)
    found = scaler._found_inf_per_device(opt)
    return {
        "kinds": {n: type(p.grad).__name__ for n, p in model.named_parameters()},
        "dtensor_grads": sum(isinstance(p.grad, DTensor) for p in model.parameters()),
        "exact": {n: torch.equal(_dense(p.grad), expected[n]) for n, p in model.named_parameters()},
        "found": {str(d): (type(t).__name__, float(t)) for d, t in found.items()},
    }


def _inf_skips(rank: int) -> dict:
    """An inf in rank 1's local shard of the colwise weight only; then a clean step."""
    import torch.distributed as dist

    from interactive_parallel.runtime.training.scaler import DTensorGradScaler

    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DTensorGradScaler("cpu", process_group=dist.group.WORLD)
    scaler.scale(torch.ones(()))
    before = {n: _dense(p.detach()).clone() for n, p in model.named_parameters()}
    _set_scaled_grads(model, 1)
    if rank == 1:
        model[0].weight.grad.to_local()[0, 0] = float("inf")
    scaler.unscale_(opt)
    found = float(sum(scaler._found_inf_per_device(opt).values()))
    scaler.step(opt)
    scaler.update()
    unchanged = all(torch.equal(_dense(p.detach()), before[n]) for n, p in model.named_parameters())
    scale_after_inf = scaler.get_scale()
    opt.zero_grad(set_to_none=True)
    scaler.scale(torch.ones(()))
    _set_scaled_grads(model, 2)
    scaler.step(opt)
    scaler.update()
    changed = all(not torch.equal(_dense(p.detach()), before[n]) for n, p in model.named_parameters()
                  if not n.startswith("3."))  # the sparse rows the gradient touches only
    return {"found": found, "unchanged": unchanged, "scale_after_inf": scale_after_inf,
            "changed_after_clean": changed}


def _train(plan: Plan, scaler_kind: str | None) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from interactive_parallel.runtime.layout.parallelize import parallelize
    from interactive_parallel.runtime.rank import state
    from interactive_parallel.runtime.training.scaler import DTensorGradScaler
    from interactive_parallel.runtime.training.train import make_optimizer, train_step
    from interactive_parallel.runtime.training.verify import global_loss

    par = parallelize(PRESETS["tiny-llama"], plan)
    opt = make_optimizer(par)
    kinds = {type(p).__name__ for p in par.parameters()}
    scaler = {None: None, "ours": DTensorGradScaler, "torch": ShardedGradScaler}[scaler_kind]
    scaler = scaler and scaler("cpu", process_group=dist.group.WORLD)
    out: dict = {"kinds": kinds}
    try:
        out["losses"] = [global_loss(par, train_step(par, opt, s, scaler=scaler).loss) for s in range(STEPS)]
        out["weights"] = par.full_state_dict()
        out["scale"] = scaler.get_scale() if scaler else None
    except RuntimeError as e:
        out["error"] = str(e)
    state.get().reset_model()
    return out


def _train_step_parity(rank: int) -> dict:
    plan = Plan(**PARITY_PLAN)
    return {kind: _train(plan, kind) for kind in (None, "ours", "torch")}


def scaler_group(rank: int) -> dict:
    return {"torch": _torch_refuses(rank), "ours": _ours_unscales(rank), "inf": _inf_skips(rank),
            "train": _train_step_parity(rank)}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(scaler_group, 2, collective_timeout_s=45.0)


def test_torch_sharded_grad_scaler_refuses_mixed_gradients(ranks):
    for rank, r in enumerate(ranks):
        msg = r["torch"]["mixed"]
        if msg is None:
            pytest.skip(f"torch {torch.__version__}'s ShardedGradScaler unscales plain + DTensor gradients")
        assert MIXED in msg, (rank, msg)


def test_torch_sharded_grad_scaler_takes_dtensors_of_two_meshes(ranks):
    """Not a failure in this torch: DTensor's foreach dispatch takes lists across meshes;
    only a plain tensor among DTensors is refused. Recorded so a change shows."""
    for r in ranks:
        assert r["torch"]["dtensors-two-meshes"] is None, r["torch"]["dtensors-two-meshes"]


def test_ours_unscales_every_kind_exactly(ranks):
    for rank, r in enumerate(ranks):
        assert r["ours"]["dtensor_grads"] == 4, r["ours"]["kinds"]
        assert "Tensor" in r["ours"]["kinds"].values(), r["ours"]["kinds"]
        assert all(r["ours"]["exact"].values()), (rank, r["ours"]["exact"])
        # torch's bookkeeping: one found-inf tensor per device, zero here on every rank
        assert r["ours"]["found"] == {"cpu": ("Tensor", 0.0)}, (rank, r["ours"]["found"])


def test_an_inf_on_one_rank_skips_the_step_on_both(ranks):
    for rank, r in enumerate(ranks):
        inf = r["inf"]
        assert inf["found"] >= 1.0, (rank, inf)
        assert inf["unchanged"], f"rank {rank} stepped past an inf"
        assert inf["scale_after_inf"] == SCALE / 2, (rank, inf)
        assert inf["changed_after_clean"], f"rank {rank} skipped a clean step"


def test_train_step_under_tp2_with_our_scaler_matches_no_scaler(ranks):
    for rank, r in enumerate(ranks):
        plain, ours = r["train"][None], r["train"]["ours"]
        assert "error" not in ours, (rank, ours["error"])
        # the mix torch's scaler refuses: DTensor weights beside plain norms
        assert ours["kinds"] == {"DTensor", "Parameter"}, ours["kinds"]
        assert ours["scale"] == SCALE
        assert max(abs(a - b) for a, b in zip(plain["losses"], ours["losses"])) <= PARITY_TOL, (plain, ours)
        diff = max(float((plain["weights"][k] - ours["weights"][k]).abs().max()) for k in plain["weights"])
        assert diff <= PARITY_TOL, (rank, diff)


def test_train_step_under_tp2_with_torchs_scaler_fails(ranks):
    for rank, r in enumerate(ranks):
        err = r["train"]["torch"].get("error")
        if err is None:
            pytest.skip(f"torch {torch.__version__}'s ShardedGradScaler runs a tp2 train_step")
        assert MIXED in err, (rank, err)

