"""Rank pools: a local ipyparallel cluster this process starts and owns, or one attached to.

Owns starting the controller and engines (a fast heartbeat, so engines are reported soon
after they start), the leash process that stops them if this process dies, and a stop
that leaves no process, port or connection file behind. A local pool is this user's
alone: its controller listens on 127.0.0.1 only, its profile directory (connection files,
logs) is readable by its owner only, and ipyparallel's HMAC message signing stays on (the
key lives in those files). An attached pool (started by
`ipcluster` with its SSH / MPI / Slurm launchers) is never stopped by us. Knows nothing
of torch or of ranks: it hands out engine ids.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings

# Controller heartbeat period: ipyparallel reports engines only after a heart-monitor
# beat (3000 ms by default), so a short period starts a pool several times sooner
# (bench/bench_session.py) and also detects dead engines sooner.
HEARTBEAT_MS = 200
LAUNCHES = ("fork", "warm", "plain")
SHUTDOWN_GRACE_S = 3.0


class Pool:
    """What a Session needs from a pool of engines."""

    client = None
    owned = False
    wanted: int | None = None
    """How many of the pool's engines the session takes as ranks (None: all of them)."""

    @property
    def engine_ids(self) -> list[int]:
        return sorted(self.client.ids)

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def pids(self) -> list[int]:
        return []

    def controller_pid(self) -> int | None:
        """The controller's process, when it is ours (None: someone else's cluster)."""
        return None


class AttachedPool(Pool):
    """An ipyparallel cluster started elsewhere; we connect and disconnect, never stop it."""

    def __init__(self, *, cluster_id: str = "", profile: str | None = None, profile_dir: str | None = None,
                 url_file: str | None = None, ranks: int | None = None, timeout: float = 60.0):
        import ipyparallel as ipp

        kwargs: dict = {"cluster_id": cluster_id}
        if url_file:
            kwargs = {"url_file": url_file}
        elif profile_dir:
            kwargs["profile_dir"] = profile_dir
        elif profile:
            kwargs["profile"] = profile
        self.client = ipp.Client(**kwargs, timeout=timeout)
        if ranks:
            self.client.wait_for_engines(ranks, timeout=timeout)
            # A cluster with more engines than asked for gives the first `ranks` (by engine id);
            # the rest stay idle.
            self.wanted = ranks
        self.description = f"attached to cluster {cluster_id or url_file or '(default)'}" + (
            f" profile {profile or profile_dir}" if profile or profile_dir else "")


