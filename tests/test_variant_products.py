"""Each variant of the files ds4 publishes today, generated tiny (issue #22): 0731 metadata with the q2
experts (ds4f-q2), the q2-q4 mix (ds4f-q2-q4) and MXFP4 experts (ds4f-mxfp4), each run through the
product's entry points — ``generate`` (CLI and Python), ``chat`` (piped REPL) and ``serve`` (the
engine backend behind the real HTTP stack, OpenAI and Anthropic shapes) — and each reporting the 0731
checkpoint and its thinking rules (low by default: no effort prefix)."""

from __future__ import annotations

import argparse
import io
import json
import sys

import pytest

import ds4_mlx
from ds4_mlx import synth
from ds4_mlx.frontends import cli
from ds4_mlx.frontends.cmd_serve import server_parts
from server_backend import LiveServer, http
from test_expert_mixes import _byte_tokenizer

VARIANTS = {"0731-q2": "q2", "0731-q2-q4": "q2-q4", "0731-mxfp4": "mxfp4"}
N = 3


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    d = tmp_path_factory.mktemp("variants")
    tok = _byte_tokenizer(d / "tokenizer.json")
    out = {}
    for name, experts in VARIANTS.items():
        cfg = synth.preset_config("tiny", n_vocab=512, n_layer=4, n_embd=256, n_head=2, head_dim=192,
                                  n_out_group=1, q_lora=64, o_lora=32, n_expert=4, n_expert_used=2, n_ff_exp=256,
                                  n_indexer_head=2, indexer_top_k=4, swa=8, experts=experts,
                                  tokenizer_json=str(tok), name=f"DeepSeek-V4-Flash-tiny-{experts}-0731")
        out[name] = d / f"tiny-{name}.gguf"  # no 0731 in the file name: the metadata decides
        synth.write_tiny_model(cfg, out[name], compute_sha256=False)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_generate_in_python_and_from_the_cli(variants, variant, capsys):
    m = ds4_mlx.load(str(variants[variant]), numerics="ds4-cpu")
    assert m.checkpoint == "0731" and "0731" in repr(m)
    r = ds4_mlx.generate(m, [{"role": "user", "content": "Hello"}], max_tokens=N, temperature=0)
    assert len(r.tokens) == N
    # 0731's default is low: no effort paragraph after BOS; high is the preview's Think Max text
    assert "Reasoning Effort" not in m.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "Absolute maximum" in m.apply_chat_template([{"role": "user", "content": "Hi"}], think="high",
                                                       ctx=400_000, tokenize=False)
    assert cli.main(["generate", "-m", str(variants[variant]), "-p", "Hello", "-n", str(N), "--temp", "0",
                     "--numerics", "ds4-cpu", "--nothink"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and out.strip()


@pytest.mark.parametrize("variant", VARIANTS)
def test_chat_repl_two_turns(variants, variant, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "stdin", io.StringIO("/think-high\nHello\n/nothink\nAgain\n"))
    rc = cli.main(["chat", "-m", str(variants[variant]), "-n", str(N), "--temp", "0", "--numerics", "ds4-cpu",
                   "--chat-dir", str(tmp_path / "chats")])
    out, err = capsys.readouterr()
    assert rc == 0 and "Traceback" not in out + err
    assert "DeepSeek V4 Flash 0731 checkpoint, thinking levels none/low/high/max (default low)" in err
    assert len([line for line in out.split("\n") if line.strip()]) >= 2


@pytest.mark.parametrize("variant", VARIANTS)
def test_serve_openai_and_anthropic(variants, variant):
    args = cli.build_parser().parse_args(["serve", "-m", str(variants[variant]), "--ctx", "1024",
                                          "--numerics", "ds4-cpu"])
    backend, config = server_parts(args)
    backend.start()
    with LiveServer(backend, config) as live:
        st, _, body = http(live.url, "POST", "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": N, "temperature": 0,
             "reasoning_effort": "max"}))
        assert st == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] == N
        st, _, body = http(live.url, "POST", "/v1/messages", json.dumps(
            {"model": "x", "max_tokens": N, "messages": [{"role": "user", "content": "Hello"}],
             "thinking": {"type": "enabled", "budget_tokens": 1024}}))
        assert st == 200, body
        assert json.loads(body)["usage"]["output_tokens"] == N
