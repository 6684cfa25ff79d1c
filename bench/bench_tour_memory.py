"""Peak memory of the tour notebook: the kernel, every engine, the controller and the helpers, together.

Executes notebooks/00_tour.ipynb headless with nbclient while a thread samples, every 0.2 s, the PSS
(proportional set size: a page shared by k processes counts 1/k in each, so the sum over processes
counts shared pages once, unlike RSS) of every process in this script's process tree (the kernel is a
child of this script, and the pool's controller, zygote, engines and watcher descend from the kernel),
plus any process started meanwhile that left the tree (re-parented) and runs ipyparallel or this
package. This script's own process is left out: it is the notebook server's stand-in, not the demo.
Prints the peak sum, when it happened and the processes at that moment. Binder gives ~2 GB; the
budget for the tour is 1.5 GB.

    python bench/bench_tour_memory.py [--notebook notebooks/00_tour.ipynb] [--interval 0.2]
"""
from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

import nbformat
import psutil
from nbclient import NotebookClient

MARKERS = ("ipyparallel", "interactive_parallel", "ipykernel", "ipengine", "ipcontroller")


def demo_processes(me: psutil.Process, since: float) -> list[psutil.Process]:
    """The processes the notebook run owns: this script's descendants, plus re-parented strays."""
    procs = {p.pid: p for p in me.children(recursive=True)}
    for p in psutil.process_iter(["pid", "create_time", "cmdline"]):
        try:
            if p.pid in procs or p.pid == me.pid or (p.info["create_time"] or 0) < since:
                continue
            if any(m in " ".join(p.info["cmdline"] or ()) for m in MARKERS):
                procs[p.pid] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return list(procs.values())


def sample(procs: list[psutil.Process]) -> tuple[int, list[tuple[int, str, int]]]:
    total, rows = 0, []
    for p in procs:
        try:
            pss = p.memory_full_info().pss
            name = " ".join(p.cmdline()[:3])[-70:]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        total += pss
        rows.append((p.pid, name, pss))
    return total, rows


def main() -> None:
    root = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--notebook", default=str(root / "notebooks" / "00_tour.ipynb"))
    ap.add_argument("--interval", type=float, default=0.2)
    args = ap.parse_args()

    path = Path(args.notebook).resolve()
    nb = nbformat.read(path, as_version=4)
    me, t0 = psutil.Process(os.getpid()), time.time()
    peak: dict = {"total": 0, "rows": [], "at": 0.0}
    samples = []
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            total, rows = sample(demo_processes(me, t0))
            samples.append(total)
            if total > peak["total"]:
                peak.update(total=total, rows=rows, at=time.time() - t0)
            stop.wait(args.interval)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        stop.set()
        thread.join()
    wall = time.time() - t0
    print(f"{path.name}: {wall:.1f} s, {len(samples)} samples every {args.interval} s")
    print(f"peak PSS of kernel + pool: {peak['total'] / 2**20:.0f} MiB ({peak['total'] / 1e9:.2f} GB) "
          f"at {peak['at']:.1f} s")
    for pid, name, pss in sorted(peak["rows"], key=lambda r: -r[2]):
        print(f"  {pid:>7}  {pss / 2**20:7.1f} MiB  {name}")


if __name__ == "__main__":
    main()
