"""DSML tool calls: canonical rendering, one-shot parsing, streaming parser, sampling guard.

Expected strings are written from spec §11.7 (canonical layout, escaping rules) and from the
behaviours ds4-server's own unit tests assert; a few odd inputs carry expectations that were
produced by compiling ds4-server's parser in a small harness (marked "ds4 harness")."""

from __future__ import annotations

import json
import random

import pytest

from ds4_mlx.chat.dsml import finish_turn, parse_message, render_tool_calls
from ds4_mlx.chat.dsml_stream import (
    ContentDelta,
    DecodeState,
    DsmlDecodeTracker,
    DsmlStreamParser,
    ReasoningDelta,
    StreamEnd,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolMarkerScanner,
)
from ds4_mlx.chat.messages import ParsedMessage, ToolCall
from ds4_mlx.errors import ChatError

D = "｜DSML｜"
START, END = f"<{D}tool_calls>", f"</{D}tool_calls>"
INV, INV_END = f"<{D}invoke", f"</{D}invoke>"
PAR, PAR_END = f"<{D}parameter", f"</{D}parameter>"


def block(*invokes: str, lead: str = "\n\n") -> str:
    return lead + START + "\n" + "".join(invokes) + END


def invoke(name: str, *params: str) -> str:
    return f'{INV} name="{name}">\n' + "".join(params) + INV_END + "\n"


def param(name: str, body: str, string: str | None = "true") -> str:
    s = f' string="{string}"' if string is not None else ""
    return f'{PAR} name="{name}"{s}>{body}{PAR_END}\n'


# --------------------------------------------------------------------------------------------
# Rendering


def test_render_canonical_block():
    calls = [
        ToolCall("bash", '{"command":"ls -la && echo \\"hi\\" 2>&1","timeout":10}'),
        ToolCall('we"ird<>&', '{"path": "/tmp/x", "opts": {"a": [1, 2.50, true, null]}}'),
    ]
    expected = (
        "\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="bash">\n'
        '<｜DSML｜parameter name="command" string="true">ls -la && echo "hi" 2>&1</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="timeout" string="false">10</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="we&quot;ird&lt;&gt;&amp;">\n'
        '<｜DSML｜parameter name="path" string="true">/tmp/x</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="opts" string="false">{"a":[1,2.50,true,null]}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls>"
    )
    assert render_tool_calls(calls) == expected


def test_render_keeps_client_key_order_and_duplicates():
    out = render_tool_calls([ToolCall("f", '{"z": 1, "a": "x", "z": 2}')])
    names = [line.split('"')[1] for line in out.split("\n") if line.startswith(PAR)]
    assert names == ["z", "a", "z"]


def test_render_escapes_only_the_closing_tag():
    out = render_tool_calls([ToolCall("f", json.dumps({
        "s": "a </｜DSML｜parameter> b </｜DSML｜tool_calls> <x> & &amp;",
        "j": {"k": "</｜DSML｜parameter>"},
    }, ensure_ascii=False))])
    assert "a &lt;/｜DSML｜parameter> b </｜DSML｜tool_calls> <x> & &amp;</｜DSML｜parameter>" in out
    assert '{"k":"\\u003c/｜DSML｜parameter>"}</｜DSML｜parameter>' in out


@pytest.mark.parametrize("args", ["[1, 2]", "not json", "", '"str"', "{unterminated", "null"])
def test_render_non_object_arguments_become_one_string_parameter(args):
    out = render_tool_calls([ToolCall("f", args)])
    assert out == ("\n\n" + START + "\n" + f'{INV} name="f">\n'
                   + f'{PAR} name="arguments" string="true">{args}{PAR_END}\n' + INV_END + "\n" + END)


def test_render_empty_object_and_no_calls():
    assert render_tool_calls([ToolCall("f", "{}")]) == "\n\n" + START + "\n" + f'{INV} name="f">\n' + INV_END + "\n" + END
    assert render_tool_calls([]) == ""


