"""Distributed runs on two loopback ranks: the pipeline mode (``--distributed pipeline``,
``model/pipeline.py``), and the failure handling both modes share (``model/distributed.py``; the
expert-parallel mode's own tests are ``test_expert_parallel.py``).

The ranks are started the way users start them, with ``mlx.launch -n 2 --backend ring`` (or, for
the failure tests, by hand with a hostfile, so that our own handling is tested and not the
launcher's habit of killing the other ranks). ``mlx.launch`` exits 0 whatever its ranks do, so
the tests read the ranks' output, not its status.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds4_mlx.errors import DistributedError, LayoutError
from ds4_mlx.model.pipeline import gguf_split, split_layers

import bench_distributed  # benchmarks/, on the path by conftest: its _run_all kills a run whole

REPO = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"]
CLI = [sys.executable, "-m", "ds4_mlx.frontends.cli"]
PROMPT = "Hello, the capital of France is"


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}  # None: unset


def _run(cmd: list[str], timeout: float = 300, **extra) -> subprocess.CompletedProcess:
    """``cmd`` to completion. A launch gets ports of its own (``mlx.launch`` otherwise starts every run
    at the same port, and two runs at once, say a developer's and CI's, connect into each other's
    rings and hang), and a run past ``timeout`` is killed with every rank it started (its own
    session), not only the launcher: an orphaned rank would spin on its sockets for ever."""
    if cmd[:len(LAUNCH)] == LAUNCH and "--starting-port" not in cmd:
        n = int(cmd[cmd.index("-n") + 1]) if "-n" in cmd else 1
        cmd = LAUNCH + ["--starting-port", str(bench_distributed.free_ports(n))] + cmd[len(LAUNCH):]
    return bench_distributed._run_all(cmd, timeout, env=_env(**extra))


def _hostfile(tmp_path: Path, n: int = 2) -> Path:
    ports = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    return path


# -- the split (a pure function) -------------------------------------------------------------------


def _max_load(ranges, sizes, first, last):
    loads = [sum(sizes[i] for i in r) for r in ranges]
    loads[0] += first
    loads[-1] += last
    return max(loads)


@pytest.mark.parametrize("sizes,n,first,last", [
    ([10] * 6, 2, 0, 0), ([10] * 6, 3, 0, 0), ([5, 1, 1, 1, 1, 5], 2, 0, 0), ([10] * 43, 2, 30, 40),
    ([1, 2, 3, 4, 5, 6, 7], 3, 0, 9), ([10, 10], 2, 100, 0), ([3] * 5, 5, 1, 1),
])
def test_split_is_contiguous_covering_and_optimal(sizes, n, first, last):
    ranges = split_layers(sizes, n, first, last)
    assert len(ranges) == n and ranges[0].start == 0 and ranges[-1].stop == len(sizes)
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:])) and all(len(r) >= 1 for r in ranges)
    # no other contiguous split has a smaller largest rank (brute force over the cut points)
    best = min(_max_load([range(a, b) for a, b in zip((0,) + cuts, cuts + (len(sizes),))], sizes, first, last)
               for cuts in itertools.combinations(range(1, len(sizes)), n - 1))
    assert _max_load(ranges, sizes, first, last) == best
    assert split_layers(sizes, n, first, last) == ranges  # deterministic


def test_split_balances_bytes_not_layer_counts():
    assert split_layers([1, 1, 1, 1, 8], 2) == [range(0, 4), range(4, 5)]
    assert split_layers([10] * 4, 2, first_extra=20) == [range(0, 1), range(1, 4)]


@pytest.mark.parametrize("n", [7, 0, -1])
def test_split_refuses_impossible_rank_counts(n):
    with pytest.raises(DistributedError, match="ranks"):
        split_layers([1] * 6, n)


def test_gguf_split_of_the_tiny_model(tiny_model_path):
    from ds4_mlx.formats.layout import load_model_file

    f, cfg, _ = load_model_file(tiny_model_path)
    try:
        ranges = gguf_split(f, cfg.n_layer, 2)
    finally:
        f.close()
    assert len(ranges) == 2 and all(len(r) >= 1 for r in ranges)
    assert ranges[0].start == 0 and ranges[-1].stop == cfg.n_layer
    assert ranges[0].stop == ranges[1].start


# -- bad combinations: one line, before anything runs -------------------------------------------------


def test_pipeline_without_a_launcher_is_one_line(tiny_model_path):
    env = {k: None for k in ("MLX_HOSTFILE", "MLX_RANK")}
    r = _run(CLI + ["generate", "-m", str(tiny_model_path), "-p", "hi", "--distributed", "pipeline"], timeout=120,
             **env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "ds4-mlx generate: error: --distributed pipeline needs two or more ranks: start every rank with "
        "mlx.launch (e.g. mlx.launch -n 2 --backend ring -- ds4-mlx generate ...)"]


def test_unknown_mode_is_refused(capsys, tiny_model_path):
    from ds4_mlx.frontends.cli import main
    import ds4_mlx

    assert main(["generate", "-m", str(tiny_model_path), "-p", "hi", "--distributed", "tensor"]) == 2
    assert "invalid choice: 'tensor'" in capsys.readouterr().err
    with pytest.raises(LayoutError, match="unknown distributed mode 'tensor'"):
        ds4_mlx.load(tiny_model_path, distributed="tensor")


# -- two ranks on loopback ---------------------------------------------------------------------------


def _generate_args(model, prompt_file, out, numerics) -> list[str]:
    return ["generate", "-m", str(model), "--prompt-file", str(prompt_file), "--raw", "--temp", "0", "-n", "6",
            "--numerics", numerics, "--dump-logprobs", str(out)]


@pytest.mark.parametrize("numerics,ranks", [("ds4-cpu", 2), ("default", 2), ("ds4-cpu", 3), ("default", 3)])
def test_pipeline_is_bit_identical_to_one_process(tiny_model_path, tmp_path, numerics, ranks):
    """The issue's acceptance line, literally: same greedy tokens, bit-identical logprobs. On three
    ranks the middle one holds layers only (the head's rows are rank 0's and the last rank's)."""
    prompt = tmp_path / "P"
    prompt.write_text(PROMPT)
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    r1 = _run(CLI + _generate_args(tiny_model_path, prompt, one, numerics))
    assert r1.returncode == 0, r1.stderr
    r2 = _run(LAUNCH + ["-n", str(ranks), "--backend", "ring", "--"] + CLI
              + _generate_args(tiny_model_path, prompt, two, numerics) + ["--distributed", "pipeline"])
    assert two.exists(), r2.stdout + r2.stderr
    assert r2.stderr.count("wrote 6 steps") == 1, r2.stderr  # rank 0 alone writes and reports
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert [s["selected"]["id"] for s in a["steps"]] == [s["selected"]["id"] for s in b["steps"]]
    assert one.read_bytes() == two.read_bytes()  # every logprob and logit, to the last bit


_SPLIT_SCRIPT = """
import sys
from ds4_mlx.model import loader, pipeline

# Each rank weighs the layers differently (as ranks on different hosts may: one has no compiler
# for the native experts, another another backend): rank 1 alone would put the cuts at layer 2
# and at head row 100.
def skewed(f, cfg, n, *args, **kwargs):
    cut, rows = (2, 100) if int(__import__("os").environ["MLX_RANK"]) == 1 else (4, 1000)
    return pipeline.PipelineSplit((range(0, cut), range(cut, cfg.n_layer)), rows, cfg.n_vocab)

loader.resident_split = skewed
m = loader.load(sys.argv[1], distributed="pipeline")
print(f"rank {m.rank}: layers {[b.il for b in m.blocks]} head rows {m.head_rows} {m.output.shape[0]}", flush=True)
if m.rank:
    m.follow()
else:
    m.close()
"""


def test_every_rank_takes_rank_0s_split(tiny_model_path, tmp_path):
    script = tmp_path / "split.py"
    script.write_text(_SPLIT_SCRIPT)
    r = _run(LAUNCH + ["-n", "2", "--backend", "ring", "--", sys.executable, str(script), str(tiny_model_path)])
    lines = sorted(line for line in r.stdout.splitlines() if line.startswith("rank "))
    assert lines == ["rank 0: layers [0, 1, 2, 3] head rows range(0, 1000) 1000",
                     "rank 1: layers [4, 5] head rows range(1000, 129280) 128280"], r.stdout + r.stderr


_RANK_SCRIPT = """
import sys
import numpy as np
from ds4_mlx.errors import DistributedError
from ds4_mlx.model.loader import load
from ds4_mlx.engine.session import Session, Snapshot

m = load(sys.argv[1], numerics="ds4-cpu", distributed="pipeline")
print(f"rank {m.rank}: layers {[b.il for b in m.blocks]} head {m.head_rows.start} {m.head_rows.stop}", flush=True)
if m.rank:
    m.follow()
    print(f"rank {m.rank}: stopped", flush=True)
    sys.exit(0)
s = Session(m, ctx=64)
s.sync([0, 5, 9, 11])
snap = s.snapshot()
s.eval(int(np.argmax(s.logits())))
foreign = snap.state.copy()
foreign.tag = None  # a state built on rank 0 alone: the other ranks never held it
s.restore(Snapshot(snap.tokens, foreign, snap.logits))
try:
    s.eval(3)
except DistributedError as exc:
    print(f"rank 0: refused: {exc}", flush=True)
"""


def test_each_rank_builds_only_its_layers_and_refuses_foreign_states(tiny_model_path, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    r = _run(LAUNCH + ["-n", "2", "--backend", "ring", "--", sys.executable, str(script), str(tiny_model_path)])
    lines = sorted(r.stdout.splitlines())
    assert len(lines) == 4, r.stdout + r.stderr
    r0, r1 = lines[0], lines[2]
    assert r0.startswith("rank 0: layers [0") and r1.startswith("rank 1: layers [")
    own0 = json.loads(r0.split("layers ")[1].split(" head")[0])
    own1 = json.loads(r1.split("layers ")[1].split(" head")[0])
    assert own0 + own1 == list(range(6))
    # the head's rows: [0, c) on rank 0, [c, n_vocab) on the last rank
    rows0, rows1 = (tuple(int(v) for v in r.split(" head ")[1].split()) for r in (r0, r1))
    assert rows0[0] == 0 and rows0[1] == rows1[0] and rows1[1] == 129280 and 0 < rows0[1] < 129280, (r0, r1)
    assert lines[1].startswith("rank 0: refused: a distributed (pipeline) run can only continue a state every "
                               "rank holds")
    assert lines[3] == "rank 1: stopped"  # rank 0's exit stopped it


# -- failure: bounded, one line ------------------------------------------------------------------------


MODES = ["pipeline", "experts"]


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_that_never_joins_ends_the_run(tiny_model_path, tmp_path, mode):
    hosts = _hostfile(tmp_path)
    t0 = time.monotonic()
    r = _run(CLI + ["generate", "-m", str(tiny_model_path), "-p", "hi", "--distributed", mode], timeout=60,
             MLX_HOSTFILE=str(hosts), MLX_RANK="0", DS4_MLX_DIST_TIMEOUT="3")
    assert time.monotonic() - t0 < 30
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [
        "ds4-mlx: error: rank 0: the other ranks did not join within 3 s "
        "(is every host of the hostfile running the same command?)"]


def _kill_one_rank_mid_generation(model, tmp_path, victim: int, mode: str) -> tuple[int, bytes, str]:
    """Two ranks started by hand; once rank 0 has printed, ``victim`` is SIGKILLed. The other rank
    must stop within a bound: returns its exit status, the rest of its stdout, and its stderr."""
    hosts = _hostfile(tmp_path)
    cmd = CLI + ["generate", "-m", str(model), "-p", PROMPT, "--raw", "--temp", "0", "-n", "400",
                 "--distributed", mode]
    survivor = 1 - victim
    procs = {}
    for rank in (1, 0):
        procs[rank] = subprocess.Popen(cmd, env=_env(MLX_HOSTFILE=str(hosts), MLX_RANK=str(rank)),
                                       stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE if rank == survivor else subprocess.DEVNULL)
    try:
        assert procs[0].stdout.read(1), "rank 0 printed nothing"  # generation has started
        procs[victim].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        procs[survivor].wait(timeout=60)
        assert time.monotonic() - t0 < 30
        out, err = procs[survivor].communicate()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return procs[survivor].returncode, out, err.decode()


def _our_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("ds4-mlx")]


@pytest.mark.parametrize("mode", MODES)
def test_a_killed_rank_ends_the_run_cleanly(tiny_model_path, tmp_path, mode):
    """Rank 1 is SIGKILLed mid-generation: rank 0 stops within a bound with one error line."""
    code, _, err = _kill_one_rank_mid_generation(tiny_model_path, tmp_path, victim=1, mode=mode)
    assert code == 2, err
    ours = _our_lines(err)
    assert len(ours) == 1 and ours[0].startswith(
        "ds4-mlx generate: error: rank 0: lost the connection to the other ranks (one exited or was killed)"), err
    assert "Traceback" not in err


@pytest.mark.parametrize("mode", MODES)
def test_a_killed_rank_0_ends_the_other_rank(tiny_model_path, tmp_path, mode):
    """The driver dies mid-generation: the follower stops within a bound with one error line."""
    code, out, err = _kill_one_rank_mid_generation(tiny_model_path, tmp_path, victim=0, mode=mode)
    assert code == 2, err
    assert out == b""  # only rank 0 prints text
    ours = _our_lines(err)
    assert len(ours) == 1 and ours[0].startswith(
        "ds4-mlx generate: error: rank 1: lost the connection to the other ranks"), err


def _by_hand(cmds: list[list[str]], tmp_path: Path, timeout: float = 300, **extra) -> list[tuple[int, str, str]]:
    """One process per rank (``cmds[rank]``) joined through a hostfile, each in its own session and
    killed with its children past ``timeout``: (exit status, stdout, stderr) per rank."""
    hosts = _hostfile(tmp_path, len(cmds))
    procs = [subprocess.Popen(cmd, env=_env(MLX_HOSTFILE=str(hosts), MLX_RANK=str(rank), **extra),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for rank, cmd in enumerate(cmds)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def test_more_ranks_than_layers_is_one_line_on_every_rank(small_model_path, tmp_path):
    """The 4-layer small model on 5 ranks, started by hand: under ``mlx.launch`` the first rank to
    exit has the launcher SIGTERM the others, which may not have printed yet."""
    cmd = CLI + ["generate", "-m", str(small_model_path), "-p", "hi", "--distributed", "pipeline"]
    for code, out, err in _by_hand([cmd] * 5, tmp_path):
        assert code == 2 and out == "", (code, out, err)
        assert err.strip().splitlines() == ["ds4-mlx generate: error: 5 ranks but the model has only 4 layers: "
                                            "a pipeline needs at least one layer per rank"], err


@pytest.mark.parametrize("what,rank1,line", [
    ("numerics", ["--numerics", "ds4-cpu"], "numerics (this rank: {numerics})"),
    ("mode", ["--distributed", "experts"], "mode (this rank: --distributed {mode})"),
    ("model", ["-m", "SMALL"], "model file (this rank: {model}"),
])
def test_ranks_started_differently_are_one_line_on_every_rank(tiny_model_path, small_model_path, tmp_path,
                                                              what, rank1, line):
    """Rank 1 runs another numerics, mode or model than rank 0: every rank names the difference
    instead of computing a wrong answer (numerics: silently different bits) or hanging (the model:
    the ranks' splits disagree)."""
    base = CLI + ["generate", "-m", str(tiny_model_path), "-p", "hi", "-n", "2", "--distributed", "pipeline",
                  "--numerics", "default"]
    other = base + [str(small_model_path) if a == "SMALL" else a for a in rank1]
    results = _by_hand([base, other], tmp_path, timeout=120)
    for rank, (code, out, err) in enumerate(results):
        mine = dict(numerics="default" if rank == 0 else "ds4-cpu", mode="pipeline" if rank == 0 else "experts",
                    model="tiny.gguf" if rank == 0 else "small.gguf")
        assert code == 2 and out == "", (rank, code, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"ds4-mlx generate: error: rank {rank}: rank {1 - rank} runs with a different "
            + line.format(**mine)), (rank, err)


def test_ranks_of_another_protocol_version_refuse_each_other(tiny_model_path, tmp_path):
    """Rank 1 runs ds4-mlx code of the previous protocol (version 1: the whole logits from the last
    rank, where version 2 shares the head's rows with rank 0): both ranks stop at the join with one
    line naming it, instead of misreading each other's messages."""
    from ds4_mlx.model.distributed import PROTOCOL_VERSION

    args = ["generate", "-m", str(tiny_model_path), "-p", "hi", "-n", "2", "--distributed", "pipeline"]
    old = [sys.executable, "-c", "import sys; from ds4_mlx.model import distributed; distributed.PROTOCOL_VERSION = 1; "
           "from ds4_mlx.frontends.cli import main; sys.exit(main(sys.argv[1:]))"] + args
    results = _by_hand([CLI + args, old], tmp_path, timeout=120)
    for rank, (code, out, err) in enumerate(results):
        assert code == 2 and out == "", (rank, code, out, err)
        assert err.strip().splitlines() == [
            f"ds4-mlx generate: error: rank {rank}: rank {1 - rank} runs with a different ds4-mlx protocol "
            f"(this rank: version {PROTOCOL_VERSION if rank == 0 else 1}); every rank must run the same command "
            "on the same model"], (rank, err)


def test_a_rank_that_joins_but_never_answers_ends_the_run(tiny_model_path, tmp_path):
    """Rank 1 is some other program that joins the ring and then says nothing (what a stranger
    connected to our ports looks like): rank 0 must not wait for it for ever."""
    rank0 = CLI + ["generate", "-m", str(tiny_model_path), "-p", "hi", "-n", "2", "--distributed", "pipeline"]
    mute = [sys.executable, "-c", "import time, mlx.core as mx; mx.distributed.init(backend='ring'); time.sleep(25)"]
    # without a bound rank 0 waits past the mute rank's exit (its first reply never comes): killed at 90 s
    (code, out, err), _ = _by_hand([rank0, mute], tmp_path, timeout=90, DS4_MLX_DIST_TIMEOUT="8")
    assert code != 0 and out == ""
    assert err.strip().splitlines() == [
        "ds4-mlx: error: rank 0: the other ranks did not join within 8 s "
        "(is every host of the hostfile running the same command?)"], err


def test_fingerprint_names_the_content(tiny_model_path, tmp_path):
    from ds4_mlx.formats.gguf import GGUFFile

    data = tiny_model_path.read_bytes()
    same, other = tmp_path / "same.gguf", tmp_path / "other.gguf"
    same.write_bytes(data)
    f = GGUFFile(tiny_model_path)
    # a byte inside the last sampled window of the tensor data changed (same header, same size)
    changed = bytearray(data)
    changed[len(data) - 100] ^= 0xFF
    other.write_bytes(bytes(changed))
    try:
        prints = [GGUFFile(p).fingerprint() for p in (same, other)]
        assert f.fingerprint() == prints[0] != prints[1]
        assert len(prints[0]) == 16 and int(prints[0], 16) >= 0
    finally:
        f.close()


@pytest.mark.parametrize("value,why", [("abc", "is not a number of seconds"), ("0", "must be a finite number"),
                                       ("inf", "must be a finite number"), ("nan", "must be a finite number")])
def test_bad_join_timeout_is_one_line(tiny_model_path, tmp_path, value, why):
    r = _run(CLI + ["generate", "-m", str(tiny_model_path), "-p", "hi", "--distributed", "pipeline"], timeout=60,
             MLX_HOSTFILE=str(_hostfile(tmp_path)), MLX_RANK="0", DS4_MLX_DIST_TIMEOUT=value)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and why in r.stderr, r.stderr
