"""Binding `ubatch server`'s listening sockets before the model loads, as llama-server does:
`--host` is a comma-separated list of IPv4/IPv6 addresses (or names) and UNIX socket paths
ending in `.sock`, all served by one server on one `--port`. With several TCP addresses an
IPv6 socket is IPv6-only, so `::` next to `0.0.0.0` does not claim IPv4 twice; `--port 0`
(any free port) works with one TCP address only. A busy port fails at once, in one line.
"""

from __future__ import annotations

import socket
from typing import Any

from ubatch.cli.common import fail


def parse_hosts(host: str) -> list[str]:
    """--host: comma-separated IPv4/IPv6 addresses or names, or UNIX socket paths ending in .sock."""
    hosts = [h.strip() for h in host.split(",") if h.strip()]
    if not hosts:
        fail("--host requires at least one address")
    return hosts


def _listen(sock: socket.socket, addr: Any, where: str, port: int) -> socket.socket:
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        fail(f"couldn't bind HTTP server socket, hostname: {where}, port: {port} ({e.strerror or e})")
    sock.set_inheritable(True)
    return sock


def bind(host: str, port: int, v6only: bool = False) -> socket.socket:
    """Bind before loading, as llama-server does: a busy port fails at once. `v6only`: an IPv6
    socket takes no IPv4 connections (with several TCP addresses, "::" must not claim 0.0.0.0)."""
    if host.endswith(".sock"):
        return _listen(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), host, host, port)
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        fail(f"couldn't bind HTTP server socket, hostname: {host}, port: {port} ({e.strerror or e})")
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
    return _listen(sock, addr, host, port)


def bind_all(hosts: list[str], port: int) -> tuple[list[socket.socket], list[str]]:
    """Every --host address bound on one port; the sockets and the addresses as llama-server
    lists them (http://127.0.0.1:8080, http://[::1]:8080, unix:///tmp/x.sock)."""
    n_tcp = sum(not h.endswith(".sock") for h in hosts)
    if port == 0 and n_tcp > 1:
        fail("--port 0 is not supported with multiple TCP addresses")
    socks, addrs = [], []
    for h in hosts:
        sock = bind(h, port, v6only=n_tcp > 1)
        socks.append(sock)
        if h.endswith(".sock"):
            addrs.append(f"unix://{h}")
        else:
            port = sock.getsockname()[1]  # port 0: the one the system picked
            addrs.append(f"http://{'[' + h + ']' if ':' in h else h}:{port}")
    return socks, addrs
