"""benchmarks/bench_distributed.py: one launched measurement on the tiny model (so the benchmark
cannot rot), its traffic counted against the protocol's message sizes, the memory target, and the
paper model's arithmetic on hand-computed values."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import bench_distributed as bd

MIB = 1 << 20


@pytest.fixture(scope="module")
def run(tiny_model_path):
    """One side-by-side run: one process, then two ranks under mlx.launch (8 prompt tokens, 2 steps),
    without the native library (``DS4_MLX_NATIVE=off``): MLX then holds the tiny model's output head
    as float32 (252 MiB, ~40 % of the one-process peak), the resident cost whose sharing between rank
    0 and the last rank these tests measure. (With the library the head is read from its Q8_0 blocks,
    70 MiB of mapped pages; the one process then peaks at ~237 MiB and the per-process floor of ~91
    MiB dominates both ranks: 0.81x / 0.73x measured.)"""
    if "DS4_MLX_EXPERT_CACHE_MB" in os.environ:
        pytest.skip("an explicit expert-cache budget is not scaled per rank")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS4_MLX_NATIVE", "off")
        return bd.measure(tiny_model_path, "pipeline", ranks=2, prompt_tokens=8, decode=2)


def test_the_json_fields(run):
    assert set(run) >= {"model", "mode", "ranks", "numerics", "prompt_tokens", "decode_tokens", "one", "per_rank",
                        "rss_ratio_max", "prefill_tps", "decode_tps", "prefill_speedup", "decode_speedup",
                        "bytes_per_prefill_token", "bytes_per_decode_token", "same_tokens"}
    json.dumps(run)  # --json prints it
    assert run["mode"] == "pipeline" and run["ranks"] == 2 and len(run["per_rank"]) == 2
    assert [p["rank"] for p in run["per_rank"]] == [0, 1]
    layers = [il for p in run["per_rank"] for il in p["layers"]]
    assert layers == sorted(set(layers)) and layers[0] == 0  # disjoint, in order, all of them
    assert run["same_tokens"] is True  # the pipeline computes what one process computes
    assert run["rank0_cache_layers"] == run["per_rank"][0]["layers"]  # its own layers' caches only
    for v in (run["prefill_tps"], run["decode_tps"], run["one"]["prefill_tps"], run["one"]["decode_tps"]):
        assert v > 0
    assert run["rss_ratio_max"] == max(p["rss_ratio"] for p in run["per_rank"])


def test_the_ranks_hold_the_resident_split(run, tiny_model_path, monkeypatch):
    """The launched ranks built the loader's split by resident bytes (the options the bench's
    workers load with: default numerics, backend and expert strategy, no native library)."""
    from ds4_mlx import native
    from ds4_mlx.formats.layout import load_model_file
    from ds4_mlx.model import load_plan
    from ds4_mlx.model.loader import resident_split

    monkeypatch.setattr(native, "library", lambda: None)  # as DS4_MLX_NATIVE=off in the workers

    f, cfg, _ = load_model_file(tiny_model_path)
    try:
        split = resident_split(f, cfg, 2, load_plan.resolve())
    finally:
        f.close()
    assert [p["layers"] for p in run["per_rank"]] == [list(r) for r in split.layers]
    # the head's rows shared: [0, c) on rank 0, [c, n_vocab) on the last rank
    assert [p["head_rows"] for p in run["per_rank"]] == [[0, split.head_cut], [split.head_cut, cfg.n_vocab]]
    assert [p["head"] for p in run["per_rank"]] == [True, True]


def test_the_counted_traffic_is_the_protocol(run, tiny_model_path):
    """Bytes the transport counted = the messages of model/pipeline.py: a 5-int64 header, the token
    ids and H [n, n_hc, n_embd] float32 (after its dtype code) down the ranks; back, each after a
    dtype code, the normed hidden state (n_embd float32) and the logits of the last rank's rows."""
    from ds4_mlx.formats.layout import load_model_file

    f, cfg, _ = load_model_file(tiny_model_path)
    f.close()
    h_row = cfg.n_hc * cfg.n_embd * 4
    first, last = (p["head_rows"] for p in run["per_rank"])
    assert first[1] > first[0]  # rank 0 holds rows: the hidden state is sent
    logits = 8 + cfg.n_embd * 4 + 8 + (last[1] - last[0]) * 4
    p = run["prompt_tokens"]
    assert run["bytes_per_decode_token"] == 40 + 8 + 8 + h_row + logits
    assert run["bytes_per_prefill_token"] == (40 + 8 * p + 8 + h_row * p + logits) / p


def test_each_rank_gets_its_share_of_the_default_expert_budget(run, tiny_model_path):
    from ds4_mlx.formats.layout import load_model_file
    from ds4_mlx.model.experts import routed_share

    f, _, _ = load_model_file(tiny_model_path)
    try:
        shares = [routed_share(f, range(p["layers"][0], p["layers"][-1] + 1)) for p in run["per_rank"]]
    finally:
        f.close()
    default = run["one"]["expert_cache"]["limit_bytes"]
    assert default == 1024 * MIB
    assert [p["expert_cache"]["limit_bytes"] for p in run["per_rank"]] == [int(default * s) for s in shares]
    # and a rank fills it only with its own layers' experts
    assert sum(p["expert_cache"]["bytes"] for p in run["per_rank"]) <= run["one"]["expert_cache"]["bytes"]


