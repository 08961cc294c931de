"""Requests the real agent clients sent, replayed (issue #21).

``tests/data/agent_requests/CLIENT.json`` holds the request bodies and headers Claude Code,
Codex CLI, opencode and Pi sent to ``ds4-mlx serve`` in ``scripts/agent_clients.py`` runs (two
turns each, the first with a call of the client's shell tool and its result; paths scrubbed,
API keys dropped).  Each is replayed against the live server: it must get a 200 and a
terminated, well-formed stream in its API's shape, and the server must prefill exactly the ids
``ds4-mlx tokenize --messages`` gives for the same body.  The server's prompt path is the real one
(parser, replay map, renderer, tokenizer) on a backend that skips the model; one client's
requests also run through the real engine in ``test_server_engine.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds4_mlx.frontends.cli import main
from ds4_mlx.frontends.server import ServerConfig, parse
from ds4_mlx.tokenizer import Tokenizer
from server_backend import LiveServer, TokenizingBackend, check_stream, http

DATA = Path(__file__).parent / "data" / "agent_requests"
CLIENTS = ["claude", "codex", "opencode", "pi"]
CTX = 65536
API = parse.API_OF_PATH


def recorded(client: str) -> list[dict]:
    return json.loads((DATA / f"{client}.json").read_text())


@pytest.fixture(scope="module")
def live(tiny_model_path):
    backend = TokenizingBackend(Tokenizer.from_gguf(str(tiny_model_path)), ctx=CTX)
    with LiveServer(backend, ServerConfig(ctx=CTX, keepalive_s=0.5)) as s:
        yield s


@pytest.mark.parametrize("client", CLIENTS)
def test_recorded_requests_get_200_a_whole_stream_and_the_tokenize_ids(client, live, tiny_model_path,
                                                                       tmp_path, capsys):
    requests = recorded(client)
    assert len(requests) >= 2  # both turns were recorded
    for i, rec in enumerate(requests):
        api = API[rec["path"].split("?")[0]]
        status, headers, raw = http(live.url, "POST", rec["path"], json.dumps(rec["body"]), rec["headers"],
                                    timeout=120)
        assert status == 200, (i, raw[:500])
        body_file = tmp_path / f"{i}.json"
        body_file.write_text(json.dumps(rec["body"]))
        assert main(["tokenize", "-m", str(tiny_model_path), "--messages", str(body_file), "--api", api,
                     "--ctx", str(CTX), "--json"]) == 0
        ids = json.loads(capsys.readouterr().out)["ids"]
        assert live.backend.prompts[-1] == ids, (client, i)
        if rec["body"].get("stream"):
            usage = check_stream(api, raw)
        else:
            obj = json.loads(raw)
            u = obj["usage"]
            usage = {"prompt": u.get("prompt_tokens", u.get("input_tokens"))}
        if usage is not None:
            assert usage["prompt"] == len(ids), (client, i)


def test_the_recordings_hold_each_clients_tool_turn_and_shapes():
    """What the fixtures must keep covering: Claude Code's system item inside messages and its
    tool_use/tool_result round, Codex's function_call / function_call_output items, the OpenAI
    clients' tool-call transcripts."""
    claude = recorded("claude")
    assert any(m.get("role") == "system" for r in claude for m in r["body"]["messages"])
    assert any(b.get("type") == "tool_result" for r in claude for m in r["body"]["messages"]
               if isinstance(m["content"], list) for b in m["content"])
    codex = recorded("codex")
    kinds = {it.get("type") for r in codex for it in r["body"]["input"]}
    assert {"function_call", "function_call_output"} <= kinds
    for client in ("opencode", "pi"):
        assert any(m.get("role") == "tool" for r in recorded(client) for m in r["body"]["messages"]), client