class LocalPool(Pool):
    """N engines on this machine, owned by this process.

    Logs at ERROR by default: ipyparallel warns with each engine's whole log when an engine
    set stops with a non-zero code, which engines torn down with torch loaded often do;
    stop() checks for itself that every process is gone.
    """

    owned = True

    def __init__(self, n: int, *, timeout: float = 60.0, log_level: int = logging.ERROR, launch: str | None = None):
        """launch: 'fork' (engines forked from one process that imported torch: Linux, the
        default there), 'warm' (ipyparallel's launcher, torch imported in a thread as each
        engine starts) or 'plain' (ipyparallel's launcher as it is)."""
        import ipyparallel as ipp

        self.n = n
        self.launch = launch or ("fork" if sys.platform.startswith("linux") else "warm")
        if self.launch not in LAUNCHES:
            raise ValueError(f"launch {self.launch!r} is not 'fork', 'warm' or 'plain'")
        self.profile_dir = tempfile.mkdtemp(prefix="ip-pool-")
        self._state_file = os.path.join(self.profile_dir, "leash.json")
        self._leash: subprocess.Popen | None = None
        self._zygotes: list[subprocess.Popen] = []
        self.cluster = ipp.Cluster(
            n=n, profile_dir=self.profile_dir, controller_ip="127.0.0.1", log_level=log_level,
            controller_args=[f"--HeartMonitor.period={HEARTBEAT_MS}", "--usethreads"], engine_timeout=int(timeout),
            delay=0.1, shutdown_atexit=True)
        if self.launch == "warm":
            self._warm_engines()
        self.description = f"local pool of {n} engines (cluster {self.cluster.cluster_id})"
        self._start_leash()
        try:
            if self.launch == "fork":
                self._fork_engines(n)  # first: its imports overlap the controller's start
                self.cluster.start_controller_sync()
                self.client = self.cluster.connect_client_sync()
            else:
                self.client = self.cluster.start_and_connect_sync()
            self._wait_for(n, timeout)
            _owner_only(os.path.join(self.profile_dir, "security"))
        except BaseException:
            self.stop()
            raise
        self._write_state()

    def _fork_engines(self, n: int) -> None:
        """n engines forked from the standing zygote template (replacements: no import), or
        from a new zygote, which imports torch while the controller starts, then waits for
        the controller's engine connection file and forks. The first zygote's template stays
        (cluster/zygote.py) to fork replacements, where the memory limit leaves room for it."""
        from .zygote import keeps_template

        if self._zygotes and self._ask_template(n):
            return
        path = os.path.join(self.profile_dir, "security", f"ipcontroller-{self.cluster.cluster_id}-engine.json")
        log = open(os.path.join(self.profile_dir, f"zygote-{len(self._zygotes)}.log"), "ab")
        spare = [] if self._zygotes or not keeps_template() else [self._requests]  # the template stays
        if spare:
            os.mkfifo(self._requests, 0o600)
        self._zygotes.append(subprocess.Popen(
            [sys.executable, "-m", "interactive_parallel.cluster.zygote", str(n), self.profile_dir, path, *spare],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()

    @property
    def _requests(self) -> str:
        return os.path.join(self.profile_dir, "zygote-requests")

    def _template_pid(self) -> int | None:
        try:
            with open(self._requests + ".pid") as f:
                return int(f.read())
        except (OSError, ValueError):
            return None

    def _ask_template(self, n: int) -> bool:
        """Have the standing template fork n engines; False when it is not there to ask."""
        try:
            fd = os.open(self._requests, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: nobody reads it
        except OSError:
            return False
        try:
            os.write(fd, f"{n}\n".encode())
        finally:
            os.close(fd)
        return True

    def _wait_for(self, total: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client.wait_for_engines(total, timeout=min(1.0, max(0.0, deadline - time.monotonic())),
                                             interactive=False)
                return
            except TimeoutError as exc:
                if self._fork_refused():
                    self._launch_instead(total)
                    deadline = time.monotonic() + timeout
                elif time.monotonic() >= deadline:
                    raise TimeoutError(f"{len(self.client.ids)} of {total} engines registered in {timeout:g} s"
                                       + self._log_tail()) from exc

    def _fork_refused(self) -> bool:
        """The zygote found CUDA initialised by its imports and forked nothing (cluster/zygote.py)."""
        from .zygote import CUDA_TOUCHED

        return (self.launch == "fork" and len(self._zygotes) == 1
                and self._zygotes[0].poll() == CUDA_TOUCHED)

    def _launch_instead(self, n: int) -> None:
        """Engines started by ipyparallel's launcher, each importing torch itself ('warm'):
        slower to start and no pages shared, but CUDA is theirs to initialise."""
        warnings.warn("the engines cannot be forked from one process here (importing torch initialised CUDA "
                      "before the fork); starting each engine on its own instead" + self._log_tail())
        self.launch = "warm"
        self._warm_engines()
        self.cluster.start_engines_sync(n=n)

    def _warm_engines(self) -> None:
        self.cluster.config.LocalEngineSetLauncher.engine_cmd = [
            sys.executable, "-m", "interactive_parallel.cluster.engine"]

    def _log_tail(self) -> str:
        logs = sorted(f for f in os.listdir(self.profile_dir) if f.startswith("zygote"))
        if not logs:
            return ""
        with open(os.path.join(self.profile_dir, logs[-1]), errors="replace") as f:
            return f"; engine log:\n{f.read()[-2000:]}"

    def pids(self) -> list[int]:
        """Pids of the controller and engines (each leads its own process group)."""
        out = []
        launchers = [self.cluster.controller] if self.cluster.controller else []
        for es in self.cluster.engines.values():
            launchers += list(getattr(es, "launchers", {}).values()) or [es]
        for launcher in launchers:
            pid = getattr(launcher, "pid", None)
            if pid:
                out.append(int(pid))
        return out + [z.pid for z in self._zygotes]

    def controller_pid(self) -> int | None:
        controller = self.cluster.controller if getattr(self, "cluster", None) else None
        pid = getattr(controller, "pid", None)
        return int(pid) if pid else None

    def engine_pids(self) -> list[int]:
        import psutil

        out = []
        for es in self.cluster.engines.values():
            out += [int(l.pid) for l in getattr(es, "launchers", {}).values() if getattr(l, "pid", None)]
        template = self._template_pid()
        for z in self._zygotes:
            try:
                out += [c.pid for c in psutil.Process(z.pid).children(recursive=True) if c.pid != template]
            except psutil.NoSuchProcess:
                pass
        return out

    def process_tree(self) -> list[int]:
        """Every process of the pool: controller, schedulers, engines and their nannies
        (a nanny runs in a session of its own, so signalling process groups misses it)."""
        import psutil

        out = []
        for pid in self.pids():
            try:
                proc = psutil.Process(pid)
                out += [pid] + [c.pid for c in proc.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        return out

    def _write_state(self) -> None:
        from . import reaper

        reaper.write_state(self._state_file, {"groups": reaper.stamped(self.pids()),
                                              "procs": reaper.stamped(self.process_tree()),
                                              "paths": [self.profile_dir]})

    def _start_leash(self) -> None:
        from . import reaper

        with open(self._state_file, "w") as f:
            json.dump({"groups": [], "paths": [self.profile_dir]}, f)
        self._leash = reaper.start(self._state_file)

    def add_engines(self, n: int, timeout: float = 60.0) -> list[int]:
        """Start n more engines; their ids, once registered. Counted as new ids, not as a total:
        a dead engine the controller has not dropped yet may leave the count while we wait."""
        before = set(self.client.ids)
        if self.launch == "fork":
            self._fork_engines(n)
        else:
            self.cluster.start_engines_sync(n=n)
        deadline = time.monotonic() + timeout
        while len(set(self.client.ids) - before) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(set(self.client.ids) - before)} of {n} new engines registered in "
                                   f"{timeout:g} s" + self._log_tail())
            time.sleep(0.02)
        self._write_state()
        return sorted(set(self.client.ids) - before)

    def stop(self) -> None:
        pids = self.pids() if getattr(self, "cluster", None) else []
        tree = self.process_tree() if pids else []
        if self.client is not None:
            try:
                # Ask the engines to exit cleanly first (a signalled engine exits non-zero and
                # ipyparallel dumps its log into the notebook), but never wait on an engine
                # that is dead or stuck in a collective: the signals below finish the job.
                self.client.shutdown(targets="all", block=False)
                _wait_gone(self.engine_pids(), SHUTDOWN_GRACE_S)
            except Exception:  # noqa: BLE001
                pass
        super().stop()
        if getattr(self, "cluster", None) is not None:
            try:
                self.cluster.stop_cluster_sync()
            except Exception:  # noqa: BLE001 - fall through to the signals below
                pass
        _kill_groups(pids, tree)
        for z in self._zygotes:
            try:
                z.wait(5)
            except subprocess.TimeoutExpired:
                z.kill()
        self._zygotes = []
        if self._leash is not None:
            try:
                os.remove(self._state_file)
            except OSError:
                pass
            self._leash.terminate()
            try:
                self._leash.wait(5)
            except subprocess.TimeoutExpired:
                self._leash.kill()
            self._leash = None
        shutil.rmtree(self.profile_dir, ignore_errors=True)


def _owner_only(folder: str) -> None:
    """Files in `folder` readable by their owner only. ipyparallel makes its connection files
    so but writes the cluster file with the default mode; rewriting an existing file keeps
    the mode, so once is enough. (The profile directory, mkdtemp's, is owner-only anyway.)"""
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o600)


def _wait_gone(pids: list[int], timeout: float) -> None:
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=timeout)


def process_gone(pid: int) -> bool:
    """The process has ended (or is a zombie nobody reaped yet). Asked before every call, so it
    is one read of /proc/<pid>/stat where there is one (cheaper than psutil's process object)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:
        import psutil

        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] == b"Z"  # the state follows the command name


def _kill_groups(pids: list[int], tree: list[int], grace: float = 3.0) -> None:
    """Make sure every process we started is gone: the groups we led, and every
    descendant seen while the pool ran (some run in sessions of their own)."""
    def alive(pid: int) -> bool:
        return not process_gone(pid)

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig == signal.SIGKILL:
            for pid in tree:
                if alive(pid):
                    try:
                        os.kill(pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
        deadline = time.monotonic() + grace
        while any(alive(p) for p in tree or pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not any(alive(p) for p in tree or pids):
            return
