"""The sections of bench/gpu_check.py: each `sec_<name>(ctx)` runs one check on the sessions
the runner keeps (`ctx.sessions`) and returns its figures (`ok`, and `_rows` for the table).
Knows nothing of time limits, budgets or output: the runner owns those.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from bench_session import train_step_s  # this folder: the same timing as the Session bench
from interactive_parallel import Plan, PlanError, Request, Session
from interactive_parallel.cluster import RankError
from interactive_parallel.runtime import api

BATCH = dict(batch_size=8, seq_len=64)
PARITY_STEPS = 3
WARMUP = 3
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-4  # the parity tests' fp32 tolerances
PROMPTS = ["12+35=", "7+8=", "40+2=", "3+3="]
LAYOUTS = {"dp2": dict(dp=2), "fsdp2": dict(fsdp=2), "tp2": dict(tp=2),
           "pp2-1f1b": dict(pp=2, pp_schedule="1f1b", microbatches=4),
           "pp2-interleaved": dict(pp=2, pp_schedule="interleaved-1f1b", microbatches=4, virtual_stages=2),
           "cp2": dict(cp=2), "dp2xtp2": dict(dp=2, tp=2)}

class SectionTimeout(BaseException):
    """The section ran past its time limit (a BaseException: no `except Exception` on the way
    turns it into a failure that lets the section run on)."""


def clean(x: Any) -> Any:
    """JSON-safe: records and dataclasses as dicts, non-finite floats as None, the rest as str."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return clean(dataclasses.asdict(x))
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [clean(v) for v in x]
    if isinstance(x, float):
        return round(x, 9) if math.isfinite(x) else None
    if x is None or isinstance(x, (bool, int, str)):
        return x
    return str(x)



class Skip(Exception):
    """The section (or a part of it) cannot run here; the message says why."""



# ---- helpers --------------------------------------------------------------------------------------
def plan(ctx, **fields) -> Plan:
    return Plan(device=ctx.args.device, **{**BATCH, **fields})


def step_losses(records) -> dict[int, float]:
    """Step -> the mean loss of the ranks that see it (pipeline ranks without the last stage: NaN)."""
    by_step: dict[int, list[float]] = {}
    for r in records:
        if not math.isnan(r.loss):
            by_step.setdefault(r.step, []).append(r.loss)
    return {step: sum(v) / len(v) for step, v in sorted(by_step.items())}


def finite(values) -> bool:
    values = list(values)
    return bool(values) and all(math.isfinite(v) for v in values)


def verify_fig(v) -> dict:
    return {"ok": v.ok, "dloss": v.dloss, "max_grad_diff": v.max_grad_diff, "tolerance": v.tolerance,
            "note": v.note}


def cpu_losses(model: str, steps: int, **fields) -> tuple[list[float], dict]:
    """`steps` steps in this process on the CPU from the seed: losses and final weights."""
    from interactive_parallel.plan import resolve_model
    from interactive_parallel.runtime.layout.parallelize import parallelize
    from interactive_parallel.runtime.training.train import make_optimizer, train_step

    par = parallelize(resolve_model(model), Plan(**{**BATCH, **fields}))
    opt = make_optimizer(par)
    return [train_step(par, opt, step).loss for step in range(steps)], par.full_state_dict()


def reference(ctx, steps: int) -> list[float]:
    if len(ctx.ref) < steps:
        ctx.ref = cpu_losses(ctx.args.model, steps)[0]
    return ctx.ref[:steps]


def fresh(ctx, s: Session, fields: dict) -> None:
    """The model from the seed under a plan of `fields`."""
    s.load_model(ctx.args.model)
    s.apply(plan(ctx, **fields))


