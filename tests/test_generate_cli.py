"""`ds4-mlx generate`: greedy output, the stats line, and prefix reuse through --kv-disk-dir."""

from __future__ import annotations

import platform
import re

import pytest

from ds4_mlx.frontends.cli import main

STATS = re.compile(r"ds4-mlx: prompt: (\d+) tokens \((\d+) cached\), prefill: (?:[\d.]+ t/s|all \d+ prompt tokens cached), "
                   r"generation: [\d.]+ t/s \((\d+) tokens\)")


@pytest.fixture(scope="module")
def text(oracle_dir) -> str:
    raw = (oracle_dir / "golden" / "prompts" / "dev_long.txt").read_text(encoding="utf-8")
    return raw.removeprefix("<｜begin▁of▁sentence｜>")


def generate(capsys, model, prompt: str, *extra: str) -> tuple[str, int, int, str]:
    """Run the command; returns (generated text, prompt tokens, cached tokens, stderr)."""
    rc = main(["generate", "-m", str(model), "-p", prompt, "--temp", "0", "-n", "6", "--ctx", "1024",
               "--nothink", *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    m = STATS.search(err)
    assert m, err
    assert int(m.group(3)) <= 6
    return out, int(m.group(1)), int(m.group(2)), err


def test_same_prompt_reuses_the_saved_prompt(capsys, tiny_model_path, text, tmp_path):
    kv = tmp_path / "kv"
    args = ("--kv-disk-dir", str(kv), "--kv-cache-min-tokens", "64")
    out1, n1, cached1, err1 = generate(capsys, tiny_model_path, text[:600], *args)
    assert cached1 == 0 and f"kv cache stored {n1} tokens" in err1  # short prompt: saved whole
    assert len(list(kv.glob("*.kv"))) == 1
    out2, n2, cached2, err2 = generate(capsys, tiny_model_path, text[:600], *args)
    assert (n2, cached2) == (n1, n1) and "kv cache hit" in err2 and "stored" not in err2
    assert out2 == out1 and out1.strip()


def test_longer_prompt_reuses_aligned_prefix_exactly(capsys, tiny_model_path, text, tmp_path):
    """With a 64-token chunk, the cold save is cut at n - 32 rounded down to 64; the second, longer
    prompt resumes there, on a chunk boundary, so its greedy output equals a cold run's."""
    kv = tmp_path / "kv"
    args = ("--kv-disk-dir", str(kv), "--kv-cache-min-tokens", "64", "--prefill-chunk", "64")
    _, n1, cached1, err1 = generate(capsys, tiny_model_path, text[:600], *args)
    cut = (n1 - 32) // 64 * 64
    assert cached1 == 0 and cut >= 64 and f"kv cache stored {cut} tokens" in err1
    out2, n2, cached2, _ = generate(capsys, tiny_model_path, text[:900], *args)
    assert n2 > n1 and cached2 == cut
    out3, n3, cached3, _ = generate(capsys, tiny_model_path, text[:900], "--prefill-chunk", "64")
    assert (n3, cached3) == (n2, 0)
    assert out2 == out3


def test_bad_kv_flags(capsys, tiny_model_path):
    rc = main(["generate", "-m", str(tiny_model_path), "-p", "x", "--kv-cache-min-tokens", "0"])
    assert rc == 2 and "--kv-cache-min-tokens must be >= 1" in capsys.readouterr().err
    rc = main(["generate", "-m", str(tiny_model_path), "-p", "x", "--prefill-chunk", "0"])
    assert rc == 2 and "--prefill-chunk must be >= 1" in capsys.readouterr().err


def test_continued_saves_and_exit_save(capsys, tiny_model_path, text, tmp_path):
    """Interval 50 with a 32-token chunk: continued saves every 64 tokens; with --raw and
    --kv-cache-save-on-exit the final state (prompt + all generated tokens but the last, which is
    never fed) is stored, and a run whose prompt replays the answer continues from it."""
    kv = tmp_path / "kv"
    args = ("--kv-disk-dir", str(kv), "--kv-cache-min-tokens", "32", "--prefill-chunk", "32",
            "--kv-cache-continued-interval-tokens", "50", "--raw", "--kv-cache-save-on-exit")
    prompt = text[:300]
    out1, n1, cached1, err1 = generate(capsys, tiny_model_path, prompt, *args)
    stored = [(int(n), why) for n, why in re.findall(r"kv cache stored (\d+) tokens \((\w+)\)", err1)]
    cut = (n1 - 32) // 32 * 32  # no chat markers in --raw prose: n - 32 aligned down to the chunk
    assert cut % 64, cut  # (a cut on a frontier would also suppress the continued saves below it)
    generated = int(STATS.search(err1).group(3))
    final = n1 + generated - 1
    expected = sorted([(f, "continued") for f in range(64, n1, 64)] + [(cut, "cold")]) + [(final, "shutdown")]
    assert cached1 == 0 and stored == expected, err1
    assert len(list(kv.glob("*.kv"))) == len(expected)

    _, n2, cached2, err2 = generate(capsys, tiny_model_path, prompt + out1.removesuffix("\n"),
                                    *args[:-1])
    assert cached2 == final and f"kv cache hit: {final} tokens" in err2, err2
    assert n2 > final


def test_bad_continued_interval(capsys, tiny_model_path):
    rc = main(["generate", "-m", str(tiny_model_path), "-p", "x", "--kv-cache-continued-interval-tokens", "-1"])
    assert rc == 2 and "--kv-cache-continued-interval-tokens must be >= 0" in capsys.readouterr().err


_EXACT_PLATFORM = (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
                   and platform.libc_ver()[0] == "glibc")


@pytest.mark.skipif(not _EXACT_PLATFORM, reason="bit-exact reproduction needs glibc's libm on x86_64")
def test_dump_logprobs_equals_ds4_cli_dump(tiny_model_path, oracle_dir, tmp_path):
    """`generate --dump-logprobs` in ds4-cpu numerics writes what ds4's CLI wrote for the same run
    (the oracle's `cli_dump_logprobs`): same selected tokens, same top-20 ids, texts and bytes, and
    logits/logprobs equal to the 9 significant digits ds4 prints."""
    import json

    from ds4_mlx.frontends.cli import main

    golden = json.loads((oracle_dir / "golden" / "raw_short.json").read_text(encoding="utf-8"))
    want = golden["cli_dump_logprobs"]
    out = tmp_path / "dump.json"
    rc = main(["generate", "-m", str(tiny_model_path), "--prompt-file",
               str(oracle_dir / "golden" / "prompts" / "raw_short.txt"), "--temp", "0", "-n", "17",
               "--ctx", str(want["ctx"]), "--numerics", "ds4-cpu", "--dump-logprobs", str(out)])
    assert rc == 0
    got = json.loads(out.read_text(encoding="utf-8"))
    assert (got["prompt_tokens"], got["ctx"], got["top_k"]) == (want["prompt_tokens"], want["ctx"], want["top_k"])
    assert len(got["steps"]) == len(want["steps"])
    for g, w in zip(got["steps"], want["steps"]):
        assert g["step"] == w["step"] and g["selected"] == w["selected"]
        assert [t["token"] for t in g["top_logprobs"]] == [t["token"] for t in w["top_logprobs"]]
        for tg, tw in zip(g["top_logprobs"], w["top_logprobs"]):
            assert float(f"{tg['logit']:.9g}") == tw["logit"]
            assert float(f"{tg['logprob']:.9g}") == tw["logprob"]
