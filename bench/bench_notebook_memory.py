"""Peak memory and wall time of the notebooks as Binder runs them: a table, one row per notebook.

Executes each notebook headless with nbclient while a thread samples, every 0.2 s, the PSS
(proportional set size: a page shared by k processes counts 1/k in each, so the sum over processes
counts shared pages once, unlike RSS) of every process the run owns: this script's descendants (the
kernel, and the controller, zygote, engines and watcher below it) plus any process carrying this
run's tag in its environment (BENCH_NOTEBOOK_RUN, inherited by every process the kernel starts, so a
re-parented stray still counts and somebody else's kernel on the same machine never does). This
script's own process is left out: it is the notebook server's stand-in. PSS, USS (the pages only that
process holds) and RSS come from /proc/PID/smaps_rollup, which is cheap enough to sample on one core.

`--limit 2` runs the kernel, and so everything it starts, in a memory cgroup of 2 GB, as Binder's
container is (tests/memory_limit.py; the package reads that limit: cluster/zygote.py keeps no
standing template under 4 GB); a run the OOM killer ends is marked in the table.

`--cores 1` pins this script, and so the kernel and everything it starts, to CPU 0 first (what
`taskset -c 0` does): Binder's one-core case. The wall time is a benchmark figure, never a bound.

    python bench/bench_notebook_memory.py --all [--cores 1] [--json out.jsonl]
    python bench/bench_notebook_memory.py notebooks/00_tour.ipynb notebooks/03_pipeline_schedules.ipynb
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path

import nbformat
import psutil
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from memory_limit import MemoryLimit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TAG = "BENCH_NOTEBOOK_RUN"
FIELDS = {"Pss:": "pss", "Private_Clean:": "uss", "Private_Dirty:": "uss", "Rss:": "rss"}


def rollup(pid: int) -> dict[str, int] | None:
    """PSS, USS and RSS of one process in bytes (None once it is gone)."""
    out = {"pss": 0, "uss": 0, "rss": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key = FIELDS.get(line.split(" ", 1)[0])
                if key:
                    out[key] += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return out


def tagged(pid: int, tag: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return tag in f.read()
    except OSError:
        return False


def owned(me: psutil.Process, tag: bytes) -> dict[int, str]:
    """pid -> short command line of every process this run owns."""
    pids = {p.pid for p in me.children(recursive=True)}
    pids |= {pid for pid in psutil.pids() if pid != me.pid and pid not in pids and tagged(pid, tag)}
    names = {}
    for pid in pids:
        try:
            names[pid] = " ".join(psutil.Process(pid).cmdline()[:4])[-80:]
        except psutil.Error:
            continue
    return names


def limited_kernel(limit: MemoryLimit) -> KernelManager:
    """A kernel manager whose kernel starts inside `limit` (its whole process tree with it)."""

    class Limited(KernelManager):
        def format_kernel_cmd(self, extra_arguments=None):
            return limit.wrap(super().format_kernel_cmd(extra_arguments))

    return Limited(kernel_name="python3")


def measure(path: Path, interval: float, limit: MemoryLimit | None = None) -> dict:
    """Execute one notebook; its wall time, peak summed PSS and the processes at that peak."""
    nb = nbformat.read(path, as_version=4)
    run = uuid.uuid4().hex
    os.environ[TAG] = run
    tag = f"{TAG}={run}".encode()
    me, t0 = psutil.Process(os.getpid()), time.time()
    peak: dict = {"pss": 0, "rows": [], "at": 0.0}
    stop, names = threading.Event(), {}

    def sampler() -> None:
        while not stop.is_set():
            names.update(owned(me, tag))
            rows = [(pid, names[pid], r) for pid in list(names) if (r := rollup(pid)) is not None]
            total = sum(r["pss"] for _, _, r in rows)
            if total > peak["pss"]:
                peak.update(pss=total, rows=rows, at=time.time() - t0)
            for pid in [pid for pid in names if not psutil.pid_exists(pid)]:
                names.pop(pid, None)
            stop.wait(interval)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    error = None
    try:
        NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}},
                       **({"km": limited_kernel(limit)} if limit else {})).execute()
    except Exception as e:  # noqa: BLE001 - a failed notebook still gets its row, marked
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:200]
    finally:
        stop.set()
        thread.join()
        os.environ.pop(TAG, None)
    return {"notebook": path.stem, "wall_s": time.time() - t0, "peak_gb": peak["pss"] / 1e9,
            "at_s": peak["at"], "error": error, "oom_killed": limit.oom_killed() if limit else 0,
            "processes": [{"pid": pid, "cmd": cmd, **{k: v / 2**20 for k, v in r.items()}}
                          for pid, cmd, r in sorted(peak["rows"], key=lambda x: -x[2]["pss"])]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", type=Path)
    ap.add_argument("--all", action="store_true", help="every notebook under notebooks/")
    ap.add_argument("--cores", type=int, default=0, help="pin to the first N CPUs (1: taskset -c 0)")
    ap.add_argument("--limit", type=float, default=0, help="GB: run each notebook in a memory cgroup this size")
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--json", type=Path, help="append one JSON line per notebook here")
    ap.add_argument("--quiet", action="store_true", help="the table only, not the processes at each peak")
    args = ap.parse_args()
    paths = sorted((ROOT / "notebooks").glob("*.ipynb")) if args.all else [p.resolve() for p in args.notebooks]
    if not paths:
        ap.error("name notebooks, or --all")
    if missing := [str(p) for p in paths if not p.is_file()]:
        ap.error(f"no such notebook: {', '.join(missing)}")
    if args.cores:
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:args.cores]))
    cores = len(os.sched_getaffinity(0))
    results = []
    for path in paths:
        if args.limit:
            with MemoryLimit(int(args.limit * 1e9)) as limit:
                r = measure(path, args.interval, limit)
                r["limit"] = limit.kind
        else:
            r = measure(path, args.interval)
        r["cores"] = cores
        results.append(r)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(r) + "\n")
        print(f"{r['notebook']}: peak {r['peak_gb']:.2f} GB at {r['at_s']:.0f} s, {r['wall_s']:.0f} s on "
              f"{cores} core(s){'  FAILED ' + r['error'] if r['error'] else ''}"
              f"{'  OOM-killed ' + str(r['oom_killed']) if r['oom_killed'] else ''}", flush=True)
        if not args.quiet:
            for p in r["processes"]:
                print(f"  {p['pid']:>7}  PSS {p['pss']:7.1f}  USS {p['uss']:7.1f}  RSS {p['rss']:7.1f} MiB  {p['cmd']}")
    under = f", under a {args.limit:g} GB limit" if args.limit else ""
    print(f"\n| notebook | peak, GB{under} | wall on {cores} core(s), s |\n|---|---:|---:|")
    for r in results:
        print(f"| {r['notebook']} | {r['peak_gb']:.2f} | {r['wall_s']:.0f}{' (failed)' if r['error'] else ''} |")


if __name__ == "__main__":
    main()
