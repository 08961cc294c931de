"""The hostile-input sweep (scripts/hostile_sweep.py, #26) in its fast form: bodies, headers,
disconnects and a burst against the real app and HTTP stack with the scripted backend.  Any 5xx,
hang or failed /health after a family is a finding and fails this test; the slow families and the
real-model/disk ones run from the script (their table is in benchmarks/NOTES.md)."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sweep_mod():
    spec = importlib.util.spec_from_file_location("hostile_sweep", REPO / "scripts" / "hostile_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fast_sweep_has_no_findings(sweep_mod):
    sweep_mod.FINDINGS.clear()
    results = sweep_mod.sweep(fast=True, seed=1, cases=120)
    assert set(results) == {"bodies", "headers", "disconnects", "concurrency"}
    assert sum(sum(c.values()) for c in results.values()) > 150
    assert sweep_mod.findings(results) == 0, "\n".join(sweep_mod.FINDINGS)
    # the sweep is not vacuous: most fuzzed bodies are refused, and refusals name the field
    assert results["bodies"]["4xx (named field)"] > 50
    assert results["concurrency"]["503 busy"] > 0 and results["concurrency"]["2xx"] > 0


@pytest.mark.parametrize("raw", [b"null", b"[]", b"7", b'"text"', b"true"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses",
                                  "/v1/completions", "/v1/messages/count_tokens"])
def test_a_body_that_is_not_an_object_is_a_400(sweep_mod, path, raw):
    # `null` used to pass the JSON check and crash the parser: HTTP 500 on every endpoint
    with sweep_mod.InProcessTarget(api_key=None) as target:
        outcome, answer = sweep_mod.raw_exchange(target.port, sweep_mod.request_bytes(path, raw), timeout=10)
    assert outcome == "4xx", answer[:300]
    body = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert "JSON" in json.dumps(body)


def test_both_framings_are_refused_at_once(sweep_mod):
    # with both headers the body was read as chunked: a plain JSON body then waited for its chunk
    # size until the body deadline (30 s in serve) instead of an answer
    with sweep_mod.InProcessTarget(api_key=None, body_timeout_s=30) as target:
        body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}'
        raw = sweep_mod.request_bytes("/v1/chat/completions", body,
                                      headers={"Transfer-Encoding": "chunked"})
        outcome, answer = sweep_mod.raw_exchange(target.port, raw, timeout=5)
    assert outcome == "4xx", answer[:300]
    assert b"both Content-Length and Transfer-Encoding" in answer