def part(parts: dict, name: str, fn: Callable[[], dict]) -> None:
    """One part of a section, isolated: its figures, or why it was skipped, or its error."""
    t = time.monotonic()
    try:
        parts[name] = fn()
    except Skip as e:
        parts[name] = {"ok": None, "skipped": str(e)}
    except SectionTimeout:
        raise
    except Exception as e:
        parts[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    parts[name]["seconds"] = time.monotonic() - t


def parts_ok(parts: dict) -> bool:
    run = [p for p in parts.values() if p.get("ok") is not None]
    return bool(run) and all(p["ok"] for p in run)


def mark(p: dict) -> str:
    return "skip: " + p["skipped"] if "skipped" in p else ("ok" if p.get("ok") else "FAILED " + p.get("error", ""))


# ---- rank-side functions (sent by value through Session.run) -------------------------------------
def _rank_group_timeouts() -> dict:
    """On every rank: the timeout torch holds for its groups, read from each group's backend options.
    (ipyparallel sends the code, not this module's globals: everything is imported here.)"""
    import os

    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh

    from interactive_parallel.runtime.rank import state

    st = state.get()
    dev = torch.device("cuda", torch.cuda.current_device()) if st.device == "cuda" else torch.device("cpu")
    world = dist.group.WORLD

    def read(pg) -> dict:
        try:
            timeout = pg._get_backend(dev).options._timeout.total_seconds()
        except Exception as e:  # an older or newer torch without these attributes
            timeout = f"unreadable: {type(e).__name__}: {e}"
        return {"timeout_s": timeout, "size": dist.get_world_size(pg), "is_world": pg == world,
                "desc": getattr(pg, "group_desc", "")}

    ws = dist.get_world_size()
    mesh = init_device_mesh(dev.type, (1, ws), mesh_dim_names=("single", "all"))
    later = dist.new_group(list(range(ws)))
    t = torch.ones(1, device=dev)
    dist.all_reduce(t, group=later)
    out = {"rank": dist.get_rank(), "backend": dist.get_backend(), "world": read(world),
           "device_mesh_subgroup": read(mesh.get_group("single")), "device_mesh_full_dim": read(mesh.get_group("all")),
           "new_group": {**read(later), "all_reduce": t.item()},
           "module_default_s": c10d.default_pg_timeout.total_seconds(),
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")}
    if st.mesh is not None:
        out["plan_mesh"] = {name: read(st.mesh.get_group(name)) for name in st.mesh.mesh_dim_names}
    return out


def _rank_where() -> dict:
    """On every rank: its pid and the CUDA device it computes on."""
    import os

    import torch

    from interactive_parallel.runtime.rank import state

    st = state.get()
    cuda = torch.cuda.is_available()
    return {"rank": st.rank, "pid": os.getpid(), "local_rank": st.local_rank,
            "current_device": torch.cuda.current_device() if cuda else None,
            "gpu": getattr(st, "gpu", None), "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}


# ---- sections -------------------------------------------------------------------------------------
def sec_versions(ctx) -> dict:
    import torch

    out: dict = {"ok": True, "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                 "device": ctx.args.device, "cpu_cores": len(os.sched_getaffinity(0)),
                 "torchrun": str(Path(sys.executable).with_name("torchrun"))}
    for name in ("transformers", "torchao", "ipyparallel"):
        try:
            out[name] = __import__(name).__version__
        except Exception as e:
            out[name] = f"not importable: {type(e).__name__}: {e}"
    try:
        v = torch.cuda.nccl.version()  # (major, minor, patch); an int in older torch
        out["nccl"] = ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)
    except Exception as e:
        out["nccl"] = f"none: {type(e).__name__}: {e}"
    out["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out["gpu"] = []
    for i in range(out["gpus"]):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        out["gpu"].append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                           "memory_gib": total / 2**30, "free_gib": free / 2**30})
    out["_rows"] = [f"python {out['python']}, torch {out['torch']}, cuda {out['cuda']}, nccl {out['nccl']}",
                    f"transformers {out['transformers']}, torchao {out['torchao']}, ipyparallel {out['ipyparallel']}",
                    f"{out['gpus']} GPU(s): " + "; ".join(f"{g['name']} {g['memory_gib']:.0f} GiB" for g in out["gpu"])]
    return out


def sec_parity_1gpu(ctx) -> dict:
    s = ctx.sessions.get(1)
    backend = s.doctor()[0].backend
    fresh(ctx, s, {})
    losses = [r.loss for r in s.train(steps=PARITY_STEPS, snapshot_every=0)]
    weights = s.run(api.full_state_dict)[0]
    v = s.verify()
    ref_losses, ref_weights = cpu_losses(ctx.args.model, PARITY_STEPS)
    dloss = [abs(a - b) for a, b in zip(losses, ref_losses)]
    dw = max(float((weights[k].float().cpu() - ref_weights[k].float()).abs().max()) for k in ref_weights)
    ok = max(dloss) <= LOSS_TOL and dw <= WEIGHT_TOL and v.ok
    rows = [f"{ctx.args.model}, 1 rank ({backend}) against one CPU process, {PARITY_STEPS} AdamW steps:",
            *[f"step {i} |dloss| {d:.2e} (tol {LOSS_TOL:.0e})" for i, d in enumerate(dloss)],
            f"weights max |dw| {dw:.2e} (tol {WEIGHT_TOL:.0e})",
            f"verify() on {ctx.args.device}: |dloss| {v.dloss:.2e}, max |dgrad| {v.max_grad_diff:.2e}: "
            f"{'OK' if v.ok else 'MISMATCH'}"]
    return {"ok": ok, "backend": backend, "session_start_s": ctx.sessions.started_s.get(1), "losses": losses,
            "cpu_losses": ref_losses, "dloss": dloss, "max_dw": dw, "tolerance": {"loss": LOSS_TOL, "weights": WEIGHT_TOL},
            "verify": verify_fig(v), "_rows": rows}


def plain_torchrun(ctx, limit_s: float) -> float:
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        raise FileNotFoundError(f"no torchrun next to {sys.executable}")
    a = ctx.args
    cfg = json.dumps(dict(BATCH, device=a.device, model=a.model, steps=a.steps, repeats=a.repeats, warmup=WARMUP))
    out = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node=1",
                          str(Path(__file__).with_name("_plain_torchrun.py")), cfg],
                         env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")),
                         capture_output=True, text=True, timeout=limit_s)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"plain torchrun failed (rc {out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])["step_s"]


