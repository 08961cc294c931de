"""A model that produces NaN/Inf is the server's fault, not the client's (issue #26 item 8): every
API answers 500 in its own error shape naming the engine's reason, a stream that already started
ends with its own error event, and ``/health`` turns 503 so a load balancer takes the instance
out.  Errors in the request itself stay 400, also on a faulty server."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from server_backend import LiveServer, http, sse_frames

from ds4_mlx.errors import InferenceError, NonFiniteError
from ds4_mlx.formats.gguf import GGUFFile
from ds4_mlx.frontends.server import Backend, EngineBackend, ServerConfig
from ds4_mlx.frontends.server.events import Content, Done, Started

CTX = 4096
REASON = "the output head produced non-finite values (NaN/Inf) at positions 7..7"


def user(text):
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def poisoned_model(tiny_model_path, tmp_path_factory):
    """The tiny model with one norm weight all NaN: every forward pass goes non-finite."""
    bad = tmp_path_factory.mktemp("fault") / "nan.gguf"
    shutil.copyfile(tiny_model_path, bad)
    name = "blk.1.attn_norm.weight"
    with GGUFFile(tiny_model_path) as f:
        t = f.tensor(name)
        offset, count, dtype = t.offset, t.n_elements, f.tensor_array(name).dtype
    with open(bad, "r+b") as fh:
        fh.seek(offset)
        fh.write(np.full(count, np.nan, dtype=dtype).tobytes())
    return bad


def _post(url, path, body):
    status, _, raw = http(url, "POST", path, json.dumps(body))
    return status, json.loads(raw)


def _health(url):
    status, _, raw = http(url, "GET", "/health")
    return status, json.loads(raw)


def test_nan_weights_are_a_500_in_every_shape_and_health_goes_down(poisoned_model):
    # keepalive far above the prefill time: the fault comes before the stream's headers, as a 500
    backend = EngineBackend(str(poisoned_model), ctx=CTX)
    with LiveServer(backend, ServerConfig(ctx=CTX, keepalive_s=30)) as s:
        assert _health(s.url) == (200, {"status": "ok", "model": "deepseek-v4-flash", "queue_depth": 0,
                                        "busy": False})
        status, body = _post(s.url, "/v1/chat/completions", {"messages": user("hi"), "max_tokens": 3})
        assert status == 500 and body["error"]["type"] == "server_error", body
        assert "layer 1 produced non-finite values" in body["error"]["message"]
        assert "at positions 0.." in body["error"]["message"]

        status, body = _post(s.url, "/v1/messages", {"model": "m", "messages": user("hi"), "max_tokens": 3})
        assert status == 500 and body["type"] == "error" and body["error"]["type"] == "api_error", body
        assert "non-finite" in body["error"]["message"]

        for path, payload in [("/v1/responses", {"input": [{"role": "user", "content": "hi"}],
                                                 "max_output_tokens": 3}),
                              ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True})]:
            status, body = _post(s.url, path, payload)
            assert status == 500 and body["error"]["type"] == "server_error", (path, body)

        status, health = _health(s.url)
        assert status == 503 and health["status"] == "error", health
        assert "layer 1 produced non-finite values" in health["reason"]
        status, _, raw = http(s.url, "GET", "/")
        assert status == 503 and json.loads(raw)["status"] == "error"

        # the client's own mistakes are still the client's: 400, whatever the server's state
        status, body = _post(s.url, "/v1/chat/completions", {"messages": user("word " * 5000)})
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        status, _, _ = http(s.url, "POST", "/v1/chat/completions", "{not json")
        assert status == 400


class _FaultBackend(Backend):
    """The real worker and queue, with a generate function that fails as the engine does: a
    non-finite forward pass after some output ("nan"), or bad input ("bad")."""

    def __init__(self):
        super().__init__(self._generate, ctx=CTX)

    def _generate(self, req, cancel):
        text = req.messages[-1]["content"]
        if text == "bad":
            raise InferenceError("token id 999999 at index 3 is outside the vocabulary 0..511")
        yield Started(5)
        if text == "nan":
            yield Content("partial")
            raise NonFiniteError(REASON)
        yield Content("fine")
        yield Done("stop", 1)


@pytest.fixture
def fault_server():
    with LiveServer(_FaultBackend(), ServerConfig(ctx=CTX, keepalive_s=0.2)) as s:
        yield s


def test_engine_input_errors_stay_400_and_health_ok(fault_server):
    status, body = _post(fault_server.url, "/v1/chat/completions", {"messages": user("bad")})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert "outside the vocabulary" in body["error"]["message"]
    assert _health(fault_server.url)[0] == 200


@pytest.mark.parametrize("path,payload,shape", [
    ("/v1/chat/completions", {"messages": user("nan"), "stream": True}, "openai"),
    ("/v1/completions", {"prompt": "nan", "stream": True}, "openai"),
    ("/v1/responses", {"input": [{"role": "user", "content": "nan"}], "stream": True}, "openai"),
    ("/v1/messages", {"model": "m", "messages": user("nan"), "stream": True, "max_tokens": 9}, "anthropic"),
])
def test_mid_stream_nonfinite_ends_the_stream_with_its_error_event(fault_server, path, payload, shape):
    status, _, raw = http(fault_server.url, "POST", path, json.dumps(payload))
    assert status == 200
    last = sse_frames(raw)[-1]
    assert last.startswith("event: error\ndata: "), last
    data = json.loads(last.split("data: ", 1)[1])
    if shape == "anthropic":
        assert data == {"type": "error", "error": {"type": "api_error", "message": REASON}}
    else:
        assert data == {"error": {"message": REASON, "type": "server_error"}}
    status, health = _health(fault_server.url)
    assert status == 503 and health["status"] == "error" and health["reason"] == REASON


def test_mid_answer_nonfinite_without_stream_is_500(fault_server):
    status, body = _post(fault_server.url, "/v1/messages", {"model": "m", "messages": user("nan"), "max_tokens": 9})
    assert status == 500 and body == {"type": "error", "error": {"type": "api_error", "message": REASON}}
    assert _health(fault_server.url)[0] == 503
    # a faulty model keeps answering what it can: the next request is served (and fails the same way)
    status, body = _post(fault_server.url, "/v1/chat/completions", {"messages": user("fine")})
    assert status == 200 and body["choices"][0]["message"]["content"] == "fine"
    assert _health(fault_server.url)[0] == 503  # weights that went NaN once stay suspect
