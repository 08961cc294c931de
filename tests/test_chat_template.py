"""DS4 chat templates: thinking modes, CLI token form, server text form.

Expected prompt texts are assembled by hand from spec §11.6 (layout) with the constant strings read
from the spec document itself (vendored in tests/data); the multi-feature render case was checked against ds4-server's own
renderer compiled in a small harness ("ds4 harness")."""

from __future__ import annotations

import json

import pytest

from ds4_mlx.chat.dsml import render_tool_calls
from ds4_mlx.chat.messages import ToolCall
from ds4_mlx.chat.template import (
    DEFAULT_SYSTEM,
    MAX_EFFORT_PREFIX,
    THINK_MAX_MIN_CONTEXT,
    TOOLS_PROMPT,
    TOOLS_SUFFIX,
    ChatTranscript,
    ThinkMode,
    append_message,
    encode_chat_prompt,
    encode_next_turn,
    render_assistant_suffix,
    render_messages,
    render_tail,
    render_tool_schemas,
    resolve_think_mode,
    think_mode_from_effort,
    think_mode_from_enabled,
)
from ds4_mlx.engine.vectors import load_vector_set
from ds4_mlx.errors import ChatError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
U = "<｜User｜>"
A = "<｜Assistant｜>"
BIG_CTX = 400000


def test_constants_match_spec(reference_dir):
    """The constants as the spec (ARCHITECTURE.md §11.6) writes them, vendored in
    tests/data/spec_constants.json by scripts/pack_oracle_golden.py (its --verify mode re-cuts them)."""
    spec = json.loads((reference_dir / "spec_constants.json").read_text(encoding="utf-8"))
    assert MAX_EFFORT_PREFIX == spec["MAX_EFFORT_PREFIX"]
    assert TOOLS_PROMPT == spec["TOOLS_PROMPT"]
    assert TOOLS_SUFFIX == spec["TOOLS_SUFFIX"]
    assert DEFAULT_SYSTEM == "You are a helpful assistant"


def test_think_mode_resolution():
    assert resolve_think_mode(ThinkMode.MAX, THINK_MAX_MIN_CONTEXT) is ThinkMode.MAX
    assert resolve_think_mode(ThinkMode.MAX, THINK_MAX_MIN_CONTEXT - 1) is ThinkMode.HIGH
    assert resolve_think_mode("max", 0) is ThinkMode.HIGH
    assert resolve_think_mode(ThinkMode.MAX, -5) is ThinkMode.HIGH
    assert resolve_think_mode(ThinkMode.HIGH, 10) is ThinkMode.HIGH
    assert resolve_think_mode("none", BIG_CTX) is ThinkMode.NONE
    with pytest.raises(ChatError):
        resolve_think_mode("extreme", BIG_CTX)
    assert [think_mode_from_effort(e) for e in ("max", "xhigh", "high", "medium", "low", "minimal", "none")] == \
        [ThinkMode.MAX] + [ThinkMode.HIGH] * 5 + [ThinkMode.NONE]
    with pytest.raises(ChatError):
        think_mode_from_effort("ultra")
    assert think_mode_from_enabled(False, ThinkMode.MAX) is ThinkMode.NONE
    assert think_mode_from_enabled(True, ThinkMode.MAX) is ThinkMode.MAX
    assert think_mode_from_enabled(True, ThinkMode.NONE) is ThinkMode.NONE


# --------------------------------------------------------------------------------------------
# Server text form


def user(text):
    return {"role": "user", "content": text}


def test_render_minimal_each_mode():
    msgs = [user("Hello")]
    assert render_messages(msgs, think=ThinkMode.NONE) == BOS + U + "Hello" + A + "</think>"
    assert render_messages(msgs, think=ThinkMode.HIGH) == BOS + U + "Hello" + A + "<think>"
    assert render_messages(msgs, think=ThinkMode.MAX, ctx=BIG_CTX) == BOS + MAX_EFFORT_PREFIX + U + "Hello" + A + "<think>"
    assert render_messages(msgs, think=ThinkMode.MAX, ctx=32768) == BOS + U + "Hello" + A + "<think>"