def sec_step_time_1gpu(ctx) -> dict:
    a = ctx.args
    s = ctx.sessions.get(1)
    if s.plan is None:
        fresh(ctx, s, {})
    ms: dict[str, float] = {}
    try:
        ms["session_default"] = train_step_s(s, a.steps, a.repeats) * 1e3
        for probes in (True, False):
            s.set_probes(probes)
            ms[f"session_nosnap_probes_{'on' if probes else 'off'}"] = \
                train_step_s(s, a.steps, a.repeats, snapshot_every=0) * 1e3
    finally:
        with contextlib.suppress(Exception):
            s.set_probes(True)
    ctx.sessions.close(1)  # the plain loop runs alone on the device
    ms["plain_torchrun"] = plain_torchrun(ctx, max(30.0, ctx.left() - 5)) * 1e3
    ratio = ms["session_nosnap_probes_off"] / ms["plain_torchrun"]
    rows = [f"median of {a.repeats} x {a.steps} steps, {a.model}, batch {BATCH['batch_size']}x{BATCH['seq_len']}:",
            f"Session, defaults             {ms['session_default']:8.2f} ms (probes on, snapshots)",
            f"Session, snapshot_every=0     {ms['session_nosnap_probes_on']:8.2f} ms (probes on)",
            f"Session, probes off           {ms['session_nosnap_probes_off']:8.2f} ms",
            f"plain torchrun loop           {ms['plain_torchrun']:8.2f} ms (Session probes off / plain: {ratio:.2f}x)"]
    return {"ok": True, "step_ms": ms, "ratio_probes_off_to_plain": ratio, "steps": a.steps, "repeats": a.repeats,
            "_rows": rows}


def layout_run(ctx, s: Session, fields: dict, ref: list[float]) -> dict:
    fresh(ctx, s, fields)
    losses = list(step_losses(s.train(2, snapshot_every=0)).values())
    v = s.verify()
    d = max(abs(x - y) for x, y in zip(losses, ref)) if len(losses) == len(ref) else math.nan
    return {"ok": bool(v.ok and finite(losses) and len(losses) == 2), "losses": losses, "verify": verify_fig(v),
            "dloss_vs_cpu": d, "cpu_within_1e-5": d <= LOSS_TOL}