def test_render_accepts_openai_dicts_and_drops_incomplete_calls():
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}},
        {"id": "c2", "type": "function", "function": {"name": "g"}},  # no arguments: dropped by ds4
        {"id": "c3", "type": "function", "function": {"name": "h", "arguments": {"b": [1, 2]}}},
    ]
    out = render_tool_calls(calls)
    assert 'name="f"' in out and 'name="g"' not in out
    assert f'{PAR} name="b" string="false">[1,2]{PAR_END}' in out
    assert render_tool_calls([calls[1]]) == ""
    with pytest.raises(ChatError):
        render_tool_calls([{"function": {"name": 3, "arguments": "{}"}}])


def test_render_replays_raw_dsml_verbatim():
    raw = "\n\n" + START + "\n" + invoke("f", param("a", "  spaced  ")) + END
    assert render_tool_calls([ToolCall("f", '{"a":"other"}')], raw_dsml=raw) == raw
    assert render_tool_calls([], raw_dsml=raw) == ""


# --------------------------------------------------------------------------------------------
# One-shot parsing


def test_parse_canonical_and_separator():
    text = "I will inspect the files.\n\n\n\n" + START + "\n" + invoke(
        "bash", param("description", "list files"), param("command", "ls -la"), param("n", "10", "false")) + END
    m = parse_message(text, thinking=False)
    assert m == ParsedMessage(None, "I will inspect the files.",
                              (ToolCall("bash", '{"description":"list files","command":"ls -la","n":10}'),),
                              text[len("I will inspect the files.\n\n"):])


@pytest.mark.parametrize("prefix", [f"{D}", "DSML｜", ""], ids=["full", "short", "plain"])
@pytest.mark.parametrize("lead", ["\n\n", "", " "])
def test_parse_spelling_variants(prefix, lead):
    text = (f"ok{lead}<{prefix}tool_calls>\n<{prefix}invoke name=\"read\">\n"
            f"<{prefix}parameter name=\"path\" string=\"true\">a.c</{prefix}parameter>\n"
            f"</{prefix}invoke>\n</{prefix}tool_calls>")
    m = parse_message(text, thinking=False)
    assert m.ok and m.content == "ok"
    assert m.tool_calls == (ToolCall("read", '{"path":"a.c"}'),)


def test_parse_string_attribute_rules_and_entities():
    text = block(invoke(
        "f",
        param("plain", "a &amp;&amp; b &lt;x&gt; &quot;q&quot; &apos;s&apos; &unknown; &amp", None),
        param("json", '[1, {"a": "b c"},  true]', "false"),
        param("other", " 7 ", "yes"),  # any value but "true" means a JSON body
        param("empty", "", "false"),
        param("esc", 'x\\u003c/y "z"', "true"),
    ))
    m = parse_message(text, thinking=False)
    args = json.loads(m.tool_calls[0].arguments)
    assert args == {"plain": "a && b <x> \"q\" 's' &unknown; &amp", "json": [1, {"a": "b c"}, True],
                    "other": 7, "empty": None, "esc": 'x\\u003c/y "z"'}
    assert m.tool_calls[0].arguments.startswith('{"plain":"a && b <x> \\"q\\"')
    assert '"json":[1,{"a":"b c"},true]' in m.tool_calls[0].arguments


def test_parse_invalid_json_body_gives_empty_arguments():
    # ds4 harness: the raw body lands in the arguments text, which then fails to re-parse -> "{}"
    m = parse_message(block(invoke("f", param("x", "oops", "false"), param("y", "1", "false"))), False)
    assert m.tool_calls == (ToolCall("f", "{}"),)


def test_parse_recovers_loose_nested_parameters():
    text = ("review done\n\n" + START + "\n" + f'{INV} name="edit">\n'
            + f'{PAR} name="path">/private/tmp/tetris.c{PAR_END}\n'
            + f'{PAR} name="edits">\n'
            + param("oldText", "old &lt;text&gt;") + param("newText", "new text")
            + INV_END + "\n" + END)
    m = parse_message(text, thinking=False)
    assert m.ok and m.content == "review done"
    assert m.tool_calls == (ToolCall(
        "edit", '{"path":"/private/tmp/tetris.c","edits":{"oldText":"old <text>","newText":"new text"}}'),)


