"""Run the real coding-agent clients against ``ds4-mlx serve``, two turns each, and print a table.

Developer tool (never run by CI, never needed by users): Claude Code, Codex CLI, opencode and Pi
are installed from npm into a cache folder, then each is configured the way README.md's agent
section says and run non-interactively for two turns (the second continues the first's
conversation) against a ``ds4-mlx serve`` on the demo model (random weights: the text is
gibberish, the protocol is what is tested).  Everything after the install runs inside a network
namespace that has only loopback (``unshare --net``), with every telemetry/update switch the
clients document turned off, so nothing leaves the machine.  A recording proxy
(``scripts/recording_proxy.py``) between each client and the server keeps every request and
response; ``--record DIR`` copies the request bodies (paths scrubbed) where the test suite's
replay fixtures live (``tests/data/agent_requests``).

    python scripts/agent_clients.py                    # all four, table on stdout
    python scripts/agent_clients.py --clients claude --keep /tmp/agents   # keep logs and homes
    python scripts/agent_clients.py --record tests/data/agent_requests

Table: client, version, turns completed, HTTP codes, prompt / cached tokens per turn, seconds per
turn, and whether turn 2 reused every token of turn 1's prompt that it resent unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import recording_proxy  # noqa: E402  (a sibling script, not a package)

PACKAGES = {
    "claude": ("@anthropic-ai/claude-code", "claude"),
    "codex": ("@openai/codex", "codex"),
    "opencode": ("opencode-ai", "opencode"),
    "pi": ("@mariozechner/pi-coding-agent", "pi"),
}
KEY = "sk-ds4-mlx-local"
MODEL_ID = "deepseek-v4-flash"
# Turn 1 asks for a command: the scripted model answers it with a call of the client's own shell
# tool, the client runs it and sends the result, so the client's real tool-call and tool-result
# transcript reaches the server (and turn 2 continues after it).
TOOL_MARK = "echo ds4-mlx"
PROMPTS = (f"Run `{TOOL_MARK}` with your shell tool, then say hello.", "Now say goodbye in one short sentence.")
SHELL_TOOLS = {"Bash": {"command": TOOL_MARK, "description": "Print a word"},  # Claude Code
               "exec_command": {"cmd": TOOL_MARK},                             # Codex CLI
               "bash": {"command": TOOL_MARK, "description": "Print a word"}}  # opencode, Pi

# Every switch the clients document for telemetry, error reports, update checks and other
# background traffic (the namespace would stop them anyway; this keeps their retries quiet).
QUIET_ENV = {
    "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
    "DISABLE_BUG_COMMAND": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1", "DO_NOT_TRACK": "1",
    "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_SHARE": "1",
    "PI_OFFLINE": "1", "PI_TELEMETRY": "0", "NO_UPDATE_NOTIFIER": "1", "CI": "1",
}


# -- install (outside the namespace: it needs the registry) ----------------------------------

def binary(cache: Path, client: str) -> Path:
    return cache / "node_modules" / ".bin" / PACKAGES[client][1]


def install(cache: Path, clients: list[str]) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    missing = [PACKAGES[c][0] for c in clients if not binary(cache, c).exists()]
    if missing:
        print(f"installing {' '.join(missing)} into {cache} ...", file=sys.stderr)
        subprocess.run(["npm", "install", "--no-fund", "--no-audit", "--silent", *missing],
                       cwd=cache, check=True, timeout=900)


def version(binary: Path) -> str:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, **QUIET_ENV))
        return (out.stdout or out.stderr).strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "?"


# -- one client ------------------------------------------------------------------------------

def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def client_setup(name: str, home: Path, base: str, cap: int, ctx: int) -> tuple[dict, list, list]:
    """Config files under ``home`` and the environment and argv of turn 1 and turn 2 (README's
    configuration plus an output cap: random weights never stop)."""
    env = {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
           "XDG_DATA_HOME": str(home / ".local/share"), "XDG_CACHE_HOME": str(home / ".cache"),
           "XDG_STATE_HOME": str(home / ".local/state")}
    p1, p2 = PROMPTS
    if name == "claude":
        env.update(ANTHROPIC_BASE_URL=base, ANTHROPIC_API_KEY=KEY, ANTHROPIC_MODEL=MODEL_ID,
                   ANTHROPIC_SMALL_FAST_MODEL=MODEL_ID, CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(cap))
        common = ["--output-format", "json", "--allowedTools", f"Bash({TOOL_MARK})"]
        return env, ["-p", p1, *common], ["-p", "--continue", p2, *common]
    if name == "codex":
        _write(home / ".codex" / "config.toml", "\n".join([
            f'model = "{MODEL_ID}"', 'model_provider = "ds4"', 'check_for_update_on_startup = false',
            '[analytics]', 'enabled = false', '[feedback]', 'enabled = false',
            '[model_providers.ds4]', 'name = "ds4-mlx"', f'base_url = "{base}/v1"',
            'wire_api = "responses"', 'env_key = "DS4_MLX_API_KEY"', ""]))
        env.update(CODEX_HOME=str(home / ".codex"), DS4_MLX_API_KEY=KEY)
        common = ["exec", "--skip-git-repo-check"]
        return env, [*common, p1], [*common, "resume", "--last", p2]
    if name == "opencode":
        cfg = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
               "model": f"ds4/{MODEL_ID}",
               "provider": {"ds4": {"npm": "@ai-sdk/openai-compatible", "name": "ds4-mlx",
                                    "options": {"baseURL": f"{base}/v1", "apiKey": KEY},
                                    "models": {MODEL_ID: {"name": "DeepSeek V4 Flash",
                                                          "limit": {"context": ctx, "output": cap}}}}}}
        _write(home / ".config" / "opencode" / "opencode.json", json.dumps(cfg, indent=1))
        common = ["run", "-m", f"ds4/{MODEL_ID}"]
        return env, [*common, p1], [*common, "--continue", p2]
    if name == "pi":
        models = {"providers": {"ds4": {
            "baseUrl": f"{base}/v1", "api": "openai-completions", "apiKey": KEY,
            "models": [{"id": MODEL_ID, "name": "DeepSeek V4 Flash", "reasoning": True,
                        "input": ["text"], "contextWindow": ctx, "maxTokens": cap,
                        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                        "compat": {"thinkingFormat": "deepseek",
                                   "requiresReasoningContentOnAssistantMessages": True}}]}}}
        _write(home / ".pi" / "agent" / "models.json", json.dumps(models, indent=1))
        common = ["--provider", "ds4", "--model", MODEL_ID, "--offline"]
        return env, [*common, "-p", p1], [*common, "--continue", "-p", p2]
    raise SystemExit(f"unknown client {name}")


def usage_of(entry: dict) -> tuple[int | None, int | None]:
    """(prompt, cached) tokens a response reported, whatever the API and streaming or not."""
    text = entry.get("response") or ""
    objs = []
    try:
        objs.append(json.loads(text))
    except ValueError:
        for line in text.splitlines():
            if line.startswith("data: ") and line[6:].strip() not in ("", "[DONE]"):
                try:
                    objs.append(json.loads(line[6:]))
                except ValueError:
                    pass
    prompt = cached = None
    for o in objs:
        for u in (o.get("usage"), (o.get("message") or {}).get("usage"), (o.get("response") or {}).get("usage")):
            if not isinstance(u, dict):
                continue
            if "prompt_tokens" in u:  # OpenAI chat
                prompt = u["prompt_tokens"]
                cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
            elif "input_tokens_details" in u:  # Responses
                prompt = u["input_tokens"]
                cached = u["input_tokens_details"].get("cached_tokens", cached)
            elif "cache_read_input_tokens" in u:  # Anthropic: input excludes the cached part
                prompt = u.get("input_tokens", 0) + u.get("cache_read_input_tokens", 0) + \
                    u.get("cache_creation_input_tokens", 0)
                cached = u.get("cache_read_input_tokens", 0)
    return prompt, cached


def _generation_requests(entries: list[dict]) -> list[dict]:
    from ds4_mlx.frontends.server.parse import API_OF_PATH

    return [e for e in entries if e["method"] == "POST" and e["path"].split("?")[0] in API_OF_PATH]


def run_client(name: str, binary: Path, out: Path, port: int, proxy_port: int, cap: int, ctx: int,
               timeout_s: int) -> dict:
    home = out / name / "home"
    work = out / name / "work"
    work.mkdir(parents=True, exist_ok=True)
    home.mkdir(parents=True, exist_ok=True)
    log_path = out / name / "exchanges.jsonl"
    proxy = recording_proxy.serve(proxy_port, port, str(log_path))
    base = f"http://127.0.0.1:{proxy_port}"
    env_extra, argv1, argv2 = client_setup(name, home, base, cap, ctx)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_"))}
    env.update(QUIET_ENV)
    env.update(env_extra)
    row = {"client": name, "version": version(binary), "turns": 0, "codes": [], "prompt": [],
           "cached": [], "seconds": [], "exit": []}
    try:
        for turn, argv in enumerate((argv1, argv2), 1):
            before = len(log_path.read_text().splitlines()) if log_path.exists() else 0
            t0 = time.time()
            try:
                done = subprocess.run([str(binary), *argv], cwd=work, env=env, capture_output=True,
                                      text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
                code = done.returncode
                (out / name / f"turn{turn}.out").write_text(done.stdout)
                (out / name / f"turn{turn}.err").write_text(done.stderr)
            except subprocess.TimeoutExpired:
                code = "timeout"
            row["seconds"].append(round(time.time() - t0, 1))
            row["exit"].append(code)
            entries = [json.loads(x) for x in log_path.read_text().splitlines()[before:]] \
                if log_path.exists() else []
            gens = _generation_requests(entries)
            row["codes"].append(sorted({e["status"] for e in entries}))
            row.setdefault("requests", []).append([e["n"] for e in gens])
            # turn 1: its last request (what turn 2 continues); turn 2: its first (the continuation)
            p, c = usage_of(gens[-1 if turn == 1 else 0]) if gens else (None, None)
            row["prompt"].append(p)
            row["cached"].append(c)
            if gens and all(e["status"] < 400 for e in gens):
                row["turns"] += 1
    finally:
        proxy.shutdown()
    return row


# -- the server: the real one, with scripted answers by default -------------------------------

REASONING = "The user wants a short reply."
ANSWER = "Hello from ds4-mlx."


def serve_scripted(argv: list[str]) -> int:
    """``ds4-mlx serve ARGV`` whose random model is made to answer like a model that stops: the
    reasoning (when the prompt opened it), ``</think>``, a short answer, EOS, forced token by token
    through a logits processor.  Everything else is the real server: rendering, tokenizer,
    prefill, KV reuse, streaming.  A random model never stops, and every client treats an answer
    cut at its output cap as a failed turn (Claude Code retries and exits 1, Codex reports
    "incomplete"); with ``--answers model`` the harness shows that instead."""
    from ds4_mlx.engine.constraints import ForcedText
    from ds4_mlx.frontends import cmd_serve
    from ds4_mlx.frontends.cli import build_parser

    args = build_parser().parse_args(["serve", *argv])
    cache: dict = {}

    def hook(req, prompt):
        from ds4_mlx.chat.dsml import render_tool_calls
        from ds4_mlx.chat.messages import ToolCall
        from ds4_mlx.chat.template import content_text

        tok = cache.get("tok")
        if tok is None:
            from ds4_mlx.tokenizer import Tokenizer

            tok = cache["tok"] = Tokenizer.from_gguf(args.model)
        eos = tok.token_to_id("<｜end▁of▁sentence｜>")
        # the last turn, past system items (Claude Code ends its first request with one)
        last = next((m for m in reversed(req.messages) if m.get("role") != "system"), {})
        text = content_text(last.get("content"))  # a string or text parts (Pi sends parts)
        names = {(t.get("function") or t).get("name") for t in req.tools or () if isinstance(t, dict)}
        shell = next((n for n in SHELL_TOOLS if n in names), None)
        if last.get("role") == "user" and TOOL_MARK in text and shell is not None:
            call = ToolCall(shell, json.dumps(SHELL_TOOLS[shell]))
            ids = tok.encode_rendered(render_tool_calls([call]))  # generation ends after the block
        else:
            ids = tok.encode(ANSWER) + [eos]
        if prompt[-1] == tok.token_to_id("<think>"):
            ids = tok.encode(REASONING) + [tok.token_to_id("</think>")] + ids
        return [ForcedText(ids)]

    return cmd_serve.run(args, logits_hook=hook)


# -- the run inside the namespace ------------------------------------------------------------

def wait_health(port: int, server: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit("ds4-mlx serve did not come up")


def inside(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, name in enumerate(args.clients):
        port = 18000 + 10 * i
        kv = out / name / "kv"
        kv.mkdir(parents=True, exist_ok=True)
        server_log = open(out / name / "server.log", "w")
        launch = ([sys.executable, os.path.abspath(__file__), "--serve-scripted"] if args.answers == "scripted"
                  else [sys.executable, "-c", "import sys; from ds4_mlx.frontends.cli import main; sys.exit(main())",
                        "serve"])
        server = subprocess.Popen(
            [*launch, "-m", args.model, "--port", str(port),
             "--ctx", str(args.ctx), "--max-tokens", str(args.max_tokens), "--kv-disk-dir", str(kv),
             "--api-key", KEY, "--trace", str(out / name / "trace.txt")],
            stdout=server_log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            wait_health(port, server)
            rows.append(run_client(name, binary(Path(args.cache), name), out, port, port + 1, args.max_tokens, args.ctx,
                                   args.turn_timeout))
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
            server_log.close()
        text = (out / name / "server.log").read_text()
        rows[-1]["server_4xx_5xx"] = sum(1 for ln in text.splitlines()
                                         if " status=4" in ln or " status=5" in ln)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    return 0


def prompt_ids(entry: dict, tok, ctx: int) -> list[int]:
    """The ids the server prefills for a recorded request (its parser and renderer, the model's
    tokenizer): what ``ds4-mlx tokenize --messages`` gives for the body."""
    from ds4_mlx.chat.request import encode_request
    from ds4_mlx.frontends.server import parse

    api = parse.API_OF_PATH[entry["path"].split("?")[0]]
    req = parse.PARSERS[api](entry["body"], parse.Limits(ctx=ctx), {}).request
    return encode_request(tok, req.messages, req.tools, req.tool_choice, req.think, ctx)


def resent_unchanged(out: Path, row: dict, tok, ctx: int) -> int | None:
    """Tokens of turn 1's last prompt that turn 2's first prompt starts with."""
    reqs = row.get("requests") or []
    if len(reqs) < 2 or not reqs[0] or not reqs[1]:
        return None
    by_n = {json.loads(x)["n"]: json.loads(x)
            for x in (out / row["client"] / "exchanges.jsonl").read_text().splitlines()}
    a, b = prompt_ids(by_n[reqs[0][-1]], tok, ctx), prompt_ids(by_n[reqs[1][0]], tok, ctx)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def table(rows: list[dict]) -> str:
    head = ("| client | version | turns | exit codes | HTTP codes | requests | turn 1 prompt (cached) "
            "| turn 2 prompt (cached) | turn 1 tokens resent unchanged | all reused | seconds | server 4xx/5xx |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        pc = [f"{p} ({c})" for p, c in zip(r["prompt"], r["cached"])] + ["-", "-"]
        same = r.get("resent")
        ok = "-" if same is None or r["cached"][1] is None else ("yes" if r["cached"][1] >= same else "no")
        codes = ", ".join("/".join(map(str, c)) for c in r["codes"])
        lines.append(f"| {r['client']} | {r['version']} | {r['turns']}/2 | {', '.join(map(str, r['exit']))} "
                     f"| {codes} | {', '.join(str(len(x)) for x in r.get('requests', []))} | {pc[0]} | {pc[1]} "
                     f"| {same if same is not None else '-'} | {ok} | {', '.join(map(str, r['seconds']))} "
                     f"| {r.get('server_4xx_5xx', '?')} |")
    return "\n".join(lines)


def scrub(obj, out_dir: str):
    """Request bodies as fixtures: the run's own paths replaced by placeholders."""
    text = json.dumps(obj, ensure_ascii=False)
    text = text.replace(out_dir, "/tmp/agent-run")
    text = text.replace(os.path.expanduser("~"), "/home/user")
    return json.loads(text)


