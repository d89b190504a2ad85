"""The listening sockets of a process tree, for tests that check nothing of megaflow listens beyond loopback."""
from __future__ import annotations

import ipaddress

import psutil


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4-mapped loopback address (::ffff:127.0.0.1)."""
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or bool(mapped and mapped.is_loopback)


def tree(pid: int) -> list[psutil.Process]:
    """Process ``pid`` and all its descendants."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def inet_listeners(processes: list[psutil.Process]) -> list[tuple[int, str, int]]:
    """(pid, ip, port) of every TCP socket in LISTEN state that ``processes`` hold (processes gone meanwhile are
    skipped)."""
    found = []
    for proc in processes:
        try:
            conns = proc.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        found += [(proc.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return found
