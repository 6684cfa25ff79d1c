"""Hosts on one machine: Linux network namespaces on one private subnet, each with its own
name, and an ipyparallel cluster across them (for the multi-host tests and workshop 09).

Owns making them and taking every trace of them away again. Host 0 holds a bridge with the
first address of the subnet; every other host is joined to it by a veth pair whose outer
end is created inside host 0 (nothing is added to the machine's own namespace: no
interface, no address, no route) and whose inner end is `eth0` with the host's address. A
process runs "on" a host through `ip netns exec` plus a UTS namespace of its own whose
host name is the host's (`ip netns exec` alone keeps the machine's name, and ranks are
grouped into hosts by name). `start_cluster` runs ipyparallel's own `ipcontroller` on host
0 (listening on its address only) and `ipengine` processes on the others; a client must
run on host 0 too (`Hosts.run(0, ...)`), as the machine's own namespace has no address on
that subnet. Every host resolves every host's name (an `/etc/netns/<namespace>/hosts` file,
which `ip netns exec` mounts over `/etc/hosts`), as a site's DNS would: Slurm node names,
torchrun's `--master_addr host1`. `close()` kills every process still inside the namespaces
(`ip netns pids`), then deletes them, which deletes their interfaces too, and their hosts
files. Needs root, `ip` (iproute2), `unshare` and `nsenter` (util-linux). Knows nothing of
torch, of sessions or of the site services run on the hosts (cluster/sites.py).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

SUBNET = "10.213.7"
NETNS_ETC = Path("/etc/netns")
IFACE = "eth0"
CLUSTER_ID = "netns"
STARTUP_S = 60.0


class Unavailable(RuntimeError):
    """Network namespaces cannot be made here (the reason is the message)."""


def why_unavailable() -> str | None:
    """None when this process can make namespaces, else why not."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces (run the suite as root, as CI does)"
    missing = [tool for tool in ("ip", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} on PATH (iproute2, util-linux)"
    return None


def _ip(*args: str, timeout: float = 10.0) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise Unavailable(f"`ip {' '.join(args)}` failed: {out.stderr.strip()}")
    return out.stdout


@dataclass
class Hosts:
    """`n` hosts (0 .. n-1); host i is namespace `names[i]`, host name `host{i}`, address `address(i)`."""

    n: int
    tag: str = field(default_factory=lambda: f"ipmh{os.getpid()}")
    names: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def hostname(self, i: int) -> str:
        return f"host{i}"

    def open(self) -> "Hosts":
        """Make the namespaces and the network; on any failure, undo what was made."""
        try:
            for i in range(self.n):
                name = f"{self.tag}h{i}"
                _ip("netns", "add", name)
                self.names.append(name)
                _ip("-n", name, "link", "set", "lo", "up")
            hub = self.names[0]
            _ip("-n", hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", hub, "addr", "add", f"{self.address(0)}/24", "dev", "br0")
            _ip("-n", hub, "link", "set", "br0", "up")
            self._write_hosts_files()
            for i in range(1, self.n):
                outer = f"v{i}"
                _ip("-n", self.names[i], "link", "add", IFACE, "type", "veth", "peer", "name", outer, "netns", hub)
                _ip("-n", hub, "link", "set", outer, "master", "br0")
                _ip("-n", hub, "link", "set", outer, "up")
                _ip("-n", self.names[i], "addr", "add", f"{self.address(i)}/24", "dev", IFACE)
                _ip("-n", self.names[i], "link", "set", IFACE, "up")
        except BaseException:
            self.close()
            raise
        return self

    def _write_hosts_files(self) -> None:
        lines = ["127.0.0.1 localhost"] + [f"{self.address(i)} {self.hostname(i)}" for i in range(self.n)]
        for name in self.names:
            (NETNS_ETC / name).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / name / "hosts").write_text("\n".join(lines) + "\n")

    def command(self, i: int, argv: list[str], *, machine_sys: bool = False) -> list[str]:
        """argv as run on host i: in its network namespace, under its host name.

        machine_sys: keep the machine's /sys (its cgroup mounts), which `ip netns exec` replaces
        by the namespace's own sysfs: a daemon that needs cgroups (slurmd) runs through nsenter,
        with the host's hosts file mounted in a mount namespace of its own."""
        set_name = f'hostname {self.hostname(i)} && exec "$@"'
        if machine_sys:
            hosts_file = NETNS_ETC / self.names[i] / "hosts"
            return ["nsenter", f"--net=/run/netns/{self.names[i]}", "unshare", "--uts", "--mount", "--", "sh", "-c",
                    f"mount --bind {hosts_file} /etc/hosts && {set_name}", "sh", *argv]
        return ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "--", "sh", "-c", set_name, "sh", *argv]

    def start(self, i: int, argv: list[str], *, env: dict | None = None, log: str | None = None,
              machine_sys: bool = False) -> subprocess.Popen:
        """Start argv on host i (each exec replaces the last, so the pid is argv's own)."""
        out = open(log, "ab") if log else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(self.command(i, argv, machine_sys=machine_sys), env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if log:
                out.close()
        self.procs.append(proc)
        return proc

    def run(self, i: int, argv: list[str], *, env: dict | None = None, log: str | None = None,
            timeout: float) -> int:
        """Run argv on host i to the end; its exit code (TimeoutExpired after `timeout` s: close()
        kills it)."""
        return self.start(i, argv, env=env, log=log).wait(timeout=timeout)

    def pids(self) -> list[int]:
        """Every process inside the namespaces now."""
        out = []
        for name in self.names:
            try:
                out += [int(p) for p in _ip("netns", "pids", name).split()]
            except Unavailable:
                pass
        return out

    def close(self, grace: float = 5.0) -> None:
        """Kill every process started here or still inside the namespaces, delete the namespaces."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in set(self.pids()) | {p.pid for p in self.procs if p.poll() is None}:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and (self.pids() or any(p.poll() is None for p in self.procs)):
                time.sleep(0.1)
        for p in self.procs:
            try:
                p.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        for name in reversed(self.names):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
        self.names = []

    def __enter__(self) -> "Hosts":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


def leftovers(tag: str) -> list[str]:
    """Namespaces (and so their interfaces) whose name starts with `tag` that still exist, and
    their hosts files."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    files = [str(p) for p in NETNS_ETC.glob(f"{tag}*")] if NETNS_ETC.exists() else []
    return [line.split()[0] for line in out.splitlines() if line.startswith(tag)] + files


def start_cluster(hosts: Hosts, ranks_per_host: dict[int, int], workdir: str | Path,
                  env: Callable[[int], dict] | None = None) -> Path:
    """`ipcontroller` on host 0, listening on its address only, and `ranks_per_host[i]`
    `ipengine` processes on host i, forked from one zygote per host; returns the profile directory to attach to (cluster id
    CLUSTER_ID). `env(host)`: the environment of that host's processes (default: ours, one
    intra-op thread). Logs go to `workdir`."""
    workdir = Path(workdir)
    env = env or (lambda _host: dict(os.environ, OMP_NUM_THREADS="1"))
    bin_dir = Path(sys.executable).parent
    profile = workdir / "profile"
    hosts.start(0, [str(bin_dir / "ipcontroller"), f"--profile-dir={profile}", f"--cluster-id={CLUSTER_ID}",
                    f"--ip={hosts.address(0)}", "--HeartMonitor.period=500", "--log-level=WARN"],
                env=env(0), log=str(workdir / "controller.log"))
    engine_file = profile / "security" / f"ipcontroller-{CLUSTER_ID}-engine.json"
    deadline = time.monotonic() + STARTUP_S
    while not engine_file.exists():  # ipengine gives up on a missing file after a few seconds
        if time.monotonic() > deadline:
            log = workdir / "controller.log"
            raise TimeoutError(f"controller did not start in {STARTUP_S:g} s:\n"
                               + (log.read_text(errors="replace")[-2000:] if log.exists() else ""))
        time.sleep(0.2)
    for host, n in ranks_per_host.items():
        # A host's engines forked from one process that imported torch (cluster/zygote.py), as a
        # local pool's are: they share its pages instead of n imports of their own.
        hosts.start(host, [sys.executable, "-m", "interactive_parallel.cluster.zygote", str(n), str(profile),
                           str(engine_file)], env=env(host), log=str(workdir / f"engines-host{host}.log"))
    return profile
