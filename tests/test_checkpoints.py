"""#22: which DeepSeek V4 Flash checkpoint a file holds (preview / 0731), and the thinking levels each
renders, through every entry point (library, CLI template, chat transcript, tokenize, serve).

The 0731 texts below are DeepSeek's encoding for that checkpoint (``encoding/encoding_dsv4.py``:
REASONING_EFFORT_PROMPTS, DEFAULT_REASONING_EFFORT = "low"), spelled out again here rather than
imported, so a change to ours cannot pass by changing both sides.
"""

from __future__ import annotations

import json
import os
import urllib.request

import gguf
import pytest

import ds4_mlx
from ds4_mlx.chat.effort import RULES, ThinkMode
from ds4_mlx.chat.template import ChatTranscript
from ds4_mlx.errors import ChatError, LayoutError
from ds4_mlx.formats.checkpoint import Checkpoint, detect_checkpoint
from ds4_mlx.frontends.cli import build_parser, main
from ds4_mlx.frontends.server import parse
from ds4_mlx.tokenizer import Tokenizer

from server_backend import LiveServer
from small_model import rewrite_gguf

BOS, U, A = "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
BIG = 393216  # the top level's context window
OFFICIAL_0731 = {
    "low": "",
    "high": ("Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
             "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
             "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
             "adversarial scenarios.\n"
             "Explicitly write out your entire deliberation process, documenting every intermediate step, "
             "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
             "unchecked.\n\n"),
    "max": ("Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
            "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
            "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
            "resolve the underlying cause rather than any surface symptom.\n"
            "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
            "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"),
}
PREVIEW_MAX = OFFICIAL_0731["high"]  # the preview's Think Max text is 0731's high


def expected_text(prefix: str, system: str, user: str, think: bool) -> str:
    """encode_messages' layout for [system, user]: BOS, effort prefix, system, User, text, Assistant, tag."""
    return BOS + prefix + system + U + user + A + ("<think>" if think else "</think>")


@pytest.fixture(scope="module")
def path_0731(tiny_model_path, tmp_path_factory):
    """The oracle's tiny model under a ds4 0731 file name (ds4 tells the checkpoints apart by name)."""
    link = tmp_path_factory.mktemp("f0731") / "DeepSeek-V4-Flash-tiny-chat-v2-imatrix-0731.gguf"
    link.symlink_to(tiny_model_path)
    return link


@pytest.fixture(scope="module")
def m0731(path_0731):
    return ds4_mlx.load(path_0731)


@pytest.fixture(scope="module")
def preview(tiny_model_path):
    return ds4_mlx.load(tiny_model_path)


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return Tokenizer.from_gguf(tiny_model_path)


# -- which checkpoint ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name, meta, want, source", [
    ("DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix-0731.gguf", {}, "0731", "file name"),
    ("DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix.gguf", {}, "preview", "no 0731"),
    ("renamed.gguf", {"general.name": "DeepSeek V4 Flash 0731"}, "0731", "general.name"),
    ("renamed.gguf", {"general.name": "DeepSeek V4 Flash"}, "preview", "no 0731"),
    ("model-10731.gguf", {}, "preview", "no 0731"),  # 0731 as a token, not inside a longer number
    ("model-07312.gguf", {"general.name": "build 107310"}, "preview", "no 0731"),
])
def test_checkpoint_from_name_and_metadata(name, meta, want, source):
    info = detect_checkpoint(meta, f"/models/{name}")
    assert info.checkpoint.value == want and info.source.startswith(source)


def test_override_wins_over_the_name_never_over_a_declared_variant():
    assert detect_checkpoint({}, "x-0731.gguf", "preview").checkpoint is Checkpoint.PREVIEW
    assert detect_checkpoint({}, "x.gguf", "0731").source == "set by the caller"
    with pytest.raises(LayoutError, match="unknown checkpoint 'v5'"):
        detect_checkpoint({}, "x.gguf", "v5")
    with pytest.raises(LayoutError, match="Vision Experimental"):
        detect_checkpoint({"deepseek4.checkpoint_variant": "vision-exp"}, "x.gguf", "0731")
    with pytest.raises(LayoutError, match="not a checkpoint variant ds4 knows"):
        detect_checkpoint({"deepseek4.checkpoint_variant": "\x1b[31mevil"}, "x.gguf")


