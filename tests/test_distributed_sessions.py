"""Frontends and sessions across ranks (``--distributed pipeline``; the snapshot, payload and disk KV
tests also ``--distributed experts``) on two loopback ranks.

The ranks are started by hand with a hostfile (``test_distributed._hostfile``), as the failure tests
there do, so that rank 0 alone gets the test's stdin and port and the other rank's exit is observed
on its own. Texts are compared in ``ds4-cpu`` numerics, where both modes are bit-identical to
one process.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest


from tests.test_distributed import CLI, _env, _hostfile

CHAT_INPUT = "/nothink\nHello\nHow are you?\n/quit\n"


def _ranks(cmd: list[str], tmp_path: Path, *, n: int = 2, stdin=None, **extra) -> dict[int, subprocess.Popen]:
    """``cmd`` started as ranks 0..n-1 of one group; rank 0 gets ``stdin`` (others: nothing)."""
    hosts = _hostfile(tmp_path, n)
    procs = {}
    for rank in range(n - 1, -1, -1):
        procs[rank] = subprocess.Popen(
            cmd, env=_env(MLX_HOSTFILE=str(hosts), MLX_RANK=str(rank), XDG_CACHE_HOME=str(tmp_path / "cache"),
                          **extra),
            stdin=stdin if rank == 0 and stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return procs


def _finish(procs: dict[int, subprocess.Popen], timeout: float = 300,
            stdin: str | None = None) -> dict[int, tuple[int, str, str]]:
    out = {}
    try:
        for rank, p in sorted(procs.items()):
            o, e = p.communicate(stdin if rank == 0 else None, timeout=timeout)
            out[rank] = (p.returncode, o, e)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


# -- chat and serve on two ranks ------------------------------------------------------------------


def test_chat_through_a_pipe_matches_one_process(tiny_model_path, tmp_path):
    """Two turns (the second continues the live session) and /quit: rank 0 prints what one
    process prints, and the other rank stops when rank 0 quits."""
    cmd = CLI + ["chat", "-m", str(tiny_model_path), "-n", "8", "--temp", "0", "--numerics", "ds4-cpu"]
    one = subprocess.run(cmd, input=CHAT_INPUT, capture_output=True, text=True, timeout=600,
                         env=_env(XDG_CACHE_HOME=str(tmp_path / "cache1")))
    assert one.returncode == 0, one.stderr
    procs = _ranks(cmd + ["--distributed", "pipeline"], tmp_path, stdin=subprocess.PIPE)
    res = _finish(procs, stdin=CHAT_INPUT)
    (rc0, out0, err0), (rc1, out1, err1) = res[0], res[1]
    assert rc0 == 0 and rc1 == 0, err0 + err1
    assert "Traceback" not in err0 + err1
    assert out1 == ""  # only rank 0 talks
    assert out0 == one.stdout and out0.count("\n") >= 2


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _serve_answers(cmd: list[str], tmp_path: Path, bodies: list[dict], n: int) -> tuple[list[dict], dict]:
    """Start ``serve`` (as ``n`` ranks when ``n`` > 1), post ``bodies`` to rank 0, SIGTERM rank 0;
    returns the answers and each rank's (status, stdout, stderr)."""
    port = _free_port()
    full = cmd + ["--port", str(port), "--log-level", "warning"]
    if n > 1:
        procs = _ranks(full + ["--distributed", "pipeline"], tmp_path, n=n)
    else:
        procs = {0: subprocess.Popen(full, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)}
    url = f"http://127.0.0.1:{port}"
    answers = []
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if json.loads(r.read()).get("status") == "ok":
                        break
            except OSError:
                pass
            assert all(p.poll() is None for p in procs.values()), _finish(procs)
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.5)
        for body in bodies:
            answers.append(_post(url + "/v1/chat/completions", body))
    finally:
        procs[0].send_signal(signal.SIGTERM)  # rank 0 only: the others must follow it out
        res = _finish(procs, timeout=120)
    return answers, res


def _chat_body(text: str) -> dict:
    return dict(model="deepseek-v4-flash", messages=[{"role": "user", "content": text}], max_tokens=6,
                temperature=0, thinking={"type": "disabled"})


def test_serve_answers_like_one_process_and_stops_with_rank_0(tiny_model_path, tmp_path):
    cmd = CLI + ["serve", "-m", str(tiny_model_path), "--ctx", "4096", "--numerics", "ds4-cpu"]
    # the second request shares the first one's prefix up to the user text (the session pool
    # rewinds to a checkpoint: a state restored on every rank), the third repeats the first
    bodies = [_chat_body("Hello, the capital of France is"), _chat_body("Hello, the capital of Italy is"),
              _chat_body("Hello, the capital of France is")]
    one, _ = _serve_answers(cmd, tmp_path, bodies, 1)
    two, res = _serve_answers(cmd, tmp_path, bodies, 2)
    for rank, (rc, _, err) in res.items():
        assert rc in (0, -signal.SIGTERM), (rank, err[-3000:])
        assert "Traceback" not in err, (rank, err[-3000:])
    assert [a["choices"][0]["message"]["content"] for a in two] == \
        [a["choices"][0]["message"]["content"] for a in one]
    assert [a["usage"] for a in two] == [a["usage"] for a in one]


