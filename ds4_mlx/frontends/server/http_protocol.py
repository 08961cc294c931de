"""uvicorn's HTTP/1.1 protocol with the two limits it lacks: a deadline for a request's headers and
a cap on open connections.

uvicorn closes idle keep-alive connections, but a connection that never finishes its headers
stays open for ever, and the API key can only be checked once the headers are in: 1100 idle,
unauthenticated, half-sent connections (the usual 1024 file-descriptor limit) made ``/health``
and every authorized request time out.  Here a connection gets ``header_timeout`` seconds to
deliver a whole request head (from its opening, or from the end of its previous response), and
beyond ``max_connections`` the connection that has waited longest without a request in progress
is closed to make room, so a flood of idle sockets cannot lock real clients out.  The body has
its own deadline in the app (``Server.read_json``: 408).

It also answers a client that half-closes its socket once its request is sent (``shutdown(SHUT_WR)``,
``nc -N``, ``socat``): uvicorn takes any EOF for a disconnect and answered such a client nothing
(see ``eof_received`` for how a client that really left is still noticed)."""

from __future__ import annotations

import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 256
EOF_PROBE_S = 1.0  # after a client's EOF, how often a plain answer in progress checks it is still there


class GuardedH11Protocol(H11Protocol):
    header_timeout: float = HEADER_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    eof_probe_s: float = EOF_PROBE_S

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        self._probe_timer = None
        self._waiting_since = time.monotonic()
        self._arm()
        if len(self.connections) > self.max_connections:
            idle = [c for c in self.connections if getattr(c, "_waiting_since", None) is not None]
            oldest = min(idle, key=lambda c: c._waiting_since)
            oldest._drop()

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._drop)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._waiting_since = None

    def _drop(self) -> None:
        """Close a connection that has no request in progress (no answer is owed to anyone)."""
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()

    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before and self.cycle is not None:
            self._disarm()  # a whole request head arrived: the app has it now
        elif self._idle():
            if self._waiting_since is None:
                self._waiting_since = time.monotonic()
            self._arm()  # bytes of a head (a first or a keep-alive request) that is not whole yet

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._idle():
            self._waiting_since = time.monotonic()  # uvicorn's keep-alive timer runs until bytes come

    def eof_received(self) -> bool | None:
        """The peer will send nothing more.  After a whole request that is allowed (HTTP/1.1 lets
        a client half-close once its message is complete, RFC 9112 9.6): keep the transport open
        (return True) so the answer is still written, then close, since no further request can
        come.  Before a request is complete (a half-sent head or body) it is a disconnect: the
        transport closes and the app sees ``http.disconnect``, as uvicorn does for any EOF.

        A client that closed its socket outright sends the same FIN as one that half-closed, and
        nothing tells them apart until something is written to it.  A stream writes all along; a
        plain answer writes nothing until it is done, so a gone client would hold the one worker
        for its whole generation.  So until the answer starts, an HTTP/1.1 peer gets a
        ``100 Continue`` every ``eof_probe_s`` (clients must accept 1xx responses, RFC 9110
        15.2): a closed socket answers the first with a reset and the next write fails, which
        is the disconnect that cancels the job."""
        cycle = self.cycle
        if (cycle is None or cycle.response_complete or cycle.disconnected
                or self.conn.their_state not in (h11.DONE, h11.MUST_CLOSE)):
            return None
        cycle.keep_alive = False
        if not cycle.response_started:  # say so, as uvicorn does for a client's own close
            cycle.default_headers = list(cycle.default_headers) + [(b"connection", b"close")]
            # never a 1xx to an HTTP/1.0 client (RFC 9110 15.2): its job runs to the end
            if self.conn.their_http_version == b"1.1":
                self._probe_timer = self.loop.call_later(self.eof_probe_s, self._probe, cycle)
        return True

    def _probe(self, cycle) -> None:
        self._probe_timer = None
        if (cycle is not self.cycle or cycle.response_started or cycle.disconnected
                or self.transport.is_closing()):
            return  # the answer is going out (its own writes find a gone client) or is over
        cycle.waiting_for_100_continue = False  # one was sent: uvicorn need not send its own
        self.transport.write(self.conn.send(h11.InformationalResponse(status_code=100, headers=[],
                                                                      reason=b"Continue")))
        self._probe_timer = self.loop.call_later(self.eof_probe_s, self._probe, cycle)

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self._probe_timer is not None:
            self._probe_timer.cancel()
            self._probe_timer = None
        super().connection_lost(exc)


def protocol(header_timeout: float = HEADER_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS) -> type:
    """The protocol class for ``uvicorn.Config(http=...)`` with these limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout": float(header_timeout), "max_connections": int(max_connections)})


def uvicorn_config(app, host: str, port: int, log_level: str = "info", **kwargs):
    """The ``uvicorn.Config`` ``serve`` runs ``app`` with: the app's ``ServerConfig`` limits on the
    connections (header deadline, connection cap), lifespan on (the backend starts and stops
    with it)."""
    import uvicorn

    cfg = app.state.server.config
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          http=protocol(cfg.header_timeout_s, cfg.max_connections), **kwargs)
