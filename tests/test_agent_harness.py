"""The pieces of ``scripts/agent_clients.py`` that run without the clients: the recording proxy
passes a stream through unchanged and records it, the usage of every API's answer is read, and
each client's configuration is what README.md says (the clients themselves never run in CI)."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest

from ds4_mlx.frontends.server import ServerConfig
from server_backend import LiveServer, ScriptedBackend, check_stream, free_port, http

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import agent_clients  # noqa: E402
import recording_proxy  # noqa: E402


@pytest.fixture(scope="module")
def live():
    with LiveServer(ScriptedBackend(), ServerConfig(keepalive_s=0.2)) as s:
        yield s


def test_the_proxy_passes_a_stream_through_and_records_the_exchange(live, tmp_path):
    log = tmp_path / "ex.jsonl"
    port = free_port()
    proxy = recording_proxy.serve(port, live.port, str(log))
    try:
        body = {"model": "m", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        via = http(f"http://127.0.0.1:{port}", "POST", "/v1/messages?beta=true", json.dumps(body),
                   {"x-api-key": "k", "anthropic-version": "2023-06-01"})
        status, _, raw = http(f"http://127.0.0.1:{port}", "HEAD", "/")
    finally:
        proxy.shutdown()
    assert via[0] == 200 and status == 200
    assert check_stream("messages", via[2])["prompt"] > 0  # whole, terminated, in order
    entries = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(e["method"], e["path"], e["status"]) for e in entries] == [
        ("POST", "/v1/messages?beta=true", 200), ("HEAD", "/", 200)]
    assert entries[0]["body"] == body and entries[0]["headers"]["x-api-key"] == "k"
    assert entries[0]["response"] == via[2].decode()
    assert agent_clients.usage_of(entries[0])[0] > 0


def test_usage_is_read_from_every_api(live):
    cases = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                       "stream_options": {"include_usage": True}}),
             ("/v1/responses", {"input": [{"role": "user", "content": "hi"}], "stream": True}),
             ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stream": True})]
    for path, body in cases:
        for _ in range(2):  # the second is warm: its cached tokens are reported
            status, _, raw = http(live.url, "POST", path, json.dumps(body))
            prompt, cached = agent_clients.usage_of({"response": raw.decode()})
        assert status == 200 and prompt > 0 and 0 < cached <= prompt, (path, prompt, cached)


@pytest.mark.parametrize("client", sorted(agent_clients.PACKAGES))
def test_each_client_is_configured_as_the_readme_says(client, tmp_path):
    env, turn1, turn2 = agent_clients.client_setup(client, tmp_path, "http://127.0.0.1:9", cap=64, ctx=4096)
    assert agent_clients.PROMPTS[0] in turn1 and agent_clients.PROMPTS[1] in turn2
    assert env["HOME"] == str(tmp_path)
    if client == "claude":
        assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9" and env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "64"
        assert "--continue" in turn2
    elif client == "codex":
        cfg = tomllib.loads((tmp_path / ".codex" / "config.toml").read_text())
        assert cfg["model_provider"] == "ds4" and cfg["model_providers"]["ds4"]["wire_api"] == "responses"
        assert cfg["model_providers"]["ds4"]["base_url"] == "http://127.0.0.1:9/v1"
        assert turn2[-3:-1] == ["resume", "--last"]
    elif client == "opencode":
        cfg = json.loads((tmp_path / ".config" / "opencode" / "opencode.json").read_text())
        prov = cfg["provider"]["ds4"]
        assert prov["npm"] == "@ai-sdk/openai-compatible" and prov["options"]["baseURL"] == "http://127.0.0.1:9/v1"
        assert prov["models"]["deepseek-v4-flash"]["limit"] == {"context": 4096, "output": 64}
    else:
        cfg = json.loads((tmp_path / ".pi" / "agent" / "models.json").read_text())
        model = cfg["providers"]["ds4"]["models"][0]
        assert cfg["providers"]["ds4"]["api"] == "openai-completions" and model["maxTokens"] == 64
        assert model["compat"] == {"thinkingFormat": "deepseek", "requiresReasoningContentOnAssistantMessages": True}
