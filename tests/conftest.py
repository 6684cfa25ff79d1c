"""Shared fixtures (a live 4-rank session per module, leak checks for pools), the tiers, and how
the suite shares a machine's cores when asked to (`-n 4`; one process by default, since on 2
cores two workers took as long as one): pytest-xdist's workers each take whole units (a module,
or a group of modules that share a session fixture or the machine's network namespaces), the
costliest first, those that mostly wait beside those that compute; each worker keeps its
temporary files and session scratch in directories of its own."""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import time

import psutil
import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TIERS = ("pure", "rank1", "multirank", "session", "multihost", "launchers", "faults", "notebook", "browser")
FAST = (
    "tests/test_initialize.py::test_full_weights_given_in_process_are_cut_into_shards",
    "tests/test_session.py::test_dp_parity_with_single_process",
    "tests/test_notebooks.py::test_notebook_runs_without_errors[04_context_parallel]",
)
"""`-m fast`, the inner loop: every pure test and these, one of each layer that starts processes
(a spawned parity group, a live session, a notebook)."""


WAITING = ("faults", "launchers", "multihost")
"""Tiers whose time is mostly waiting (collective timeouts, pools dying and restarting, Slurm and
sshd): under xdist they are handed out between the computing tiers, so the workers are
rarely both idle."""
COMPUTING = ("notebook", "session", "multirank", "browser", "rank1", "pure")
"""The other tiers, costliest first, so the run ends on short units that even the workers out."""
UNITS = {
    "tests/test_activations.py": "parity_steps", "tests/test_dryrun.py": "parity_steps",
    "tests/test_local_mode.py": "parity_steps", "tests/test_parallel_parity.py": "parity_steps",
    "tests/test_comms_model.py": "parity_steps",
    "tests/test_launchers.py": "hosts", "tests/test_multihost.py": "hosts",
}
"""Modules that must run in one worker: one session fixture (parity_steps), or namespaced hosts
beside Slurm's daemons on fixed ports."""
APART = ("tests/test_notebooks.py",)
"""Modules whose tests share nothing (each notebook starts its own kernel and pool): each test is
a unit of its own, which evens the workers out."""


def _unit(item) -> str:
    module = item.nodeid.split("::")[0]
    return item.nodeid if module in APART else UNITS.get(module, module)


def _schedule(config, items, tier_of: dict) -> None:
    """Under xdist: mark each test with its unit (--dist loadgroup keeps a unit in one worker, so
    its module fixtures start once) and order the units, waiting and computing in turn."""
    units: dict[str, list] = {}
    for item in items:
        units.setdefault(_unit(item), []).append(item)
    by_tier = {t: [u for u, its in units.items() if tier_of[its[0].nodeid] == t] for t in TIERS}
    waiting = [u for t in WAITING for u in by_tier[t]]
    computing = [u for t in COMPUTING for u in by_tier[t]]
    order = []
    while waiting or computing:
        order += [lane.pop(0) for lane in (computing, waiting) if lane]
    items[:] = [item for unit in order for item in units[unit]]
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_unit(item)))


