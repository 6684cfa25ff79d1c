"""Pools started through ipyparallel's own launchers for a site: Slurm (sbatch, then srun in the
job), MPI (mpiexec) and SSH, as `Session.start(launcher=...)` asks for them.

Owns choosing and configuring ipyparallel's launcher classes (their own options passed through
under ipyparallel's names), waiting for the engines while watching what the launcher can tell
(a Slurm job's state and pending reason, a launcher process that exited), naming the host and
the reason when engines do not come (which hosts registered none, whether such a host can reach
the controller at all: asked of every SSH host as soon as its engines are launched), and a stop
that leaves no job queued and no process behind. The ranks' side of a multi-host run
(rendezvous, interfaces, same torch) is cluster/rendezvous.py's; this module knows nothing of
torch or of ranks, only of engines and hosts.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .errors import SessionError
from .pool import HEARTBEAT_MS, Pool

LAUNCHERS = {"slurm": "Slurm", "mpi": "MPI", "ssh": "SSH"}
# Slurm job states after which no engine of the job will register.
SLURM_ENDED = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
               "COMPLETED", "PREEMPTED"}
# Pending reasons under which the job will never start as submitted (squeue's %r): the request
# exceeds what the partition is or allows.
SLURM_NEVER = {"PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints",
               "ReqNodeNotAvail", "InvalidAccount", "InvalidQOS", "AssocMaxNodesPerJobLimit"}
PROBE_S = 5.0
SSH_POLL_S = 10


class LaunchError(SessionError):
    """The launcher could not give the engines asked for; the message names the host or job and why."""


def slurm_template(nodes: int | None, per_node: int | None) -> str:
    """ipyparallel's Slurm engine script with the node layout a torchrun user would ask sbatch for."""
    lines = ["#!/bin/sh", "#SBATCH --export=ALL", "#SBATCH --job-name=ipengine-{cluster_id}", "#SBATCH --ntasks={n}",
             "#SBATCH --output={output_file}"]
    if nodes:
        lines.append(f"#SBATCH --nodes={nodes}")
    if per_node:
        lines.append(f"#SBATCH --ntasks-per-node={per_node}")
    return "\n".join(lines + ["srun {program_and_args}", ""])