def test_metadata_variants_through_load_and_inspect(small_model_path, tmp_path, capsys):
    named = rewrite_gguf(small_model_path, tmp_path / "renamed.gguf", metadata={
        "general.name": ("DeepSeek V4 Flash 0731 (small)", gguf.GGUFValueType.STRING, None)})
    assert main(["inspect", str(named), "--no-tensors"]) == 0
    assert "checkpoint: DeepSeek V4 Flash 0731 (general.name); thinking levels none, low, high, max, default low" \
        in capsys.readouterr().out
    vision = rewrite_gguf(small_model_path, tmp_path / "vision.gguf", metadata={
        "deepseek4.checkpoint_variant": ("vision-exp", gguf.GGUFValueType.STRING, None)})
    with pytest.raises(LayoutError, match="Vision Experimental"):
        ds4_mlx.load(vision)
    assert main(["inspect", str(vision), "--no-tensors"]) == 1
    assert "layout: INVALID: " in capsys.readouterr().out and True


def test_model_object_says_which_checkpoint(m0731, preview):
    assert m0731.checkpoint == "0731" and preview.checkpoint == "preview"
    assert "checkpoint='0731'" in repr(m0731)
    assert "DeepSeek V4 Flash 0731 (file name)" in m0731._repr_html_()
    assert ds4_mlx.load(m0731.path, checkpoint="preview").checkpoint == "preview"
    with pytest.raises(LayoutError, match="unknown checkpoint"):
        ds4_mlx.load(m0731.path, checkpoint="0732")


# -- 0731's levels: the official bytes, tokenized ---------------------------------------------------------


@pytest.mark.parametrize("level", ["low", "high", "max"])
def test_0731_level_renders_the_official_encoding(m0731, tok, level):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]
    want = expected_text(OFFICIAL_0731[level], "You are terse.", "Hello", think=True)
    assert m0731.apply_chat_template(msgs, think=level, ctx=BIG, tokenize=False) == want
    assert m0731.apply_chat_template(msgs, think=level, ctx=BIG) == tok.encode_rendered(want)
    # the CLI form (a string prompt) holds the same text
    ids = m0731.apply_chat_template("Hello", system="You are terse.", think=level, ctx=BIG)
    assert tok.decode(ids) == want


def test_0731_default_is_low_and_preview_keeps_ds4s_rules(m0731, preview, tok):
    msgs = [{"role": "user", "content": "Hi"}]
    assert m0731.apply_chat_template(msgs, system=None, tokenize=False, ctx=BIG) == expected_text("", "", "Hi", True)
    assert m0731.effort().mode is ThinkMode.LOW and preview.effort().mode is ThinkMode.HIGH
    # preview: high has no prefix, max has the "Absolute maximum" text, low renders as high
    assert preview.apply_chat_template(msgs, system=None, think="high", ctx=BIG, tokenize=False) == expected_text("", "", "Hi", True)
    assert preview.apply_chat_template(msgs, system=None, think="low", ctx=BIG, tokenize=False) == expected_text("", "", "Hi", True)
    assert preview.apply_chat_template(msgs, system=None, think="max", ctx=BIG, tokenize=False) == \
        expected_text(PREVIEW_MAX, "", "Hi", True)
    for model in (m0731, preview):
        assert model.apply_chat_template(msgs, system=None, think=False, ctx=BIG, tokenize=False) == expected_text("", "", "Hi", False)


def test_top_level_below_its_window_is_high_on_both(m0731, preview):
    msgs = [{"role": "user", "content": "Hi"}]
    assert m0731.apply_chat_template(msgs, system=None, think="max", ctx=4096, tokenize=False) == \
        expected_text(OFFICIAL_0731["high"], "", "Hi", True)
    assert preview.apply_chat_template(msgs, system=None, think="max", ctx=4096, tokenize=False) == expected_text("", "", "Hi", True)
    r = ds4_mlx.generate(m0731, "Hello", think="max", max_tokens=1, temperature=0, ctx=4096)
    assert r.stats.think == "high" and any("Think Max" in n for n in r.stats.notices)
    r = ds4_mlx.generate(m0731, "Hello", max_tokens=1, temperature=0, ctx=4096)
    assert r.stats.think == "low" and not r.stats.notices


def test_bad_level_is_a_clear_error(m0731):
    with pytest.raises(ChatError, match="'none', 'low', 'high', 'max'"):
        m0731.apply_chat_template("Hi", think="extreme")


# -- the chat REPL's transcript ---------------------------------------------------------------------------


