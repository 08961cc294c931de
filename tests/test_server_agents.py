"""What the real agent clients send and need, on the scripted backend (issue #21): Claude Code's
system item inside Anthropic ``messages``, its text blocks, deferred tools and ``tool_reference``,
``HEAD /`` and ``count_tokens``; the answer-length default and cap Codex needs; the cache
decision of a stream whose prefill outlasts the keepalive; reasoning tokens in usage; Responses
event lines, announced items and reasoning-only turns; the request log line and ``--trace``.

The shapes are the ones the real clients sent to ``scripts/agent_clients.py`` (Claude Code
2.1.332, Codex CLI 0.171, opencode 1.18.33, Pi 0.73.1); each test fails on the code before the fix."""

from __future__ import annotations

import json
import logging

import pytest

from ds4_mlx.chat.request import render_request
from ds4_mlx.frontends.server import ServerConfig
from server_backend import LiveServer, ScriptedBackend, http, sse_frames

ENV = "# Environment\nYou have been invoked in the following environment:\n - Platform: linux"
REMINDER = "<system-reminder>\nAttribution for git commits...\n</system-reminder>"


@pytest.fixture(scope="module")
def live():
    with LiveServer(ScriptedBackend(), ServerConfig(keepalive_s=0.2)) as s:
        yield s


def post(live, path, body, headers=None):
    status, h, raw = http(live.url, "POST", path, json.dumps(body), headers)
    return status, h, raw


def claude_code_body(*extra_messages, tools=None, **kw):
    """The shape of Claude Code 2.1.332's first request: system blocks (billing header first), a
    user message of two text blocks, then a ``system`` item with the environment."""
    return {"model": "deepseek-v4-flash", "max_tokens": 32, "stream": True,
            "thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "high"},
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332;"},
                       {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": REMINDER},
                                                       {"type": "text", "text": "Say hello."}]},
                         {"role": "system", "content": [{"type": "text", "text": ENV}]}, *extra_messages],
            "tools": tools or [{"name": "Bash", "description": "Run a command",
                                "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}],
            **kw}


# -- Anthropic: what Claude Code sends ---------------------------------------------------------

def test_a_system_item_inside_messages_is_system_text_as_ds4_renders_it(live):
    status, _, raw = post(live, "/v1/messages?beta=true", claude_code_body())
    assert status == 200, raw
    frames = sse_frames(raw)
    assert frames[-1].startswith("event: message_stop")
    sent = live.backend.requests[-1]
    assert [m["role"] for m in sent.messages] == ["system", "user", "system"]
    text = render_request(sent.messages, sent.tools, sent.tool_choice, sent.think)
    # ds4 gathers every system/developer text after the tools prompt, joined by blank lines
    assert "You are a Claude agent.\n\n" + ENV + "<｜User｜>" + REMINDER + "\n\nSay hello.<｜Assistant｜><think>" in text
    for role in ("developer", "system"):
        status, _, raw = post(live, "/v1/messages", {"max_tokens": 8, "messages": [
            {"role": "user", "content": "hi"}, {"role": role, "content": "be brief"}]})
        assert status == 200, raw
        assert live.backend.requests[-1].messages[-1] == {"role": "system", "content": "be brief"}


@pytest.mark.parametrize("role", ["tool", "function", "bot", None, 7])
def test_an_unsupported_role_is_a_400_anthropic_clients_recognise(live, role):
    status, _, raw = post(live, "/v1/messages", {"max_tokens": 8, "messages": [
        {"role": "user", "content": "hi"}, {"role": role, "content": "x"}]})
    body = json.loads(raw)
    assert status == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "messages[1].role" in body["error"]["message"] and "is not supported" in body["error"]["message"]


def test_tool_use_in_a_system_item_is_refused_by_name(live):
    status, _, raw = post(live, "/v1/messages", {"max_tokens": 8, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]}]})
    assert status == 400 and "messages[1].content[0]: tool_use in a system message is not supported" in \
        json.loads(raw)["error"]["message"]