# -- snapshots across ranks ------------------------------------------------------------------------

# What every rank script starts with: load in ds4-cpu numerics; a follower serves rank 0 and, when it
# stops, prints which states it still keeps (none: every drop reached it); rank 0 records the sha256 of
# each set of logits with ``rec``.
_RANK_PROLOGUE = """
import hashlib, json, sys
import numpy as np
from ds4_mlx.model.loader import load
from ds4_mlx.engine.session import Session

def start(path, mode):
    m = load(path, numerics="ds4-cpu", distributed=mode or None)
    if getattr(m, "rank", 0):
        m.follow()
        print(json.dumps({"rank": m.rank, "kept": sorted(m.kept)}), flush=True)
        sys.exit(0)
    return m

out = []
def rec(s):
    out.append(hashlib.sha256(s.logits().tobytes()).hexdigest())
"""

_SNAPSHOT_SCRIPT = _RANK_PROLOGUE + """
m = start(sys.argv[1], sys.argv[2])
s = Session(m, ctx=64, chunk=4)
s.sync([0, 5, 9, 11, 13, 2, 7]); rec(s)
snap = s.snapshot()
for _ in range(3):
    s.eval(s.argmax()); rec(s)
s.restore(snap); rec(s)                         # the snapshot, behind the live end
s.eval(3); rec(s)
s.sync([0, 5, 9, 11, 13, 8]); rec(s)            # diverges: the automatic checkpoint at 4 is restored
t = Session(m, ctx=64, chunk=4)                 # a second session, fed in turns with the first
t.sync([1, 2, 3]); rec(t)
s.eval(4); rec(s)
t.eval(5); rec(t)
s.restore(snap); s.eval(6); rec(s)
del snap, t
s.drop_checkpoints()
s.eval(6); rec(s)
s.eval(7); rec(s)                                # carries the drops of everything let go above
print(json.dumps({"rank": 0, "out": out, "kept": sorted(getattr(m, "_kept", []))}), flush=True)
"""


@pytest.mark.parametrize("mode", ["pipeline", "experts"])
def test_snapshots_restore_on_every_rank_like_one_process(tiny_model_path, tmp_path, mode):
    """Snapshot, generate on, restore, a divergence that restores an automatic checkpoint, and two
    sessions fed in turns: every logit is bit-identical to one process, and once rank 0 has let
    go of its snapshots the other rank keeps exactly the states rank 0 still holds (none here)."""
    from tests.test_distributed import LAUNCH, _run

    script = tmp_path / "snap.py"
    script.write_text(_SNAPSHOT_SCRIPT)
    one = _run([sys.executable, str(script), str(tiny_model_path), ""])
    assert one.returncode == 0, one.stderr
    ref = json.loads(one.stdout.strip().splitlines()[-1])
    r = _run(LAUNCH + ["-n", "2", "--backend", "ring", "--", sys.executable, str(script), str(tiny_model_path),
                       mode])
    got = {d["rank"]: d for d in (json.loads(line) for line in r.stdout.splitlines() if line.startswith("{"))}
    assert set(got) == {0, 1}, r.stdout + r.stderr
    assert len(ref["out"]) == 13 and got[0]["out"] == ref["out"]
    assert got[0]["kept"] == got[1]["kept"] == []


# -- payloads and the disk KV cache across ranks -----------------------------------------------------

_PAYLOAD_SCRIPT = _RANK_PROLOGUE + """
model, mode, save_to, load_from = sys.argv[1:5]
m = start(model, mode)
prompt = list(range(100, 237))                  # 137 tokens: rows in every compressor lane (ratio 128 too)
s = Session(m, ctx=300, chunk=8)
s.sync(prompt)
s.save(save_to)
t = Session(m, ctx=300, chunk=8)
t.load(load_from); rec(t)
for _ in range(3):
    t.eval(t.argmax()); rec(t)
s.eval(5); rec(s)                               # the saving session continues where it was
t.sync(prompt + [7, 8]); rec(t)                 # behind t's live end: the loaded state again
s.eval(6); rec(s)
print(json.dumps({"rank": 0, "out": out, "kept": sorted(getattr(m, "_kept", []))}), flush=True)
"""