def pytest_configure(config):
    """An xdist worker's temporary files and session scratch go to directories of its own, so
    what one worker's tests count as left behind (tests/test_cycles.py) is theirs alone; and the
    torch it runs in-process (references, dry runs, notebook kernels) takes its share of the
    cores, not all of them: two workers each with as many OpenMP threads as cores spin against
    each other (runtime.groups.dist.threads_for; ranks set their own count)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // workers)))
        config._own_dirs = [tempfile.mkdtemp(prefix=f"ip-{worker}-"),
                            tempfile.mkdtemp(prefix=f"ip-{worker}-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)]
        os.environ["TMPDIR"], os.environ["IP_SCRATCH_BASE"] = config._own_dirs
        tempfile.tempdir = None  # gettempdir() reads TMPDIR again
        for path in config._own_dirs:  # at exit, after multiprocessing's own clean-up (atexit runs last first)
            atexit.register(shutil.rmtree, path, True)


@pytest.hookimpl(tryfirst=True)  # before xdist appends each test's group to its node id
def pytest_collection_modifyitems(config, items):
    """Every test belongs to exactly one tier (`-m pure` must run every pure test, and only
    tests that start no process): refuse one with none or with several (a module's mark and a
    test's own add up). Mark the inner loop's tests `fast` (FAST), and refuse a FAST entry that
    names no test, so the loop cannot shrink unseen."""
    tiers = {item.nodeid: [t for t in TIERS if item.get_closest_marker(t)] for item in items}
    wrong = [f"{node} ({', '.join(found) or 'none'})" for node, found in tiers.items() if len(found) != 1]
    if wrong:
        raise pytest.UsageError("tests without exactly one tier marker (" + ", ".join(TIERS) + "):\n  " +
                                "\n  ".join(wrong))
    fast = set(FAST)
    for item in items:
        if item.nodeid in fast or item.get_closest_marker("pure"):
            item.add_marker(pytest.mark.fast)
    whole = {item.nodeid.split("::")[0] for item in items}  # modules collected whole (no test named)
    whole -= {arg.split("::")[0] for arg in config.args if "::" in arg}
    stale = [n for n in FAST if n.split("::")[0] in whole and n not in tiers]
    if stale:
        raise pytest.UsageError("conftest.FAST names tests that do not exist: " + ", ".join(stale))
    if hasattr(config, "workerinput") and config.getvalue("loadgroup"):  # an xdist worker
        _schedule(config, items, {node: found[0] for node, found in tiers.items()})


_WORKER_RERUNS: list[str] = []
"""What the xdist workers' harnesses reran (pytest_testnodedown gathers it)."""


def _reruns() -> list[str]:
    import sys

    return getattr(sys.modules.get("mp_harness"), "RERUNS", [])


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand them to the controller
        session.config.workeroutput["reruns"] = list(_reruns())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _WORKER_RERUNS.extend(getattr(node, "workeroutput", {}).get("reruns", []))


def pytest_terminal_summary(terminalreporter):
    """How many spawned groups ran again after a native crash (tests/mp_harness.py), in this
    process or in any xdist worker: a green run with reruns is not a clean one, and says so."""
    reruns = _reruns() + _WORKER_RERUNS
    if reruns:
        terminalreporter.write_sep("=", f"{len(reruns)} spawned group(s) ran again after a native crash")
        for line in reruns:
            terminalreporter.write_line(line)


def pool_footprint(session) -> tuple[list[int], list[int]]:
    """(pids, listening ports) of everything a session's pool runs."""
    pids = session.ranks.pool.process_tree() + ([session.ranks.pool._leash.pid] if session.ranks.pool._leash else [])
    ports = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.pid in pids and conn.status == psutil.CONN_LISTEN:
            ports.append(conn.laddr.port)
    return pids, ports


def alive(pid: int) -> bool:
    """The process runs (a zombie has ended)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_gone(pids: list[int], ports: list[int], within: float = 10.0) -> None:
    """Every process in `pids` ended and none of `ports` listened on by one of them (or by a
    process we cannot see): on a shared machine another user's process may take a freed port."""
    deadline = time.monotonic() + within
    mine = set(pids)
    while True:
        running = [p for p in pids if alive(p)]
        listening = {c.laddr.port for c in psutil.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and (c.pid is None or c.pid in mine)}
        still = [p for p in ports if p in listening]
        if not running and not still:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left behind: processes {running}, listening ports {still}")
        time.sleep(0.2)


def until(condition, timeout: float) -> bool:
    """Poll `condition` until it holds or `timeout` seconds pass; whether it held."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@contextlib.contextmanager
def live_session(ranks: int, **options):
    """A local Session of `ranks` ranks; once stopped, checked to have left nothing running (its
    scratch directory of re-plans and snapshots, and that directory's leash, included)."""
    from interactive_parallel import Session

    s = Session(ranks=ranks, **options)
    pids, ports = pool_footprint(s)
    try:
        yield s
    finally:
        scratch = s.model.scratch.path if s.model.scratch.created else None
        leash = s.model.scratch.pids()
        if s.alive:  # and what it started since (replacement engines)
            later = pool_footprint(s)
            pids, ports = sorted(set(pids) | set(later[0])), sorted(set(ports) | set(later[1]))
        s.stop()
        assert_gone(pids + leash, ports)
        assert scratch is None or not os.path.exists(scratch), f"scratch directory {scratch} left behind"


@pytest.fixture(scope="session")
def _pool4():
    """One 4-rank session for every module that asks for `session4`: a pool started once (its
    ranks import torch and transformers once), checked at the end of the run to have left nothing."""
    with live_session(4) as s:
        yield s


@pytest.fixture(scope="module")
def session4(_pool4):
    """A 4-rank session as a module finds a new one: `Session.reset` before the module (every
    rank forgets its model, faults and probe switches; the session its records, calibration and
    scratch directory), on the ranks the earlier modules used."""
    _pool4.reset()
    yield _pool4
    scratch = _pool4.model.scratch.path if _pool4.model.scratch.created else None
    leash = _pool4.model.scratch.pids()
    _pool4.reset()
    assert scratch is None or not os.path.exists(scratch), f"scratch directory {scratch} left behind by reset"
    assert_gone(leash, [])


PRECISIONS = ("fp32", "bf16")


@pytest.fixture(scope="session")
def parity_runs():
    """{"runs": {label: parity run}, "records": {(label, precision): {rank: (MemoryRecord,
    [CommRecord], [ShardRecord])}}}: every parity plan of tests/test_parallel_parity.py (3 AdamW
    steps, then again with clipping, and its bf16 plans) on spawned gloo ranks, one group per world
    size, with the records of each plan's first step in fp32 and of one step in bf16 on every rank."""
    from mp_harness import run_ranks
    from parity_workers import parity_and_records
    from test_parallel_parity import BF16, CONFIGS_2, CONFIGS_4, STEPS, clipped

    runs, records = {}, {}
    for world, configs, extra in ((2, CONFIGS_2, []), (4, CONFIGS_4, BF16)):
        per_rank = run_ranks(parity_and_records, world, configs + clipped(configs) + extra, STEPS,
                             [label for label, _, _ in configs], configs, timeout_s=900)
        runs.update(per_rank[0]["runs"])
        for rank, out in enumerate(per_rank):
            for key, value in out["records"].items():
                records.setdefault(key, {})[rank] = value
    return {"runs": runs, "records": records}


@pytest.fixture(scope="session")
def parity_steps(parity_runs):
    """{(label, precision): {rank: (MemoryRecord, [CommRecord], [ShardRecord])}}: one training step of
    every parity plan (tests/test_parallel_parity.py) in fp32 and bf16 on every rank (parity_runs);
    the measured side of tests/test_activations.py, tests/test_dryrun.py and the comms model."""
    return parity_runs["records"]


def parity_plan_params() -> list:
    """pytest params (label, precision) of every parity plan in both precisions."""
    from test_parallel_parity import ALL

    return [pytest.param(label, precision, id=f"{label}-{precision}") for label in ALL for precision in PRECISIONS]


def single_process_losses(steps: int, **plan_fields) -> list[float]:
    """Per-step losses of one uninterrupted run of tiny-llama in this process: the oracle the
    live sessions' steps are held to (same seed, weights and batches under every plan)."""
    from interactive_parallel import Plan
    from interactive_parallel.plan import PRESETS
    from interactive_parallel.runtime.layout.parallelize import parallelize
    from interactive_parallel.runtime.training.train import make_optimizer, train_step

    par = parallelize(PRESETS["tiny-llama"], Plan(**plan_fields))
    opt = make_optimizer(par)
    return [train_step(par, opt, step).loss for step in range(steps)]


def step_losses(records) -> dict[int, float]:
    """Step -> the mean loss of the ranks that see it (the others report NaN)."""
    import math

    by_step: dict[int, list[float]] = {}
    for r in records:
        if not math.isnan(r.loss):
            by_step.setdefault(r.step, []).append(r.loss)
    return {step: sum(v) / len(v) for step, v in by_step.items()}