class LaunchedPool(Pool):
    """An ipyparallel cluster this process starts with a site launcher and stops at the end.

    Its engines run on other hosts, so it is not `owned` in the local pool's sense (no local pid
    to watch, no engine added by forking); like an attached pool, a lost engine is picked up when
    the launcher brings it back, and stop() stops the whole cluster: the Slurm job cancelled and
    checked gone, mpiexec and the SSH engines killed, the profile directory removed when ours.
    """

    def __init__(self, launcher: str, n: int, *, controller_ip: str, hosts: dict[str, int] | None = None,
                 nodes: int | None = None, ssh_args: list[str] | None = None, options: dict | None = None,
                 environment: dict | None = None, profile_dir: str | None = None, timeout: float = 120.0,
                 log_level: int = logging.ERROR):
        import ipyparallel as ipp
        from traitlets.config import Config

        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher {launcher!r} is not one of {', '.join(LAUNCHERS)}")
        if launcher in ("ssh", "mpi") and hosts and sum(hosts.values()) < n:
            raise ValueError(f"hosts {hosts} offer {sum(hosts.values())} engines, fewer than ranks({n})")
        self.launcher, self.n, self.timeout, self.nodes = launcher, n, timeout, nodes
        self._deadline = time.monotonic() + timeout  # the launch itself counts (SSH starts engines one by one)
        self._stopped = False
        self.hosts = dict(hosts or {})
        self.ssh_args = list(ssh_args or [])
        self._own_dir = profile_dir is None
        self.profile_dir = profile_dir or tempfile.mkdtemp(prefix=f"ip-{launcher}-")
        config = Config()
        section = config[f"{LAUNCHERS[launcher]}EngineSetLauncher"]
        section.update(self._launcher_config(nodes, environment or {}))
        section.update(options or {})  # the user's own ipyparallel options win
        self.cluster = ipp.Cluster(
            n=n, profile_dir=self.profile_dir, controller_ip=controller_ip, engine_launcher_class=LAUNCHERS[launcher],
            controller_args=[f"--HeartMonitor.period={HEARTBEAT_MS}"], engine_timeout=int(timeout), config=config,
            log_level=log_level, shutdown_atexit=True)
        self.description = f"{launcher} pool of {n} engines (cluster {self.cluster.cluster_id})"
        try:
            self.cluster.start_controller_sync()
            self._start_engines()
            self.client = self.cluster.connect_client_sync()
            self._wait_for_engines()
        except BaseException:
            self.stop()
            raise

    # ---- configuration ---------------------------------------------------------------------------
    def _launcher_config(self, nodes: int | None, environment: dict) -> dict:
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **environment}
        if self.launcher == "slurm":
            per_node = self.n // nodes if nodes and self.n % nodes == 0 else None
            # the batch script and the job's output in the profile directory, not wherever
            # this process happens to run (a path here wins over ipyparallel's work_dir)
            return {"batch_template": slurm_template(nodes, per_node), "environment": env,
                    "batch_file_name": os.path.join(self.profile_dir, "slurm_engine.sbatch")}
        if self.launcher == "ssh":
            if not self.hosts:
                raise ValueError("launcher 'ssh' needs hosts={host: engines, ...}")
            # Each host its own remote profile directory: on a shared filesystem scp would copy
            # the connection files onto themselves and truncate them.
            engines = {h: {"n": k, "remote_profile_dir": f"{self.profile_dir}/remote-{h}"} for h, k in self.hosts.items()}
            # poll_seconds: each engine is waited on by a remote wait this long, which a stop
            # waits out (ipyparallel's default is 60 s)
            return {"engines": engines, "remote_python": sys.executable, "ssh_args": self.ssh_args,
                    "scp_args": self.ssh_args, "environment": env, "poll_seconds": SSH_POLL_S}
        if self.launcher == "mpi":
            args = ["--host", ",".join(f"{h}:{k}" for h, k in self.hosts.items())] if self.hosts else []
            # MPI only launches and numbers the ranks here (torch.distributed carries their
            # traffic): its TCP transport, which listens on every interface, stays off.
            args += ["--mca", "pml", "ob1", "--mca", "btl", "self,vader"]
            if self.ssh_args:
                args += ["--mca", "plm_rsh_agent", " ".join(["ssh", *self.ssh_args])]
            if os.geteuid() == 0:
                args.append("--allow-run-as-root")
            # Open MPI forwards to remote ranks only what -x names, and ipyparallel hands its
            # engines their profile and cluster through IPP_* variables, not arguments.
            for name in ["IPP_CLUSTER_ID", "IPP_PROFILE_DIR"] + sorted(
                    n for n in {*env, "PATH", "PYTHONPATH", "HF_HUB_OFFLINE", "TRANSFORMERS_VERBOSITY"}
                    if n in env or n in os.environ):
                args += ["-x", name]
            return {"mpi_args": args, "environment": env}
        raise ValueError(f"launcher {self.launcher!r} is not one of {', '.join(LAUNCHERS)}")

    def _start_engines(self) -> None:
        try:
            self.cluster.start_engines_sync()
        except subprocess.CalledProcessError as exc:
            said = (exc.output or b"").decode(errors="replace") if isinstance(exc.output, bytes) else (exc.output or "")
            raise LaunchError(f"{self.launcher}: `{' '.join(map(str, exc.cmd))}` refused the engines' job "
                              f"(exit {exc.returncode}): {said.strip() or '(no output)'}") from None

    # ---- waiting, and saying why not ---------------------------------------------------------------
    def _engine_set(self):
        return next(iter(self.cluster.engines.values()), None)

    def _wait_for_engines(self) -> None:
        reach_checked = False
        while len(self.client.ids) < self.n:
            problem = self._ended()
            if not problem and not reach_checked and self.launcher == "ssh" and self._controller_address():
                reach_checked = True
                problem = self._unreachable()
            if problem:
                raise LaunchError(problem)
            if time.monotonic() > self._deadline:
                raise LaunchError(self._diagnose())
            time.sleep(0.5)

    def _ended(self) -> str | None:
        """Why no more engines will come, when the launcher already says so."""
        es = self._engine_set()
        if es is None:
            return None
        if self.launcher == "slurm":
            state, reason, _ = self.slurm_job()
            if state in SLURM_ENDED or state == "":
                return (f"Slurm job {es.job_id} is {state or 'gone'} ({reason}) with {len(self.client.ids)} of {self.n} "
                        f"engines registered: {self._output(es)}")
            if state == "PENDING" and reason.split(",")[0].strip("()") in SLURM_NEVER:
                return (f"Slurm job {es.job_id} cannot be scheduled: PENDING ({reason}): it asks for "
                        f"{self.nodes or '?'} nodes and {self.n} tasks; {_partitions()}")
            return None
        stopped = [l for l in getattr(es, "launchers", {}).values() if getattr(l, "state", "") == "after"]
        if self.launcher == "mpi" and getattr(es, "state", "") == "after":
            return f"mpiexec exited with {len(self.client.ids)} of {self.n} engines registered: {self._output(es)}"
        if stopped:
            return "; ".join(f"the engine on {l.location} exited: {self._output(l)}" for l in stopped)
        return None

    def slurm_job(self) -> tuple[str, str, str]:
        """(state, reason, node list) of the engines' job as squeue reports it ('' once it is gone)."""
        es = self._engine_set()
        if es is None or not getattr(es, "job_id", ""):
            return "", "", ""
        lines, said = _squeue(str(es.job_id), "%T|%r|%N")
        fields = (lines or [""])[0].split("|")
        return (fields[0], fields[1], fields[2]) if len(fields) == 3 else ("", said, "")

    def _output(self, launcher) -> str:
        try:
            text = launcher.get_output(remove=False) or ""
        except Exception as exc:  # noqa: BLE001 - only a message is at stake
            text = f"(its output could not be read: {exc})"
        return text.strip()[-1500:] or "(no output)"

    def _registered_hosts(self) -> dict[str, int]:
        """Engines per host among those that did register (their names and addresses both count)."""
        if not self.client.ids:
            return {}
        names = self.client[:].apply_sync(_host_names)
        counts: dict[str, int] = {}
        for known in names:
            for name in known:
                counts[name] = counts.get(name, 0) + 1
        return counts

    def _diagnose(self) -> str:
        have = self._registered_hosts()
        head = f"{self.launcher}: {len(self.client.ids)} of {self.n} engines registered within {self.timeout:g} s"
        if self.launcher == "slurm":
            state, reason, nodes = self.slurm_job()
            if state == "PENDING":
                return f"{head}: Slurm job {self._engine_set().job_id} is still PENDING (reason: {reason})"
            expected = {h: 0 for h in _slurm_hostnames(nodes)}
        else:
            expected = dict(self.hosts)
        short = [h for h, k in expected.items() if have.get(h, 0) < max(k, 1)]
        if not short:
            return f"{head} (hosts with engines: {have or 'none'})"
        return f"{head}; " + "; ".join(f"host {h}: {have.get(h, 0)} registered, {self._reach(h)[1]}" for h in short)

    def _unreachable(self) -> str | None:
        """The SSH hosts that cannot open a connection to the controller, asked of every host at
        once while the engines start: their engines would never register, so they are named
        now rather than when the launch times out."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=len(self.hosts) or 1) as pool:
            said = dict(zip(self.hosts, pool.map(self._reach, self.hosts)))
        cut = [h for h, (ok, _) in said.items() if not ok]
        if not cut:
            return None
        return (f"{self.launcher}: {len(self.client.ids)} of {self.n} engines registered when the hosts were "
                "asked; " + "; ".join(f"host {h}: 0 registered, {said[h][1]}" for h in cut))

    def _reach(self, host: str) -> tuple[bool, str]:
        """Whether `host` can open a connection to the controller's registration port (over ssh):
        (False only when the probe itself failed to connect, what to say)."""
        addr = self._controller_address()
        if addr is None or not self.ssh_args and self.launcher != "ssh":
            return True, "its engine log may say why"
        code = f"import socket; socket.create_connection(({addr[0]!r}, {addr[1]}), {PROBE_S})"
        try:
            out = subprocess.run(["ssh", *self.ssh_args, host, sys.executable, "-c", json.dumps(code)],
                                 capture_output=True, text=True, timeout=PROBE_S + 20)
        except subprocess.TimeoutExpired:
            return True, f"ssh to it did not answer within {PROBE_S + 20:g} s; its engine log may say why"
        if out.returncode == 0:
            return True, f"reaches the controller at {addr[0]}:{addr[1]}; its engine log may say why"
        lines = out.stderr.strip().splitlines() or ["(no output)"]
        if out.returncode == 255:  # ssh's own failure (ssh exits 255), not the probe's
            return True, f"ssh to it failed ({lines[-1]}); its engine log may say why"
        return False, f"cannot reach the controller at {addr[0]}:{addr[1]}: {lines[-1]}"

    def _controller_address(self) -> tuple[str, int] | None:
        path = Path(self.profile_dir) / "security" / f"ipcontroller-{self.cluster.cluster_id}-engine.json"
        try:
            info = json.loads(path.read_text())
            return info["interface"].split("://")[-1], int(info["registration"])
        except (OSError, KeyError, ValueError):
            return None

    # ---- stopping --------------------------------------------------------------------------------
    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        super().stop()
        job = getattr(self._engine_set(), "job_id", "") if self.launcher == "slurm" else ""
        try:
            self.cluster.stop_cluster_sync()
        except Exception:  # noqa: BLE001 - stopping must not fail half-way; what is left is checked below
            pass
        if job:
            _cancel_until_gone(str(job))
        if self._own_dir:
            shutil.rmtree(self.profile_dir, ignore_errors=True)


def _host_names() -> list[str]:
    """On an engine: its host name and every IPv4 address it has (a host may be named either way)."""
    import socket

    from ..runtime.groups import net

    return [socket.gethostname(), *(a for addrs in net.ipv4_interfaces().values() for a in addrs)]


def _squeue(job: str, fmt: str) -> tuple[list[str], str]:
    """squeue's lines for one job in `fmt` (none once it is gone), and what it said on stderr."""
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", fmt], capture_output=True, text=True, timeout=15)
    return [line for line in out.stdout.splitlines() if line.strip()], out.stderr.strip()


def _partitions() -> str:
    """'partition debug has 2 nodes (idle)', per partition, as sinfo reports them."""
    out = subprocess.run(["sinfo", "-h", "-o", "%P %D %t"], capture_output=True, text=True, timeout=15)
    parts = [line.split() for line in out.stdout.splitlines() if len(line.split()) == 3]
    return "; ".join(f"partition {p.rstrip('*')} has {d} nodes ({t})" for p, d, t in parts) or "sinfo lists no partition"


def _slurm_hostnames(nodelist: str) -> list[str]:
    if not nodelist or nodelist.startswith("("):
        return []
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=15)
    return out.stdout.split()


def _cancel_until_gone(job: str, wait_s: float = 30.0) -> None:
    """scancel the job, then wait until squeue no longer lists it (its steps killed by slurmd)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not _squeue(job, "%T")[0]:
            return
        subprocess.run(["scancel", job], capture_output=True, timeout=15)
        time.sleep(0.5)
    raise LaunchError(f"Slurm job {job} still listed {wait_s:g} s after scancel")
