"""The one-shot GPU check: what a lent GPU machine runs in one call of at most 5 minutes.

One JSON line per section, written and flushed as each section ends, to DIR/gpu_check.jsonl
(`--out DIR`; default $OUT when set, else bench/out), so a run cut short still returns what
ran; a short table per section on stdout. Every line is {"section", "ok", "seconds", ...figures};
a section that raised has "ok": false, "error" ("Type: message") and "traceback" (its last
lines), and the run goes on; a section not run has "ok": false and "skipped" (why), a part of
one that cannot run here (fp16 on a CPU) "ok": null and "skipped". A last line, "summary", lists
what passed, failed and was not run, and the run's seconds. Sections:

  versions            torch, CUDA, NCCL, transformers, torchao, Python; GPU count, names, memory
  parity_1gpu         one rank (NCCL, one GPU): 3 AdamW steps against the same 3 in this process on
                      the CPU (|dloss| per step, max |dw|) and verify() on the GPU
  step_time_1gpu      Session train() per step (defaults; snapshot_every=0 with probes on and off)
                      against a plain torchrun loop (bench/_plain_torchrun.py, this venv's torchrun)
  layouts_2gpu        dp2, fsdp2, tp2, pp2 (1f1b and interleaved-1f1b), cp2 on one 2-rank session
                      (apply re-lays out), dp2xtp2 on 4 ranks: 2 steps each from the seed, verify()
  precision_2gpu      bf16 under fsdp2, fp16 under tp2: 2 steps, losses finite, verify()
  group_timeout_2gpu  the timeout torch holds for the world group, a DeviceMesh sub-group, a later
                      new_group and the plan's mesh groups, read on every rank, against collective_timeout
  faults_2gpu         an injected hang, then a kill: the error (type, first line, ranks named),
                      the next train() (recovery), each rank's pid and current CUDA device after it
  records_2gpu        one fsdp2 step's MemoryRecords and CommRecords (op, bytes, start, end)
  inference_2gpu      generate and serve under tp2, int8 and int4 weight-only quantization
  state_2gpu          save under dp2, load under fsdp2 (losses against continuing); a re-plan to tp2
                      (verify()'s loss before and after, on the same weights and batch)

Each section runs under its own time limit (SIGALRM), every Session call under the session's
call timeout, and the whole run under `--budget-s` (default 290 s on CUDA, 840 s with
`--device cpu`): sections left when it is spent are written as skipped. The 2-GPU sections
are skipped, saying why, when torch sees fewer than 2 GPUs (dp2xtp2: fewer than 4).
`--device cpu` runs the same sections with gloo (the 2-GPU ones on `--cpu-devices` CPU ranks,
default 2), which only proves the script works; what cannot run on a CPU (fp16) says so.
    python bench/gpu_check.py [--out DIR] [--sections a,b] [--device cuda|cpu] [--budget-s 290]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import _gpu_sections as sections  # this folder: the sections themselves
from _gpu_sections import SectionTimeout, clean
from interactive_parallel import Session

SECTIONS: dict[str, tuple[int, float]] = {  # name -> (devices it needs, its time limit on CUDA, s)
    "versions": (0, 30), "parity_1gpu": (1, 90), "step_time_1gpu": (1, 120), "layouts_2gpu": (2, 150),
    "precision_2gpu": (2, 60), "group_timeout_2gpu": (2, 45), "faults_2gpu": (2, 150),
    "records_2gpu": (2, 45), "inference_2gpu": (2, 90), "state_2gpu": (2, 75)}
CPU_SLOWER = 3.0
"""Section limits with --device cpu: 2 CPU cores run the same steps several times slower."""
MIN_SECTION_S = 8.0
"""A section is not started with less of the total budget left than this."""


# ---- output ---------------------------------------------------------------------------------------
class Writer:
    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "gpu_check.jsonl"
        self.file = open(self.path, "w")
        self.lines: list[dict] = []

    def write(self, line: dict, rows: list[str]) -> None:
        line = clean(line)
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.lines.append(line)
        state = "SKIP" if "skipped" in line else ("ok" if line["ok"] else "FAILED")
        print(f"== {line['section']}: {state} ({line['seconds']:.1f} s)", flush=True)
        for row in rows or ([line["skipped"]] if "skipped" in line else []):
            print(f"   {row}", flush=True)


# ---- sessions, kept between sections --------------------------------------------------------------
class Sessions:
    """One live Session per rank count, started when a section first needs it and dropped when a
    section fails (whatever it left is not trusted by the next)."""

    def __init__(self, args):
        self.args, self.live, self.started_s = args, {}, {}

    def get(self, ranks: int) -> Session:
        s = self.live.get(ranks)
        if s is not None and s.alive:
            return s
        t = time.monotonic()
        self.live[ranks] = Session(ranks=ranks, device=self.args.device, timeout=self.args.call_timeout,
                                   collective_timeout=self.args.collective_timeout)
        self.started_s[ranks] = time.monotonic() - t
        return self.live[ranks]

    def close(self, ranks: int | None = None) -> None:
        for n in [ranks] if ranks is not None else list(self.live):
            s = self.live.pop(n, None)
            if s is not None:
                with contextlib.suppress(Exception):
                    s.stop()


@contextlib.contextmanager
def time_limit(seconds: float):
    def fire(_sig, _frame):
        raise SectionTimeout(f"the section ran past its limit of {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---- the run --------------------------------------------------------------------------------------
class Context:
    def __init__(self, args, devices: int):
        self.args, self.devices, self.ref = args, devices, []
        self.sessions = Sessions(args)
        self.deadline = time.monotonic() + args.budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()


def drain_loop() -> None:
    """Cancel what a timed-out call left pending on this thread's event loop (the one the Session's
    blocking calls run on), so the next section's calls do not drive it."""
    import asyncio

    from interactive_parallel.cluster import twins

    loop = getattr(twins._local, "loop", None)
    if loop is None or loop.is_closed() or loop.is_running():
        return
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        with contextlib.suppress(Exception):
            loop.run_until_complete(asyncio.wait(tasks, timeout=10))


