"""Scheduling: 16 concurrent clients, disconnect mid-stream cancels the job, prefill keepalives,
shutdown cancels in-flight work; and property-based fuzzing of request bodies (never a 5xx)."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_backend import LiveServer, ScriptedBackend, http, sse_frames


def test_sixteen_concurrent_clients():
    backend = ScriptedBackend(delay=0.002)
    with LiveServer(backend) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)

        def ask(i):
            if i % 2:
                return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": f"hi {i}"}], stream=True) if c.choices)
            return client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"hi {i}"}]).choices[0].message.content

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(ask, range(16)))
        assert answers == ["Hello, world!"] * 16
        assert len(backend.requests) == 16


def _open_stream(port: int, body: dict) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _wait(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_disconnect_mid_stream_cancels_and_server_stays_healthy():
    backend = ScriptedBackend(delay=0.05)
    with LiveServer(backend) as s:
        sock = _open_stream(s.port, {"messages": [{"role": "user", "content": "script:long"}], "stream": True})
        got = b""
        while b"tick" not in got:
            got += sock.recv(4096)
        sock.close()
        _wait(lambda: backend.cancelled)
        _wait(lambda: not backend.busy)
        status, _, body = http(s.url, "GET", "/metrics")
        assert "ds4_client_disconnects_total 1" in body.decode()
        r = http(s.url, "POST", "/v1/chat/completions",
                 json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
        assert r[0] == 200 and json.loads(r[2])["choices"][0]["message"]["content"] == "Hello, world!"


def test_disconnect_non_stream_cancels():
    backend = ScriptedBackend(delay=0.05)
    with LiveServer(backend) as s:
        sock = _open_stream(s.port, {"messages": [{"role": "user", "content": "script:long"}]})
        _wait(lambda: backend.busy)
        sock.close()
        _wait(lambda: backend.cancelled)
        _wait(lambda: not backend.busy)


def test_waiting_job_withdrawn_on_disconnect():
    backend = ScriptedBackend(delay=0.05)
    with LiveServer(backend) as s:
        first = _open_stream(s.port, {"messages": [{"role": "user", "content": "script:long"}]})
        _wait(lambda: backend.busy)
        second = _open_stream(s.port, {"messages": [{"role": "user", "content": "hi"}]})
        _wait(lambda: backend.queue_depth == 1)
        second.close()
        _wait(lambda: backend.queue_depth == 0)
        first.close()
        _wait(lambda: not backend.busy)
        assert len(backend.requests) == 1  # the withdrawn job never ran


def test_prefill_keepalive_comments():
    backend = ScriptedBackend(prefill_s=0.8)
    with LiveServer(backend) as s:
        status, _, raw = http(s.url, "POST", "/v1/chat/completions",
                              json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True}))
        frames = sse_frames(raw)
        assert status == 200 and frames[0] == ": prefill" and frames[-1] == "data: [DONE]"


def test_shutdown_cancels_in_flight_stream():
    backend = ScriptedBackend(delay=0.05)
    s = LiveServer(backend).__enter__()
    result = {}

    def run():
        result["r"] = http(s.url, "POST", "/v1/chat/completions",
                           json.dumps({"messages": [{"role": "user", "content": "script:long"}], "stream": True}))

    t = threading.Thread(target=run)
    t.start()
    _wait(lambda: backend.busy)
    s.__exit__(None, None, None)
    t.join(20)
    status, _, raw = result["r"]
    chunks = [json.loads(f[6:]) for f in sse_frames(raw) if f.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "error"
    assert not backend.alive


# -- fuzzing -----------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)
FIELDS = ["messages", "model", "tools", "tool_choice", "max_tokens", "temperature", "top_p", "top_k", "min_p",
          "stop", "stream", "seed", "thinking", "think", "reasoning_effort", "system", "input", "prompt",
          "stop_sequences", "instructions", "reasoning", "output_config", "stream_options", "max_output_tokens"]
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool", "system", "x"]) | json_values,
                                 "content": st.text(max_size=30) | json_values},
                                optional={"tool_calls": json_values, "tool_call_id": json_values,
                                          "reasoning_content": json_values})
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6) | st.fixed_dictionaries(
    {"messages": st.lists(message, min_size=1, max_size=4)},
    optional={f: json_values for f in FIELDS if f != "messages"})

_fuzz = {}


def _fuzz_server():
    if "s" not in _fuzz:
        _fuzz["s"] = LiveServer(ScriptedBackend()).__enter__()
    return _fuzz["s"]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"]),
       body=bodies)
def test_fuzz_request_bodies_never_5xx(path, body):
    s = _fuzz_server()
    status, _, raw = http(s.url, "POST", path, json.dumps(body))
    assert status < 500, (status, raw[:300])
    if status >= 400:
        assert "error" in json.loads(raw)


def test_fuzz_server_still_alive():
    s = _fuzz_server()
    assert http(s.url, "GET", "/health")[0] == 200
    s.__exit__(None, None, None)