@pytest.mark.parametrize("broken", [
    START + "\n" + f"{INV}>\n" + END,                                   # invoke without a name
    START + "\n" + invoke("f", param("a", "1")),                         # never closed (truncated)
    START + "\n" + f'{INV} name="f">\n{PAR} name="a" string="true">unterminated',
    START + "\n" + f'{INV} name="f">\nstray text\n' + INV_END + END,
    START + "\n" + f'{INV} name="f">\n<{D}parameter string="true">no name{PAR_END}' + INV_END + END,
])
def test_parse_failure_returns_whole_text(broken):
    text = "<think>r</think>trying a tool\n\n" + broken
    m = parse_message(text, thinking=False)
    assert m == ParsedMessage(None, text, (), None, ok=False)


def test_parse_thinking_gates_tool_calls():
    call = block(invoke("bash", param("command", "true")))
    quoted = parse_message("<think>I might write:" + call + "\nstill reasoning</think>Final answer.", True)
    assert quoted.ok and quoted.tool_calls == () and quoted.content == "Final answer."
    assert START in quoted.reasoning
    real = parse_message("need a shell check</think>" + call, True)
    assert real.reasoning == "need a shell check" and real.content == ""
    assert real.tool_calls == (ToolCall("bash", '{"command":"true"}'),)
    # Without </think> nothing is reasoning and nothing is executable: all is content.
    truncated = parse_message("still thinking " + call, True)
    assert truncated == ParsedMessage(None, "still thinking " + call)
    # Non-thinking mode still splits a </think> and strips a leading <think>.
    assert parse_message("<think>r</think>c", False) == ParsedMessage("r", "c")
    assert parse_message("<think>r c", False) == ParsedMessage(None, "<think>r c")


def test_parse_ignores_text_after_block_and_prefers_blank_line_start():
    first = block(invoke("a", param("x", "1")), lead="")
    second = block(invoke("b", param("y", "2")))
    m = parse_message("pre " + first + " mid" + second + " tail", False)
    # ds4 looks for "\n\n<｜DSML｜tool_calls>" before a bare marker, so the later block wins and the
    # earlier one is part of the content.
    assert [c.name for c in m.tool_calls] == ["b"]
    assert m.content == "pre " + first + " mid"
    assert m.raw_dsml == second
    m2 = parse_message("x" + block(invoke("a", param("x", "1"))) + "trailing junk", False)
    assert m2.content == "x" and m2.raw_dsml == block(invoke("a", param("x", "1")))


def test_parse_odd_inputs_match_ds4():
    # ds4 harness outputs for inputs that exercise lenient corners of the parser.
    cases = [
        (block(invoke("f", f'{PAR} name="a"  >  \n{PAR_END}\n')), '{"a":"  \\n"}'),
        (block(invoke("f", f'{PAR} string="false" name="n">+3{PAR_END}\n')), '{"n":+3}'),
        (block(invoke("f", f'{PAR} name="n" string="false">1 2{PAR_END}\n')), '{"n":1}'),
        (block(invoke("f", f'{PAR} name="a&amp;b" string="true">v{PAR_END}\n')), '{"a&b":"v"}'),
        (block(invoke("f", f'{PAR} name="c" string="true">\x01\t{PAR_END}\n')), '{"c":"\\u0001\\t"}'),
    ]
    for text, args in cases:
        m = parse_message(text, False)
        assert m.tool_calls == (ToolCall("f", args),), text


NASTY_VALUES = {
    "quotes": 'He said "hi" and \'bye\'',
    "newlines": "line1\nline2\r\n\ttabbed\n",
    "angle": "a < b && c > d; if (x<y) {}",
    "closing_param": "x</｜DSML｜parameter>y",
    "closing_block": "</｜DSML｜tool_calls> </｜DSML｜invoke>",
    "unicode": "é 日本語 😀 \u00a0",
    "backslash": "C:\\path\\n not a newline",
    "empty": "",
    "spaces": "  padded  ",
    "specials": "<｜User｜><｜Assistant｜><｜end▁of▁sentence｜>｜DSML｜",
    "nested": {"deep": [{"k": "</｜DSML｜parameter>", "n": -1.5e-3}], "e": {}},
    "int": 0,
    "float": -1.25,
    "bool_t": True,
    "bool_f": False,
    "null": None,
    "array": [1, "two", [3, {"four": None}]],
}


