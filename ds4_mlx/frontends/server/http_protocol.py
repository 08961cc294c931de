"""uvicorn's HTTP/1.1 protocol with the two limits it lacks: a deadline for a request's headers and
a cap on open connections.

uvicorn closes idle keep-alive connections, but a connection that never finishes its headers
stays open for ever, and the API key can only be checked once the headers are in: 1100 idle,
unauthenticated, half-sent connections (the usual 1024 file-descriptor limit) made ``/health``
and every authorized request time out.  Here a connection gets ``header_timeout`` seconds to
deliver a whole request head (from its opening, or from the end of its previous response), and
beyond ``max_connections`` the connection that has waited longest without a request in progress
is closed to make room, so a flood of idle sockets cannot lock real clients out.  The body has
its own deadline in the app (``Server.read_json``: 408)."""

from __future__ import annotations

import time

from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 256


class GuardedH11Protocol(H11Protocol):
    header_timeout: float = HEADER_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
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

    def connection_lost(self, exc) -> None:
        self._disarm()
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
