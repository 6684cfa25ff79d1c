"""Two and three hosts on one machine: network namespaces joined on one subnet.

The ipyparallel controller runs on host 0 with `ipcontroller --ip=<host 0>` and the
engines on the other hosts with `ipengine` (interactive_parallel.cluster.netns) (2 ranks a host at most); the client
(tests/multihost_driver.py) attaches a Session on host 0 and trains dp2 x tp2 at parity
with one process, verifies, generates and exports. Checked here: ranks grouped by host,
the rendezvous on the interface that reaches the controller (or the one named), every
socket of every rank bound to its host's address and nowhere else, the clock offsets (one
host's clock is set 5 s ahead: its offset is measured at setup and its timeline corrected),
the exported script run by torchrun across two hosts, and nothing left behind (namespaces,
interfaces, processes), also on failure. Needs root (skips with the reason otherwise).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from interactive_parallel.cluster import netns

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(600)]

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
CLUSTER_ID = netns.CLUSTER_ID
DRIVER_S = 300.0
TORCHRUN_S = 240.0
SKEW_S = 5.0
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-4


def _links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    return sorted(line.split(":")[1].strip() for line in out.splitlines())


@pytest.fixture
def make_hosts():
    """make_hosts(n) -> opened netns.Hosts; all of them are torn down after the test, and
    checked to have left no namespace, interface or process behind."""
    reason = netns.why_unavailable()
    if reason:
        pytest.skip(reason)
    links_before = _links()
    made: list[netns.Hosts] = []

    def make(n: int) -> netns.Hosts:
        hosts = netns.Hosts(n)
        try:
            hosts.open()
        except netns.Unavailable as exc:
            pytest.skip(f"network namespaces cannot be made here: {exc}")
        made.append(hosts)
        return hosts

    try:
        yield make
    finally:
        seen: set[int] = set()
        for hosts in made:
            seen |= set(hosts.pids()) | {p.pid for p in hosts.procs}
            hosts.close()
        alive = [p for p in seen if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"processes left behind: {alive}"
        assert not [n for h in made for n in netns.leftovers(h.tag)], "namespaces left behind"
        assert _links() == links_before, "interfaces of this machine changed"


def _env(skew_s: float = 0.0) -> dict:
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if skew_s:
        paths.insert(0, str(HERE / "clock_skew"))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths + [str(HERE)]), OMP_NUM_THREADS="1",
                IP_TEST_CLOCK_SKEW_S=str(skew_s), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"


def start_cluster(hosts: netns.Hosts, ranks_per_host: dict[int, int], tmp: Path,
                  skew: dict[int, float] | None = None) -> Path:
    return netns.start_cluster(hosts, ranks_per_host, tmp, env=lambda host: _env((skew or {}).get(host, 0.0)))


def run_driver(hosts: netns.Hosts, profile: Path, ranks: int, tmp: Path, *extra: str) -> dict:
    out, log = tmp / "result.json", tmp / "driver.log"
    code = hosts.run(0, [sys.executable, str(HERE / "multihost_driver.py"), str(profile), CLUSTER_ID, str(ranks),
                         str(out), *extra], env=_env(), log=str(log), timeout=DRIVER_S)
    result = json.loads(out.read_text()) if out.exists() else {"error": _tail(log)}
    assert code == 0 and "error" not in result, result.get("error", "") + "\n" + _tail(log)
    return result


def check_session(result: dict, hosts: netns.Hosts, layout: dict[int, int]) -> None:
    """Ranks grouped by host, bound to their host's address, at parity with one process."""
    info = result["info"]
    names = [r["host"] for r in info]
    order = list(dict.fromkeys(names))  # hosts in the order their first engine registered
    assert names == [h for h in order for _ in range(names.count(h))], info  # a host's ranks are contiguous
    assert {h: names.count(h) for h in order} == {hosts.hostname(h): n for h, n in layout.items()}, info
    address = {hosts.hostname(h): hosts.address(h) for h in layout}
    assert all(r["address"] == address[r["host"]] and r["interface"] == netns.IFACE for r in info), info
    assert [r["local_rank"] for r in info] == [names[:i].count(h) for i, h in enumerate(names)], info
    for r, listen in zip(info, result["listening"]):
        # the store and gloo on the host's address; ipyparallel's own heartbeat monitor on
        # loopback; nothing on a wildcard or any other address
        ips = [s.rsplit(":", 1)[0] for s in listen]
        assert address[r["host"]] in ips and all(ip in (address[r["host"]], "127.0.0.1") for ip in ips), (r, listen)
    assert all(r["all_reduce_ok"] for r in result["doctor"]), result["doctor"]
    assert len(result["losses"]) == len(result["ref_losses"]) == 3
    assert max(abs(a - b) for a, b in zip(result["losses"], result["ref_losses"])) <= LOSS_TOL, result
    assert not result["weight_names_differ"] and result["weight_diff"] <= WEIGHT_TOL, result["weight_diff"]
    assert result["verify"]["ok"], result["verify"]
    assert result["generated"] == result["ref_generated"]


