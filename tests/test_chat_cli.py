"""`ds4-mlx chat` (frontends/cmd_chat.py): the REPL through a pipe, in process, and through a pty.

The model runs in ds4-cpu numerics where texts are compared: there, a session resumed at any length
continues bit for bit like a cold prefill of the same tokens, so a live multi-turn chat must print
exactly what a fresh ``generate`` of the same transcript prints.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ds4_mlx.chat.template import ChatTranscript, ThinkMode
from ds4_mlx.frontends.cli import main
from ds4_mlx.frontends.cmd_chat import FAINT, RESET, AnswerPrinter, LineReader

REPO = Path(__file__).resolve().parents[1]
STATS = re.compile(r"prompt: (\d+) tokens \((\d+) cached\)")
U1, U2 = "Hello", "How are you?"
N = 3  # tokens per answer in the in-process tests (ds4-cpu decoding is slow); the pipe test uses 8


def _env(tmp_path: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    env.pop("NO_COLOR", None)
    return env


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    import ds4_mlx

    return ds4_mlx.load(tiny_model_path, numerics="ds4-cpu")


def _reference(engine, n: int):
    """The two answers of the reference conversation (``/nothink``, U1, U2; n greedy tokens each),
    each computed by a fresh ``generate`` over the whole transcript so far (no session reuse)."""
    import ds4_mlx

    tr = ChatTranscript(engine.tokenizer, think=ThinkMode.NONE, ctx=32768)
    answers, prompts = [], []
    for text in (U1, U2):
        ids = tr.begin_turn(text)
        res = ds4_mlx.generate(engine, ids, max_tokens=n, temperature=0, think=False)
        assert len(res.tokens) == n  # no early EOS: the turn lengths below assume it
        answers.append(res.text)
        prompts.append(len(ids))
        tr.append_generated(res.tokens)
        tr.end_turn()
    return answers, prompts


@pytest.fixture(scope="module")
def expected(engine):
    return _reference(engine, N)


def _chat(monkeypatch, capsys, tmp_path, model, lines, *extra):
    """``ds4-mlx chat`` in process with ``lines`` piped on stdin: (rc, stdout, stderr)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    rc = main(["chat", "-m", str(model), "-n", str(N), "--temp", "0", "--numerics", "ds4-cpu",
               "--chat-dir", str(tmp_path / "chats"), *extra])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def _answers(out: str) -> list[str]:
    return out.split("\n")[:-1]


# ------------------------------------------------------------------------------------------------
# the acceptance, through a real pipe


