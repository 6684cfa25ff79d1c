"""A site's services on the namespaced hosts of cluster/netns.py: a real Slurm cluster (munge,
slurmctld on one host, slurmd on the others) and sshd on every host, for the launcher tests and
workshop 09.

Owns writing their configuration (in a work directory of the caller's, nothing under /etc but
the hosts files netns writes; Slurm's and munge's sockets in a short temporary directory, as a
Unix socket's path may not pass 107 bytes and slurmd names one per job step), starting the daemons, waiting until they serve, and taking every
trace of them away again: jobs cancelled, daemons stopped, generated keys and files removed.
Slurm runs with what a one-machine site needs and no more: munge authentication on its own
socket and key, no cgroup task containment (proctrack/linuxproc, task/none), no accounting.
sshd listens on its host's address only, accepts one key made here, and hands every session
the host's name (it runs in the host's UTS namespace), as a real node would. Knows nothing of
ipyparallel, torch or sessions: cluster/launchers.py starts engines through these services.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

from .netns import Hosts

SLURM_TOOLS = ("slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel", "sinfo", "munged", "mungekey")
SSH_TOOLS = ("sshd", "ssh", "scp", "ssh-keygen")
MPI_TOOLS = ("mpiexec", "orted")
READY_S = 60.0
SOCKET_PATH_MAX = 107
"""Bytes in a Unix socket's path (sun_path holds 108 with its terminating zero)."""
STEP_SOCKET = "_4294967295.4294967291"
"""The longest tail slurmd adds to a node's name for a step's socket: _<job id>.<step id>."""


def missing_tools(kind: str) -> list[str]:
    """The programs a site of `kind` ('slurm', 'ssh', 'mpi') needs that are not on PATH."""
    tools = {"slurm": SLURM_TOOLS, "ssh": SSH_TOOLS, "mpi": MPI_TOOLS + SSH_TOOLS}[kind]
    found = {t: shutil.which(t) or shutil.which(t, path="/usr/sbin:/usr/bin:/sbin") for t in tools}
    return [t for t, path in found.items() if path is None]


def _run(argv: list[str], *, env: dict | None = None, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)