def test_round_trip_render_parse_nasty_values():
    calls = [ToolCall("edit", json.dumps(NASTY_VALUES, ensure_ascii=False)), ToolCall("noop", "{}")]
    text = "Let me do it." + render_tool_calls(calls)
    m = parse_message(text, thinking=False)
    assert m.ok and m.content == "Let me do it."
    assert [c.name for c in m.tool_calls] == ["edit", "noop"]
    assert json.loads(m.tool_calls[0].arguments) == NASTY_VALUES
    assert list(json.loads(m.tool_calls[0].arguments)) == list(NASTY_VALUES)
    # Re-rendering the parsed calls reproduces the block: a stable cache key across turns.
    assert render_tool_calls(m.tool_calls) == m.raw_dsml


def test_round_trip_known_lossy_corners():
    # ds4 keeps string bodies raw but the parser decodes entities, so entity text in a value
    # does not survive; and in thinking mode a "</think>" inside an argument moves the point after
    # which calls are searched, so the calls are lost.  Both are ds4 behaviour, kept on purpose.
    m = parse_message(render_tool_calls([ToolCall("f", '{"v":"&amp; &lt;"}')]), False)
    assert json.loads(m.tool_calls[0].arguments) == {"v": "& <"}
    text = "r</think>" + render_tool_calls([ToolCall("f", '{"v":"a</think>b"}')])
    assert parse_message(text, True).tool_calls == ()
    assert parse_message(text, False).tool_calls == (ToolCall("f", '{"v":"a</think>b"}'),)


def test_round_trip_through_tokenizer(ds4_tokenizer):
    calls = [ToolCall("edit", json.dumps(NASTY_VALUES, ensure_ascii=False))]
    text = "reasoning with <b>tags</b></think>Content & more." + render_tool_calls(calls)
    ids = ds4_tokenizer.encode_rendered(text)
    dsml_id = ds4_tokenizer.special_ids["｜DSML｜"]
    assert ids.count(dsml_id) == text.count("｜DSML｜")
    assert ds4_tokenizer.decode(ids) == text
    assert b"".join(ds4_tokenizer.token_text(i) for i in ids).decode("utf-8") == text
    m = parse_message(ds4_tokenizer.decode(ids), thinking=True)
    assert m.reasoning == "reasoning with <b>tags</b>" and m.content == "Content & more."
    assert json.loads(m.tool_calls[0].arguments) == NASTY_VALUES


# --------------------------------------------------------------------------------------------
# End of turn


def test_finish_turn_rules():
    good = "ok" + block(invoke("f", param("a", "1")))
    out = finish_turn(good, thinking=False, has_tools=True, finish="stop", saw_tool_start=True, saw_tool_end=True)
    assert out.finish == "tool_calls" and out.error is None and out.message.tool_calls

    truncated = "ok\n\n" + START + "\n" + invoke("f", param("a", "1"))
    out = finish_turn(truncated, thinking=False, has_tools=True, finish="length", saw_tool_start=True,
                      saw_tool_end=False)
    assert (out.finish, out.error) == ("error", "unterminated tool call")
    assert out.message == ParsedMessage(None, truncated, (), None, ok=False)

    malformed = "trying a tool\n\n" + START + "\n" + f"{INV}>\n" + END
    for finish, expected in (("tool_calls", "stop"), ("stop", "stop"), ("length", "length")):
        out = finish_turn(malformed, thinking=False, has_tools=True, finish=finish, saw_tool_start=True,
                          saw_tool_end=True)
        assert (out.finish, out.error) == (expected, "invalid tool call")
        assert out.message.content == malformed and out.message.reasoning is None

    # Without tools in the request the decode loop never tracks markers: finish is untouched.
    out = finish_turn(malformed, thinking=False, has_tools=False, finish="stop", saw_tool_start=False,
                      saw_tool_end=False)
    assert (out.finish, out.error) == ("stop", None)
    out = finish_turn("plain</think>answer", thinking=True, has_tools=True, finish="length",
                      saw_tool_start=False, saw_tool_end=False)
    assert (out.finish, out.message) == ("length", ParsedMessage("plain", "answer"))


# --------------------------------------------------------------------------------------------
# Streaming


