#!/usr/bin/env python3
"""Hostile-input sweep of ``ds4-mlx serve`` (#26): throw bad bodies, bad headers, slow clients,
disconnects, bursts and disk trouble at a live server and count what comes back.

    .venv/bin/python scripts/hostile_sweep.py --fast              # in-process scripted backend, seconds
    .venv/bin/python scripts/hostile_sweep.py --model tiny.gguf   # a real `ds4-mlx serve` subprocess

Without ``--model`` the server is the real app and HTTP stack (uvicorn + the guarded h11
protocol) in this process, with the test suite's ScriptedBackend in place of the model: the HTTP
layer is what most cases attack, and it answers in milliseconds.  With ``--model`` every family
runs against ``ds4-mlx serve`` in its own process, and the disk family (kill -9 during a save, a
read-only and a full KV directory) becomes possible.

Every case gets one outcome: "2xx", "4xx (named field)" (the error names the field the case
broke), "4xx", "503 busy" (queue full, with Retry-After: expected in the burst), "5xx",
"hang/timeout", "connection closed", "refused at start" (serve exited with a usage error), and
after every family "health failed" if /health did not answer 200.  5xx, hang/timeout and health
failed are findings; the exit status is 1 when there is any.  Only loopback and temp dirs are used.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
FINDINGS: list[str] = []  # one line per finding: the request and the start of the answer
FINDING_OUTCOMES = ("5xx", "hang/timeout", "health failed")
OUTCOMES = ("2xx", "4xx (named field)", "4xx", "503 busy", "5xx", "hang/timeout", "connection closed",
            "refused at start", "health failed")

ENDPOINTS = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                             "temperature": 0.5, "stream": False},
    "/v1/messages": {"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                     "system": "be brief", "stream": False},
    "/v1/responses": {"input": "hi", "max_output_tokens": 4, "instructions": "be brief", "stream": False},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4, "stream": False},
    "/v1/messages/count_tokens": {"model": "x", "messages": [{"role": "user", "content": "hi"}]},
}


# ------------------------------------------------------------------------------------------ raw HTTP

def raw_exchange(port: int, data: bytes, *, timeout: float, chunks: list[tuple[float, bytes]] | None = None,
                 read: bool = True) -> tuple[str, bytes]:
    """Send ``data`` (then each ``(pause, bytes)`` of ``chunks``) on a fresh connection and read
    until the server closes it.  Returns (outcome class before field naming, raw response)."""
    try:
        s = socket.create_connection((HOST, port), timeout=timeout)
    except OSError:
        return "connection closed", b""
    got = b""
    try:
        s.settimeout(timeout)
        s.sendall(data)
        for pause, piece in chunks or ():
            time.sleep(pause)
            s.sendall(piece)
        if not read:
            return "connection closed", b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            piece = s.recv(65536)
            if not piece:
                break
            got += piece
            if _complete(got):
                break
        else:
            return "hang/timeout", got
    except (TimeoutError, socket.timeout):
        return ("hang/timeout", got) if not got or not _complete(got) else (_status_class(got), got)
    except OSError:  # reset / broken pipe: the server hung up on us
        if not got:
            return "connection closed", got
    finally:
        s.close()
    return _status_class(got), got


def _complete(raw: bytes) -> bool:
    """A whole response with a Content-Length (Connection: close covers the rest at EOF)."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            try:
                return len(body) >= int(v.strip())
            except ValueError:
                return False
    return False


def _status_class(raw: bytes) -> str:
    if not raw.startswith(b"HTTP/1."):
        return "connection closed"
    try:
        code = int(raw.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return "connection closed"
    if code == 503 and b"retry-after:" in raw.lower().partition(b"\r\n\r\n")[0]:
        return "503 busy"
    return f"{code // 100}xx" if code // 100 in (2, 4, 5) else f"{code // 100}xx"


def request_bytes(path: str, body: bytes, *, method: str = "POST", headers: dict | None = None,
                  content_type: str | None = "application/json") -> bytes:
    h = {"Host": f"{HOST}", "Connection": "close"}
    if content_type is not None:
        h["Content-Type"] = content_type
    if method != "GET" or body:
        h["Content-Length"] = str(len(body))
    h.update(headers or {})
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items() if v is not None)
    return head.encode("latin-1") + b"\r\n" + body


