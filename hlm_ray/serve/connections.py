"""The connection guard: what uvicorn cannot bound on its own, for every HTTP server Serve
starts (its proxy, and with direct ingress each replica's own port).

A connection costs the server a file descriptor from `accept` on, but nothing in uvicorn limits
how long a client may take to finish its request headers (its keep-alive timeout only runs
between requests, the guard's body timeout only after the headers) or how many connections one
server holds (`limit_concurrency` answers 503 after the headers, while the connection stays
open). Clients that open thousands of connections and send one header line every few seconds
took the file descriptors of the whole process and every other client with them. Here, as
nginx's `client_header_timeout` and `limit_conn` do:

- a request whose headers are not complete `HLM_SERVE_HEADER_TIMEOUT_S` (default 10 s) after
  its first byte (or after the connection opened) is answered 408 and the connection closed;
- a connection beyond `HLM_SERVE_MAX_CONNECTIONS_PER_CLIENT` (default 1024) open ones from the
  same address, or beyond `HLM_SERVE_MAX_CONNECTIONS` (default 4096; at most the process's
  open-file limit less 256) in all, is answered 503 and closed at once. Behind a load balancer
  every client has its address: set the per-client limit to 0 (off) there.

Ray builds uvicorn's `Config` itself and has no option for its protocol, so `install()` (called
by the guard's `proxy_middlewares`, in the process that is about to start its server) points
uvicorn's protocol table at the guarded classes below. `tests/test_serve_connections.py` checks
that uvicorn still resolves them, so an upgrade that moves the table fails there, not silently.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
from collections import Counter
from dataclasses import dataclass

from hlm_ray.serve.error_shape import error_body

HEADER_TIMEOUT_ENV = "HLM_SERVE_HEADER_TIMEOUT_S"
MAX_CONNECTIONS_ENV = "HLM_SERVE_MAX_CONNECTIONS"
PER_CLIENT_ENV = "HLM_SERVE_MAX_CONNECTIONS_PER_CLIENT"
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_PER_CLIENT = 1024
LINGER_S = 1.0  # a connection answered 408 or 503 is closed this long after the answer
FD_MARGIN = 256  # descriptors left for the process's own files, pipes and Ray's sockets

log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class Limits:
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    per_client: int = DEFAULT_PER_CLIENT  # 0: no per-client limit

    @classmethod
    def from_env(cls, env=os.environ) -> Limits:
        limits = cls(
            header_timeout_s=float(env.get(HEADER_TIMEOUT_ENV, DEFAULT_HEADER_TIMEOUT_S)),
            max_connections=int(env.get(MAX_CONNECTIONS_ENV, DEFAULT_MAX_CONNECTIONS)),
            per_client=int(env.get(PER_CLIENT_ENV, DEFAULT_PER_CLIENT)),
        )
        return limits.within_file_limit()

    def within_file_limit(self) -> Limits:
        """At most the open-file limit less a margin: past it `accept` itself fails, and with it
        every client of the process."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY or self.max_connections <= soft - FD_MARGIN:
            return self
        bound = max(1, soft - FD_MARGIN)
        log.warning(
            "%s=%d is over this process's open-file limit (%d) less %d: %d connections at most",
            MAX_CONNECTIONS_ENV, self.max_connections, soft, FD_MARGIN, bound,
        )  # fmt: skip
        return Limits(self.header_timeout_s, bound, self.per_client)

    def env(self) -> dict[str, str]:
        return {
            HEADER_TIMEOUT_ENV: f"{self.header_timeout_s:g}",
            MAX_CONNECTIONS_ENV: str(self.max_connections),
            PER_CLIENT_ENV: str(self.per_client),
        }


class _Open:
    """The process's open guarded connections: in all and per client address."""

    def __init__(self) -> None:
        self.total = 0
        self.by_client: Counter[str] = Counter()

    def add(self, client: str) -> None:
        self.total += 1
        self.by_client[client] += 1

    def remove(self, client: str) -> None:
        self.total -= 1
        self.by_client[client] -= 1
        if self.by_client[client] <= 0:
            del self.by_client[client]


OPEN = _Open()
LIMITS = Limits()  # replaced by install() from the environment


def _response(status: int, reason: str, message: str) -> bytes:
    body = error_body(status, message)
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def guarded(base: type) -> type:
    """`base` (one of uvicorn's HTTP protocols) with the header deadline and connection limits.

    The deadline is armed when a connection opens and when the first byte of a later request
    arrives (uvicorn's own keep-alive timer covers the idle time between), and disarmed when
    uvicorn starts a new request cycle: its headers are complete."""

    class Guarded(base):
        _deadline: asyncio.TimerHandle | None = None
        _armed_cycle: object = None
        _counted: str | None = None
        _closing = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            client = self.client[0] if self.client else ""
            limits = LIMITS
            if OPEN.total >= limits.max_connections:
                self._refuse(f"the server holds {OPEN.total} connections, its limit")
                return
            if limits.per_client and OPEN.by_client[client] >= limits.per_client:
                self._refuse(f"{client} holds {OPEN.by_client[client]} connections, the limit")
                return
            OPEN.add(client)
            self._counted = client
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._closing:
                return  # answered 408 or 503: the rest is not read
            if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first byte of the next request
            super().data_received(data)
            if self._deadline is not None and self.cycle is not self._armed_cycle:
                self._disarm()  # a new request cycle: its headers are complete

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._counted is not None:
                OPEN.remove(self._counted)
                self._counted = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._armed_cycle = self.cycle
            self._deadline = self.loop.call_later(LIMITS.header_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            seconds = f"{LIMITS.header_timeout_s:g}"
            log.info(
                "client %s sent no complete request headers in %s s: 408", self.client, seconds
            )
            self._answer_and_close(408, "Request Timeout",
                                   f"the request headers were not received within {seconds} s")  # fmt: skip

        def _refuse(self, why: str) -> None:
            log.warning("connection from %s refused: %s", self.client, why)
            self._answer_and_close(503, "Service Unavailable", f"too many connections: {why}")

        def _answer_and_close(self, status: int, reason: str, message: str) -> None:
            """Answer, end our side, and close after LINGER_S: closing at once with the
            client's unread bytes in the socket would reset the connection, and the reset can
            reach the client before the answer does. What the client sends meanwhile is
            dropped (`data_received`)."""
            self._closing = True
            self.transport.write(_response(status, reason, message))
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


def _protocols() -> dict[str, type]:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    protocols = {"h11": guarded(H11Protocol)}
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools not installed: uvicorn's "auto" is h11
        protocols["auto"] = protocols["h11"]
    else:
        protocols["httptools"] = guarded(HttpToolsProtocol)
        protocols["auto"] = protocols["httptools"]
    return protocols


PROTOCOLS = _protocols()
GuardedAuto = PROTOCOLS["auto"]
GuardedH11 = PROTOCOLS["h11"]
GuardedHttpTools = PROTOCOLS.get("httptools")


def install(limits: Limits | None = None) -> Limits:
    """Make every uvicorn server this process starts from now on use the guarded protocols,
    with `limits` (default: from the environment). Returns the limits in force."""
    global LIMITS
    from uvicorn import config

    LIMITS = limits or Limits.from_env()
    for name in PROTOCOLS:
        config.HTTP_PROTOCOLS[name] = f"{__name__}:Guarded{_suffix(name)}"
    return LIMITS


def _suffix(name: str) -> str:
    return {"auto": "Auto", "h11": "H11", "httptools": "HttpTools"}[name]
