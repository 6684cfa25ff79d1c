"""Functions the multi-host test runs on its ranks (module level: the ranks import them by name)."""
from __future__ import annotations


def listening() -> list[str]:
    """'address:port' of every TCP socket this rank's process listens on."""
    import psutil

    proc = psutil.Process()
    conns = proc.net_connections(kind="inet") if hasattr(proc, "net_connections") else proc.connections(kind="inet")
    return sorted({f"{c.laddr.ip}:{c.laddr.port}" for c in conns if c.status == psutil.CONN_LISTEN})
