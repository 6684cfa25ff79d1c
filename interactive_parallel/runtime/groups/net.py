"""Where a rank listens: the address and network interface its sockets bind to.

Owns three choices and nothing else. The rendezvous address of rank 0: the address of an
interface the user names, else the address this host reaches a given peer (the ipyparallel
controller) from, else loopback. The interface every rank's gloo (and NCCL bootstrap)
sockets bind to: the one named, else the one this host reaches rank 0 through, so one
rule serves engines, torchrun and spawned processes alike. And the listening socket of
rank 0's store, bound to that address before the store exists (torch's TCPStore binds
every interface unless it is handed a socket: measured, `*:port`).

Why not the host name: Debian and Ubuntu map it to 127.0.1.1, which no other host can
reach, and a host in a network namespace may not resolve its own name at all (gloo then
falls back to loopback). Knows nothing of torch, of process groups or of ipyparallel;
standard library and psutil only, so the client can import it.
"""
from __future__ import annotations

import ipaddress
import socket

LOOPBACK = "127.0.0.1"


def ipv4_interfaces() -> dict[str, list[str]]:
    """Interface name -> its IPv4 addresses, as this process's network namespace sees them."""
    import psutil

    return {name: [a.address for a in addrs if a.family == socket.AF_INET]
            for name, addrs in psutil.net_if_addrs().items()}


def address_of(interface: str) -> str:
    """The IPv4 address of `interface`, or ValueError naming the interfaces there are."""
    table = ipv4_interfaces()
    addrs = table.get(interface) or []
    if not addrs:
        have = ", ".join(f"{n} ({', '.join(a) or 'no IPv4'})" for n, a in sorted(table.items()))
        raise ValueError(f"no IPv4 address on interface {interface!r} of host {socket.gethostname()}; "
                         f"interfaces: {have}")
    return addrs[0]


def interface_of(address: str) -> str:
    """The name of the interface holding `address` on this host."""
    for name, addrs in ipv4_interfaces().items():
        if address in addrs:
            return name
    raise ValueError(f"address {address} is on no interface of host {socket.gethostname()}")


def route_source(toward: str) -> str:
    """The local address this host would use to reach `toward` (a host name or IPv4 address).

    A UDP connect sends nothing: it only asks the kernel's routing table for the source.
    """
    target = socket.gethostbyname(toward)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target, 9))
        except OSError as exc:
            raise ValueError(f"host {socket.gethostname()} has no route to {toward} ({target}): {exc}") from exc
        return s.getsockname()[0]


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(socket.gethostbyname(address)).is_loopback


def rendezvous_address(interface: str | None = None, toward: str | None = None) -> str:
    """Rank 0's address: on `interface`, else the source address toward `toward`, else loopback."""
    if interface:
        return address_of(interface)
    if toward:
        return route_source(toward)
    return LOOPBACK


def bind_interface(master_addr: str, interface: str | None = None) -> tuple[str, str]:
    """(interface, address) this rank's process-group sockets bind to: `interface` when named,
    else the interface this host reaches `master_addr` through (loopback for a local group)."""
    if interface:
        return interface, address_of(interface)
    source = route_source(master_addr)
    return interface_of(source), source


def listener(address: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to `address` (port 0: the kernel picks one) and listening."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # A port left in TIME_WAIT by the previous group on this rank must not block the next.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((socket.gethostbyname(address), port))
        s.listen(socket.SOMAXCONN)
    except OSError as exc:
        s.close()
        raise OSError(exc.errno, f"cannot listen on {address}:{port} on host {socket.gethostname()}: "
                                 f"{exc.strerror}") from exc
    return s