def sec_layouts_2gpu(ctx) -> dict:
    ref = reference(ctx, 2)
    parts: dict = {}
    s = ctx.sessions.get(2)
    for name, fields in LAYOUTS.items():
        if name == "dp2xtp2":
            continue
        part(parts, name, lambda: layout_run(ctx, s, fields, ref))

    def four():
        if ctx.devices < 4:
            raise Skip(f"needs 4 ranks (a plan's degrees multiply to the session's ranks: dp(2) * tp(2) = 4), "
                       f"and {ctx.devices} {'GPUs are' if ctx.args.device == 'cuda' else 'CPU ranks are'} lent")
        try:
            return layout_run(ctx, ctx.sessions.get(4), LAYOUTS["dp2xtp2"], ref)
        finally:
            ctx.sessions.close(4)

    part(parts, "dp2xtp2", four)
    rows = [f"{n:16s} {mark(p):8s} losses {[round(x, 6) for x in p.get('losses', [])]} "
            f"verify |dloss| {p['verify']['dloss'] if 'verify' in p else '-'}" if "losses" in p else f"{n:16s} {mark(p)}"
            for n, p in parts.items()]
    return {"ok": parts_ok(parts), "session_start_s": ctx.sessions.started_s.get(2), "cpu_losses": ref,
            "layouts": parts, "_rows": rows}


def sec_precision_2gpu(ctx) -> dict:
    s = ctx.sessions.get(2)
    parts: dict = {}

    def run(fields: dict) -> dict:
        try:
            s.check_plan(plan(ctx, **fields))
        except PlanError as e:
            raise Skip("the plan is refused here: " + "; ".join(e.problems)) from None
        fresh(ctx, s, fields)
        losses = list(step_losses(s.train(2, snapshot_every=0)).values())
        v = s.verify()
        return {"ok": bool(finite(losses) and v.ok), "losses": losses, "finite": finite(losses), "verify": verify_fig(v)}

    part(parts, "bf16-fsdp2", lambda: run(dict(fsdp=2, precision="bf16")))
    part(parts, "fp16-tp2", lambda: run(dict(tp=2, precision="fp16")))
    return {"ok": parts_ok(parts), "runs": parts, "_rows": [f"{n:12s} {mark(p)}" for n, p in parts.items()]}


def sec_group_timeout_2gpu(ctx) -> dict:
    s = ctx.sessions.get(2)
    if s.plan is None:
        fresh(ctx, s, dict(tp=2))
    want = s.collective_timeout
    per_rank = s.run(_rank_group_timeouts)
    checked = []
    for r in per_rank:
        groups = {"world": r["world"], "device_mesh_subgroup": r["device_mesh_subgroup"],
                  "device_mesh_full_dim": r["device_mesh_full_dim"], "new_group": r["new_group"],
                  **{f"plan_mesh_{k}": v for k, v in r.get("plan_mesh", {}).items()}}
        checked += [g["timeout_s"] == want for g in groups.values()]
    ok = all(checked) and all(r["new_group"]["all_reduce"] == len(per_rank) for r in per_rank)
    rows = [f"collective_timeout {want:g} s; on each rank, seconds per group:"]
    for r in per_rank:
        plan_groups = ", ".join(f"plan {k} {v['timeout_s']}" for k, v in r.get("plan_mesh", {}).items())
        rows.append(f"rank {r['rank']} ({r['backend']}): world {r['world']['timeout_s']}, mesh sub-group "
                    f"{r['device_mesh_subgroup']['timeout_s']}, new_group {r['new_group']['timeout_s']}"
                    + (f", {plan_groups}" if plan_groups else ""))
    return {"ok": ok, "collective_timeout_s": want, "plan": s.plan.describe() if s.plan else None,
            "ranks": per_rank, "_rows": rows}


