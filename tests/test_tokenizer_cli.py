"""`ds4-mlx tokenize`: output formats, chat template, errors."""

from __future__ import annotations

import ast
import json

import pytest

from ds4_mlx.frontends.cli import main
from ds4_mlx.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_path) -> Tokenizer:
    return Tokenizer.from_gguf(tiny_model_path)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["tokenize", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_text_lines(capsys, tiny_model_path, tok):
    text = "<｜begin▁of▁sentence｜>Ciao 👋🏽 <think>x</think>"
    rc, out, err = run_cli(capsys, "-m", str(tiny_model_path), "--text", text)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    ids = [int(line.split("\t")[0]) for line in lines]
    assert ids == tok.encode_rendered(text)
    assert ids[0] == tok.bos_id and 128821 in ids and 128822 in ids
    pieces = [ast.literal_eval(line.split("\t", 1)[1]) for line in lines]
    # str where the token is whole UTF-8, bytes where it cuts a character (the emoji here)
    assert any(isinstance(p, bytes) for p in pieces)
    joined = b"".join(p if isinstance(p, bytes) else p.encode() for p in pieces)
    assert joined.decode() == text


def test_json_and_file(capsys, tiny_model_path, tok, tmp_path):
    text = "Il 5 maggio 1821\r\n\tfine｜DSML｜"
    f = tmp_path / "in.txt"
    f.write_bytes(text.encode("utf-8"))
    rc, out, _ = run_cli(capsys, "-m", str(tiny_model_path), "--file", str(f), "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["ids"] == tok.encode_rendered(text)
    assert doc["ids"][-1] == 128825
    assert doc["pieces"] == [tok.token_text(i).decode("utf-8", "backslashreplace") for i in doc["ids"]]
    assert "".join(doc["pieces"]) == text


def test_chat_matches_oracle_template(capsys, tiny_model_path, oracle_dir):
    """--chat --nothink reproduces ds4's CLI prompt of the oracle's chat_nothink case."""
    g = json.loads((oracle_dir / "golden" / "chat_nothink.json").read_text(encoding="utf-8"))
    assert g["chat"]["system"] == "You are a helpful assistant" and g["chat"]["think_mode"] == "none"
    rc, out, _ = run_cli(capsys, "-m", str(tiny_model_path), "--text", g["prompt_text"], "--chat", "--nothink",
                         "--json")
    assert rc == 0
    assert json.loads(out)["ids"] == g["prompt_tokens"]


def test_chat_options(capsys, tiny_model_path, tok):
    m = str(tiny_model_path)
    _, out, _ = run_cli(capsys, "-m", m, "--text", "hi", "--chat", "--json")
    default = json.loads(out)["ids"]
    assert default[0] == tok.bos_id and default[-2:] == [128804, 128821]  # thinking on by default
    assert tok.decode(default[1:-4]) == "You are a helpful assistant"
    _, out, _ = run_cli(capsys, "-m", m, "--text", "hi", "--chat", "--system", "", "--json")
    assert json.loads(out)["ids"] == [tok.bos_id, 128803] + tok.encode("hi") + [128804, 128821]
    # Think Max adds its prefix after BOS only with a big enough context
    _, out, _ = run_cli(capsys, "-m", m, "--text", "hi", "--chat", "--think-max", "--ctx", "400000", "--json")
    maxed = json.loads(out)["ids"]
    assert tok.decode(maxed[1:8]).startswith("Reasoning Effort: Absolute")
    _, out, _ = run_cli(capsys, "-m", m, "--text", "hi", "--chat", "--think-max", "--json")
    assert json.loads(out)["ids"] == default


def test_bad_model_path(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "-m", str(tmp_path / "missing.gguf"), "--text", "x")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "missing.gguf" in err and err.startswith("ds4-mlx tokenize: error:")


def test_bad_text_file(capsys, tiny_model_path, tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes(b"caf\xe9")
    rc, _, err = run_cli(capsys, "-m", str(tiny_model_path), "--file", str(f))
    assert rc == 2 and err.count("\n") == 1 and "--file" in err and "is not UTF-8 (byte 3)" in err
    rc, _, err = run_cli(capsys, "-m", str(tiny_model_path), "--file", str(tmp_path / "nope.txt"))
    assert rc == 2 and "nope.txt" in err


def test_not_a_gguf(capsys, tmp_path):
    f = tmp_path / "fake.gguf"
    f.write_bytes(b"not a gguf at all, just text" * 4)
    rc, _, err = run_cli(capsys, "-m", str(f), "--text", "x")
    assert rc == 2 and err.count("\n") == 1 and "fake.gguf" in err
