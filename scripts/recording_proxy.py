"""A loopback HTTP proxy that records every request and response passing through it.

Developer tool for :mod:`scripts.agent_clients` (never imported by the package): a real agent
client talks to this proxy, the proxy forwards to ``ds4-mlx serve`` and appends one JSON line per
exchange to a log, with the request's method, path, headers and body and the response's status,
headers and body (an SSE stream is recorded whole, and passed on chunk by chunk as it arrives so
the client sees the server's real timing).

    python scripts/recording_proxy.py --listen 8001 --upstream 8000 --log exchanges.jsonl
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-authorization", "proxy-authenticate", "content-length"}


def _text(raw: bytes):
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw.decode("utf-8", "replace")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    upstream: tuple[str, int] = ("127.0.0.1", 8000)
    log_path: str = "exchanges.jsonl"
    lock = threading.Lock()
    counter = [0]

    def log_message(self, *args):  # the log file is the record; stderr stays quiet
        pass

    def _relay(self) -> None:
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(n) if n else b""
        t0 = time.time()
        conn = http.client.HTTPConnection(*self.upstream, timeout=3600)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["Content-Length"] = str(len(body))
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
        except OSError as exc:
            self.send_error(502, f"upstream: {exc}")
            self._record(body, 502, {}, str(exc).encode(), t0)
            return
        self.send_response_only(resp.status, resp.reason)
        out_headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP_BY_HOP]
        for k, v in out_headers:
            self.send_header(k, v)
        chunked = self.command != "HEAD"
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        got = bytearray()
        while chunked:
            piece = resp.read1(65536)
            if not piece:
                break
            got += piece
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
            except OSError:  # the client went away: stop reading, the server frees its worker
                break
        if chunked:
            try:
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                pass
        conn.close()
        self._record(body, resp.status, dict(out_headers), bytes(got), t0)

    def _record(self, body: bytes, status: int, headers: dict, out: bytes, t0: float) -> None:
        with self.lock:
            self.counter[0] += 1
            entry = {"n": self.counter[0], "t": round(t0, 3), "seconds": round(time.time() - t0, 3),
                     "method": self.command, "path": self.path, "headers": dict(self.headers.items()),
                     "body": _text(body), "status": status, "response_headers": headers,
                     "response": out.decode("utf-8", "replace")}
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry, ensure_ascii=False) + "\n")

    do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = _relay


def serve(listen: int, upstream: int, log_path: str) -> ThreadingHTTPServer:
    """Start the proxy on a daemon thread; returns the server (``.shutdown()`` stops it)."""
    handler = type("Handler", (_Handler,), {"upstream": ("127.0.0.1", upstream), "log_path": log_path})
    httpd = ThreadingHTTPServer(("127.0.0.1", listen), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", type=int, default=8001)
    ap.add_argument("--upstream", type=int, default=8000)
    ap.add_argument("--log", default="exchanges.jsonl")
    a = ap.parse_args()
    serve(a.listen, a.upstream, a.log)
    threading.Event().wait()


if __name__ == "__main__":
    main()