def named(outcome: str, raw: bytes, field: str | None) -> str:
    """"4xx (named field)" when the error message says which field was wrong."""
    if outcome != "4xx" or not field:
        return outcome
    body = raw.partition(b"\r\n\r\n")[2].decode("utf-8", "replace")
    return "4xx (named field)" if field in body else outcome


def note(outcome: str, what: str, raw: bytes) -> str:
    """Keep what it takes to reproduce a finding; returns ``outcome``."""
    if outcome in FINDING_OUTCOMES:
        FINDINGS.append(f"{outcome} {what} -> {raw[:400]!r}")
    return outcome


# --------------------------------------------------------------------------------------------- targets

class InProcessTarget:
    """The real app + HTTP stack with the tests' ScriptedBackend; short deadlines so the slow
    clients are fast cases."""

    kind = "in-process scripted backend"

    def __init__(self, *, api_key: str | None = None, max_queue: int = 4, delay: float = 0.01,
                 header_timeout_s: float = 0.5, body_timeout_s: float = 0.5):
        sys.path.insert(0, str(REPO / "tests"))
        from server_backend import LiveServer, ScriptedBackend  # the suite's harness: one copy of it

        from ds4_mlx.frontends.server import ServerConfig

        self.header_timeout_s, self.body_timeout_s = header_timeout_s, body_timeout_s
        self.api_key = api_key
        cfg = ServerConfig(keepalive_s=0.2, api_key=api_key, header_timeout_s=header_timeout_s,
                           body_timeout_s=body_timeout_s, max_body_bytes=1024 * 1024)
        self.max_body_bytes = cfg.max_body_bytes
        self.backend = ScriptedBackend(max_queue=max_queue, delay=delay)
        self.max_queue = max_queue
        self._live = LiveServer(self.backend, cfg)
        self.port = self._live.port
        self.app = self._live.app

    def __enter__(self):
        self._live.__enter__()
        return self

    def __exit__(self, *exc):
        self._live.__exit__(*exc)

    long_prompt = "script:long"


