"""`ds4-mlx serve -m MODEL`: OpenAI / Anthropic / Responses API server for coding agents.

Endpoints: GET /v1/models, /v1/models/{id}, /health, /metrics, / (GET and HEAD); POST
/v1/chat/completions, /v1/completions, /v1/messages, /v1/messages/count_tokens, /v1/responses.  One inference worker; requests wait in a FIFO of
at most --max-queue (503 + Retry-After beyond).  Binds 127.0.0.1 by default: pass --host 0.0.0.0
and --api-key to serve a network.  SIGTERM/SIGINT: stop accepting, cancel what is running (its
stream ends with finish "error", as ds4), save the live sessions to the disk cache (reason
"shutdown", with --kv-disk-dir), then exit.

Across machines: `mlx.launch ... -- ds4-mlx serve ... --distributed pipeline`; rank 0 serves HTTP,
the other ranks hold their layers and exit when rank 0 does (SIGTERM to rank 0 is enough).

KV reuse: each request continues the live session holding the longest prefix of its prompt (or
the hidden reasoning of the last answer, or a disk checkpoint); the `x-ds4-cache` response header
and the usage fields say what was reused.

tool_choice "required" / a named tool are passed to the engine as decoding constraints (the
DSML block, or the named invoke, must open the answer); "none" drops the tools prompt."""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys

from ds4_mlx.chat.template import DEFAULT_CTX
from ds4_mlx.errors import Ds4Error
from ds4_mlx.frontends.args import (CTX, add_disk_cache_options, add_draft_options, add_model_options,
                                    draft_options, ranged)


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="run the OpenAI/Anthropic-compatible API server",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p, distributed=True)
    add_draft_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", action=ranged(int, 1, 65535, why="a TCP port"), default=8000, metavar="N",
                   help="port (default 8000)")
    p.add_argument("--ctx", action=CTX, default=DEFAULT_CTX, metavar="N",
                   help=f"context size in tokens (default {DEFAULT_CTX})")
    p.add_argument("--model-id", default="deepseek-v4-flash", help="model id served (default %(default)s)")
    p.add_argument("--sessions", type=int, default=1,
                   help="live KV sessions kept in RAM, least recently used evicted first; a request "
                        "takes the one sharing its longest prefix, or the one named by its "
                        "X-Session-Id header (default 1, as ds4)")
    p.add_argument("--sessions-mb", type=float, default=0,
                   help="memory budget of the live sessions in MiB (0 = bounded by --sessions only)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests allowed to wait for the worker (default 64); more get 503")
    p.add_argument("--api-key", default=os.environ.get("DS4_MLX_API_KEY"),
                   help="require this key (Authorization: Bearer or x-api-key); env DS4_MLX_API_KEY")
    p.add_argument("--cors", nargs="+", metavar="ORIGIN", default=(),
                   help="let web pages of these origins call the server from a browser (e.g. "
                        "http://localhost:3000; * for any, which lets every site you visit use it)")
    p.add_argument("--allow-host", action="append", metavar="NAME", default=[],
                   help="also answer requests whose Host header names NAME (default: localhost, "
                        "127.0.0.1 and ::1 on a loopback bind, any on a network bind unless this "
                        "is given); other Hosts get 421, which stops DNS-rebinding pages")
    p.add_argument("--max-body-mb", type=float, default=16.0, help="request body limit (default 16 MiB)")
    p.add_argument("--max-messages", type=int, default=4096, help="messages per request (default 4096)")
    p.add_argument("--max-tokens", "--tokens", action=ranged(int, 1), default=393216, metavar="N", dest="max_tokens",
                   help="answer length for a request that names none, and the most one may ask for "
                        "(each answer also stops at the context's end); default 393216 as ds4, i.e. "
                        "the context. Codex CLI sends no limit: bound its answers with this")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="info (default): one line per request (status, reason of an error, prompt / "
                        "cached / generated tokens, cache source, timings) and the disk-cache saves")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="append each request's rendered prompt, cache decision, output and tool "
                        "calls to FILE (as ds4's --trace)")
    add_disk_cache_options(p)
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    if args.ctx < 16:
        raise Ds4Error(f"--ctx must be >= 16, got {args.ctx}")
    if args.max_queue < 0:
        raise Ds4Error(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.sessions < 1:
        raise Ds4Error(f"--sessions must be >= 1, got {args.sessions}")
    if not args.sessions_mb >= 0:
        raise Ds4Error(f"--sessions-mb must be >= 0, got {args.sessions_mb}")
    if args.max_body_mb <= 0 or args.max_messages < 1:
        raise Ds4Error("--max-body-mb and --max-messages must be positive")
    if args.api_key is not None and not args.api_key:
        raise Ds4Error("--api-key must not be empty")
    if not os.path.isfile(args.model):
        raise Ds4Error(f"{args.model}: no such model file")


def _log_to_stderr(level: str) -> None:
    """The server's own lines (requests, cache saves, shutdown) beside uvicorn's: uvicorn
    configures only its loggers, so ``ds4_mlx`` gets a handler of its own."""
    import logging
    import sys

    logger = logging.getLogger("ds4_mlx")
    if not any(getattr(h, "_ds4_mlx", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s ds4-mlx: %(message)s"))
        handler._ds4_mlx = True
        logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def _bind_error(exc: OSError) -> str:
    known = {errno.EADDRINUSE: "address already in use (another server on that port?)",
             errno.EADDRNOTAVAIL: "not an address of this machine",
             errno.EACCES: "permission denied (ports below 1024 need privileges)"}
    return known.get(exc.errno) or (exc.strerror or str(exc)).lower()


def listen(host: str, port: int) -> list:
    """Sockets bound to ``host``:``port``, one per address the name resolves to (``localhost``:
    IPv4 and IPv6), as uvicorn would bind them.  Bound here, before the model loads, so a port in
    use or a host that is no address of this machine fails at once, as one line naming it,
    instead of after the load with uvicorn's error lines (and it keeps the port from being taken
    while the model loads)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise Ds4Error(f"--host {host!r}: no such address ({exc.strerror})") from None
    socks, seen, unavailable = [], set(), None
    try:
        for family, kind, proto, _, addr in infos:
            if (family, addr[:2]) in seen:
                continue
            seen.add((family, addr[:2]))
            where = f"[{addr[0]}]:{addr[1]}" if family == socket.AF_INET6 else f"{addr[0]}:{addr[1]}"
            try:
                sock = socket.socket(family, kind, proto)
            except OSError as exc:  # a family this kernel lacks (no IPv6): skipped, as asyncio does
                unavailable = unavailable or f"cannot listen on {where}: {_bind_error(exc)}"
                continue
            socks.append(sock)
            # as asyncio and uvicorn do: a restart need not wait out the old connections' TIME_WAIT
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # the IPv4 address, if any, has a socket of its own
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise Ds4Error(f"cannot listen on {where}: {_bind_error(exc)}") from None
                # ``localhost`` on a host without ::1: served on the addresses it has (asyncio's rule)
                socks.pop().close()
                unavailable = unavailable or f"cannot listen on {where}: {_bind_error(exc)}"
        if not socks:
            raise Ds4Error(unavailable or f"--host {host!r}: no address to listen on")
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def serve(app, backend, host: str, port: int, log_level: str = "info", sockets: list | None = None) -> None:
    """Run ``app`` with uvicorn until SIGTERM/SIGINT, cancelling in-flight work first.  ``sockets``:
    already bound by :func:`listen` (uvicorn binds ``host``:``port`` itself otherwise)."""
    import uvicorn

    _log_to_stderr(log_level)
    if sockets:  # uvicorn says where it listens only when it binds itself
        import logging

        logging.getLogger("ds4_mlx.server").info("listening on %s", ", ".join(
            ("http://[%s]:%d" if s.family == socket.AF_INET6 else "http://%s:%d") % s.getsockname()[:2]
            for s in sockets))

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            backend.begin_shutdown()  # in-flight streams end now, so uvicorn can drain quickly
            super().handle_exit(sig, frame)

    from ds4_mlx.frontends.server.http_protocol import uvicorn_config

    _Server(uvicorn_config(app, host, port, log_level, timeout_graceful_shutdown=30)).run(sockets=sockets)


def allowed_hosts(bind: str, extra: list[str]) -> tuple[str, ...] | None:
    """The Host names served: on a loopback bind the loopback names (a page on any site can reach
    a local server; only its Host tells it apart), on a network bind any unless names are given."""
    from ds4_mlx.frontends.server.app import LOOPBACK_HOSTS

    names = tuple(n.strip().lower().strip("[]") for n in extra if n.strip())
    if bind.strip("[]") in LOOPBACK_HOSTS:
        return LOOPBACK_HOSTS + names
    return (bind.strip("[]").lower(),) + names if names else None


def _follow_unless_rank_0(args: argparse.Namespace) -> None:
    """``--distributed``: only rank 0 serves HTTP (its worker thread loads and drives the model);
    every other rank loads its share here, on the main thread, follows rank 0 and exits when rank
    0 stops (``Engine.open``), so it never binds the port. Joining here first tells which rank
    this is; the loader's own join on rank 0's worker gets the same group back."""
    from ds4_mlx.engine.engine import Engine
    from ds4_mlx.frontends.args import model_options
    from ds4_mlx.model.distributed import join

    if join().rank() != 0:
        Engine.open(args.model, **model_options(args))  # returns only on rank 0


def server_parts(args: argparse.Namespace, *, logits_hook=None):
    """The backend (not started) and the ServerConfig ``serve`` runs with these options."""
    from ds4_mlx.chat.effort import RULES
    from ds4_mlx.formats.checkpoint import detect_checkpoint
    from ds4_mlx.formats.gguf import GGUFFile
    from ds4_mlx.frontends.server import EngineBackend, ServerConfig

    # The checkpoint decides how requests' thinking controls read; decided here, once, from the
    # file's header, and the worker loads the model with the same answer.
    with GGUFFile(args.model) as header:
        checkpoint = detect_checkpoint(header.metadata, args.model, args.checkpoint)
    backend = EngineBackend(args.model, ctx=args.ctx, numerics=args.numerics, experts=args.experts,
                            simulate_memory=args.simulate_memory, experts_cache=args.experts_cache,
                            experts_cache_policy=args.experts_cache_policy,
                            checkpoint=checkpoint.checkpoint.value,
                            distributed=args.distributed,
                            kv_disk_dir=args.kv_disk_dir,
                            kv_disk_space_mb=args.kv_disk_space_mb, sessions=args.sessions,
                            sessions_mb=args.sessions_mb,
                            max_queue=args.max_queue, model_id=args.model_id, logits_hook=logits_hook,
                            **draft_options(args))
    config = ServerConfig(ctx=args.ctx, model_id=args.model_id, api_key=args.api_key, cors=tuple(args.cors),
                          allowed_hosts=allowed_hosts(args.host, args.allow_host),
                          max_body_bytes=int(args.max_body_mb * 1024 * 1024),
                          max_messages=args.max_messages, max_output=args.max_tokens, trace=args.trace,
                          effort_rules=RULES[checkpoint.checkpoint])
    return backend, config


def run(args: argparse.Namespace, *, logits_hook=None) -> int:
    """``logits_hook``: see :class:`~ds4_mlx.frontends.server.EngineBackend` (developer tools
    script the answers of a random model with it; the CLI passes none)."""
    _check(args)
    if args.distributed:
        _follow_unless_rank_0(args)
    from ds4_mlx.frontends.server import create_app

    backend, config = server_parts(args, logits_hook=logits_hook)
    app = create_app(backend, config)
    sockets = listen(args.host, args.port)
    try:
        # The model loads here, not in uvicorn's lifespan (which then finds the backend started):
        # a model, --ctx or --kv-disk-dir that cannot be used is a Ds4Error, one line from the CLI,
        # where uvicorn printed it as a traceback of "Application startup failed".
        backend.start()
        print(f"ds4-mlx serve: {args.model}: {config.effort_rules.banner()}", file=sys.stderr, flush=True)
        try:
            serve(app, backend, args.host, args.port, args.log_level, sockets=sockets)
        finally:
            # after the lifespan's own close a no-op; if uvicorn failed before it, the shutdown
            # save still runs.  (Not after a failed or interrupted start: Ctrl-C during the load
            # must not wait for the loading thread.)
            backend.close()
    finally:
        for sock in sockets:
            sock.close()
    return 0