def test_sharing_the_head_evens_the_ranks(run):
    """With the output head whole on the last rank that rank peaked at 0.77x the one process (rank
    0: 0.49x; this run's 8 + 2 tokens); its rows shared with rank 0 (0.59x / 0.67x), no rank passes
    0.7x. The issue's 0.6x is the xfail below."""
    assert run["rss_ratio_max"] <= 0.7, run["per_rank"]


@pytest.mark.xfail(strict=True, reason="the tiny model's output head (129280 x 512: 252 MiB as float32 on the "
                   "CPU backend without the native library, as measured here) is about 40 % of the one-process peak; shared between rank 0 and the last rank "
                   "it evens the ranks, but the worse one still peaks at 0.65x (32 + 8 tokens; 0.67x here): on a "
                   "model this small the per-process floor (Python, MLX, BLAS, the mapping, the activations) is "
                   "itself a sixth of the one-process peak (benchmarks/NOTES.md, 'Distributed'; the 4-layer "
                   "real-dims model meets it in both numerics: 0.53x default, 0.54x ds4-cpu)")
def test_every_rank_is_within_the_target(run):
    assert run["rss_ratio_max"] <= 0.6, run["per_rank"]


def test_an_unknown_mode_is_skipped_in_one_line(capsys):
    assert bd.main(["--mode", "tensor"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("bench_distributed: mode 'tensor' is not available") \
        and out[0].endswith("skipped")


# -- the paper model ----------------------------------------------------------------------------------


def test_paper_pipeline_by_hand():
    # 4 layers of 1 ms, 2 ranks, 10 us + bytes / 1 GB/s per message, n_embd 4, n_hc 1, 10 logits:
    # H message 4*4 + 48 = 64 B, logits 10*4 + 8 = 48 B -> 2 * 10 us + 112 ns of transfer
    r = bd.paper_decode(1e-3, 4, 2, "pipeline", 1e-5, 1e9, n_embd=4, n_hc=1, n_vocab=10)
    assert r["bytes_per_token"] == 112
    assert r["comm_s"] == pytest.approx(2.0112e-5, rel=1e-12)
    assert r["s_per_token"] == pytest.approx(4.020112e-3, rel=1e-12)
    one = bd.paper_decode(1e-3, 4, 1, "pipeline", 1e-5, 1e9, n_embd=4, n_hc=1, n_vocab=10)
    assert one == {"s_per_token": 4e-3, "tps": 250.0, "comm_s": 0.0, "bytes_per_token": 0}


def test_paper_experts_by_hand():
    # half of each layer's time is routed experts, split over 2 ranks: 4 ms * 0.75 = 3 ms; one all_sum
    # of 4 floats per layer = 2 ring steps of 8 B: 4 layers * 2 * (10 us + 8 ns)
    r = bd.paper_decode(1e-3, 4, 2, "experts", 1e-5, 1e9, n_embd=4, n_hc=1, n_vocab=10, expert_share=0.5)
    assert r["comm_s"] == pytest.approx(8.0064e-5, rel=1e-12)
    assert r["s_per_token"] == pytest.approx(3.080064e-3, rel=1e-12)
    assert r["bytes_per_token"] == 128
    with pytest.raises(ValueError, match="unknown mode"):
        bd.paper_decode(1e-3, 4, 2, "tensor", 1e-5, 1e9, 4, 1, 10)


def test_paper_table_is_printed_and_is_the_readme_s(capsys):
    assert bd.main(["--paper"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| quant | link | Macs | mode |") and len(lines) == 2 + 18
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert "\n".join(lines) in readme  # the README's table is reproducible by --paper
    rows = bd.paper_table()
    mine = bd.paper_table(t_layer_ms=1.0)  # your own per-layer time: one Mac = 1 / (43 ms)
    assert all(r["tps"] == pytest.approx(1e3 / 43) for r in mine if r["macs"] == 1)
    # one Mac is the measured speed; a pipeline on one sequence adds only link time
    for quant, tps in bd.SINGLE_MAC_TPS.items():
        one = [r for r in rows if r["quant"] == quant and r["macs"] == 1]
        assert one and all(r["tps"] == pytest.approx(tps) for r in one)
        pipe = [r for r in rows if r["quant"] == quant and r["mode"] == "pipeline"]
        assert all(r["tps"] < tps for r in pipe)


def test_a_bad_model_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGU")
    assert bd.main(["--model", str(bad), "--prompt-tokens", "4", "--decode", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bench_distributed: error: the one-process run failed (exit 2): ") \
        and "magic" in err[0], err


@pytest.mark.parametrize("argv", [["--ranks", "1"], ["--prompt-tokens", "1"], ["--decode", "-1"],
                                  ["--paper", "--t-layer-ms", "0"], ["--paper", "--t-layer-ms", "nan"]])
def test_bad_settings_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bd.main(argv)
    assert exc.value.code == 2 and "must be" in capsys.readouterr().err


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped, e.g. under a container's init, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_a_timed_out_run_leaves_no_process_behind(tmp_path):
    """Past the timeout every process the command started is killed, not only the command (under
    mlx.launch the command is the launcher, and orphaned ranks kept spinning on their sockets)."""
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time\n"
              f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
              "time.sleep(120)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        bd._run_all([sys.executable, "-c", script], timeout=3)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)
