"""Sessions on clusters started the way sites start them: ipyparallel's own Slurm, MPI and SSH
launchers, for real, on hosts in network namespaces (cluster/netns.py) running a real Slurm
(munge, slurmctld, one slurmd per node), sshd and Open MPI's mpiexec (cluster/sites.py).

Each launcher: `ipcluster start --engines=<launcher>` on the login host, a Session attached to it
trains dp2 x tp2 at parity with one process and generates (tests/multihost_driver.py, the
checks of tests/test_multihost.py), and stopping leaves no job queued and no process behind.
Slurm also: the ranks' hosts are the job's nodes, torch's ranks follow SLURM_PROCID, and the
exported script runs under `srun torchrun` across the two nodes and resumes the session's
state. MPI: torch's ranks are the MPI ranks. `Session.start(launcher=...)`: a Slurm job that
cannot be scheduled and an SSH host that cannot reach the controller are named with the reason
as soon as the launcher can tell (not at the launch timeout), a host with another torch build is refused naming it, and each leaves
nothing running. Needs root and the site's packages (skips naming what is missing).
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from interactive_parallel.cluster import netns, sites
from test_multihost import BIN, CLUSTER_ID, HERE, _env, _tail, check_session, make_hosts, run_driver  # noqa: F401

pytestmark = [pytest.mark.launchers, pytest.mark.timeout(600)]
START_S = 120.0
FAULT_S = 45.0  # the launch timeout of the fault cases (the launch included): each names its cause, not the timeout
SSH_POLL_S = 10  # ipyparallel's SSH engines are waited on in remote waits this long: stop waits one out


def needs(kind: str) -> None:
    reason = netns.why_unavailable()
    missing = sites.missing_tools(kind)
    if kind == "mpi":
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            missing.append("mpi4py (pip)")
    if reason or missing:
        pytest.skip(reason or f"needs {', '.join(missing)} (Debian: slurm-wlm munge openmpi-bin openssh-server)")


def ipcluster(hosts: netns.Hosts, launcher: str, profile: Path, config: str, tmp: Path, env: dict):
    """`ipcluster start -n 4 --engines=<launcher>` on host 0, its launcher configured by a file
    as a user's ipcluster_config.py would; returns the process."""
    cfg = tmp / "launcher_config.py"
    cfg.write_text("c = get_config()  # noqa\n" + config)
    proc = hosts.start(0, [str(BIN / "ipcluster"), "start", "-n", "4", f"--engines={launcher}",
                           f"--profile-dir={profile}", f"--cluster-id={CLUSTER_ID}", f"--ip={hosts.address(0)}",
                           f"--config={cfg}", "--IPController.log_level=WARN"], env=env,
                       log=str(tmp / "ipcluster.log"))
    # a client attaches once the controller has written its connection file, as a user waits
    # for ipcluster's "Starting ... engines" before attaching
    client_file = profile / "security" / f"ipcontroller-{CLUSTER_ID}-client.json"
    deadline = time.monotonic() + 60
    while not client_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, _tail(tmp / "ipcluster.log")
        time.sleep(0.2)
    return proc


def stop_ipcluster(proc, tmp: Path) -> None:
    """Ctrl-C to the foreground `ipcluster start`, as in its terminal: it stops its engines
    (scancel, mpiexec, the SSH engines) and the controller, and exits. (`ipcluster stop` from a
    second process would stop them too, then wait to fetch each SSH engine's log again.)"""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        raise AssertionError("ipcluster did not stop in 90 s:\n" + _tail(tmp / "ipcluster.log")) from None


def attach_and_check(hosts, profile, tmp, layout, *extra) -> dict:
    try:
        result = run_driver(hosts, profile, 4, tmp, *extra)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nipcluster:\n{_tail(tmp / 'ipcluster.log')}") from None
    check_session(result, hosts, layout)
    return result


@pytest.fixture
def slurm(make_hosts, tmp_path):
    """The login node (host 0) and two Slurm compute nodes: (hosts, the site, Slurm's environment)."""
    needs("slurm")
    hosts = make_hosts(3)
    site = sites.SlurmSite(hosts, tmp_path / "slurm", nodes=[1, 2]).open()
    try:
        yield hosts, site, dict(_env(), SLURM_CONF=str(site.conf))
    finally:
        site.close()


