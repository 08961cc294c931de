"""Property-based fuzz of every POST endpoint (issue #26): whatever the body holds (wrong types, lone
surrogates, numbers past float's range, NaN, deep or empty structures, unknown fields), the server
answers a client error or a success, never a 5xx, and stays healthy. A fixed budget per endpoint, a
fixed seed (hypothesis' derandomize), so CI runs the same bodies every time."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4_mlx.frontends.server import ServerConfig
from server_backend import LiveServer, ScriptedBackend, http

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
FIELDS = ("model", "messages", "prompt", "input", "system", "instructions", "max_tokens", "max_completion_tokens",
          "max_output_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_sequences",
          "stream", "stream_options", "tools", "tool_choice", "thinking", "reasoning", "reasoning_effort",
          "output_config", "logprobs", "top_logprobs", "n", "metadata")

# Characters drawn from the whole range, lone surrogates included, and often from the hostile few.
_char = st.sampled_from(["a", " ", "\n", "\x00", "é", "😀", "\ud800", "\udfff", "<｜User｜>", "</think>"]) \
    | st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=())
_text = st.lists(_char, max_size=6).map("".join)
_number = (st.sampled_from([0, 1, 4, -1, 0.5, 2 ** 63, 10 ** 309, -(10 ** 309), 10 ** 400])
           | st.integers(min_value=-(10 ** 400), max_value=10 ** 400) | st.floats(allow_nan=True, allow_infinity=True))
_leaf = st.none() | st.booleans() | _number | _text | st.sampled_from(
    ["user", "assistant", "system", "tool", "developer", "text", "function", "auto", "none", "required",
     "enabled", "disabled", "high", "max", "low", "tool_use", "tool_result", "message", "input_text"])
_json = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.sampled_from(["role", "content", "type", "text", "name", "id", "input", "arguments", "function",
                     "tool_calls", "tool_call_id", "tool_use_id", "parameters", "effort", "budget_tokens"])
    | _text, inner, max_size=4), max_leaves=12)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool"]) | _leaf},
                                 optional={"content": _text | _json, "tool_calls": _json, "name": _leaf})
# A valid request of every endpoint (each reads its own fields and ignores the others) with one to
# three fields replaced: most bodies then get past the first check and reach the deeper ones.
BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi",
        "max_tokens": 4}
_body = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), _json | _leaf, min_size=1, max_size=3).map(lambda d: {**BASE, **d}),
    st.builds(lambda msgs, d: {**BASE, **d, "messages": msgs}, st.lists(_message, min_size=1, max_size=3),
              st.dictionaries(st.sampled_from(FIELDS[3:]), _leaf, max_size=2)),
    st.dictionaries(st.sampled_from(FIELDS), _json, max_size=6),
)


@pytest.fixture(scope="module")
def live():
    with LiveServer(ScriptedBackend(), ServerConfig(keepalive_s=0.2, max_messages=50)) as s:
        yield s


@pytest.mark.parametrize("path", ENDPOINTS)
def test_no_body_gets_a_5xx(live, path):
    seen: dict[int, int] = {}

    @settings(max_examples=120, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
    @given(body=_body)
    def one(body):
        raw = json.dumps(body, ensure_ascii=True, allow_nan=True)  # lone surrogates as \\udXXX escapes
        status, headers, text = http(live.url, "POST", path, raw, timeout=30)
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, (path, raw[:400], text[:400])
        if status >= 400:
            err = json.loads(text)
            assert "error" in err, text[:300]

    one()
    assert sum(seen.values()) >= 100 and any(400 <= s < 500 for s in seen), seen
    assert http(live.url, "GET", "/health")[0] == 200