class ServeTarget:
    """``ds4-mlx serve`` in its own process (the engine on a real GGUF)."""

    kind = "ds4-mlx serve subprocess"

    def __init__(self, model: str, *, api_key: str | None = None, max_queue: int = 4,
                 kv_dir: str | None = None, extra: list[str] = ()):
        sys.path.insert(0, str(REPO / "tests"))
        from server_backend import free_port

        self.model, self.api_key, self.max_queue, self.kv_dir = model, api_key, max_queue, kv_dir
        self.extra = list(extra)
        self.port = free_port()
        self.header_timeout_s, self.body_timeout_s = 10.0, 30.0  # serve has no options for these
        self.max_body_bytes = 16 * 1024 * 1024
        self.proc = None
        self.stderr_path = Path(tempfile.mkstemp(prefix="hostile-serve-", suffix=".log")[1])

    def start(self, timeout: float = 180) -> str | None:
        """None when healthy; else why not ("refused at start" when serve exited by itself)."""
        cmd = [sys.executable, "-m", "ds4_mlx.frontends.cli", "serve", "-m", self.model, "--port", str(self.port),
               "--ctx", "4096", "--max-tokens", "32", "--max-queue", str(self.max_queue), "--log-level", "info", *self.extra]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        if self.kv_dir:
            cmd += ["--kv-disk-dir", self.kv_dir]
        self.log = open(self.stderr_path, "a")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log, cwd=REPO)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return "refused at start"
            if health(self) == 200:
                return None
            time.sleep(0.3)
        return "hang/timeout"

    def kill9(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.kill9()

    def __enter__(self):
        why = self.start()
        if why:
            raise RuntimeError(f"serve did not start ({why}); log: {self.stderr_path}")
        return self

    def __exit__(self, *exc):
        self.stop()

    long_prompt = "tell me a long story " * 8


def health(target, timeout: float = 10.0) -> int | None:
    outcome, raw = raw_exchange(target.port, request_bytes("/health", b"", method="GET", content_type=None),
                                timeout=timeout)
    try:
        return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.") else None
    except (IndexError, ValueError):
        return None


def auth(target) -> dict:
    return {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}


def post(target, path: str, body, *, field: str | None = None, headers: dict | None = None,
         timeout: float = 20.0, content_type: str | None = "application/json") -> str:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    h = auth(target)
    h.update(headers or {})
    outcome, raw = raw_exchange(target.port, request_bytes(path, data, headers=h, content_type=content_type),
                                timeout=timeout)
    note(outcome, f"{path} {data[:300]!r}", raw)
    return named(outcome, raw, field)


# -------------------------------------------------------------------------------------------- families

def random_json(rng: random.Random, depth: int = 0):
    """One random JSON value, biased to the values that break type checks."""
    pick = rng.randrange(12)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.choice([0, -1, 1, 2**63, -(2**63) - 1, 10**400, 4096, 2**31])
    if pick == 3:
        return rng.choice([0.5, -1e308, 1e-320, 3.4e38])
    if pick == 4:
        return rng.choice(["", "x" * rng.randrange(1, 300), "\u0000", "user", "assistant", "tool", "\U0001f600",
                           "<｜User｜>", "auto", "none", "required"])
    if pick == 5 and depth < 3:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    if pick == 6 and depth < 3:
        return {rng.choice(["type", "role", "content", "text", "name", "x"]): random_json(rng, depth + 1)
                for _ in range(rng.randrange(4))}
    if pick == 7:
        return []
    if pick == 8:
        return {}
    return rng.choice(["hi", 7, [1], {"a": 1}, "-1"])


def field_paths(value, path=()):
    """Every (path, key name) of a body, nested ones included."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        yield path + (k,), (k if isinstance(k, str) else None)
        yield from field_paths(v, path + (k,))


def replaced(body, path, new):
    body = json.loads(json.dumps(body))
    at = body
    for k in path[:-1]:
        at = at[k]
    at[path[-1]] = new
    return body


def family_bodies(target, rng: random.Random, cases: int) -> list[str]:
    out = []
    # seeded fuzz: a random value in every field (nested ones too) of each endpoint's valid body
    per_field = []
    for ep, body in ENDPOINTS.items():
        for path, name in field_paths(body):
            per_field.append((ep, body, path, name))
    for i in range(cases):
        ep, body, path, name = per_field[i % len(per_field)]
        value = random_json(rng)
        if path[-1] == "stream":
            value = rng.choice([value, True])
        field = name if name is not None else (path[-2] if len(path) > 1 and isinstance(path[-2], str) else None)
        out.append(post(target, ep, replaced(body, path, value), field=field))
    chat = ENDPOINTS["/v1/chat/completions"]
    fixed = [
        (b"{", None), (b"", None), (b"null", None), (b"[]", None), (b"\"just a string\"", None),
        (b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 4}', "content"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + b"0" * 5000 + b"}", "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": NaN}', None),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', None),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -Infinity}', None),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', "temperature"),
        (b'{"a":' * 10000 + b"1" + b"}" * 10000, None),          # deep nesting
        (b"[" * 100000 + b"]" * 100000, None),
        (b"\xff\xfe\x00garbage", None),                         # not UTF-8
        (json.dumps({**chat, "tools": [{"type": "function", "function": {"name": f"t{i}", "parameters": {}}}
                                       for i in range(5000)]}).encode(), "tools"),
        (json.dumps({**chat, "messages": [{"role": "user", "content": "x" * 100}] * 5000}).encode(), None),
    ]
    for data, field in fixed:
        for ep in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
            out.append(post(target, ep, data, field=field))
    # oversized body (beyond --max-body-mb), and the wrong Content-Types
    out.append(post(target, "/v1/chat/completions", b" " * (target.max_body_bytes + 10) + json.dumps(chat).encode()))
    for ctype in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        out.append(post(target, "/v1/chat/completions", chat, content_type=ctype))
    return out


def family_headers(target, rng: random.Random, cases: int) -> list[str]:
    out = []
    body = json.dumps(ENDPOINTS["/v1/chat/completions"]).encode()
    base = {"Connection": "close", "Content-Type": "application/json", **auth(target)}

    def send(head_lines: list[str], payload: bytes = body, timeout: float = 10.0) -> str:
        head = "".join(f"{line}\r\n" for line in head_lines).encode("latin-1", "replace")
        outcome, raw = raw_exchange(target.port, head + b"\r\n" + payload, timeout=timeout)
        return note(outcome, f"{head[:300]!r} + {payload[:100]!r}", raw)

    common = [f"{k}: {v}" for k, v in base.items()]
    ln = f"Content-Length: {len(body)}"
    start = "POST /v1/chat/completions HTTP/1.1"
    out.append(send([start, *common, ln]))                                   # no Host at all
    for host in ("evil.example", "", "127.0.0.1:99999", "a" * 5000, "127.0.0.1, evil.example"):
        out.append(send([start, f"Host: {host}", *common, ln]))
    out.append(send([start, f"Host: {HOST}", f"Host: evil.example", *common, ln]))
    if target.api_key:
        for bad in ("Bearer wrong", "Bearer ", "Basic Zm9vOmJhcg==", "Bearer " + "k" * 10000, ""):
            out.append(send([start, f"Host: {HOST}", "Connection: close", "Content-Type: application/json",
                             f"Authorization: {bad}", ln]))
        out.append(send([start, f"Host: {HOST}", "Connection: close", "Content-Type: application/json",
                         "x-api-key: wrong", ln]))
    for cl in ("-1", "abc", "99999999999999999999", "1e3", f"{len(body)}, {len(body) + 1}"):
        out.append(send([start, f"Host: {HOST}", *common, f"Content-Length: {cl}"], timeout=5))
    # a Content-Length far beyond the body that is sent: the body deadline answers (408) or the
    # size limit does (413), never a hang
    out.append(send([start, f"Host: {HOST}", *common, f"Content-Length: {target.max_body_bytes * 4}"],
                    timeout=target.body_timeout_s + 5))
    out.append(send([start, f"Host: {HOST}", *common, f"Content-Length: {len(body) + 50}"],
                    timeout=target.body_timeout_s + 5))
    out.append(send([start, f"Host: {HOST}", *common, ln, f"Content-Length: {len(body) + 1}"]))
    chunked = [start, f"Host: {HOST}", *common, "Transfer-Encoding: chunked"]
    for garbage in (b"zz\r\nhello\r\n0\r\n\r\n", b"ffffffffffffffff\r\nx\r\n", b"5\r\nab\r\n0\r\n\r\n",
                    b"-5\r\nhello\r\n0\r\n\r\n"):
        out.append(send(chunked, garbage, timeout=target.body_timeout_s + 5))
    out.append(send(chunked + [ln]))                                          # both framings
    ok_chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    out.append(send(chunked, ok_chunked))                                      # valid chunked: 2xx
    for line in ("GARBAGE", "POST /v1/chat/completions HTTP/9.9", "POST " + "/a" * 20000 + " HTTP/1.1",
                 "\x00\x01\x02", "GET /health HTTP/1.1\r\nX: " + "v" * 100000):
        out.append(send([line, f"Host: {HOST}", "Connection: close"], b""))
    header_flood = [start, f"Host: {HOST}", *common, ln] + [f"X-{i}: {'y' * 50}" for i in range(2000)]
    out.append(send(header_flood))
    for _ in range(max(0, cases // 20)):  # random bytes where a request line should be
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
        outcome, raw = raw_exchange(target.port, junk + b"\r\n\r\n", timeout=5)
        out.append(note(outcome, f"junk {junk[:100]!r}", raw))
    return out


def family_slow(target, rng: random.Random, cases: int) -> list[str]:
    """Headers trickled past the header deadline (the server must close: "connection closed"
    expected), a body that stops coming (408 expected), and a head trickled just inside it."""
    out = []
    body = json.dumps(ENDPOINTS["/v1/chat/completions"]).encode()
    req = request_bytes("/v1/chat/completions", body, headers=auth(target))
    head, _, _ = req.partition(b"\r\n\r\n")
    ht, bt = target.header_timeout_s, target.body_timeout_s
    # one byte every ht/4 s: the head takes far longer than ht; the server must cut it off
    step = ht / 4
    pieces = [(step, head[i:i + 1]) for i in range(1, min(len(head), 40))]
    out.append(raw_exchange(target.port, head[:1], chunks=pieces, timeout=ht * 3 + 5)[0])
    out.append(raw_exchange(target.port, b"", chunks=[(ht * 2, b"")], timeout=ht + 5)[0])  # silent
    # the body stalls half way
    half = req[: len(req) - len(body) // 2]
    out.append(raw_exchange(target.port, half, timeout=bt + 10)[0])
    # a whole head sent at once, the body dribbled within the body deadline: must still work
    pieces = [(bt / 10, body[i:i + 20]) for i in range(0, len(body), 20)]
    out.append(raw_exchange(target.port, head + b"\r\n\r\n", chunks=pieces, timeout=bt * 2 + 20)[0])
    return out


def family_disconnects(target, rng: random.Random, cases: int) -> list[str]:
    """Leave mid-head, mid-body, before the answer, and mid-stream; each case's outcome is that of
    the valid request sent right after (2xx expected: the server shrugged the disconnect off)."""
    out = []
    after = ENDPOINTS["/v1/chat/completions"]
    n = max(4, cases // 10)
    for i in range(n):
        ep = list(ENDPOINTS)[i % 4]
        body = dict(ENDPOINTS[ep])
        if ep != "/v1/messages/count_tokens":
            body["stream"] = True
            body[("max_output_tokens" if ep == "/v1/responses" else "max_tokens")] = 64
        if ep == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": target.long_prompt}]
        data = request_bytes(ep, json.dumps(body).encode(), headers=auth(target))
        cut = rng.choice(["head", "body", "before-answer", "mid-stream"])
        s = socket.create_connection((HOST, target.port), timeout=10)
        try:
            if cut == "head":
                s.sendall(data[: rng.randrange(1, data.index(b"\r\n\r\n"))])
            elif cut == "body":
                s.sendall(data[: rng.randrange(data.index(b"\r\n\r\n") + 4, len(data))])
            else:
                s.sendall(data)
                if cut == "mid-stream":
                    s.recv(rng.randrange(1, 400))
            if rng.random() < 0.5:  # RST instead of FIN
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        except OSError:
            pass
        finally:
            s.close()
        out.append(post(target, "/v1/chat/completions", after, timeout=60))
    return out


def family_concurrency(target, rng: random.Random, cases: int, n_streams: int = 4) -> list[str]:
    """N parallel streams (all 2xx), then a burst well beyond --max-queue (2xx or "503 busy")."""
    results: list[str] = []
    lock = threading.Lock()

    def one(body, timeout):
        r = post(target, "/v1/chat/completions", body, timeout=timeout)
        with lock:
            results.append(r)

    stream = {**ENDPOINTS["/v1/chat/completions"], "stream": True}
    threads = [threading.Thread(target=one, args=(stream, 120)) for _ in range(n_streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    long = {**ENDPOINTS["/v1/chat/completions"], "max_tokens": 64,
            "messages": [{"role": "user", "content": target.long_prompt}]}
    burst = target.max_queue * 3 + 2
    threads = [threading.Thread(target=one, args=(long, 300)) for _ in range(burst)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if "503 busy" not in results:  # a burst this size must overflow the queue somewhere
        results.append("5xx")
    return results


FAST_FAMILIES = {"bodies": family_bodies, "headers": family_headers, "disconnects": family_disconnects,
                 "concurrency": family_concurrency}
SLOW_FAMILIES = {"slow clients": family_slow}


# -------------------------------------------------------------------------------------------- disk

def family_disk(model: str, rng: random.Random, cases: int) -> list[str]:
    """kill -9 while a disk-cache save is under way, then restart on the same directory (it must
    serve); a read-only KV dir; a full one (a tiny tmpfs).  Needs --model (the engine saves)."""
    out = []
    base = Path(tempfile.mkdtemp(prefix="hostile-kv-"))
    # long enough for a cold save (>= the store's min_tokens), so a save runs during the request
    long_prompt = " ".join(f"word{i}" for i in range(900))
    body = {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 4}
    kv = base / "kv"
    kv.mkdir()
    try:
        for delay in (0.3, 0.8, 1.5, 3.0)[: max(1, min(4, cases // 25))]:
            t = ServeTarget(model, kv_dir=str(kv))
            why = t.start()
            if why:
                out.append(why if why != "refused at start" else "5xx")
                continue
            th = threading.Thread(target=post, args=(t, "/v1/chat/completions",
                                                     {**body, "messages": [{"role": "user",
                                                                            "content": long_prompt + f" {delay}"}]}),
                                  kwargs={"timeout": 120}, daemon=True)
            th.start()
            time.sleep(delay)
            t.kill9()
            th.join(5)
            t2 = ServeTarget(model, kv_dir=str(kv))
            why = t2.start()
            if why:
                out.append("health failed")
                continue
            out.append(post(t2, "/v1/chat/completions", body, timeout=120))
            out.append(post(t2, "/v1/chat/completions", body, timeout=120))  # again: a disk or live hit
            t2.stop()
        out += _odd_dir(model, base / "ro", "ro", body)
        out += _odd_dir(model, base / "full", "size=96k", body)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return out


def _odd_dir(model: str, d: Path, opts: str, body) -> list[str]:
    """serve on a tmpfs mounted with ``opts``: refusing at start with a usage error is fine, so
    is serving (saves failing quietly); a 5xx or a crash is not."""
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)], capture_output=True)
    if r.returncode != 0:
        print(f"  (disk: cannot mount a tmpfs with {opts}: {r.stderr.decode().strip()}; skipped)")
        return []
    try:
        if opts == "size=96k":  # fill it to the last block, as a full disk is
            try:  # the close flushes too, and fails the same way
                with open(d / "filler", "wb") as f:
                    while True:
                        f.write(b"\0" * 4096)
                        f.flush()
            except OSError:
                pass
        t = ServeTarget(model, kv_dir=str(d))
        why = t.start()
        if why == "refused at start":
            return ["refused at start"]
        if why:
            return [why]
        out = [post(t, "/v1/chat/completions", body, timeout=120) for _ in range(2)]
        if t.proc.poll() is not None:
            out.append("health failed")
        t.stop()
        return out
    finally:
        subprocess.run(["umount", str(d)], capture_output=True)


# ---------------------------------------------------------------------------------------------- main

def run_family(name: str, fn, target, rng, cases: int) -> Counter:
    c = Counter(fn(target, rng, cases))
    if health(target) != 200:  # after every family /health must answer
        c["health failed"] += 1
    return c


def sweep(*, fast: bool, seed: int, cases: int, model: str | None = None, api_key: str | None = "sweep-key",
          families: list[str] | None = None, target=None) -> dict[str, Counter]:
    """Family -> outcome counts.  ``target``: an already running one (tests pass their own)."""
    rng = random.Random(seed)
    chosen = dict(FAST_FAMILIES)
    if not fast:
        chosen.update(SLOW_FAMILIES)
    if families:
        chosen = {k: v for k, v in {**FAST_FAMILIES, **SLOW_FAMILIES}.items() if k in families}
    results: dict[str, Counter] = {}
    if target is None:
        target = ServeTarget(model, api_key=api_key) if model else InProcessTarget(api_key=api_key)
        ctx = target
    else:
        ctx = None
    if ctx is not None:
        ctx.__enter__()
    try:
        for name, fn in chosen.items():
            t0 = time.monotonic()
            results[name] = run_family(name, fn, target, rng, cases)
            print(f"  {name}: {sum(results[name].values())} cases, {time.monotonic() - t0:.1f} s", flush=True)
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    if not fast and model and (not families or "disk" in families):
        t0 = time.monotonic()
        results["disk"] = Counter(family_disk(model, rng, cases))
        print(f"  disk: {sum(results['disk'].values())} cases, {time.monotonic() - t0:.1f} s", flush=True)
    elif not fast and not families:
        print("  disk: skipped (needs --model: the scripted backend has no disk cache)")
    return results


def findings(results: dict[str, Counter]) -> int:
    return sum(c[o] for c in results.values() for o in FINDING_OUTCOMES)


def table(results: dict[str, Counter]) -> str:
    cols = [o for o in OUTCOMES if any(c[o] for c in results.values())] or ["2xx"]
    rows = ["| family | cases | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
    for fam, c in results.items():
        rows.append(f"| {fam} | {sum(c.values())} | " + " | ".join(str(c[o]) for o in cols) + " |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF for a real `ds4-mlx serve` subprocess (default: in-process scripted backend)")
    ap.add_argument("--fast", action="store_true", help="only the fast families (bodies, headers, disconnects, concurrency)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", type=int, default=200, help="fuzzed body cases (other families scale from it)")
    ap.add_argument("--family", action="append", help="run only this family (repeatable)")
    ap.add_argument("--no-api-key", action="store_true", help="serve without --api-key (skips the bad-auth cases)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    results = sweep(fast=args.fast, seed=args.seed, cases=args.cases, model=args.model,
                    api_key=None if args.no_api_key else "sweep-key", families=args.family)
    print(table(results))
    n = findings(results)
    print(f"total {sum(sum(c.values()) for c in results.values())} cases in {time.monotonic() - t0:.1f} s")
    print(f"findings: {n}")
    for line in FINDINGS:
        print("  " + line)
    return 1 if n else 0


if __name__ == "__main__":
    sys.exit(main())