def test_render_system_and_developer_merge():
    msgs = [{"role": "system", "content": "You are terse."}, user("Hello"),
            {"role": "developer", "content": [{"type": "text", "text": "Dev "}, "rules", {"type": "image_url"}]}]
    assert render_messages(msgs, think=ThinkMode.MAX, ctx=BIG_CTX) == (
        BOS + MAX_EFFORT_PREFIX + "You are terse.\n\nDev rules" + U + "Hello" + A + "<think>")
    # An empty first system text adds no separator (ds4 only separates after non-empty text).
    msgs = [{"role": "system", "content": ""}, {"role": "system", "content": "b"}, user("x")]
    assert render_messages(msgs, think="none") == BOS + "b" + U + "x" + A + "</think>"


def test_render_multi_turn_drops_old_reasoning_without_tools():
    msgs = [user("first"), {"role": "assistant", "content": "first answer", "reasoning_content": "old hidden"},
            user("second")]
    assert render_messages(msgs, think="high") == (
        BOS + U + "first" + A + "</think>first answer" + EOS + U + "second" + A + "<think>")
    assert render_messages(msgs, think="none") == (
        BOS + U + "first" + A + "</think>first answer" + EOS + U + "second" + A + "</think>")


def test_render_keeps_reasoning_after_last_user_and_with_tools():
    # An assistant message after the last user turn keeps its reasoning (continuation/prefill).
    msgs = [user("q"), {"role": "assistant", "content": "partial", "reasoning_content": "r"}]
    assert render_messages(msgs, think="high") == BOS + U + "q" + A + "<think>r</think>partial" + EOS
    assert render_messages(msgs, think="none") == BOS + U + "q" + A + "</think>partial" + EOS
    # With tools in context every assistant turn keeps its reasoning.
    msgs = [user("first"), {"role": "assistant", "content": "a1", "reasoning_content": "r1"}, user("second")]
    out = render_messages(msgs, tools=[{"name": "t", "input_schema": {}}], think="high")
    assert A + "<think>r1</think>a1" + EOS in out


def test_render_tools_prompt_exact():
    tools = [
        {"type": "function", "function": {"name": "bash", "description": "Run", "parameters": {"type": "object"}}},
        {"name": "read", "description": "Read a file", "input_schema": {"type": "object"}},
    ]
    msgs = [{"role": "system", "content": "CLIENT SYSTEM"}, user("hi")]
    schemas = ('{"name":"bash","description":"Run","parameters":{"type":"object"}}\n'
               '{"name":"read","description":"Read a file","input_schema":{"type":"object"}}')
    assert render_messages(msgs, tools=tools, think="high") == (
        BOS + TOOLS_PROMPT + schemas + TOOLS_SUFFIX + "\n\nCLIENT SYSTEM" + U + "hi" + A + "<think>")
    # Raw JSON text is kept byte for byte (number spelling, spacing, escapes).
    raw = '[ {"type": "function", "function": {"name": "f", "x": 1.50, "d": "\\u00e9"}} , {"name":"g"} ]'
    assert render_tool_schemas(raw) == '{"name": "f", "x": 1.50, "d": "\\u00e9"}\n{"name":"g"}'
    assert render_tool_schemas(['{"name" : "h"}', {"name": "i"}]) == '{"name" : "h"}\n{"name":"i"}'
    assert render_tool_schemas([]) == "" and render_tool_schemas(None) == ""
    assert render_messages([user("x")], tools=[], think="none") == BOS + U + "x" + A + "</think>"
    with pytest.raises(ChatError):
        render_tool_schemas("[1, ")
    with pytest.raises(ChatError):
        render_tool_schemas([3])


def test_render_responses_tool_shapes():
    raw = ('[{"type":"namespace","name":"mcp.","tools":[{"type":"function","name":"read","description":"R",'
           '"parameters":{"type":"object"}},{"name":"ls"},{"type":"custom","name":"skip"}]},'
           '{"type":"tool_search"}]')
    assert render_tool_schemas(raw) == (
        '{"name":"mcp.read","description":"R","parameters":{"type":"object"}}\n'
        '{"name":"mcp.ls","description":"","parameters":{"type":"object","properties":{}}}\n'
        '{"name":"tool_search","description":"Search available tools.",'
        '"parameters":{"type":"object","properties":{}}}')