def test_text_blocks_of_one_message_are_separate_paragraphs(live):
    status, _, _ = post(live, "/v1/messages", {"max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>a</system-reminder>"},
                                     {"type": "text", "text": ""},
                                     {"type": "text", "text": "<system-reminder>b</system-reminder>"},
                                     {"type": "image", "source": {}}, {"type": "text", "text": "go"}]}]})
    assert status == 200
    assert live.backend.requests[-1].messages[-1]["content"] == \
        "<system-reminder>a</system-reminder>\n\n<system-reminder>b</system-reminder>\n\ngo"


def test_deferred_tools_stay_out_of_the_prompt_until_a_tool_reference_loads_them(live):
    bash = {"name": "Bash", "input_schema": {"type": "object"}}
    search = {"name": "ToolSearch", "input_schema": {"type": "object"}}
    cron = {"name": "CronCreate", "description": "Schedule a job", "defer_loading": True,
            "input_schema": {"type": "object", "properties": {"when": {"type": "string"}}}}
    tools = [bash, search, cron]
    status, _, raw = post(live, "/v1/messages", claude_code_body(tools=tools))
    assert status == 200, raw
    first = live.backend.requests[-1]
    assert [t["name"] for t in first.tools] == ["Bash", "ToolSearch"]
    first_text = render_request(first.messages, first.tools, first.tool_choice, first.think)
    assert "CronCreate" not in first_text
    loaded = claude_code_body(
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "ToolSearch",
                                           "input": {"query": "cron"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "tool_reference", "tool_name": "CronCreate"},
            {"type": "tool_reference", "tool_name": "Bash"}]}]},
        tools=tools)
    status, _, raw = post(live, "/v1/messages", loaded)
    assert status == 200, raw
    second = live.backend.requests[-1]
    assert [t["name"] for t in second.tools] == ["Bash", "ToolSearch"]  # the tools prompt is unchanged
    result = [m for m in second.messages if m["role"] == "tool"][0]["content"]
    # the loaded tool's schema line, as the tools prompt would have it, where the reference stands
    assert json.loads(result) == {k: v for k, v in cron.items() if k != "defer_loading"}
    second_text = render_request(second.messages, second.tools, second.tool_choice, second.think)
    head = first_text[:first_text.index("<｜User｜>")]
    assert second_text.startswith(head)  # the prefix the first turn cached is still the prefix
    status, _, raw = post(live, "/v1/messages", {"max_tokens": 8, "tools": tools, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "ToolSearch", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2",
                                      "content": [{"type": "tool_reference"}]}]}]})
    assert status == 400 and "tool_reference needs a tool_name" in json.loads(raw)["error"]["message"]


def test_head_and_get_root_answer_the_probe(live):
    status, headers, raw = http(live.url, "HEAD", "/")
    assert status == 200 and raw == b""
    status, _, raw = http(live.url, "GET", "/")
    assert status == 200 and json.loads(raw)["status"] == "ok"


def test_count_tokens_counts_what_messages_would_prefill(live):
    body = claude_code_body(stream=False)
    status, _, raw = post(live, "/v1/messages/count_tokens", {k: v for k, v in body.items() if k != "max_tokens"})
    assert status == 200, raw
    n = json.loads(raw)["input_tokens"]
    status, _, raw = post(live, "/v1/messages", body)
    usage = json.loads(raw)["usage"]
    assert n == usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
    status, _, raw = post(live, "/v1/messages/count_tokens", {"messages": [{"role": "nobody", "content": "x"}]})
    assert status == 400 and json.loads(raw)["type"] == "error"


# -- the answer length: Codex sends no cap -------------------------------------------------------

def test_a_request_without_a_limit_gets_the_servers_and_none_gets_more():
    with LiveServer(ScriptedBackend(), ServerConfig(keepalive_s=0.2, max_output=7)) as s:
        for body, want in (({}, 7), ({"max_output_tokens": 100000}, 7), ({"max_output_tokens": 3}, 3)):
            status, _, raw = http(s.url, "POST", "/v1/responses", json.dumps(
                {"model": "m", "input": [{"role": "user", "content": "hi"}], **body}))
            assert status == 200, raw
            assert s.backend.requests[-1].max_tokens == want
        status, _, raw = http(s.url, "GET", "/v1/models")
        assert json.loads(raw)["data"][0]["top_provider"]["max_completion_tokens"] == 7


