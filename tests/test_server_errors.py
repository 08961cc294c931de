"""Security and error paths: API key, body/depth/count caps, bad JSON, unknown paths, CORS,
queue full; every error has a JSON body in the client's protocol shape."""

from __future__ import annotations

import json
import socket

import anthropic
import openai
import pytest

from ds4_mlx.frontends.server import ServerConfig
from server_backend import LiveServer, ScriptedBackend, http

KEY = "s3cret-key"
CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}]})


@pytest.fixture(scope="module")
def live():
    with LiveServer(ScriptedBackend(), ServerConfig(api_key=KEY, cors=("http://app.example",), keepalive_s=0.2,
                                                    max_messages=50)) as s:
        yield s


AUTH = {"Authorization": f"Bearer {KEY}"}


def assert_openai_error(status_body, status):
    got, _, body = status_body
    assert got == status, body
    err = json.loads(body)["error"]
    assert isinstance(err["message"], str) and err["type"]
    assert "Traceback" not in err["message"]
    return err


def test_api_key(live):
    assert_openai_error(http(live.url, "POST", "/v1/chat/completions", CHAT), 401)
    assert_openai_error(http(live.url, "POST", "/v1/chat/completions", CHAT,
                             {"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(http(live.url, "GET", "/v1/models", None, {"x-api-key": KEY + "x"}), 401)
    status, _, body = http(live.url, "POST", "/v1/messages", CHAT)
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    assert json.loads(body)["type"] == "error"
    assert http(live.url, "POST", "/v1/chat/completions", CHAT, AUTH)[0] == 200
    assert http(live.url, "POST", "/v1/chat/completions", CHAT, {"x-api-key": KEY})[0] == 200
    assert http(live.url, "GET", "/health")[0] == 200  # liveness probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live.url + "/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=live.url, api_key="nope", max_retries=0).messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    ok = anthropic.Anthropic(base_url=live.url, api_key=KEY, max_retries=0).messages.create(
        model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert ok.content[-1].text == "Hello, world!"


def test_bad_json_unknown_path_and_method(live):
    err = assert_openai_error(http(live.url, "POST", "/v1/chat/completions", "{not json", AUTH), 400)
    assert err["message"] == "invalid JSON request"
    assert_openai_error(http(live.url, "POST", "/v1/chat/completions", b"\xff\xfe", AUTH), 400)
    err = assert_openai_error(http(live.url, "GET", "/nope", None, AUTH), 404)
    assert err == {"message": "unknown endpoint", "type": "invalid_request_error"}
    assert_openai_error(http(live.url, "GET", "/v1/chat/completions", None, AUTH), 405)
    assert_openai_error(http(live.url, "POST", "/v1/chat/completions", "[]", AUTH), 400)
    assert_openai_error(http(live.url, "POST", "/v1/chat/completions", "{}", AUTH), 400)
    assert_openai_error(http(live.url, "POST", "/v1/responses", '{"input": 5}', AUTH), 400)
    assert_openai_error(http(live.url, "POST", "/v1/completions", '{"prompt": null}', AUTH), 400)
    for field in ({"temperature": "hot"}, {"max_tokens": 0}, {"top_p": 2}, {"stop": [1]},
                  {"tool_choice": "sometimes"}, {"thinking": "yes"}, {"reasoning_effort": "huge"},
                  {"seed": 1.5}, {"stream": "yes"}, {"messages": [{"role": "user", "content": [{"text": 5}]}]},
                  {"messages": [{"role": 3}]}, {"tools": {"a": 1}}):
        body = dict({"messages": [{"role": "user", "content": "hi"}]}, **field)
        assert_openai_error(http(live.url, "POST", "/v1/chat/completions", json.dumps(body), AUTH), 400)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/completions", "/v1/responses"])
def test_lone_surrogates_and_overflowing_numbers_are_400_naming_the_field(live, path):
    """Issue #26 item 2: a lone UTF-16 surrogate in ``model`` and an integer ``temperature`` past
    float's range were HTTP 500 (a surrogate string also streamed a 200 with a broken body)."""
    base = {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi", "max_tokens": 4}
    cases = [
        ('"model": "m\\ud800"', "model"),
        ('"messages": [{"role": "user", "content": "a\\udfffb"}]', "messages[0].content"),
        ('"stream": true, "model": "\\udc00"', "model"),
        ('"temperature": 1' + "0" * 400, "temperature"),
        ('"top_p": -1' + "0" * 400, "top_p"),
    ]
    for extra, field in cases:
        body = json.dumps(base)[:-1] + ", " + extra + "}"
        status, _, text = http(live.url, "POST", path, body, AUTH)
        assert status == 400, (path, extra, status, text[:300])
        doc = json.loads(text)
        err = doc["error"]
        assert field in err["message"], (path, err)
        assert "Traceback" not in err["message"] and len(err["message"]) < 300
    assert http(live.url, "GET", "/health")[0] == 200


def test_deep_nesting_and_message_count(live):
    deep = '{"messages": [{"role": "user", "content": "x"}], "x": ' + "[" * 100000 + "]" * 100000 + "}"
    status, _, body = http(live.url, "POST", "/v1/chat/completions", deep, AUTH)
    assert status in (400, 413, 422) and "error" in json.loads(body)
    deep = '{"messages": [{"role": "user", "content": "x"}], "x": ' + "[" * 200 + "]" * 200 + "}"
    assert_openai_error(http(live.url, "POST", "/v1/chat/completions", deep, AUTH), 400)
    many = json.dumps({"messages": [{"role": "user", "content": "x"}] * 51})
    assert_openai_error(http(live.url, "POST", "/v1/chat/completions", many, AUTH), 413)
    assert http(live.url, "GET", "/health")[0] == 200


def _send_huge(url_port: int, declared: int, send: int) -> bytes:
    """POST a body of ``send`` bytes declaring ``declared``; return what the server answered."""
    s = socket.create_connection(("127.0.0.1", url_port), timeout=20)
    try:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n".encode())
        chunk = b" " * (1 << 20)
        try:
            for _ in range(send >> 20):
                s.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = b""
        try:
            while True:
                got = s.recv(65536)
                if not got:
                    break
                data += got
        except (ConnectionResetError, socket.timeout):
            pass
        return data
    finally:
        s.close()


def test_64mib_body_is_413(live):
    answer = _send_huge(live.port, 64 << 20, 64 << 20)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"error"' in answer
    assert http(live.url, "GET", "/health")[0] == 200


def test_cors_and_options(live):
    origin = {"Origin": "http://app.example"}
    status, headers, _ = http(live.url, "OPTIONS", "/v1/chat/completions", None, origin)
    assert status == 204 and headers["access-control-allow-origin"] == "http://app.example"
    assert headers["vary"] == "Origin"
    status, headers, _ = http(live.url, "GET", "/v1/models", None, {**AUTH, **origin})
    assert headers["access-control-allow-methods"] == "GET, POST, OPTIONS"
    # another site gets no CORS headers (its browser then refuses to hand it the answer)
    status, headers, _ = http(live.url, "OPTIONS", "/v1/chat/completions", None, {"Origin": "http://evil.example"})
    assert status == 204 and "access-control-allow-origin" not in headers


def test_no_cors_headers_by_default():
    with LiveServer(ScriptedBackend()) as s:
        status, headers, _ = http(s.url, "OPTIONS", "/v1/models")
        assert status == 204 and "access-control-allow-origin" not in headers


def test_queue_full_is_503_with_retry_after():
    backend = ScriptedBackend(max_queue=0, prefill_s=2.0)
    with LiveServer(backend) as s:
        import threading

        first = threading.Thread(target=http, args=(s.url, "POST", "/v1/chat/completions", CHAT))
        first.start()
        import time
        deadline = time.monotonic() + 10
        while not backend.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        status, headers, body = http(s.url, "POST", "/v1/chat/completions", CHAT)
        assert status == 503 and headers["retry-after"].isdigit()
        assert "queue is full" in json.loads(body)["error"]["message"]
        status, _, body = http(s.url, "POST", "/v1/messages", CHAT)
        assert status == 503 and json.loads(body)["error"]["type"] == "overloaded_error"
        first.join()
        assert http(s.url, "GET", "/health")[0] == 200


def test_a_foreign_host_and_a_non_json_post_are_refused_before_anything_runs(live):
    """#26 item 6: any web page could make the default (no key, localhost) server generate with a
    cross-site text/plain POST, and a DNS-rebinding page could read the answers."""
    backend = ScriptedBackend()
    with LiveServer(backend, ServerConfig(keepalive_s=0.2)) as s:
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "[::2]:1"):
            status, _, raw = http(s.url, "POST", "/v1/chat/completions", CHAT, {"Host": host})
            assert status == 421 and "is not served here" in json.loads(raw)["error"]["message"], host
            assert http(s.url, "GET", "/health", None, {"Host": host})[0] == 421
        for host in ("localhost:1234", "127.0.0.1", "[::1]:8000", "LOCALHOST"):
            assert http(s.url, "POST", "/v1/chat/completions", CHAT, {"Host": host})[0] == 200, host
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
            status, _, raw = http(s.url, "POST", "/v1/messages", CHAT, {"Content-Type": kind})
            body = json.loads(raw)
            assert status == 415 and body["type"] == "error" and "Content-Type: application/json" in \
                body["error"]["message"], kind
        for kind in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json"):
            assert http(s.url, "POST", "/v1/chat/completions", CHAT, {"Content-Type": kind})[0] == 200, kind
        assert len(backend.requests) == 7  # the refused ones never reached the backend


def test_the_cli_allows_loopback_names_on_a_loopback_bind_only():
    from ds4_mlx.frontends.cmd_serve import allowed_hosts

    assert allowed_hosts("127.0.0.1", []) == ("localhost", "127.0.0.1", "::1")
    assert allowed_hosts("::1", ["My-Box.lan"]) == ("localhost", "127.0.0.1", "::1", "my-box.lan")
    assert allowed_hosts("0.0.0.0", []) is None  # its names are not known here: --allow-host names them
    assert allowed_hosts("0.0.0.0", ["gpu.lan"]) == ("0.0.0.0", "gpu.lan")