def stream(text, thinking: bool, cuts=(), as_bytes=False):
    parser = DsmlStreamParser(thinking)
    data = text.encode("utf-8") if as_bytes else text
    events, prev = [], 0
    for k in sorted(cuts):
        events += parser.feed(data[prev:k])
        prev = k
    events += parser.feed(data[prev:])
    events += parser.finish()
    return events


def accumulate(events):
    reasoning, content, calls, args, starts = [], [], [], {}, []
    for e in events:
        if isinstance(e, ReasoningDelta):
            reasoning.append(e.text)
        elif isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ToolCallStart):
            starts.append((e.index, e.name))
        elif isinstance(e, ToolCallArgumentsDelta):
            args.setdefault(e.index, []).append(e.fragment)
        elif isinstance(e, ToolCallEnd):
            calls.append(e.call)
    return "".join(reasoning), "".join(content), calls, {k: "".join(v) for k, v in args.items()}, starts


_TEXT_ATOMS = ["a", "word", " ", "\n", "\t", "<", ">", "&", '"', "/", "\\", "é", "日本", "😀", "{", "}",
               "[", ":", ",", "7", "&amp", "&lt;", "<b>", "</", "｜", "DSML", "<｜DSML｜tool", "</｜DSML｜param"]


def _rtext(r: random.Random, k: int) -> str:
    return "".join(r.choice(_TEXT_ATOMS) for _ in range(k))


def _random_turn(r: random.Random) -> tuple[str, bool, list[ToolCall]]:
    """A well-formed generated turn: optional reasoning, content, canonical DSML calls."""
    thinking = r.random() < 0.6
    calls = []
    for _ in range(r.randint(0, 3)):
        args = {}
        for _ in range(r.randint(0, 4)):
            key = _rtext(r, r.randint(1, 3))
            args[key] = r.choice([_rtext(r, r.randint(0, 8)), r.randint(-9, 9), 2.5, None, True,
                                  [1, "a", {"x": "</｜DSML｜parameter>"}], {"k": []}, "&"])
        calls.append(ToolCall(_rtext(r, r.randint(1, 3)), json.dumps(args, ensure_ascii=r.random() < 0.5)))
    content = _rtext(r, r.randint(0, 10))
    for marker in ("<｜DSML｜tool_calls>", "<DSML｜tool_calls>", "<tool_calls>"):
        content = content.replace(marker, "")
    text = (_rtext(r, r.randint(0, 10)) + "</think>" if thinking else "") + content + render_tool_calls(calls)
    return text, thinking, calls


def _check_live_equals_final(events, text, thinking, n_calls):
    end = events[-1]
    assert isinstance(end, StreamEnd)
    m = end.message
    assert m == parse_message(text, thinking)
    assert end.live_matches, text
    reasoning, content, calls, args, starts = accumulate(events)
    assert (reasoning if thinking else None) == m.reasoning
    assert content == m.content
    assert tuple(calls) == m.tool_calls and len(calls) == n_calls
    assert starts == [(i, c.name) for i, c in enumerate(calls)]
    assert all(args[i] == c.arguments for i, c in enumerate(calls))


def test_stream_equals_one_shot_under_random_splits():
    r = random.Random(20240601)
    for _ in range(300):
        text, thinking, calls = _random_turn(r)
        as_bytes = r.random() < 0.4
        n = len(text.encode("utf-8")) if as_bytes else len(text)
        cuts = [r.randrange(n + 1) for _ in range(r.randint(0, 25))]
        events = stream(text, thinking, cuts, as_bytes)
        _check_live_equals_final(events, text, thinking, len(calls))


def test_stream_char_by_char_and_one_piece():
    r = random.Random(7)
    for _ in range(20):
        text, thinking, calls = _random_turn(r)
        _check_live_equals_final(stream(text, thinking, range(len(text))), text, thinking, len(calls))
        _check_live_equals_final(stream(text, thinking), text, thinking, len(calls))


def test_stream_token_by_token(ds4_tokenizer):
    r = random.Random(11)
    for _ in range(15):
        text, thinking, calls = _random_turn(r)
        parser = DsmlStreamParser(thinking)
        events = []
        for tid in ds4_tokenizer.encode_rendered(text):
            events += parser.feed(ds4_tokenizer.token_text(tid))
        events += parser.finish()
        _check_live_equals_final(events, text, thinking, len(calls))