@pytest.fixture(scope="module")
def payload_one_process(tiny_model_path, tmp_path_factory):
    """The payload script in one process, once for both modes: (script, its saved file, its record)."""
    from tests.test_distributed import _run

    d = tmp_path_factory.mktemp("payload_one")
    script = d / "payload.py"
    script.write_text(_PAYLOAD_SCRIPT)
    one_file = d / "one.ds4s"
    one = _run([sys.executable, str(script), str(tiny_model_path), "", str(one_file), str(one_file)], timeout=600)
    assert one.returncode == 0, one.stderr
    return script, one_file, json.loads(one.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pipeline", "experts"])
def test_payloads_are_one_process_files_and_load_on_every_rank(tiny_model_path, tmp_path, mode,
                                                               payload_one_process):
    """A payload saved on two ranks is byte for byte the file one process saves (pipeline: each
    rank's layers gathered to rank 0; experts: rank 0's own cache, already whole), and a file one
    process saved loads on two ranks (each keeps its layers: all of them in experts mode) and
    continues with bit-identical logits."""
    from tests.test_distributed import LAUNCH, _run

    script, one_file, ref = payload_one_process
    two_file = tmp_path / "two.ds4s"
    r = _run(LAUNCH + ["-n", "2", "--backend", "ring", "--", sys.executable, str(script), str(tiny_model_path),
                       mode, str(two_file), str(one_file)], timeout=600)
    got = {d["rank"]: d for d in (json.loads(line) for line in r.stdout.splitlines() if line.startswith("{"))}
    assert set(got) == {0, 1}, r.stdout + r.stderr
    assert two_file.read_bytes() == one_file.read_bytes()
    assert len(ref["out"]) == 7 and got[0]["out"] == ref["out"]
    assert got[0]["kept"] == got[1]["kept"]  # the other rank keeps exactly what rank 0 still names


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pipeline", "experts"])
def test_disk_kv_cache_hits_on_every_rank_like_one_process(tiny_model_path, tmp_path, mode):
    """``generate --kv-disk-dir`` on two ranks: a second run of the prompt hits the entry the first
    stored, an entry one process stored hits as well, and both give one process's logprobs, to
    the bit."""
    from tests.test_distributed import LAUNCH, PROMPT, _generate_args, _run

    prompt = tmp_path / "P"
    prompt.write_text(PROMPT + " " + " ".join(f"item {i}," for i in range(8)))

    def generate(dump: Path, kv: Path, ranks: int) -> str:
        cmd = CLI + _generate_args(tiny_model_path, prompt, dump, "ds4-cpu") + [
            "--kv-disk-dir", str(kv), "--kv-cache-min-tokens", "32", "--prefill-chunk", "32"]
        if ranks > 1:
            cmd = LAUNCH + ["-n", str(ranks), "--backend", "ring", "--"] + cmd + ["--distributed", mode]
        r = _run(cmd, timeout=600)
        assert dump.exists(), r.stdout + r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        return r.stderr

    one_kv, two_kv = tmp_path / "kv1", tmp_path / "kv2"
    err = generate(tmp_path / "one.json", one_kv, 1)
    assert "kv cache stored" in err, err
    ref = (tmp_path / "one.json").read_bytes()
    err = generate(tmp_path / "two-a.json", two_kv, 2)  # cold: stores (a pipeline gathers rank 1's layers)
    assert "kv cache stored" in err and "kv cache hit" not in err, err
    assert (tmp_path / "two-a.json").read_bytes() == ref
    err = generate(tmp_path / "two-b.json", two_kv, 2)  # the same prompt again: every rank restores
    assert "kv cache hit" in err, err
    assert (tmp_path / "two-b.json").read_bytes() == ref
    err = generate(tmp_path / "two-c.json", one_kv, 2)  # an entry one process wrote
    assert "kv cache hit" in err, err
    assert (tmp_path / "two-c.json").read_bytes() == ref


_KILLED_SAVE_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
import ds4_mlx
from ds4_mlx.errors import DistributedError
from ds4_mlx.engine.disk_cache import DiskCache, KVStoreOptions

model, work = sys.argv[1], Path(sys.argv[2])
(work / f"pid{os.environ['MLX_RANK']}").write_text(str(os.getpid()))
engine = ds4_mlx.load(model, numerics="ds4-cpu", distributed="pipeline")   # rank 1 follows in here
disk = DiskCache(engine, work / "kv", ctx=64, options=KVStoreOptions(min_tokens=16))
s = engine.new_session(ctx=64, chunk=8)
s.sync(list(range(100, 140)))
os.kill(int((work / "pid1").read_text()), signal.SIGKILL)   # the other rank dies as the saves begin
time.sleep(1)
for what, save in (("payload", lambda: s.save(work / "s.ds4s")), ("disk", lambda: disk.save(s, "cold"))):
    try:
        print(what, "saved", save(), flush=True)
    except DistributedError as exc:
        print(what, "refused:", str(exc).splitlines()[0][:60], flush=True)
"""


def test_a_rank_killed_at_a_save_leaves_nothing_behind(tiny_model_path, tmp_path):
    """The other rank is SIGKILLed just before rank 0 saves: the gather fails with a one-line
    error before any file is opened, so no payload file and no disk KV entry exist afterwards."""
    from ds4_mlx.engine.kvstore_admin import list_entries

    script = tmp_path / "save.py"
    script.write_text(_KILLED_SAVE_SCRIPT)
    procs = _ranks([sys.executable, str(script), str(tiny_model_path), str(tmp_path)], tmp_path)
    res = _finish(procs, timeout=300)
    out = res[0][1].splitlines()
    assert [line.split(":")[0] for line in out] == ["payload refused", "disk refused"], res[0]
    assert "lost the connection" in out[0] and "group is closed" in out[1], out
    assert not (tmp_path / "s.ds4s").exists()
    assert not list_entries(tmp_path / "kv").files