def fault_run(ctx, s: Session, fault: str, fields: dict, victim: int = 1) -> dict:
    ref = reference(ctx, 4)
    fresh(ctx, s, fields)
    s.train(2, snapshot_every=2)
    before = {p.rank: p.pid for p in s.ranks_info}
    s.inject(victim, fault, at_step=1)
    t = time.monotonic()
    out: dict = {"plan": s.plan.describe(), "victim": victim}
    try:
        s.train(3, snapshot_every=2)
        out.update(raised=None)
    except RankError as e:
        out.update(raised=type(e).__name__, ename=e.ename, first_line=str(e).splitlines()[0], rank_named=e.rank,
                   others=sorted(e.others), stuck=e.stuck, fault=e.fault)
    out["error_after_s"] = time.monotonic() - t
    t = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        losses = step_losses(s.train(2, snapshot_every=2))
    out["next_call_s"] = time.monotonic() - t
    restored = getattr(s.model, "restored", None)
    out.update(recovered=sorted(losses) == [2, 3], losses_after=losses, restored=clean(restored),
               dloss_vs_uninterrupted_cpu=max((abs(v - ref[k]) for k, v in losses.items()), default=math.nan))
    where = s.run(_rank_where)
    out["ranks_after"] = [{**w, "replaced": before.get(w["rank"]) != w["pid"],
                           "place_gpu": getattr(p, "gpu", None)} for w, p in zip(where, s.ranks_info)]
    out["ok"] = bool(out["raised"] and out["rank_named"] == victim and out["recovered"]
                     and any(r["replaced"] for r in out["ranks_after"]))
    return out


def sec_faults_2gpu(ctx) -> dict:
    s = ctx.sessions.get(2)
    parts: dict = {}
    part(parts, "hang", lambda: fault_run(ctx, s, "hang", dict(fsdp=2)))
    part(parts, "kill", lambda: fault_run(ctx, s, "kill", dict(dp=2)))
    rows = [f"collective_timeout {s.collective_timeout:g} s"]
    for n, p in parts.items():
        rows.append(f"{n} ({p.get('plan', '-')}): {mark(p)}; {p.get('ename', '-')} naming rank {p.get('rank_named')} "
                    f"after {p.get('error_after_s', math.nan):.1f} s; next train {p.get('next_call_s', math.nan):.1f} s")
        rows.append(f"  first line: {p.get('first_line', '-')}")
        rows += [f"  rank {r['rank']}: pid {r['pid']}{' (replaced)' if r['replaced'] else ''}, "
                 f"cuda device {r['current_device']}" for r in p.get("ranks_after", [])]
    return {"ok": parts_ok(parts), "collective_timeout_s": s.collective_timeout, "faults": parts, "_rows": rows}


def sec_records_2gpu(ctx) -> dict:
    s = ctx.sessions.get(2)
    fresh(ctx, s, dict(fsdp=2))
    s.set_probes(True)
    recs = list(s.train(1, snapshot_every=0))
    ranks, rows = [], []
    for r in sorted(recs, key=lambda r: r.rank):
        mem = clean(r.memory) if r.memory is not None else None
        comms = [{"op": c.op, "bytes": c.bytes, "axis": c.axis, "start": c.start, "end": c.end,
                  "dur_ms": (c.end - c.start) * 1e3} for c in r.comms]
        positive = sum(c["end"] > c["start"] for c in comms)
        ranks.append({"rank": r.rank, "memory": mem, "device_peak": getattr(r.memory, "device_peak", None),
                      "comms": comms, "n_comms": len(comms), "n_end_after_start": positive,
                      "comm_bytes": sum(c["bytes"] for c in comms)})
        rows.append(f"rank {r.rank}: memory {mem}")
        rows.append(f"  {len(comms)} comm ops, {sum(c['bytes'] for c in comms)} bytes, end > start in {positive}; "
                    + ", ".join(f"{c['op']} {c['bytes']} B {c['dur_ms']:.3f} ms" for c in comms[:4]))
    ok = bool(ranks) and all(r["memory"] is not None and r["n_comms"] > 0 for r in ranks)
    return {"ok": ok, "plan": s.plan.describe(), "ranks": ranks, "_rows": rows}


