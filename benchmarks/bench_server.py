"""Agent-like load on `ds4-mlx serve`: time to first token cold vs warm (live KV) vs from disk, and
requests/s of short completions with concurrent clients.

An agent resends its whole transcript every turn. The transcript here is a system prompt plus
tool-call / tool-result turns totalling about ``--tokens`` tokens, resent with a growing tail over
``--turns`` turns:

* cold: each turn's transcript on a fresh server with no disk cache (nothing reusable);
* warm: the same turns in order on one server (each extends the live KV of the previous one);
* disk: a server restarted on the disk cache the warm run left (first turn after the restart).

Goal (issue 9): warm TTFT <= 5 % of cold. Then ``--clients`` clients send short completions
concurrently for ``--seconds`` seconds (one inference worker: requests queue FIFO).

    python benchmarks/bench_server.py -m tiny.gguf [--tokens 8000 --turns 10 --clients 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from server_backend import LiveServer, http  # noqa: E402  (the tests' loopback harness)

from ds4_mlx.frontends.server import EngineBackend, ServerConfig  # noqa: E402


def transcript(n_tokens: int, turns: int) -> list[list[dict]]:
    """``turns`` request bodies' messages, each extending the previous one by a tool round trip;
    the first holds about ``n_tokens`` - (tail) tokens of system prompt."""
    system = "You are a coding agent. " + " ".join(f"Rule {i}: keep files tidy and tests green."
                                                     for i in range(max(1, n_tokens // 11)))
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Fix the failing test."}]
    out = []
    for t in range(turns):
        out.append(list(msgs))
        cid = f"call_{t:032x}"
        msgs = msgs + [
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": cid, "type": "function",
                             "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/m{t}.py"})}}]},
            {"role": "tool", "tool_call_id": cid, "content": f"def f{t}(x):\n    return x + {t}\n" * 8}]
    return out


TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                           "parameters": {"type": "object",
                                                          "properties": {"path": {"type": "string"}}}}}]


def ttft(url: str, messages: list[dict]) -> tuple[float, dict]:
    """Seconds to the first streamed chunk with content, and the cache header."""
    import http.client as hc

    body = json.dumps({"model": "deepseek-chat", "messages": messages, "tools": TOOLS, "max_tokens": 1,
                       "temperature": 0, "stream": True})
    host, port = url.removeprefix("http://").split(":")
    conn = hc.HTTPConnection(host, int(port), timeout=3600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = None
    for line in resp:
        if first is None and line.startswith(b"data: ") and b'"delta":{"role"' not in line:
            first = time.perf_counter() - t0
        if line.startswith(b"data: [DONE]"):
            break
    conn.close()
    return first or (time.perf_counter() - t0), {"cache": resp.getheader("x-ds4-cache")}


def server(model: str, ctx: int, kv_dir: str | None) -> LiveServer:
    return LiveServer(EngineBackend(model, ctx=ctx, kv_disk_dir=kv_dir),
                      ServerConfig(ctx=ctx, keepalive_s=5.0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--tokens", type=int, default=8000, help="transcript size (default 8000)")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--cold-turns", type=int, default=2, help="turns measured cold (each restarts a server)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--ctx", type=int, default=16384)
    args = ap.parse_args()

    turns = transcript(args.tokens, args.turns)
    kv_dir = tempfile.mkdtemp(prefix="bench-server-kv-")
    cold = []
    for i in range(min(args.cold_turns, len(turns))):
        with server(args.model, args.ctx, None) as s:
            t, info = ttft(s.url, turns[-1 - i])
            cold.append(t)
    warm, first_warm, headers = [], None, []
    with server(args.model, args.ctx, kv_dir) as s:
        for k, msgs in enumerate(turns):
            t, info = ttft(s.url, msgs)
            headers.append(info["cache"])
            if k == 0:
                first_warm = t
            else:
                warm.append(t)
    with server(args.model, args.ctx, kv_dir) as s:  # restarted: live KV gone, disk kept
        disk_t, disk_info = ttft(s.url, turns[-1])

        done = [0]
        stop = time.monotonic() + args.seconds

        def client(i: int) -> None:
            n = 0
            while time.monotonic() < stop:
                status, _, _ = http(s.url, "POST", "/v1/chat/completions", json.dumps(
                    {"model": "deepseek-chat", "messages": [{"role": "user", "content": f"ping {i} {n}"}],
                     "max_tokens": 4, "temperature": 0}), timeout=3600)
                n += status == 200
            done[0] += n

        t0 = time.monotonic()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rps = done[0] / (time.monotonic() - t0)

    cold_t = sum(cold) / len(cold)
    warm_t = sum(warm) / max(1, len(warm))
    rows = [("cold (no cache, full transcript)", cold_t, "source=none"),
            ("first turn on a fresh server", first_warm, headers[0]),
            (f"warm live (mean of turns 2..{len(turns)})", warm_t, headers[-1]),
            ("disk after restart (last turn)", disk_t, disk_info["cache"])]
    print(f"transcript: ~{args.tokens} tokens, {len(turns)} turns; model {args.model}")
    print(f"{'TTFT':<40} {'seconds':>9} {'% of cold':>10}  cache")
    for name, t, h in rows:
        print(f"{name:<40} {t:9.3f} {100 * t / cold_t:9.1f}%  {h}")
    print(f"warm/cold = {100 * warm_t / cold_t:.1f}% (goal <= 5%)")
    print(f"short completions: {rps:.2f} requests/s with {args.clients} concurrent clients "
          f"({done[0]} in {args.seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