def test_stream_final_message_always_matches_one_shot():
    # Malformed, truncated and adversarial texts: the final message is always parse_message's,
    # and whenever the stream claims its live events match, they really do.
    r = random.Random(99)
    pieces = ["<think>", "</think>", "\n\n", START, END, INV + ' name="f">', INV_END, PAR + ' name="a">',
              PAR + ' name="b" string="false">', PAR_END, "<DSML｜tool_calls>", "<tool_calls>", "</tool_calls>",
              "text", " ", "&amp;", '{"k": [1, "x"]}', "<", "｜"]
    matched = 0
    for _ in range(400):
        text = "".join(r.choice(pieces) for _ in range(r.randint(0, 14)))
        thinking = r.random() < 0.5
        events = stream(text, thinking, [r.randrange(len(text) + 1) for _ in range(r.randint(0, 10))])
        end = events[-1]
        assert end.message == parse_message(text, thinking)
        if end.live_matches:
            matched += 1
            reasoning, content, calls, _, _ = accumulate(events)
            assert content == end.message.content and tuple(calls) == end.message.tool_calls
    assert matched > 50


def test_stream_never_emits_partial_delimiters():
    text = "Hello \n\n" + START + "\n" + invoke("f", param("a", "x &amp; y")) + END
    parser = DsmlStreamParser(thinking=False)
    seen = []
    for ch in text:
        seen += parser.feed(ch)
        content = "".join(e.text for e in seen if isinstance(e, ContentDelta))
        assert "Hello".startswith(content), content
    fragments = [e.fragment for e in seen if isinstance(e, ToolCallArgumentsDelta)]
    assert "".join(fragments) == '{"a":"x & y"}'
    # The entity is held until complete, then emitted decoded.
    assert fragments == ["{", '"a":"', "x", " ", "&", " ", "y", '"', "}"]

    # Held text is released once it proves to be ordinary text...
    parser = DsmlStreamParser(thinking=False)
    assert parser.feed("a <") == [ContentDelta("a")]
    assert parser.feed("b") == [ContentDelta(" <b")]
    assert parser.feed(" \n") == []
    assert parser.feed("c") == [ContentDelta(" \nc")]
    # ... or at the end.
    assert parser.feed("\n\n<｜DSML｜too") == []
    assert parser.finish()[0] == ContentDelta("\n\n<｜DSML｜too")

    parser = DsmlStreamParser(thinking=True)
    assert parser.feed("<thi") == []
    assert parser.feed("nk>abc</th") == [ReasoningDelta("abc")]
    assert parser.feed("ink>x") == [ContentDelta("x")]


def test_stream_utf8_bytes_split_inside_characters():
    text = "flag 🚩 é</think>done 日本"
    data = text.encode("utf-8")
    for cut in range(len(data) + 1):
        parser = DsmlStreamParser(thinking=True)
        ev = parser.feed(data[:cut]) + parser.feed(data[cut:]) + parser.finish()
        assert "".join(e.text for e in ev if isinstance(e, ReasoningDelta)) == "flag 🚩 é"
        assert "".join(e.text for e in ev if isinstance(e, ContentDelta)) == "done 日本"
        assert all("\ufffd" not in getattr(e, "text", "") for e in ev)


def test_stream_reports_divergence():
    # Reasoning never closed: ds4's final message is all content; the live view sent reasoning.
    end = stream("still thinking", True, [3])[-1]
    assert end.message == ParsedMessage(None, "still thinking") and not end.live_matches
    # Malformed block after streamed content.
    text = "ok\n\n" + START + "\n" + f"{INV}>\n" + END
    end = stream(text, False)[-1]
    assert not end.message.ok and not end.live_matches


def test_stream_misuse_raises():
    parser = DsmlStreamParser(thinking=False)
    parser.finish()
    with pytest.raises(ChatError):
        parser.feed("x")
    with pytest.raises(ChatError):
        parser.finish()
    with pytest.raises(ChatError):
        DsmlStreamParser(thinking=False).feed(3)


# --------------------------------------------------------------------------------------------
# Sampling guard (temperature 0 inside DSML markup)


def _tracker_state(text: str) -> DecodeState:
    t = DsmlDecodeTracker()
    return t.update(text)


