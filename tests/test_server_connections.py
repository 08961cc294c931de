"""Slow and idle clients (#26 item 4): a request head must arrive within the header deadline, a
body must keep coming within the body deadline (408), and a flood of idle connections cannot lock
real clients out (beyond the cap the connection idle longest is closed).  Before, 1100 half-sent
unauthenticated connections made /health and authorized requests time out."""

from __future__ import annotations

import json
import socket
import time

from ds4_mlx.frontends.server import ServerConfig
from server_backend import LiveServer, ScriptedBackend, http

HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()


def _closed_within(s: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed ``s`` (None if it was still open after ``seconds``)."""
    t0 = time.monotonic()
    s.settimeout(seconds)
    try:
        while True:
            data = s.recv(4096)
            if not data:
                return time.monotonic() - t0
    except (TimeoutError, socket.timeout):
        return None
    except ConnectionResetError:
        return time.monotonic() - t0


def test_a_request_head_that_never_completes_is_closed_at_the_deadline():
    with LiveServer(ScriptedBackend(), ServerConfig(keepalive_s=0.2, header_timeout_s=0.6)) as s:
        silent = socket.create_connection(("127.0.0.1", s.port))
        partial = socket.create_connection(("127.0.0.1", s.port))
        partial.sendall(HEAD)  # no blank line: the head never ends
        # a keep-alive connection that answers one request, then starts another and stops
        again = socket.create_connection(("127.0.0.1", s.port))
        again.sendall(HEAD + f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY)
        again.settimeout(10)
        got = b""
        while b"Hello, world!" not in got:
            got += again.recv(65536)
        again.sendall(b"GET /health HTTP/1.1\r\n")
        for sock in (silent, partial, again):
            took = _closed_within(sock, 5)
            assert took is not None and took < 3, took
            sock.close()
        assert http(s.url, "GET", "/health")[0] == 200


def test_a_body_that_stops_coming_gets_408():
    with LiveServer(ScriptedBackend(), ServerConfig(keepalive_s=0.2, body_timeout_s=0.5)) as s:
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        sock.sendall(HEAD + b"Content-Length: 100\r\n\r\n" + BODY[:10])
        t0 = time.monotonic()
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            piece = sock.recv(65536)
            if not piece:
                break
            answer += piece
        assert time.monotonic() - t0 < 5
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        err = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert "nothing came for 0.5 s after 10 bytes" in err["message"]
        sock.close()
        assert len(s.backend.requests) == 0


def test_a_flood_of_idle_connections_does_not_lock_clients_out():
    with LiveServer(ScriptedBackend(), ServerConfig(keepalive_s=0.2, header_timeout_s=60,
                                                    max_connections=16)) as s:
        idle = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(60)]
        for sock in idle[::2]:
            sock.sendall(HEAD)  # half of them half-sent
        t0 = time.monotonic()
        assert http(s.url, "POST", "/v1/chat/completions", BODY, timeout=10)[0] == 200
        assert http(s.url, "GET", "/health", timeout=10)[0] == 200
        assert time.monotonic() - t0 < 5
        closed = sum(_closed_within(sock, 0.05) is not None for sock in idle)
        assert closed >= 60 - 16, closed  # the oldest idle ones made room
        for sock in idle:
            sock.close()


def test_a_huge_body_is_decoded_off_the_event_loop_and_tools_are_capped():
    """#26 item 5: one 14.9 MiB request with 3.9 M empty tools froze /health and other clients'
    streams for 17-31 s (rendering and the nesting check ran on the event loop). Decoding, the
    checks, parsing and rendering now run in a worker thread; what still holds the loop up is the
    GIL during ``json.loads`` of the body (one C call: about half a second for 15 MiB here)."""
    import threading

    with LiveServer(ScriptedBackend(), ServerConfig(keepalive_s=0.2, max_tools=64)) as s:
        status, _, raw = http(s.url, "POST", "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{}] * 65}))
        err = json.loads(raw)["error"]
        assert status == 413 and err["message"] == "tools: 65 entries, the limit is 64" and err["param"] == "tools"
        # 4 M empty arrays in a field the server ignores: every one is checked (depth, Unicode)
        big = json.dumps({"messages": [{"role": "user", "content": "x"}], "metadata": [[]] * 4_000_000})
        assert len(big) > 14 << 20
        over = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "y"}] * 8}
                                        for _ in range(60000)]})  # over --max-messages
        result = {}
        valid = json.dumps({"max_tokens": 4, "messages": [
            {"role": "user", "content": "z" * 3500} for _ in range(4000)]})  # 14 MiB to render
        for body, want in ((big, 200), (over, 413), (valid, 200)):
            t = threading.Thread(target=lambda b=body: result.__setitem__(
                "answer", http(s.url, "POST", "/v1/chat/completions", b, timeout=120)))
            t.start()
            worst = 0.0
            while t.is_alive():
                t0 = time.monotonic()
                assert http(s.url, "GET", "/health", timeout=30)[0] == 200
                worst = max(worst, time.monotonic() - t0)
                time.sleep(0.05)
            t.join()
            assert result["answer"][0] == want
            # The bug froze /health for 17-31 s; the GIL-held json.loads costs ~0.5 s alone but 2 s once
            # under two other CPU-bound jobs on 2 cores, so the bound is 5 s: still far below the bug.
            assert worst < 5.0, worst


def _half_closed_exchange(port: int, request: bytes, timeout: float = 10) -> bytes:
    """Send ``request``, shut our sending side (``nc -N``, ``curl`` with some options), read until
    the server closes: the whole response."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        got = b""
        while True:
            piece = sock.recv(65536)
            if not piece:
                return got
            got += piece
    finally:
        sock.close()


def _post_request(body: bytes) -> bytes:
    return HEAD + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


def test_a_client_that_half_closes_after_its_request_still_gets_the_answer():
    """#26 item 8: EOF after a complete request is allowed by HTTP/1.1 (the client only says it
    sends nothing more); uvicorn took it for a disconnect and answered nothing."""
    # delay: the EOF arrives well before the answer is ready
    with LiveServer(ScriptedBackend(delay=0.05), ServerConfig(keepalive_s=0.2)) as s:
        plain = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
        answer = _half_closed_exchange(s.port, _post_request(plain))
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        head, body = answer.split(b"\r\n\r\n", 1)
        assert json.loads(body)["choices"][0]["message"]["content"] == "Hello, world!"
        assert b"connection: close" in head.lower()  # nothing more can come: no keep-alive

        stream = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                             "stream": True}).encode()
        answer = _half_closed_exchange(s.port, _post_request(stream))
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        assert b"Hello" in answer and b"data: [DONE]" in answer

        answer = _half_closed_exchange(s.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200") and b'"status":"ok"' in answer, answer[:300]
        assert len(s.backend.requests) == 2 and not s.backend.cancelled


def test_a_slow_answer_to_a_half_closed_client_comes_after_interim_continues():
    """Until a plain answer starts, a half-closed peer gets ``100 Continue`` probes (the only way to
    tell it from a client that closed outright, whose job must be cancelled: see
    test_server_concurrency's disconnect tests); a client parses them and reads the answer."""
    with LiveServer(ScriptedBackend(delay=0.6), ServerConfig(keepalive_s=0.2)) as s:
        plain = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
        answer = _half_closed_exchange(s.port, _post_request(plain))
        interim, final = answer.split(b"HTTP/1.1 200 OK\r\n", 1)
        assert interim and interim == b"HTTP/1.1 100 Continue\r\n\r\n" * (len(interim) // 25), interim
        assert json.loads(final.split(b"\r\n\r\n", 1)[1])["choices"][0]["message"]["content"] == "Hello, world!"
        assert not s.backend.cancelled


def test_a_client_that_half_closes_before_its_body_is_complete_is_a_disconnect(caplog):
    with LiveServer(ScriptedBackend(), ServerConfig(keepalive_s=0.2)) as s:
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall(HEAD + f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY[:10])
        sock.shutdown(socket.SHUT_WR)
        took = _closed_within(sock, 5)
        assert took is not None and took < 3, took
        sock.close()
        # a half-sent head is the same
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall(HEAD)
        sock.shutdown(socket.SHUT_WR)
        took = _closed_within(sock, 5)
        assert took is not None and took < 3, took
        sock.close()
        # nothing reached the worker, and it is free for the next client
        assert len(s.backend.requests) == 0 and not s.backend.busy
        assert http(s.url, "POST", "/v1/chat/completions", BODY, timeout=10)[0] == 200
    # a client gone mid-body is logged as such, not as an unhandled error with its traceback
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    assert any("closed the connection after 10 bytes" in r.getMessage() for r in caplog.records)