def record(out: Path, dest: Path, clients: list[str]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in clients:
        log_path = out / name / "exchanges.jsonl"
        if not log_path.exists():
            continue
        entries = _generation_requests([json.loads(x) for x in log_path.read_text().splitlines()])
        kept = []
        for e in entries:
            if e["status"] != 200:
                continue
            headers = {k: v for k, v in e["headers"].items()
                       if k.lower() not in ("host", "content-length", "x-api-key", "authorization",
                                            "connection", "accept-encoding")}
            kept.append({"path": e["path"], "headers": headers, "body": e["body"]})
        (dest / f"{name}.json").write_text(json.dumps(scrub(kept, str(out)), ensure_ascii=False, indent=1) + "\n")
        print(f"recorded {len(kept)} requests of {name} -> {dest / (name + '.json')}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="claude,codex,opencode,pi")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/ds4-mlx/agent-clients"),
                    help="npm folder the clients are installed into")
    ap.add_argument("--model", default=None, help="GGUF to serve (default: the demo model)")
    ap.add_argument("--ctx", type=int, default=65536)
    ap.add_argument("--max-tokens", type=int, default=128,
                    help="output cap per answer (client and server; a scripted tool call needs ~60)")
    ap.add_argument("--turn-timeout", type=int, default=900)
    ap.add_argument("--keep", default=None, help="keep logs, homes and traces in this folder")
    ap.add_argument("--record", default=None, help="write the 200 request bodies here as fixtures")
    ap.add_argument("--answers", choices=["scripted", "model"], default="scripted",
                    help="scripted (default): the model is made to answer briefly and stop; model: the "
                         "random model's own output, cut at --max-tokens")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    if sys.argv[1:2] == ["--serve-scripted"]:
        return serve_scripted(sys.argv[2:])
    args = ap.parse_args()
    args.clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    if args.inside:
        return inside(args)

    if args.model is None:
        from ds4_mlx.frontends.cmd_demo import default_cache_dir, ensure_demo_model

        args.model = str(ensure_demo_model(default_cache_dir()))
    install(Path(args.cache), args.clients)
    out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="ds4-agents-"))
    if out.exists() and args.keep:
        for name in args.clients:
            shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    me = [sys.executable, os.path.abspath(__file__), "--inside", "--out", str(out),
          "--clients", ",".join(args.clients), "--cache", args.cache, "--model", args.model,
          "--ctx", str(args.ctx), "--max-tokens", str(args.max_tokens),
          "--turn-timeout", str(args.turn_timeout), "--answers", args.answers]
    # only loopback inside: nothing a client does can leave the machine
    unshare = ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *me]
    if os.geteuid() != 0:
        unshare[1:1] = ["--map-root-user"]
    code = subprocess.call(unshare)
    rows = json.loads((out / "rows.json").read_text()) if (out / "rows.json").exists() else []
    from ds4_mlx.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(args.model)
    for r in rows:
        r["resent"] = resent_unchanged(out, r, tok, args.ctx)
    print(table(rows))
    if args.record:
        record(out, Path(args.record), args.clients)
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