# -- the cache decision of a long prefill ---------------------------------------------------------

STREAMS = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
           ("/v1/completions", {"prompt": "hi", "stream": True}),
           ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stream": True}),
           ("/v1/responses", {"input": [{"role": "user", "content": "hi"}], "stream": True})]


@pytest.mark.parametrize("path, body", STREAMS, ids=[p for p, _ in STREAMS])
def test_a_stream_whose_prefill_outlasts_the_keepalive_still_gets_the_cache_decision(path, body):
    with LiveServer(ScriptedBackend(prefill_s=0.7), ServerConfig(keepalive_s=0.2)) as s:
        for attempt in range(2):  # cold, then warm: the second reuses the first's prompt
            status, headers, raw = http(s.url, "POST", path, json.dumps(body))
            assert status == 200
            assert "x-ds4-cache" not in headers  # the headers left during the prefill
            frames = sse_frames(raw)
            notes = [f for f in frames if f.startswith(": x-ds4-cache ")]
            assert len(notes) == 1, frames[:6]
            i = frames.index(notes[0])
            assert all(f == ": prefill" for f in frames[:i]) and i >= 1  # before any event
            source, reused = notes[0][len(": x-ds4-cache "):].split("; ")
            if attempt:
                assert source == "source=live" and int(reused.split("=")[1]) > 0


def test_a_quick_stream_keeps_the_header_and_no_comment(live):
    status, headers, raw = post(live, "/v1/chat/completions", STREAMS[0][1])
    assert status == 200 and headers["x-ds4-cache"].startswith("source=")
    assert not any(f.startswith(": x-ds4-cache") for f in sse_frames(raw))


# -- reasoning tokens ---------------------------------------------------------------------------

def test_reasoning_tokens_are_counted_in_usage(live):
    def ask(path, body):
        status, _, raw = post(live, path, body)
        assert status == 200, raw
        return raw

    chat = json.loads(ask("/v1/chat/completions", {"messages": [{"role": "user", "content": "script:reasoning_only"}]}))
    assert chat["usage"]["completion_tokens_details"] == {"reasoning_tokens": 6}
    chat = json.loads(ask("/v1/chat/completions", {"messages": [{"role": "user", "content": "script:mixed"}]}))
    assert chat["usage"]["completion_tokens"] == 5
    assert chat["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
    resp = json.loads(ask("/v1/responses", {"input": [{"role": "user", "content": "script:reasoning_only"}]}))
    assert resp["usage"]["output_tokens_details"] == {"reasoning_tokens": 6}
    raw = ask("/v1/chat/completions", {"messages": [{"role": "user", "content": "script:mixed"}], "stream": True,
                                       "stream_options": {"include_usage": True}})
    usage = [json.loads(f[6:]) for f in sse_frames(raw) if f.startswith("data: {")][-1]["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 3}


# -- Responses ------------------------------------------------------------------------------------

def test_a_reasoning_item_with_no_answer_after_it_is_replayed(live):
    items = [{"role": "user", "content": "first"},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "thinking about it"}]},
             {"role": "user", "content": "second"}]
    status, _, raw = post(live, "/v1/responses", {"input": items})
    assert status == 200, raw
    msgs = live.backend.requests[-1].messages
    assert msgs == [{"role": "user", "content": "first"},
                    {"role": "assistant", "content": "", "reasoning_content": "thinking about it"},
                    {"role": "user", "content": "second"}]
    # an empty summary (reasoning not shown) adds no turn; reasoning before a call stays with it
    items = [{"role": "user", "content": "a"}, {"type": "reasoning", "summary": []},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "plan"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "ok"}]
    status, _, raw = post(live, "/v1/responses", {"input": items})
    assert status == 200, raw
    msgs = live.backend.requests[-1].messages
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    assert msgs[1]["reasoning_content"] == "plan" and msgs[1]["tool_calls"][0]["id"] == "c1"