def test_decode_tracker_states():
    head = START + "\n" + f'{INV} name="edit">\n'
    assert _tracker_state("plain text <b>") is DecodeState.OUTSIDE
    assert _tracker_state(head) is DecodeState.STRUCTURAL
    assert _tracker_state(head + f'{PAR} name="path" string="true">/tmp/a.py') is DecodeState.STRING_BODY
    assert _tracker_state(head + f'{PAR} name="path" string="true">/tmp/a.py</') is DecodeState.STRUCTURAL
    assert _tracker_state(head + f'{PAR} name="path" string="true">/tmp/a.py<') is DecodeState.STRING_BODY
    assert _tracker_state(head + f'{PAR} name="e" string="false">[{{') is DecodeState.JSON_STRUCTURAL
    assert _tracker_state(head + f'{PAR} name="e" string="false">[{{"t":"for i in') is DecodeState.JSON_STRING
    assert _tracker_state(head + f'{PAR} name="e" string="false">["a\\"</') is DecodeState.JSON_STRING
    assert _tracker_state(head + f'{PAR} name="e">1') is DecodeState.JSON_STRUCTURAL  # untyped: JSON
    done = head + f'{PAR} name="e" string="false">[]{PAR_END}\n{INV_END}\n{END}'
    assert _tracker_state(done) is DecodeState.OUTSIDE
    assert _tracker_state(done + "\n\n" + head) is DecodeState.OUTSIDE  # only the first block


def test_decode_tracker_incremental_equals_fresh():
    text = ("pre <think>x</think>" + block(invoke("f", param("s", "a</b>c"), param("j", '{"k": "v}"}', "false")),
                                           invoke("g"))) + "after"
    t = DsmlDecodeTracker()
    for i in range(len(text) + 1):
        if i and text[i - 1] == "<":
            continue  # see test_decode_tracker_lone_angle_bracket
        assert t.update(text[:i]) is _tracker_state(text[:i]), i


def test_decode_tracker_lone_angle_bracket():
    # ds4's tracker steps over a payload '<' that arrives on its own (a one-char tail is not yet a
    # partial closing tag), so the closing tag that then follows is not seen until a later one:
    # the guard is path dependent.  Kept as in ds4; it only affects the temperature choice.
    head = START + "\n" + f'{INV} name="f">\n' + f'{PAR} name="s" string="true">a'
    t = DsmlDecodeTracker()
    assert t.update(head + "<") is DecodeState.STRING_BODY
    assert t.update(head + "</") is DecodeState.STRING_BODY
    assert _tracker_state(head + "</") is DecodeState.STRUCTURAL


def test_stream_parser_exposes_structural_state():
    parser = DsmlStreamParser(thinking=False)
    states = []
    for piece in ["Sure.", "\n\n", START, "\n", f'{INV} name="f">', "\n", f'{PAR} name="s" string="true">',
                  "body", PAR_END, "\n", f'{PAR} name="j" string="false">', '{"k":', ' "v', 'al"', "}",
                  PAR_END, "\n", INV_END, "\n", END]:
        parser.feed(piece)
        states.append(parser.in_structural_syntax())
    assert states == [False, False, True, True, True, True, False, False, True, True, True, True, False,
                      True, True, True, True, True, True, False]


def test_tool_marker_scanner():
    call = block(invoke("f", param("a", "1")))

    def scan(pieces, thinking):
        s = ToolMarkerScanner(thinking)
        text = ""
        for p in pieces:
            text += p
            s.update(text, p)
        return s

    s = scan(["I could call", call, " but no", "</think>answer"], thinking=True)
    assert not s.saw_start and not s.saw_end
    s = scan(["reason", "</think>", "ok", call[:10], call[10:]], thinking=True)
    assert s.saw_start and s.saw_end
    s = scan(["ok" + call[:-3]], thinking=False)
    assert s.saw_start and not s.saw_end
    s = scan(["stray ", END, " text"], thinking=False)
    assert s.saw_orphan_end and not s.saw_start and not s.saw_end
    # The prompt's last think tag decides where generation starts.
    s = ToolMarkerScanner(True, prompt_text="<｜User｜>q<｜Assistant｜></think>")
    s.update(call, call)
    assert s.saw_start and s.saw_end