def test_slurm_ipcluster_attach_train_export_and_nothing_queued(slurm, tmp_path):
    hosts, site, env = slurm
    template = tmp_path / "engines.sbatch"
    template.write_text("#!/bin/sh\n#SBATCH --export=ALL\n#SBATCH --job-name=ipengine-{cluster_id}\n"
                        "#SBATCH --ntasks={n}\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n"
                        "#SBATCH --output={output_file}\nsrun {program_and_args}\n")
    profile = tmp_path / "profile"
    proc = ipcluster(hosts, "Slurm", profile, f"c.SlurmEngineSetLauncher.batch_template_file = {str(template)!r}\n"
                     f"c.SlurmEngineSetLauncher.batch_file_name = {str(tmp_path / 'engines.job')!r}\n",
                     tmp_path, env)
    script = tmp_path / "train_dp2_tp2.py"
    result = attach_and_check(hosts, profile, tmp_path, {1: 2, 2: 2}, "--export", str(script))
    # the ranks' hosts are the Slurm nodes; torch's ranks follow srun's SLURM_PROCID
    assert sorted({r["host"] for r in result["info"]}) == site.node_names
    assert [r["launcher_rank"] for r in result["info"]] == [0, 1, 2, 3], result["info"]
    stop_ipcluster(proc, tmp_path)
    assert site.drained() == []

    # the exported script under srun torchrun, across the two nodes, as a Slurm user types it
    line = (f"{BIN / 'torchrun'} --nnodes $SLURM_NNODES --node_rank $SLURM_NODEID --nproc_per_node 2 "
            "--master_addr $(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1) --master_port 29517 "
            f"{script}")
    code = hosts.run(0, ["srun", "--nodes=2", "--ntasks-per-node=1", "sh", "-c", line], env=env,
                     log=str(tmp_path / "srun.log"), timeout=240)
    log = _tail(tmp_path / "srun.log", 6000)
    assert code == 0, log
    losses = [float(m) for m in re.findall(r"step 3 loss ([0-9.]+)", log)]
    assert losses and abs(losses[0] - result["ref_next_loss"]) <= 1e-4, (losses, result["ref_next_loss"], log)
    assert site.drained() == []


def start_session(machines: netns.Hosts, tmp, env: dict, **kwargs) -> dict:
    """Session.start(**kwargs) by tests/launcher_driver.py on host 0: what it reported."""
    out, log = tmp / "start.json", tmp / "start.log"
    out.unlink(missing_ok=True)
    machines.run(0, [sys.executable, str(HERE / "launcher_driver.py"), str(out), json.dumps(kwargs)], env=env,
              log=str(log), timeout=START_S + 120)
    result = json.loads(out.read_text()) if out.exists() else {"traceback": _tail(log)}
    assert "traceback" not in result, result["traceback"] + "\n" + _tail(log)
    return result


def test_slurm_session_start_and_a_job_that_cannot_be_scheduled(slurm, tmp_path):
    hosts, site, env = slurm
    ok = start_session(hosts, tmp_path, env, launcher="slurm", ranks=2, nodes=2, controller_ip=hosts.address(0),
                       timeout=START_S)
    assert "error" not in ok, ok
    assert [r["host"] for r in ok["info"]] == site.node_names and all(d["all_reduce_ok"] for d in ok["doctor"])
    assert [r["launcher_rank"] for r in ok["info"]] == [0, 1], ok["info"]
    assert site.drained() == []
    # the batch script and the job's output stayed in the session's profile directory
    assert not list(Path.cwd().glob("slurm*")), list(Path.cwd().glob("slurm*"))

    bad = start_session(hosts, tmp_path, env, launcher="slurm", ranks=5, nodes=5, controller_ip=hosts.address(0),
                        timeout=FAULT_S)
    assert bad.get("error_type") == "LaunchError", bad
    # Slurm takes the job and keeps it pending for good: named at once, with the partition's size
    assert "cannot be scheduled" in bad["error"] and "PartitionConfig" in bad["error"], bad["error"]
    assert "5 nodes" in bad["error"] and "debug has 2" in bad["error"], bad["error"]
    assert site.drained() == []


def engine_env() -> dict:
    """What the engines need of the test's environment on a host reached over ssh or mpiexec."""
    env = _env()
    return {k: env[k] for k in ("PYTHONPATH", "OMP_NUM_THREADS", "HF_HUB_OFFLINE", "TRANSFORMERS_VERBOSITY",
                                "IP_TEST_CLOCK_SKEW_S")}


def engines_left(hosts: netns.Hosts, wait_s: float = 20.0) -> list[str]:
    """Command lines of engine processes still running on any host after up to `wait_s` s (an
    engine's nanny leaves a moment after its engine)."""
    import psutil

    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for pid in hosts.pids():
            try:
                cmd = " ".join(psutil.Process(pid).cmdline())
            except psutil.Error:
                continue
            if "ipyparallel.engine" in cmd or "ipengine" in cmd:
                left.append(cmd)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def train_on(hosts: netns.Hosts, launcher: str, config: str, tmp: Path) -> dict:
    """`ipcluster start --engines=<launcher>` (profile tmp/profile), a Session attached trains at
    parity (attach_and_check), Ctrl-C, and no engine is left on any host; the driver's report."""
    proc = ipcluster(hosts, launcher, tmp / "profile", config, tmp, _env())
    result = attach_and_check(hosts, tmp / "profile", tmp, {1: 2, 2: 2})
    stop_ipcluster(proc, tmp)
    assert engines_left(hosts) == []
    return result