@pytest.mark.parametrize("script", ["reasoning_only", "default", "tool"])
def test_responses_stream_has_event_lines_and_announces_every_item(live, script):
    status, _, raw = post(live, "/v1/responses", {"input": [{"role": "user", "content": f"script:{script}"}],
                                                  "stream": True})
    assert status == 200
    events = []
    for f in sse_frames(raw):
        if f.startswith(":"):
            continue
        head, data = f.split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: ")
        obj = json.loads(data[6:])
        assert obj["type"] == head[7:]
        events.append(obj)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"]
    final = events[-1]["response"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert [it["id"] for it in final["output"]] == added == done


# -- what the server says about each request -------------------------------------------------------

def test_one_log_line_per_request_with_the_reason_of_an_error(live, caplog):
    with caplog.at_level(logging.INFO, logger="ds4_mlx.server"):
        post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        post(live, "/v1/messages", {"max_tokens": 8, "messages": [{"role": "robot", "content": "x"}]})
        post(live, "/v1/messages", {"max_tokens": 8, "stream": True,
                                    "messages": [{"role": "user", "content": "script:mixed"}]})
    lines = [r.getMessage() for r in caplog.records if r.name == "ds4_mlx.server"
             and r.getMessage().startswith("request ")]
    assert len(lines) == 3, lines
    ok, bad, streamed = lines
    assert "endpoint=/v1/chat/completions status=200 stream=0 prompt=" in ok
    for field in ("cached=", "source=", "generated=4", "reasoning=0", "finish=stop", "prefill=", "decode="):
        assert field in ok, ok
    assert "endpoint=/v1/messages status=400 reason=\"messages[0].role 'robot' is not supported" in bad
    assert "status=200 stream=1" in streamed and "generated=5 reasoning=3" in streamed


def test_the_trace_file_holds_prompt_decision_and_output(tmp_path):
    trace = tmp_path / "trace.txt"
    with LiveServer(ScriptedBackend(), ServerConfig(keepalive_s=0.2, trace=str(trace))) as s:
        post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": "trace me"}]})
    text = trace.read_text()
    block = text.split("===== ")[-1]
    assert "POST /v1/chat/completions" in block and "cache: source=" in block
    assert "--- prompt ---\n<｜begin▁of▁sentence｜>" in block and "<｜User｜>trace me<｜Assistant｜><think>" in block
    assert "--- reasoning ---\nLet me think.\n--- content ---\nHello, world!\n" in block
    assert "--- end: finish=stop generated=4" in block


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice":
        {"type": "function", "function": {"name": "ghost"}},
        "tools": [{"type": "function", "function": {"name": "real", "parameters": {}}}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                      "tool_choice": {"type": "tool", "name": "ghost"}, "tools": [{"name": "real", "input_schema": {}}]}),
    ("/v1/responses", {"input": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "function", "name": "ghost"},
                       "tools": [{"type": "function", "name": "real", "parameters": {}}]}),
], ids=["chat-named", "chat-required", "messages-named", "responses-named"])
def test_a_forced_tool_that_does_not_exist_is_a_400_not_a_forced_call(live, path, body):
    """#26 item 8: tool_choice naming a tool not in tools was accepted and its invoke forced."""
    n = len(live.backend.requests)
    status, _, raw = post(live, path, body)
    assert status == 400, raw
    err = json.loads(raw)["error"]
    assert "tool_choice" in err["message"] and ("ghost" in err["message"] or "tools is empty" in err["message"])
    assert len(live.backend.requests) == n
    ok = dict(body, tool_choice={"type": "tool", "name": "real"} if path == "/v1/messages" else
              {"type": "function", "name": "real"} if path == "/v1/responses" else
              {"type": "function", "function": {"name": "real"}})
    if "tools" in body:
        assert post(live, path, ok)[0] == 200