def test_piped_two_turns_reuse_the_session_and_match_a_fresh_generate(tiny_model_path, tmp_path, engine):
    import ds4_mlx

    proc = subprocess.run(
        [sys.executable, "-m", "ds4_mlx.frontends.cli", "chat", "-m", str(tiny_model_path), "-n", "8",
         "--temp", "0", "--numerics", "ds4-cpu"],
        input=f"/nothink\n{U1}\n{U2}\n/quit\n", capture_output=True, text=True, env=_env(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    stats = [tuple(map(int, m)) for m in STATS.findall(proc.stderr)]
    assert len(stats) == 2, proc.stderr
    (p1, c1), (p2, c2) = stats
    answers, prompts = _reference(engine, 8)
    assert (p1, c1) == (prompts[0], 0)
    assert p2 == prompts[1] and c2 > 0, proc.stderr
    # the live session held the first prompt and all generated tokens but the last (never fed)
    assert c2 == prompts[0] + 8 - 1
    # stdout is the answers only, each followed by a newline
    assert proc.stdout == "".join(a + "\n" for a in answers)
    # turn 1 is exactly `generate -p U1 --nothink`
    assert answers[0] == ds4_mlx.generate(engine, U1, max_tokens=8, temperature=0, think=False).text


# ------------------------------------------------------------------------------------------------
# commands, in process


def test_save_load_round_trip_continues_identically(monkeypatch, capsys, tmp_path, tiny_model_path, expected):
    answers, prompts = expected
    rc, out, err = _chat(monkeypatch, capsys, tmp_path, tiny_model_path, ["/nothink", U1, "/save t-1"])
    assert rc == 0 and _answers(out) == answers[:1]
    assert (tmp_path / "chats" / "t-1.json").is_file() and (tmp_path / "chats" / "t-1.session").is_file()
    # a new process state: thinking mode, transcript and KV state all come from the save
    rc, out, err = _chat(monkeypatch, capsys, tmp_path, tiny_model_path, ["/load t-1", U2])
    assert rc == 0, err
    assert _answers(out) == answers[1:]
    assert [tuple(map(int, m)) for m in STATS.findall(err)] == [(prompts[1], prompts[0] + N - 1)], err


def test_reset_and_ctx_start_over(monkeypatch, capsys, tmp_path, tiny_model_path, expected):
    answers, prompts = expected
    rc, out, err = _chat(monkeypatch, capsys, tmp_path, tiny_model_path,
                         ["/nothink", U1, "/ctx 64", U2, "/reset", U1, "/ctx 15", U1])
    assert rc == 0, err
    # /ctx: a new session, the conversation kept and prefilled again (nothing cached), same text;
    # /reset: a new conversation; /ctx too small for the conversation: reset
    assert _answers(out) == [answers[0], answers[1], answers[0], answers[0]]
    assert [tuple(map(int, m)) for m in STATS.findall(err)] == [
        (prompts[0], 0), (prompts[1], 0), (prompts[0], 0), (prompts[0], 0)], err
    assert "ctx 64: new session" in err and "does not fit and was reset" in err and "new conversation" in err


def test_read_sends_the_file_as_a_message(monkeypatch, capsys, tmp_path, tiny_model_path, expected):
    (tmp_path / "msg.txt").write_text(U1, encoding="utf-8")
    rc, out, err = _chat(monkeypatch, capsys, tmp_path, tiny_model_path, ["/nothink", f"/read {tmp_path / 'msg.txt'}"])
    assert rc == 0, err
    assert _answers(out) == expected[0][:1]


def test_multiline_block_is_one_message(monkeypatch, capsys, tmp_path, tiny_model_path, engine):
    import ds4_mlx

    rc, out, err = _chat(monkeypatch, capsys, tmp_path, tiny_model_path,
                         ["/nothink", '"""', "first line", "/not a command", '"""'])
    assert rc == 0, err
    want = ds4_mlx.generate(engine, "first line\n/not a command", max_tokens=N, temperature=0, think=False)
    assert _answers(out) == [want.text]


def test_bad_commands_never_end_the_repl(monkeypatch, capsys, tmp_path, tiny_model_path, engine):
    chats = tmp_path / "chats"
    chats.mkdir()
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    (tmp_path / "empty.txt").write_bytes(b"")
    with open(tmp_path / "huge.txt", "wb") as fh:
        fh.truncate((16 << 20) + 1)
    good = {"format": "ds4-mlx-chat", "version": 1, "model_id": engine.model_id.hex(), "ctx": 64,
            "think": "none", "system": "", "session_tokens": 0, "tokens": [engine.tokenizer.bos_id]}
    hostile = {
        "notjson": "{", "list": "[]", "alien": json.dumps(dict(good, format="other")),
        "future": json.dumps(dict(good, version=9)), "othermodel": json.dumps(dict(good, model_id="00" * 32)),
        "badtok": json.dumps(dict(good, tokens=[engine.tokenizer.bos_id, 10 ** 9])),
        "booltok": json.dumps(dict(good, tokens=[True])), "hugectx": json.dumps(dict(good, ctx=1 << 40)),
        "nobos": json.dumps(dict(good, tokens=[5])), "kvpast": json.dumps(dict(good, session_tokens=7)),
        "nopayload": json.dumps(dict(good, session_tokens=1)), "badthink": json.dumps(dict(good, think="x")),
    }
    for name, text in hostile.items():
        (chats / f"{name}.json").write_text(text, encoding="utf-8")
    cmds = ["/frobnicate", "/ctx", "/ctx abc", "/ctx 1", "/ctx 1e3", f"/ctx {1 << 40}", "/think now", "/help me",
            "/read", f"/read {tmp_path / 'nope.txt'}", f"/read {tmp_path}", f"/read {tmp_path / 'latin1.txt'}",
            f"/read {tmp_path / 'empty.txt'}", f"/read {tmp_path / 'huge.txt'}",
            "/save", "/save ../escape", "/save .hidden", "/save a/b", "/load missing"]
    cmds += [f"/load {name}" for name in hostile]
    rc, out, err = _chat(monkeypatch, capsys, tmp_path, tiny_model_path, cmds + ["/help", "/quit"])
    assert rc == 0
    banner, *lines = err.strip().split("\n")
    assert banner.startswith("ds4-mlx chat: ") and "preview checkpoint" in banner, banner
    assert len(lines) == len(cmds), err  # exactly one line per bad command
    assert lines[0].startswith("ds4-mlx: unknown command '/frobnicate'; commands: /help")
    assert "/ctx must be in [2, 1048576], got 1" in err and "not UTF-8 text (byte 3)" in err
    assert "saved with another model" in err and "not a saved chat" in err
    assert not (tmp_path / "escape.json").exists()
    assert out.startswith("Commands:") and '"""' in out  # /help documents the multi-line convention


# ------------------------------------------------------------------------------------------------
# the pieces, without a model


def test_answer_printer_drops_think_tags_and_dims_reasoning():
    buf = io.StringIO()
    p = AnswerPrinter(buf, faint=True, in_think=True)
    for piece in ["Let me", " think", "</", "think>", "Answer", "<thi", "s is text"]:
        p.feed(piece)
    p.finish()
    assert buf.getvalue() == f"{FAINT}Let me think{RESET}\nAnswer<this is text\n"
    plain = io.StringIO()
    p = AnswerPrinter(plain, faint=False, in_think=False)
    p.feed("<think>r</think>a\n")
    p.finish()
    assert plain.getvalue() == "r\na\n"


def test_line_reader_blocks_and_end_of_input():
    err = io.StringIO()
    src = io.StringIO('  hi  \n"""one"""\n"""first\n  second\nthird"""\n"""\nopen')
    r = LineReader(src, io.StringIO(), err, interactive=False, history=None)
    assert r.read() == ("hi", False)
    assert r.read() == ("one", True)
    assert r.read() == ("first\n  second\nthird", True)
    assert r.read() is None and "ended inside" in err.getvalue()


# ------------------------------------------------------------------------------------------------
# through a terminal


def _pty_session(pexpect, tiny_model_path, env, first_words: str) -> tuple[int | None, str]:
    from pty_spawn import CTRL_C, CTRL_D, finish, spawn

    # ds4-cpu numerics: the greedy answer is exact (the tiny random model's logits are nearly flat, so
    # a default-numerics argmax may change with the BLAS's summation order), so its start is known.
    child = spawn([sys.executable, "-m", "ds4_mlx.frontends.cli", "chat", "-m", str(tiny_model_path),
                   "-n", "400", "--temp", "0", "--nothink", "--numerics", "ds4-cpu"], env=env)
    log = io.StringIO()
    child.logfile_read = log
    try:
        child.expect_exact("ds4> ")
        child.sendline(U1)
        child.expect_exact(first_words)    # the streamed answer (the greedy text of this prompt)
        child.send(CTRL_C)                 # Ctrl-C mid-answer: back to the prompt
        child.expect(r"generation: [0-9.]+ t/s \((\d+) tokens\)")
        assert int(child.match.group(1)) < 400
        child.expect_exact("ds4> ")
        child.send("half a line")
        child.expect_exact("half a line")  # echoed: readline holds the line before Ctrl-C arrives
        child.send(CTRL_C)                 # Ctrl-C at the prompt: the line is dropped
        child.expect_exact("ds4> ")
        child.send(CTRL_D)                 # Ctrl-D: leave
        child.expect(pexpect.EOF)
    except pexpect.TIMEOUT as exc:
        raise pexpect.TIMEOUT(f"{exc.value.splitlines()[0] if exc.value else 'timeout'}; the session so far:\n"
                              f"{log.getvalue()[-3000:]}") from None
    finally:
        status = finish(child)  # kills a stuck session: the test fails instead of hanging
    return status, log.getvalue()


def test_pty_prompt_stream_ctrl_c_and_ctrl_d(tiny_model_path, tmp_path, expected):
    """A terminal session. Terminal timing on a loaded 2-core machine is not ours to control, so a
    session that times out is tried once more; a wrong answer or a second timeout fails."""
    pexpect = pytest.importorskip("pexpect")
    env = _env(tmp_path)
    env["TERM"] = "xterm"
    first_words = expected[0][0].strip().split("\n")[0][:12]
    assert first_words
    try:
        status, text = _pty_session(pexpect, tiny_model_path, env, first_words)
    except pexpect.TIMEOUT:
        status, text = _pty_session(pexpect, tiny_model_path, env, first_words)
    assert status == 0, text
    assert "Traceback" not in text and "partial answer stays" in text
    assert (tmp_path / "cache" / "ds4-mlx" / "chat_history").read_text().strip().endswith(U1)


def test_chat_speculates_with_the_mtp_drafter_and_answers_the_same(monkeypatch, capsys, tmp_path, tiny_model_path,
                                                                   expected):
    """``chat --mtp FILE``: two turns, a /save and a /load with the preview's MTP drafter (the file
    the generator writes for the tiny model): the same answers as plain decoding, drafts counted in
    each stats line, and the saved session holds no draft state (it loads and speculates again)."""
    from ds4_mlx.synth import preset_config
    from ds4_mlx.synth_drafter import write_tiny_drafter

    mtp = tmp_path / "tiny-mtp.gguf"
    write_tiny_drafter(preset_config("tiny"), mtp, "mtp")
    answers, prompts = expected
    rc, out, err = _chat(monkeypatch, capsys, tmp_path, tiny_model_path, ["/nothink", U1, "/save spec"],
                         "--mtp", str(mtp), "--draft-k", "3")
    assert rc == 0 and _answers(out) == answers[:1], err
    assert "draft:" in err
    rc, out, err = _chat(monkeypatch, capsys, tmp_path, tiny_model_path, ["/load spec", U2],
                         "--mtp", str(mtp), "--draft-k", "3")
    assert rc == 0 and _answers(out) == answers[1:], err
    assert "draft:" in err