def test_ssh_ipcluster_attach_train(make_hosts, tmp_path):
    needs("ssh")
    hosts = make_hosts(3)
    ssh = sites.SshSite(hosts, tmp_path / "ssh", on=[1, 2]).open()
    try:
        profile = tmp_path / "profile"
        # each host its own remote profile directory, as separate machines have (one shared
        # path would have scp copy the connection files onto themselves)
        engines = {hosts.hostname(i): {"n": 2, "remote_profile_dir": f"{profile}/remote-{hosts.hostname(i)}"}
                   for i in (1, 2)}
        config = "".join(f"c.SSHEngineSetLauncher.{k} = {v!r}\n" for k, v in {
            "engines": engines, "remote_python": sys.executable, "ssh_args": ssh.ssh_args, "scp_args": ssh.ssh_args,
            "environment": engine_env(), "poll_seconds": SSH_POLL_S}.items())
        train_on(hosts, "SSH", config, tmp_path)
    finally:
        ssh.close()


def test_mpi_ipcluster_attach_train_and_torch_ranks_are_the_mpi_ranks(make_hosts, tmp_path):
    needs("mpi")
    hosts = make_hosts(3)
    ssh = sites.SshSite(hosts, tmp_path / "ssh", on=[1, 2]).open()
    try:
        args = ["--host", f"{hosts.hostname(1)}:2,{hosts.hostname(2)}:2", "--mca", "plm_rsh_agent",
                " ".join(["ssh", *ssh.ssh_args]), "--allow-run-as-root",
                # MPI only launches and numbers the engines: its TCP transport would listen on
                # every interface (the check below refuses that), shared memory does not
                "--mca", "pml", "ob1", "--mca", "btl", "self,vader"]
        for name in ["IPP_CLUSTER_ID", "IPP_PROFILE_DIR", *engine_env()]:  # what Open MPI forwards
            args += ["-x", name]
        result = train_on(hosts, "MPI", f"c.MPILauncher.mpi_args = {args!r}\n", tmp_path)
        assert [r["launcher_rank"] for r in result["info"]] == [0, 1, 2, 3], result["info"]
    finally:
        ssh.close()


def test_ssh_session_start_names_an_unreachable_host_and_another_torch(make_hosts, tmp_path):
    needs("ssh")
    hosts = make_hosts(4)
    ssh = sites.SshSite(hosts, tmp_path / "ssh", on=[1, 2, 3]).open()
    try:
        # host 3 cannot reach the controller's address (a route that refuses it, as a firewall
        # would); the login host still reaches host 3 over ssh from a second address
        subprocess.run(["ip", "-n", hosts.names[0], "addr", "add", f"{netns.SUBNET}.254/24", "dev", "br0"], check=True)
        subprocess.run(["ip", "-n", hosts.names[3], "route", "add", "prohibit", f"{hosts.address(0)}/32"], check=True)
        ssh.config.write_text(f"Host {hosts.hostname(3)}\n    BindAddress {netns.SUBNET}.254\n" + ssh.config.read_text())
        names = [hosts.hostname(i) for i in (1, 2, 3)]
        bad = start_session(hosts, tmp_path, _env(), launcher="ssh", ranks=3, hosts={h: 1 for h in names},
                            ssh_args=ssh.ssh_args, environment=engine_env(), controller_ip=hosts.address(0),
                            timeout=FAULT_S)
        assert bad.get("error_type") == "LaunchError", bad
        assert f"host {names[2]}: 0 registered, cannot reach the controller at {hosts.address(0)}:" in bad["error"], bad
        # asked while the engines start, not diagnosed when the launch timed out
        assert "when the hosts were asked" in bad["error"] and "registered within" not in bad["error"], bad
        assert names[0] not in bad["error"], bad
        assert engines_left(hosts) == []

        # host 2's torch is another build (its metadata, first on its path, says 2.12.0)
        old = tmp_path / "oldtorch" / "torch-2.12.0.dist-info"
        old.mkdir(parents=True)
        (old / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.12.0\n")
        env2 = dict(engine_env(), PYTHONPATH=f"{old.parent}:{engine_env()['PYTHONPATH']}")
        engines = {h: {"n": 1, "remote_profile_dir": str(tmp_path / f"remote-{h}"),
                       **({"environment": env2} if h == names[1] else {})} for h in names[:2]}
        other = start_session(hosts, tmp_path, _env(), launcher="ssh", ranks=2, hosts={h: 1 for h in names[:2]},
                              ssh_args=ssh.ssh_args, environment=engine_env(), options={"engines": engines},
                              controller_ip=hosts.address(0), timeout=START_S)
        assert other.get("error_type") == "SessionError", other
        assert other["error"].startswith("torch differs across hosts: "), other
        assert f"{names[1]} has torch 2.12.0" in other["error"] and f"{names[0]} has torch 2." in other["error"], other
        assert engines_left(hosts) == []
    finally:
        ssh.close()
