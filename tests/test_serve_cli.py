"""`ds4-mlx serve` as a user runs it: the real command in its own process on loopback, with an API key,
answering the openai SDK, reusing the KV of a repeated request, refusing a wrong key, logging one line
per request, and leaving cleanly on SIGTERM with the live session saved to the disk cache (ds4's
"shutdown" save) and said so in the log."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

openai = pytest.importorskip("openai")

KEY = "k-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return json.loads(r.read()).get("status") == "ok"
    except OSError:
        return False


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_serve_command_end_to_end(tiny_model_path, tmp_path):
    port = _free_port()
    kv = tmp_path / "kv"
    cmd = [sys.executable, "-m", "ds4_mlx.frontends.cli", "serve", "-m", str(tiny_model_path),
           "--port", str(port), "--api-key", KEY, "--ctx", "4096", "--kv-disk-dir", str(kv),
           "--log-level", "info"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not _health(url):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        # a prompt long enough for a disk save (min 512 tokens) so SIGTERM has something to store
        text = "Summarise this: " + " ".join(f"item {i}," for i in range(300))
        req = dict(model="deepseek-v4-flash", messages=[{"role": "user", "content": text}],
                   max_tokens=4, temperature=0, extra_body={"thinking": {"type": "disabled"}})
        first = client.chat.completions.create(**req)
        second = client.chat.completions.create(**req)
        assert first.choices[0].message.content == second.choices[0].message.content
        assert second.usage.prompt_tokens == first.usage.prompt_tokens > 512
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key=KEY + "x", max_retries=0).models.list()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"serve did not exit within 120 s of SIGTERM\n{err[-3000:]}")
    # uvicorn drains, runs the shutdown (the KV save), then re-raises the signal it caught so the
    # process ends the way an unhandled SIGTERM ends (what service managers expect)
    assert proc.returncode in (0, -signal.SIGTERM), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "DeepSeek V4 Flash preview checkpoint, thinking levels none/high/max (default high)" in err, err[-3000:]
    # the server's own lines beside uvicorn's: one per request (the 401 with its reason), and the
    # shutdown save
    requests = [ln for ln in err.splitlines() if " ds4-mlx: request " in ln]
    assert len([ln for ln in requests if "endpoint=/v1/chat/completions status=200" in ln]) == 2, err[-3000:]
    assert any("status=401" in ln and 'reason="invalid or missing API key"' in ln for ln in requests), requests
    assert any("prompt=" in ln and "cached=" in ln and "decode=" in ln for ln in requests), requests
    assert any("kv cache stored" in ln and "(shutdown)" in ln for ln in err.splitlines()), err[-3000:]
    from ds4_mlx.engine.kvstore_admin import list_entries

    reasons = {f.entry.reason.name.lower() for f in list_entries(kv).files if f.entry is not None}
    # the prompt's cold save happens during the request; the live session (prompt + answer) is
    # stored with reason "shutdown" only if the SIGTERM path ran the backend's shutdown
    assert "shutdown" in reasons, reasons


def test_start_up_errors_are_one_line_without_traceback(tiny_model_path, tmp_path):
    """#26 item 8: a port in use, a --kv-disk-dir that is a file, a model that is no GGUF, a --host
    that is no address of this machine: each printed uvicorn's 30-line traceback (or its own
    error lines) and exited 3. Now one ``ds4-mlx serve: error:`` line and exit 2, as every other
    command's errors; the address is taken before the model loads, so those fail at once."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a model at all " * 64)
    not_a_dir = tmp_path / "kv-file"
    not_a_dir.write_text("")
    model = str(tiny_model_path)
    cases = {
        "port in use": (["-m", model, "--port", str(busy.getsockname()[1])],
                        f"cannot listen on 127.0.0.1:{busy.getsockname()[1]}: address already in use"),
        "kv dir is a file": (["-m", model, "--kv-disk-dir", str(not_a_dir)], "is not a directory"),
        "not a gguf": (["-m", str(garbage)], "not a GGUF file"),
        "model is a folder": (["-m", str(tmp_path)], "no such model file"),
        "unknown host": (["-m", model, "--host", "no-such-host.invalid"],
                         "--host 'no-such-host.invalid': no such address"),
        "bad address": (["-m", model, "--host", "999.1.1.1"], "--host '999.1.1.1': no such address"),
        # TEST-NET-1 (RFC 5737): never an address of this machine
        "foreign address": (["-m", model, "--host", "192.0.2.1"],
                            "cannot listen on 192.0.2.1:"),
    }
    procs = {}
    for name, (args, _) in cases.items():
        if "--port" not in args:
            args = args + ["--port", str(_free_port())]
        procs[name] = subprocess.Popen([sys.executable, "-m", "ds4_mlx.frontends.cli", "serve", "--ctx", "4096",
                                        *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=300)
            want = cases[name][1]
            assert "Traceback" not in err, (name, err[-3000:])
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("ds4-mlx serve: error: "), (name, err[-3000:])
            assert want in lines[0], (name, lines[0])
            assert proc.returncode == 2, (name, proc.returncode, err)
    finally:
        busy.close()
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
