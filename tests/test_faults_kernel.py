"""The kernel dies in the middle of `train`, `save` and `serve` (a client process SIGKILLed,
as a kernel restart or an out-of-memory kill ends it; 2 ranks, tiny-llama, dp2):
- the pool's engines and controller end after the kill, no port they listened on is left, and
  the session's temporary directories (the pool's profile, the ranks' scratch with its
  snapshots) are gone: waited for up to SETTLE_S = 30 s, a wait and not a bound (the seconds
  it took are a figure, below);
- a checkpoint interrupted mid-write (the ranks' DCP data files written, its metadata not) leaves
  the previous checkpoint at its name whole and loadable, and the partial one beside it under
  `<name>.partial-<token>`, where `atomic_dir.partials` finds it, `load` refuses it by name,
  and the next save of that name removes it.
The seconds from the kill until nothing was left land in artifacts/faults-kernel.md
(docs/faults.md quotes them); no assertion bounds them."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conftest import alive, live_session, until
from interactive_parallel import Plan
from interactive_parallel.cluster.checkpoints import MANIFEST, CheckpointError
from interactive_parallel.runtime.checkpoints import atomic_dir

pytestmark = pytest.mark.faults

SETTLE_S = 30.0
PLAN = dict(dp=2, batch_size=4, seq_len=16)
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
MEASURED: dict[str, float] = {}

KERNEL = textwrap.dedent("""
    import json, os, sys, time
    import psutil
    from interactive_parallel import Plan, Request, Session

    phase, ckpt = sys.argv[1], sys.argv[2]

    def say(**kw):
        print(json.dumps(kw), flush=True)

    def slow_finish():
        # the ranks' data files are written; the metadata (DCP writes it last) waits
        import time as _t
        from torch.distributed.checkpoint import FileSystemWriter
        real = FileSystemWriter.finish
        def finish(self, *a, **k):
            _t.sleep(60)
            return real(self, *a, **k)
        FileSystemWriter.finish = finish

    s = Session(ranks=2, collective_timeout=5)
    s.load_model("tiny-llama")
    s.apply(Plan(**%(plan)r))
    s.train(2, snapshot_every=1)  # the scratch directory exists, with a snapshot in it
    if phase == "save":
        s.save(ckpt)  # the previous checkpoint, complete
    pool = s.ranks.pool
    pids = pool.process_tree() + [pool._leash.pid] + s.model.scratch.pids()
    ports = sorted({c.laddr.port for c in psutil.net_connections(kind="inet")
                    if c.pid in pids and c.status == psutil.CONN_LISTEN})
    say(pids=pids, ports=ports, scratch=s.model.scratch.path, profile=pool.profile_dir)
    if phase == "train":
        s.train(100000, on_step=lambda recs: say(step=recs[0].step))
    elif phase == "serve":
        reqs = [Request(id=str(i), prompt=f"{i}+1=", arrival=0.05 * i, max_new_tokens=240) for i in range(64)]
        s.serve(reqs, engine="ours", on_token=lambda t: say(token=t.prompt))
    else:
        s.run(slow_finish)
        say(saving=True)
        s.save(ckpt)
    say(finished=True)
""") % {"plan": PLAN}


def _listening(ports: list[int]) -> list[int]:
    return sorted({c.laddr.port for c in psutil.net_connections(kind="inet")
                   if c.status == psutil.CONN_LISTEN and c.laddr.port in ports})


def _kill_kernel(tmp_path, phase: str, ready) -> tuple[dict, float, Path]:
    """Start the kernel, SIGKILL it once `ready(line)` says the phase is under way; its footprint,
    and seconds from the kill until none of its pool's processes or ports is left."""
    script, ckpt = tmp_path / "kernel.py", tmp_path / "ckpt"
    script.write_text(KERNEL)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "kernel.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, str(script), phase, str(ckpt)], stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env)
    footprint: dict = {}
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, f"the kernel ended before its {phase} was under way:\n{log.read_text()[-3000:]}"
            msg = json.loads(line)
            assert "finished" not in msg, f"{phase} finished before the kernel was killed"
            if "pids" in msg:
                footprint = msg
            elif ready(msg, ckpt):
                break
        else:
            raise AssertionError(f"{phase} never got under way")
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(10)
        pids, ports = footprint["pids"], footprint["ports"]
        while (any(alive(p) for p in pids) or _listening(ports)) and time.monotonic() - killed < SETTLE_S:
            time.sleep(0.02)
        gone_s = time.monotonic() - killed
        assert not [p for p in pids if alive(p)] and not _listening(ports), "the pool outlived its kernel"
        # the directories go after the processes (the watcher removes them last)
        while (os.path.exists(footprint["scratch"]) or os.path.exists(footprint["profile"])) and \
                time.monotonic() - killed < SETTLE_S:
            time.sleep(0.02)
        assert not os.path.exists(footprint["scratch"]) and not os.path.exists(footprint["profile"])
        return footprint, gone_s, ckpt
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _data_written(ckpt: Path) -> bool:
    """The interrupted save's ranks have written their data files (not its metadata)."""
    return any(len([f for f in os.listdir(p) if f.endswith(".distcp")]) >= 2 for p in atomic_dir.partials(str(ckpt)))


def _ready(phase: str):
    """When the kernel is to be killed: its phase under way (a few steps, tokens, data files)."""
    tokens = []
    if phase == "train":
        return lambda msg, _ckpt: msg.get("step", -1) >= 3
    if phase == "serve":
        return lambda msg, _ckpt: "token" in msg and (tokens.append(1) or len(tokens) >= 8)
    return lambda msg, ckpt: msg.get("saving") and until(lambda: _data_written(ckpt), 60)


@pytest.mark.parametrize("phase", ["train", "serve", "save"])
def test_kernel_death_mid_call_leaves_nothing(tmp_path, phase):
    footprint, gone_s, ckpt = _kill_kernel(tmp_path, phase, _ready(phase))
    MEASURED[phase] = gone_s
    _write_figures()
    assert footprint["ports"] and len(footprint["pids"]) >= 4
    if phase == "save":
        _check_interrupted_checkpoint(ckpt)


def _check_interrupted_checkpoint(ckpt: Path) -> None:
    """The previous checkpoint is whole and loads; the partial one is found, refused, then removed."""
    partial = atomic_dir.partials(str(ckpt))
    assert len(partial) == 1 and atomic_dir.is_partial(partial[0]), partial
    assert not os.path.exists(os.path.join(partial[0], ".metadata"))  # it never completed
    assert os.path.isfile(ckpt / ".metadata") and os.path.isfile(ckpt / MANIFEST)
    with live_session(2, collective_timeout=5.0) as s:
        s.load_model("tiny-llama")
        s.apply(Plan(**PLAN))
        s.load(str(ckpt))
        step = s.run(lambda: __import__("interactive_parallel.runtime.rank.state", fromlist=["get"]).get().step)
        assert step == [2, 2], step  # the two steps trained before the first save
        with pytest.raises(CheckpointError, match="interrupted save"):
            s.load(partial[0])
        s.save(str(ckpt))
        assert atomic_dir.partials(str(ckpt)) == []
        s.load(str(ckpt))


def _write_figures() -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    lines = ["| kernel killed during | s until engines, controller and ports are gone |", "|---|---|"]
    lines += [f"| {phase} | {s:.2f} |" for phase, s in MEASURED.items()]
    (ARTIFACTS / "faults-kernel.md").write_text("\n".join(lines) + "\n")