def run_section(ctx: Context, writer: Writer, name: str) -> None:
    need, limit = SECTIONS[name]
    limit *= CPU_SLOWER if ctx.args.device == "cpu" else 1.0
    limit = min(limit, ctx.args.section_limit_s or limit)
    unit = "GPUs" if ctx.args.device == "cuda" else "CPU ranks (--cpu-devices)"
    if ctx.devices < need:
        what = "torch sees no GPU" if ctx.devices == 0 else f"needs {need} {unit}, {ctx.devices} here"
        return writer.write({"section": name, "ok": False, "seconds": 0.0, "skipped": what}, [])
    if ctx.left() < MIN_SECTION_S:
        return writer.write({"section": name, "ok": False, "seconds": 0.0,
                             "skipped": f"the total budget of {ctx.args.budget_s:g} s is spent"}, [])
    limit = min(limit, ctx.left())
    t = time.monotonic()
    try:
        with time_limit(limit):
            figures = getattr(sections, f"sec_{name}")(ctx)
        rows = figures.pop("_rows", [])
        line = {"section": name, "ok": bool(figures.pop("ok")), "seconds": time.monotonic() - t, **figures}
    except (Exception, SectionTimeout) as e:
        if isinstance(e, SectionTimeout):
            drain_loop()
        ctx.sessions.close()  # whatever the section left running is not trusted by the next one
        tb = traceback.format_exc().strip().splitlines()
        line = {"section": name, "ok": False, "seconds": time.monotonic() - t,
                "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                "traceback": "\n".join(tb[-12:])}
        rows = [line["error"]]
    writer.write(line, rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).with_name("out")))
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, of: " + ", ".join(SECTIONS))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--budget-s", type=float, default=None, help="total seconds (default 290; 840 with --device cpu)")
    ap.add_argument("--section-limit-s", type=float, default=None, help="cap every section's own time limit")
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--steps", type=int, default=20, help="steps per timed train() call (step_time_1gpu)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--collective-timeout", type=float, default=10.0, help="the sessions' collective_timeout (s)")
    ap.add_argument("--call-timeout", type=float, default=None, help="the sessions' call timeout (default 60 s; 150 s on cpu)")
    ap.add_argument("--cpu-devices", type=int, default=2, help="with --device cpu: the ranks standing in for GPUs")
    args = ap.parse_args()
    args.budget_s = args.budget_s or (840.0 if args.device == "cpu" else 290.0)
    args.call_timeout = args.call_timeout or (150.0 if args.device == "cpu" else 60.0)
    chosen = [n.strip() for n in args.sections.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    import torch

    devices = (torch.cuda.device_count() if torch.cuda.is_available() else 0) if args.device == "cuda" \
        else args.cpu_devices
    writer = Writer(Path(args.out))
    print(f"gpu_check: {len(chosen)} section(s) on {args.device} ({devices} {'GPUs' if args.device == 'cuda' else 'CPU ranks'}), "
          f"budget {args.budget_s:g} s -> {writer.path}", flush=True)
    ctx, t0 = Context(args, devices), time.monotonic()
    try:
        for name in [n for n in SECTIONS if n in chosen]:
            run_section(ctx, writer, name)
    finally:
        ctx.sessions.close()
    lines = writer.lines
    summary = {"section": "summary", "ok": all(x["ok"] or "skipped" in x for x in lines),
               "seconds": time.monotonic() - t0, "device": args.device, "devices": devices,
               "passed": [x["section"] for x in lines if x["ok"]],
               "failed": [x["section"] for x in lines if not x["ok"] and "skipped" not in x],
               "not_run": {x["section"]: x["skipped"] for x in lines if "skipped" in x},
               "parts_not_run": {f"{x['section']}/{k}": p["skipped"] for x in lines for v in x.values()
                                 if isinstance(v, dict) for k, p in v.items() if isinstance(p, dict) and "skipped" in p}}
    writer.write(summary, [f"passed {summary['passed']}", f"failed {summary['failed']}",
                           f"not run {list(summary['not_run'])}; parts not run {list(summary['parts_not_run'])}"])
    if args.device == "cuda" and devices == 0:
        return 2
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