def sec_inference_2gpu(ctx) -> dict:
    s = ctx.sessions.get(2)
    fresh(ctx, s, dict(tp=2))
    parts: dict = {}

    def gen() -> dict:
        t = time.monotonic()
        texts = s.generate(PROMPTS, max_new_tokens=16)
        wall = time.monotonic() - t
        chars = sum(len(x) for x in texts)  # the tokenizer is one token per character
        return {"ok": chars > 0, "texts": texts, "tokens": chars, "wall_s": wall, "tokens_per_s": chars / wall}

    def serve() -> dict:
        reqs = [Request(id=str(i), prompt=p, arrival=0.02 * i, max_new_tokens=16) for i, p in enumerate(PROMPTS * 2)]
        r = s.serve(reqs)
        texts = r.texts
        return {"ok": bool(texts) and all(texts.values()), "engine": r.engine, "reason": r.reason,
                "tokens": r.tokens, "tokens_per_s": r.tokens_per_s, "mean_ttft_s": r.mean_ttft, "texts": texts}

    def quant(scheme: str) -> dict:
        try:
            recs = list(s.quantize(scheme))
            texts = s.generate(PROMPTS, max_new_tokens=16)
        finally:
            with contextlib.suppress(Exception):
                s.dequantize()
        return {"ok": all(texts), "texts": texts,
                "ranks": [{k: getattr(q, k, None) for k in ("rank", "linears", "params_before", "params_after",
                                                            "tokens_per_s_before", "tokens_per_s_after", "agreement")}
                          for q in recs]}

    part(parts, "generate", gen)
    part(parts, "serve", serve)
    part(parts, "int8-weight-only", lambda: quant("int8-weight-only"))
    part(parts, "int4-weight-only", lambda: quant("int4-weight-only"))
    rows = []
    for n, p in parts.items():
        speed = p.get("tokens_per_s")
        if speed is None and p.get("ranks"):
            speed = p["ranks"][0].get("tokens_per_s_after")
        rows.append(f"{n:17s} {mark(p)}; tokens/s {speed if speed is None else round(speed)}"
                    + (f"; engine {p['engine']}" if "engine" in p else "")
                    + (f"; text {list(p['texts'].values() if isinstance(p['texts'], dict) else p['texts'])[:2]}"
                       if "texts" in p else ""))
    return {"ok": parts_ok(parts), "plan": "tp2", "runs": parts, "_rows": rows}


def sec_state_2gpu(ctx) -> dict:
    s = ctx.sessions.get(2)
    fresh(ctx, s, dict(dp=2))
    s.train(2, snapshot_every=0)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        ck = os.path.join(tmp, "ckpt")
        s.save(ck)
        cont = step_losses(s.train(2, snapshot_every=0))
        s.apply(plan(ctx, fsdp=2))
        s.load(ck)
        loaded = step_losses(s.train(2, snapshot_every=0))
    d_load = max((abs(v - cont.get(k, math.nan)) for k, v in loaded.items()), default=math.nan)
    before = s.verify()
    s.apply(plan(ctx, tp=2))
    after = s.verify()
    d_replan = abs(after.loss_par - before.loss_par)
    ok = (sorted(loaded) == sorted(cont) == [2, 3] and d_load <= LOSS_TOL and d_replan <= LOSS_TOL
          and before.ok and after.ok)
    rows = [f"save under dp2 at step 2, load under fsdp2: steps 2-3 {list(loaded.values())} against continuing "
            f"under dp2 {list(cont.values())}: max |dloss| {d_load:.2e}",
            f"re-plan fsdp2 -> tp2 at step 4: verify() loss {before.loss_par:.6f} -> {after.loss_par:.6f} "
            f"(|d| {d_replan:.2e}); verify ok before {before.ok}, after {after.ok}"]
    return {"ok": ok, "continued_dp2": cont, "loaded_fsdp2": loaded, "dloss_load": d_load,
            "replan": {"from": "fsdp2", "to": "tp2", "loss_before": before.loss_par, "loss_after": after.loss_par,
                       "dloss": d_replan, "verify_before": verify_fig(before), "verify_after": verify_fig(after)},
            "_rows": rows}