def _stop(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGTERM the daemons still running, then SIGKILL any that outlive `grace`."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            p.kill()


@dataclass
class SlurmSite:
    """Slurm across `hosts`: slurmctld on host `controller`, one slurmd per host in `nodes`
    (node name = the host's name, NodeAddr = its address), one partition 'debug' of them all."""

    hosts: Hosts
    workdir: Path
    nodes: list[int]
    controller: int = 0
    cpus: int = 2
    procs: list[subprocess.Popen] = field(default_factory=list)
    sockets: Path | None = None
    """Where munge's socket and slurmd's spool (a socket per job step) live: made short by open()."""

    @property
    def conf(self) -> Path:
        return self.workdir / "slurm.conf"

    @property
    def env(self) -> dict:
        """The environment a Slurm command (sbatch, srun, squeue) needs here: SLURM_CONF."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    @property
    def node_names(self) -> list[str]:
        return [self.hosts.hostname(i) for i in self.nodes]

    def _munge(self) -> list[str]:
        return [f"--socket={self.sockets / 'munge.socket'}", f"--key-file={self.workdir / 'munge.key'}",
                f"--pid-file={self.workdir / 'munged.pid'}", f"--log-file={self.workdir / 'munged.log'}",
                f"--seed-file={self.workdir / 'munged.seed'}"]

    def _write_conf(self) -> None:
        w, h = self.workdir, self.hosts
        nodes = "\n".join(f"NodeName={h.hostname(i)} NodeAddr={h.address(i)} CPUs={self.cpus} State=UNKNOWN"
                          for i in self.nodes)
        self.conf.write_text(textwrap.dedent(f"""\
            ClusterName=ipnetns
            SlurmctldHost={h.hostname(self.controller)}({h.address(self.controller)})
            SlurmUser=root
            SlurmdUser=root
            AuthType=auth/munge
            CredType=cred/munge
            AuthInfo=socket={self.sockets / 'munge.socket'}
            StateSaveLocation={w / 'state'}
            SlurmdSpoolDir={self.sockets}/spool-%n
            SlurmctldPidFile={w / 'slurmctld.pid'}
            SlurmdPidFile={w}/slurmd-%n.pid
            SlurmctldLogFile={w / 'slurmctld.log'}
            SlurmdLogFile={w}/slurmd-%n.log
            ProctrackType=proctrack/linuxproc
            TaskPlugin=task/none
            SelectType=select/cons_tres
            SelectTypeParameters=CR_CPU
            JobAcctGatherType=jobacct_gather/none
            AccountingStorageType=accounting_storage/none
            MpiDefault=none
            ReturnToService=2
            SlurmdParameters=config_overrides
            KillWait=5
            """) + nodes + f"\nPartitionName=debug Nodes={','.join(self.node_names)} Default=YES "
                           "MaxTime=INFINITE State=UP\n")

    def open(self) -> "SlurmSite":
        """Write the configuration, start munged, slurmctld and the slurmds; return once every
        node is idle (TimeoutError naming the nodes that are not, with the daemons' log tails)."""
        self.sockets = Path(tempfile.mkdtemp(prefix="ip-slurm-"))
        longest = max(len(f"{self.sockets}/spool-{n}/{n}{STEP_SOCKET}") for n in self.node_names)
        if longest > SOCKET_PATH_MAX:
            shutil.rmtree(self.sockets)
            raise ValueError(f"slurmd's step sockets under {self.sockets} would be {longest} bytes long, over "
                             f"a Unix socket's {SOCKET_PATH_MAX}: set TMPDIR to a shorter directory")
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "state").mkdir(exist_ok=True)
        for name in self.node_names:
            (self.sockets / f"spool-{name}").mkdir(exist_ok=True)
        try:
            key = self.workdir / "munge.key"
            _run(["mungekey", "--create", f"--keyfile={key}", "--force"]).check_returncode()
            key.chmod(0o600)
            _run(["munged", *self._munge(), "--force"]).check_returncode()
            self._write_conf()
            env = self.env
            self.procs.append(self.hosts.start(self.controller, ["slurmctld", "-D", "-f", str(self.conf)], env=env,
                                               log=str(self.workdir / "slurmctld.out")))
            for i in self.nodes:  # slurmd needs the machine's cgroup mounts, which `ip netns exec` hides
                self.procs.append(self.hosts.start(i, ["slurmd", "-D", "-N", self.hosts.hostname(i), "-f",
                                                       str(self.conf)], env=env, machine_sys=True,
                                                   log=str(self.workdir / f"slurmd-{self.hosts.hostname(i)}.out")))
            self._wait_idle()
        except BaseException:
            self.close()
            raise
        return self

    def command(self, argv: list[str]) -> list[str]:
        """A Slurm client command as typed on the controller's host (the login node)."""
        return self.hosts.command(self.controller, argv)

    def states(self) -> dict[str, str]:
        out = _run(self.command(["sinfo", "-h", "-N", "-o", "%N %t"]), env=self.env, timeout=15)
        return dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + READY_S
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.states()
            if all(states.get(n, "").startswith("idle") for n in self.node_names):
                return
            time.sleep(0.5)
        logs = "\n".join(f"{p.name}: {p.read_text(errors='replace')[-600:]}" for p in sorted(self.workdir.glob("*.out")))
        raise TimeoutError(f"Slurm nodes not idle after {READY_S:g} s: {states}\n{logs}")

    def jobs(self) -> list[str]:
        """Every job the controller still knows as pending or running ('id state reason')."""
        out = _run(self.command(["squeue", "-h", "-o", "%i %T %r"]), env=self.env, timeout=15)
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]

    def drained(self, wait_s: float = 30.0) -> list[str]:
        """The jobs still listed after up to `wait_s` s (a cancelled job completes its steps first)."""
        deadline = time.monotonic() + wait_s
        while (left := self.jobs()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left

    def close(self) -> None:
        """Cancel every job, stop the daemons (their processes die with the namespaces too) and
        munged, remove every file written here."""
        if self.conf.exists() and any(p.poll() is None for p in self.procs):
            _run(self.command(["scancel", "--full", "--user=root"]), env=self.env, timeout=15)
        _stop(self.procs)
        if (self.workdir / "munged.pid").exists():
            _run(["munged", f"--socket={self.sockets / 'munge.socket'}", "--stop"], timeout=15)
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self.sockets is not None:
            shutil.rmtree(self.sockets, ignore_errors=True)


@dataclass
class SshSite:
    """sshd on each host in `on` (its address, port 22), accepting one key made here; `config`
    is the ssh client configuration that reaches them (ssh -F config, scp -F config)."""

    hosts: Hosts
    workdir: Path
    on: list[int]
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def config(self) -> Path:
        return self.workdir / "ssh_config"

    @property
    def ssh_args(self) -> list[str]:
        return ["-F", str(self.config)]

    def open(self) -> "SshSite":
        self.workdir.mkdir(parents=True, exist_ok=True)
        w = self.workdir
        try:
            for key in ("host_key", "client_key"):
                _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(w / key)]).check_returncode()
            shutil.copy(w / "client_key.pub", w / "authorized_keys")
            self.config.write_text(textwrap.dedent(f"""\
                Host *
                    IdentityFile {w / 'client_key'}
                    IdentitiesOnly yes
                    StrictHostKeyChecking no
                    UserKnownHostsFile /dev/null
                    BatchMode yes
                    LogLevel ERROR
                    ConnectTimeout 10
                """))
            Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
            for i in self.on:
                cfg = w / f"sshd_config-{self.hosts.hostname(i)}"
                cfg.write_text(textwrap.dedent(f"""\
                    ListenAddress {self.hosts.address(i)}
                    HostKey {w / 'host_key'}
                    AuthorizedKeysFile {w / 'authorized_keys'}
                    PermitRootLogin prohibit-password
                    PasswordAuthentication no
                    KbdInteractiveAuthentication no
                    UsePAM no
                    StrictModes no
                    PidFile {w}/sshd-{self.hosts.hostname(i)}.pid
                    AcceptEnv *
                    Subsystem sftp internal-sftp
                    """))
                sshd = shutil.which("sshd") or "/usr/sbin/sshd"
                self.procs.append(self.hosts.start(i, [sshd, "-D", "-e", "-f", str(cfg)],
                                                   log=str(w / f"sshd-{self.hosts.hostname(i)}.log")))
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def ssh(self, i: int, command: str, *, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Run `command` on host i over ssh, from host 0 (as a launcher would)."""
        return _run(self.hosts.command(0, ["ssh", *self.ssh_args, self.hosts.address(i), command]), timeout=timeout)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        pending = list(self.on)
        while pending and time.monotonic() < deadline:
            pending = [i for i in pending if self.ssh(i, "hostname").stdout.strip() != self.hosts.hostname(i)]
            if pending:
                time.sleep(0.3)
        if pending:
            logs = "\n".join((self.workdir / f"sshd-{self.hosts.hostname(i)}.log").read_text(errors="replace")[-600:]
                             for i in pending)
            raise TimeoutError(f"sshd on hosts {pending} did not answer in {READY_S:g} s\n{logs}")

    def close(self) -> None:
        _stop(self.procs)
        shutil.rmtree(self.workdir, ignore_errors=True)