def test_two_hosts_train_generate_and_export(make_hosts, tmp_path):
    """Engines on hosts 1 and 2 (2 ranks each); the rendezvous found from the route to the controller."""
    hosts = make_hosts(3)
    layout = {1: 2, 2: 2}
    profile = start_cluster(hosts, layout, tmp_path)
    script = tmp_path / "train_dp2_tp2.py"
    result = run_driver(hosts, profile, 4, tmp_path, "--export", str(script))
    check_session(result, hosts, layout)
    assert all(abs(c["offset_s"]) <= max(0.05, c["rtt_s"]) for c in result["clocks"]), result["clocks"]

    # the exported script, across the same two hosts, by torchrun (its own rendezvous)
    text = script.read_text()
    assert "--nnodes 2" in text and "--nproc_per_node 2" in text
    port = "29517"
    runs = [hosts.start(h, [str(BIN / "torchrun"), "--nnodes", "2", "--node_rank", str(k), "--nproc_per_node", "2",
                            "--master_addr", hosts.address(1), "--master_port", port, str(script)],
                        env=_env(), log=str(tmp_path / f"torchrun-host{h}.log")) for k, h in enumerate(layout)]
    codes = [p.wait(timeout=TORCHRUN_S) for p in runs]
    logs = [_tail(tmp_path / f"torchrun-host{h}.log", 6000) for h in layout]
    assert codes == [0, 0], "\n".join(logs)
    # it resumes the weights, AdamW state and step the session saved beside it: its step 3 is the reference's
    losses = [float(m) for m in re.findall(r"step 3 loss ([0-9.]+)", logs[0])]
    assert losses and abs(losses[0] - result["ref_next_loss"]) <= 1e-4, (losses, result["ref_next_loss"])


def test_three_hosts_named_interface_and_a_clock_5s_ahead(make_hosts, tmp_path):
    """Hosts 1, 2, 3 with 2 + 1 + 1 ranks (a tensor-parallel pair spans hosts 2 and 3), the
    interface named by the user, and host 3's clock 5 s ahead."""
    hosts = make_hosts(4)
    layout = {1: 2, 2: 1, 3: 1}
    profile = start_cluster(hosts, layout, tmp_path, skew={3: SKEW_S})
    result = run_driver(hosts, profile, 4, tmp_path, "--interface", netns.IFACE)
    check_session(result, hosts, layout)

    skewed = [r["rank"] for r in result["info"] if r["host"] == hosts.hostname(3)]
    offsets = {c["rank"]: c["offset_s"] for c in result["clocks"]}
    assert len(skewed) == 1 and abs(offsets[skewed[0]] - SKEW_S) <= 0.25, offsets
    assert all(abs(v) <= 0.25 for r, v in offsets.items() if r not in skewed), offsets
    # every rank ends the step's last collective at about the same moment: on the client's
    # clock the ends line up; on the ranks' own clocks host 3's are 5 s late
    ends = {int(r): span[1] for r, span in result["timeline"].items()}
    raw = {int(r): span[1] for r, span in result["timeline_raw"].items()}
    assert max(ends.values()) - min(ends.values()) <= 1.0, ends
    assert raw[skewed[0]] - max(v for r, v in raw.items() if r not in skewed) >= SKEW_S - 1.0, raw
