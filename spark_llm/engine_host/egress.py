"""What an engine process sends outside this host, on record: each TCP connection it opens, each datagram it
addresses and each name it looks up, towards anything but this host's loopback, is one ``egress`` event in the
engine directory's record (``events.jsonl``, :func:`~spark_llm.engine_host.directory.read_events`) and a warning
in the engine's log. An engine is told not to call out (:data:`~spark_llm.engine_host.spec.NO_CALLS_OUT_ENV`); this
is how a deployment whose inference nodes have no way out sees that it does not try.

Seen through Python's audit hooks (PEP 578), which the socket module raises before each call: vLLM's usage report,
Hugging Face's hub client, ``requests``, ``httpx`` and ``urllib`` all go through it. Not seen: sockets opened by
native code and processes the engine spawns (tensor-parallel workers); a network policy is the enforcement, this is
the record. Deciding (:func:`outside`) is kept apart from recording (:func:`watch`).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
from typing import Any, Callable, NamedTuple, Optional, Union

log = logging.getLogger(__name__)

#: The audit events of the socket module that reach another host (Python's audit events table).
SOCKET_EVENTS = ("socket.connect", "socket.sendto", "socket.getaddrinfo")


class Egress(NamedTuple):
    """One call that reaches past loopback: ``call`` is ``connect``, ``sendto`` or ``lookup``; ``address`` is
    ``host:port`` (a lookup's name, when it gives no port: ``host``); ``protocol`` is ``tcp``, ``udp`` or ``dns``."""

    call: str
    address: str
    protocol: str


def _address(host: str) -> Optional[Union[ipaddress.IPv4Address, ipaddress.IPv6Address]]:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None


def outside(event: str, args: tuple, local_names: frozenset[str] = frozenset({"localhost"})) -> Optional[Egress]:
    """The call an audit ``event`` with ``args`` makes outside this host, or None: a Unix socket, a loopback address
    and a lookup of one of ``local_names`` (``localhost``, this host's names) stay inside. A pure function of what
    Python's socket module passes to audit hooks: ``(socket, address)`` for ``socket.connect`` and
    ``socket.sendto``, ``(host, port, family, type, protocol)`` for ``socket.getaddrinfo``."""
    if event == "socket.getaddrinfo":
        host, port = args[0], args[1]
        if host is None:
            return None
        host = host.decode() if isinstance(host, bytes) else str(host)
        if not host or _address(host) is not None or host.lower() in local_names:
            return None  # an address asks no one (its connect is what counts); this host's names are in /etc/hosts
        return Egress("lookup", f"{host}:{port}" if port not in (None, 0, "0") else host, "dns")
    if event not in ("socket.connect", "socket.sendto"):
        return None
    sock, address = args[0], args[-1]
    if getattr(sock, "family", None) not in (socket.AF_INET, socket.AF_INET6) or not isinstance(address, tuple):
        return None  # a Unix socket (the engine's own), netlink, a packet socket
    host = address[0].decode() if isinstance(address[0], bytes) else str(address[0])
    ip = _address(host)
    if ip.is_loopback if ip is not None else host.lower() in local_names:
        return None
    protocol = "udp" if getattr(sock, "type", None) == socket.SOCK_DGRAM else "tcp"
    return Egress(event.split(".", 1)[1], f"{host}:{address[1]}", protocol)


def local_names() -> frozenset[str]:
    """This host's own names (``localhost``, its hostname), whose lookups ``/etc/hosts`` answers."""
    names = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}
    try:
        names.add(socket.gethostname().lower())
    except OSError:
        pass
    return frozenset(names)


def watch(record: Callable[[Egress], Any]) -> None:
    """From now on, this process's calls outside (:func:`outside`) are given to ``record`` (and logged), once per
    address and call; the call itself goes ahead. An audit hook stays for the process's life, and forked children
    (the slots' engines of :func:`~spark_llm.engine_host.server.fork_per_slot`) inherit it."""
    names, seen = local_names(), set()

    def hook(event: str, args: tuple) -> None:
        if event not in SOCKET_EVENTS:
            return
        try:  # an audit hook that raises fails the call it watches
            found = outside(event, args, names)
            if found is not None and found not in seen:
                seen.add(found)
                log.warning("engine process calls out: %s %s (%s)", found.call, found.address, found.protocol)
                record(found)
        except Exception:  # noqa: BLE001 - the record is best-effort; the engine's call is not ours to fail
            pass
    sys.addaudithook(hook)