def test_transcript_swaps_the_prefix_when_the_level_changes(tok):
    rules = RULES[Checkpoint.F0731]
    t = ChatTranscript(tok, system="S", think=True, ctx=BIG, rules=rules)
    assert t.think is ThinkMode.LOW and tok.decode(t.begin_turn("a")) == expected_text("", "S", "a", True)
    t.append_generated(tok.encode("ok"))
    t.end_turn()
    for level in ("high", "max", "low"):
        t.think = ThinkMode(level)
        text = tok.decode(t.begin_turn("b"))
        assert text.startswith(BOS + OFFICIAL_0731[level] + "S" + U + "a" + A), level
        t.abort_turn()
    saved = list(t.tokens)
    t.think = ThinkMode.MAX
    t.begin_turn("c")
    again = ChatTranscript.from_tokens(tok, t.tokens, "max", BIG, rules=rules)
    again.think = ThinkMode.NONE
    again.abort_turn()
    assert tok.decode(again.begin_turn("c")).startswith(BOS + "S" + U)  # the recognised prefix was removed
    assert saved[:1] == [tok.bos_id]


# -- the server: request controls read with the checkpoint's rules ---------------------------------------


LIMITS_0731 = parse.Limits(ctx=BIG, effort_rules=RULES[Checkpoint.F0731])


@pytest.mark.parametrize("body, level", [
    ({}, "low"),
    ({"reasoning_effort": "minimal"}, "low"), ({"reasoning_effort": "low"}, "low"),
    ({"reasoning_effort": "medium"}, "low"), ({"reasoning_effort": "high"}, "high"),
    ({"reasoning_effort": "xhigh"}, "high"), ({"reasoning_effort": "max"}, "max"),
    ({"reasoning_effort": "none"}, "none"), ({"thinking": {"type": "disabled"}}, "none"),
    ({"thinking": {"type": "enabled"}}, "low"), ({"model": "deepseek-chat"}, "none"),
    ({"model": "deepseek-reasoner"}, "low"), ({"think": True, "reasoning_effort": "high"}, "high"),
])
def test_0731_request_controls(body, level):
    req = parse.parse_chat({"messages": [{"role": "user", "content": "x"}], **body}, LIMITS_0731).request
    assert req.think.value == level and req.think.prefix == OFFICIAL_0731.get(level, "")


def test_0731_anthropic_and_responses_effort_names():
    msgs = {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    assert parse.parse_messages({**msgs, "output_config": {"effort": "max"}}, LIMITS_0731).request.think.value == "max"
    assert parse.parse_messages({**msgs, "output_config": {"effort": "low"}}, LIMITS_0731).request.think.value == "low"
    r = parse.parse_responses({"input": "x", "reasoning": {"effort": "high"}}, LIMITS_0731).request
    assert r.think.value == "high"
    with pytest.raises(Exception, match="reasoning_effort must be one of none, minimal"):
        parse.parse_chat({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "ultra"}, LIMITS_0731)


def test_tokenize_messages_on_a_0731_file_prefills_the_official_bytes(path_0731, tok, tmp_path, capsys):
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"messages": [{"role": "user", "content": "Hello"}], "reasoning_effort": "max"}))
    assert main(["tokenize", "-m", str(path_0731), "--messages", str(req), "--ctx", str(BIG), "--json"]) == 0
    ids = json.loads(capsys.readouterr().out)["ids"]
    assert ids == tok.encode_rendered(expected_text(OFFICIAL_0731["max"], "", "Hello", True))
    assert main(["tokenize", "-m", str(path_0731), "--text", "Hello", "--chat", "-sys", "", "--think-high",
                 "--ctx", str(BIG), "--json"]) == 0
    ids = json.loads(capsys.readouterr().out)["ids"]
    assert tok.decode(ids) == expected_text(OFFICIAL_0731["high"], "", "Hello", True)


def test_serve_on_a_0731_file_reads_effort_with_its_rules(path_0731, tok):
    """The whole serve wiring (the options, the header's checkpoint, the worker's load): the prompt of a
    'high' request is the 'low' prompt plus the official high paragraph."""
    from ds4_mlx.frontends.cmd_serve import server_parts

    args = build_parser().parse_args(["serve", "-m", str(path_0731), "--ctx", "4096"])
    backend, config = server_parts(args)
    assert config.effort_rules.checkpoint is Checkpoint.F0731

    def prompt_tokens(server, effort):
        body = {"model": "deepseek-v4-flash", "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "user", "content": "Hello"}], "reasoning_effort": effort}
        rq = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                    headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(rq, timeout=120) as resp:
            return json.loads(resp.read())["usage"]["prompt_tokens"], resp.headers.get("x-ds4-think")

    with LiveServer(backend, config) as server:
        (low, _), (high, _), (mx, note) = (prompt_tokens(server, e) for e in ("low", "high", "max"))
    assert high - low == len(tok.encode(OFFICIAL_0731["high"]))
    assert mx == high and note == "max refused: context 4096 < 393216; using high"
    assert os.path.basename(backend.model_path).endswith("-0731.gguf")