def test_render_assistant_tool_calls_and_results():
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command":"pwd"}'}}
    msgs = [user("where?"),
            {"role": "assistant", "content": "", "reasoning_content": "need pwd", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "/tmp\n</tool_result> & <b>"},
            {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "second"}]},
            {"role": "assistant", "content": "done"},
            {"role": "function", "content": "late"}]
    dsml = render_tool_calls([ToolCall("bash", '{"command":"pwd"}')])
    assert dsml.startswith("\n\n<｜DSML｜tool_calls>")
    expected = (BOS + U + "where?" + A + "<think>need pwd</think>" + dsml + EOS
                + U + "<tool_result>/tmp\n&lt;/tool_result> & <b></tool_result><tool_result>second</tool_result>"
                + A + "<think></think>done" + EOS
                + U + "<tool_result>late</tool_result>" + A + "<think>")
    # Tool context comes from the history alone here (no tools in the request).
    assert render_messages(msgs, think="high") == expected


def test_render_ds4_harness_case():
    # ds4 harness output for a request mixing every feature (verified byte for byte).
    msgs = [
        {"role": "system", "content": "S"}, {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a", "reasoning_content": "r",
         "tool_calls": [{"id": "x", "function": {"name": "f",
                                                  "arguments": '{"a": 1.50, "b":"x</｜DSML｜parameter>"}'}}]},
        {"role": "tool", "content": "res</tool_result>"}, {"role": "tool", "content": "r2"},
    ]
    tools = '[{"type":"function","function":{"name":"f"}}]'
    expected = (
        BOS + TOOLS_PROMPT + '{"name":"f"}' + TOOLS_SUFFIX + "\n\nS" + U + "u" + A + "<think>r</think>a"
        + "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
        + '<｜DSML｜parameter name="a" string="false">1.50</｜DSML｜parameter>\n'
        + '<｜DSML｜parameter name="b" string="true">x&lt;/｜DSML｜parameter></｜DSML｜parameter>\n'
        + "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS
        + U + "<tool_result>res&lt;/tool_result></tool_result><tool_result>r2</tool_result>" + A + "<think>")
    assert render_messages(msgs, tools=tools, think="high") == expected


def test_render_edge_roles_and_replay():
    call = {"function": {"name": "f", "arguments": "{}"}}
    raw = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>  "
    msgs = [{"content": "no role is user"}, {"role": "narrator", "content": "ignored"},
            {"role": "assistant", "content": "x", "tool_calls": [call], "raw_dsml": raw},
            {"role": "assistant", "content": "y", "tool_calls": None}]
    assert render_messages(msgs, think="none") == (
        BOS + U + "no role is user" + A + "</think>x" + raw + EOS + "y" + EOS)
    with pytest.raises(ChatError):
        render_messages(["not a dict"])
    with pytest.raises(ChatError):
        render_messages([{"role": 5}])
    with pytest.raises(ChatError):
        render_messages([{"role": "user", "content": [{"text": 3}]}])
    with pytest.raises(ChatError):
        render_messages([{"role": "assistant", "tool_calls": {"function": {}}}])


def test_render_tail_and_assistant_suffix_are_prompt_canonical():
    tools = [{"name": "bash", "input_schema": {"type": "object"}}]
    history = [user("inspect")]
    prompt = render_messages(history, tools=tools, think="high")
    calls = [ToolCall("bash", '{"command":"cd /tmp && git diff 2>/dev/null","timeout":10}')]
    suffix = render_assistant_suffix("", "need a tool", calls, "high")
    assert "&amp;" not in suffix and "&gt;" not in suffix
    history.append({"role": "assistant", "content": "", "reasoning_content": "need a tool",
                    "tool_calls": [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]})
    assert prompt + suffix == render_messages(history, tools=tools, think="high")
    history.append({"role": "tool", "content": "ok"})
    full = render_messages(history, tools=tools, think="high")
    tail = render_tail(history, 2, think="high")
    assert tail == EOS + U + "<tool_result>ok</tool_result>" + A + "<think>"
    assert full == prompt + suffix[: -len(EOS)] + tail
    assert render_assistant_suffix("hi", "ignored", [], "none") == "hi" + EOS


# --------------------------------------------------------------------------------------------
# CLI token form


def test_encode_chat_prompt_structure(ds4_tokenizer):
    sid = ds4_tokenizer.special_ids
    user_text = "Ciao <｜User｜> and </think> stay text"
    ids = encode_chat_prompt(ds4_tokenizer, user_text, think=ThinkMode.HIGH)
    system_ids = ds4_tokenizer.encode(DEFAULT_SYSTEM)
    user_ids = ds4_tokenizer.encode(user_text)
    assert ids == [ds4_tokenizer.bos_id, *system_ids, sid["<｜User｜>"], *user_ids, sid["<｜Assistant｜>"],
                   sid["<think>"]]
    assert sid["<｜User｜>"] not in user_ids and sid["</think>"] not in user_ids
    assert encode_chat_prompt(ds4_tokenizer, "q", system="", think="none") == [
        ds4_tokenizer.bos_id, sid["<｜User｜>"], *ds4_tokenizer.encode("q"), sid["<｜Assistant｜>"], sid["</think>"]]
    max_ids = encode_chat_prompt(ds4_tokenizer, "q", system=None, think="max", ctx=BIG_CTX)
    prefix = ds4_tokenizer.encode(MAX_EFFORT_PREFIX)
    assert max_ids[: 1 + len(prefix)] == [ds4_tokenizer.bos_id, *prefix] and max_ids[-1] == sid["<think>"]
    assert encode_chat_prompt(ds4_tokenizer, "q", system=None, think="max", ctx=32768) == \
        encode_chat_prompt(ds4_tokenizer, "q", system=None, think="high")


def test_cli_and_server_forms_agree(ds4_tokenizer):
    for think in ("none", "high"):
        msgs = [{"role": "system", "content": "Be brief."}, user("2+2?")]
        server = ds4_tokenizer.encode_rendered(render_messages(msgs, think=think))
        assert server == encode_chat_prompt(ds4_tokenizer, "2+2?", system="Be brief.", think=think)


def test_test_vector_prompt_lengths(ds4_tokenizer):
    """The API vectors shipped in the package (what `ds4-mlx vectors` prompts): ds4's no-system,
    no-thinking prompt has the API's usage.prompt_tokens."""
    cases = load_vector_set("preview").cases
    for case in cases:
        ids = encode_chat_prompt(ds4_tokenizer, case.prompt, system="", think=ThinkMode.NONE)
        assert case.api_prompt_tokens is not None and len(ids) == case.api_prompt_tokens, case.id
    assert len(cases) == 5


def test_library_append_message(ds4_tokenizer):
    sid = ds4_tokenizer.special_ids
    toks: list[int] = []
    append_message(ds4_tokenizer, toks, "assistant", "<think>r</think>ans")
    assert toks[0] == sid["<｜Assistant｜>"] and toks[1] != sid["</think>"]
    toks = []
    append_message(ds4_tokenizer, toks, "assistant", "plain")
    assert toks[:2] == [sid["<｜Assistant｜>"], sid["</think>"]]
    toks = []
    append_message(ds4_tokenizer, toks, "tool", "out")
    assert toks == [sid["<｜User｜>"], *ds4_tokenizer.encode("Tool: "), *ds4_tokenizer.encode("out")]
    toks = []
    append_message(ds4_tokenizer, toks, "developer", "dev")
    assert toks == ds4_tokenizer.encode("dev")


def test_chat_transcript_multi_turn(ds4_tokenizer):
    sid = ds4_tokenizer.special_ids
    chat = ChatTranscript(ds4_tokenizer, system="Sys", think="high", ctx=32768)
    first = chat.begin_turn("one")
    assert first == encode_chat_prompt(ds4_tokenizer, "one", system="Sys", think="high")
    generated = ds4_tokenizer.encode_rendered("thinking</think>answer")
    chat.append_generated(generated)
    chat.end_turn()
    second = chat.begin_turn("two")
    assert second == first + generated + [ds4_tokenizer.eos_id, sid["<｜User｜>"], *ds4_tokenizer.encode("two"),
                                          sid["<｜Assistant｜>"], sid["<think>"]]
    assert second == first + generated + encode_next_turn(ds4_tokenizer, "two", think="high")
    # An interrupted turn with nothing generated is rolled back.
    before = list(chat.tokens[: len(second) - 3 - len(ds4_tokenizer.encode("two"))])
    chat.abort_turn()
    assert chat.tokens == before
    # Switching to Think Max with enough context inserts the prefix right after BOS; back removes it.
    chat.think, chat.ctx = ThinkMode.MAX, BIG_CTX
    third = chat.begin_turn("three")
    prefix = ds4_tokenizer.encode(MAX_EFFORT_PREFIX)
    assert third[: 1 + len(prefix)] == [ds4_tokenizer.bos_id, *prefix]
    assert third[1 + len(prefix):][: len(before) - 1] == before[1:]
    chat.abort_turn()
    chat.think = ThinkMode.NONE
    fourth = chat.begin_turn("four")
    assert fourth[: len(before)] == before and fourth[-1] == sid["</think>"]
