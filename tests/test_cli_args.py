"""The `ds4-mlx` argument surface: strict numeric options, the sub-command's usage on errors,
--version, `--prompt-file -`, --dump-logprobs path checks, Ctrl-C (exit 130) and closed pipes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds4_mlx.frontends.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]
STATS = re.compile(r"ds4-mlx: prompt: (\d+) tokens \((\d+) cached\)")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ds4_mlx.frontends.cli", *args], env=_env(), **kw)


def _usage_error(capsys, argv: list[str], command: str) -> str:
    """Run argv, expect exit 2 with `command`'s usage and exactly one error line; return it."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    assert f"usage: ds4-mlx {command} " in err, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"ds4-mlx {command}: error: "), err
    assert err.rstrip("\n").splitlines()[-1] == errors[0]
    return errors[0]


GEN = ["generate", "-m", "model.gguf", "-p", "x"]


@pytest.mark.parametrize("flag, value, expect", [
    ("--temp", "-1", "--temp must be in [0, 100], got -1"),
    ("--temp", "nan", "--temp must be a finite number, got 'nan'"),
    ("--temp", "1e999", "--temp must be a finite number"),
    ("--temp", "hot", "--temp must be a number, got 'hot'"),
    ("--top-p", "5", "--top-p must be in (0, 1], got 5: it is a probability mass"),
    ("--top-p", "0", "--top-p must be in (0, 1], got 0"),
    ("--min-p", "-2", "--min-p must be in [0, 1], got -2"),
    ("--min-p", "1.5", "--min-p must be in [0, 1], got 1.5"),
    ("--top-k", "5000", "--top-k must be in [0, 1024], got 5000"),
    ("--top-k", "1.5", "--top-k must be an integer, got '1.5'"),
    ("--ctx", "100000000", "--ctx must be in [2, 1048576], got 100000000"),
    ("--ctx", "1", "--ctx must be in [2, 1048576], got 1"),
    ("--ctx", "", "--ctx must be an integer, got ''"),
    ("-n", "-1", "-n must be >= 0, got -1"),
    ("--tokens", "-1", "--tokens must be >= 0, got -1"),
    ("--seed", "-1", "--seed must be in [0, 18446744073709551615], got -1"),
    ("--seed", str(1 << 64), "--seed must be in [0, 18446744073709551615]"),
    ("--seed", "0x10", "--seed must be an integer, got '0x10'"),
    ("--logprobs-top-k", "0", "--logprobs-top-k must be in [1, 128], got 0"),
    ("--logprobs-top-k", "129", "--logprobs-top-k must be in [1, 128], got 129"),
    ("--prefill-chunk", "0", "--prefill-chunk must be >= 1, got 0"),
    ("--kv-disk-space-mb", "-1", "--kv-disk-space-mb must be >= 0, got -1"),
    ("--kv-disk-space-mb", "inf", "--kv-disk-space-mb must be a finite number"),
    ("--kv-cache-min-tokens", "0", "--kv-cache-min-tokens must be >= 1, got 0"),
    ("--kv-cache-boundary-align-tokens", "-5", "--kv-cache-boundary-align-tokens must be >= 0, got -5"),
    ("--kv-cache-continued-interval-tokens", "-1", "--kv-cache-continued-interval-tokens must be >= 0"),
])
def test_generate_rejects_bad_numbers_while_parsing(capsys, flag, value, expect):
    line = _usage_error(capsys, [*GEN, flag, value], "generate")
    assert expect in line


@pytest.mark.parametrize("argv, command, expect", [
    (["demo", "-n", "-1"], "demo", "-n must be >= 0, got -1"),
    (["demo", "--seed", "-3"], "demo", "--seed must be in [0, 18446744073709551615], got -3"),
    (["tokenize", "-m", "m.gguf", "--text", "a", "--chat", "--ctx", "0"], "tokenize",
     "--ctx must be in [2, 1048576], got 0"),
    (["tokenize", "-m", "m.gguf", "--text", "a", "--ctx", "2097152"], "tokenize", "--ctx must be in [2, 1048576]"),
    (["serve", "-m", "m.gguf", "--kv-disk-space-mb", "-5"], "serve", "--kv-disk-space-mb must be >= 0, got -5"),
    (["serve", "-m", "m.gguf", "--max-tokens", "0"], "serve", "--max-tokens must be >= 1, got 0"),
])
def test_other_commands_reject_bad_numbers(capsys, argv, command, expect):
    assert expect in _usage_error(capsys, argv, command)


def test_edge_values_are_accepted():
    p = build_parser()
    a = p.parse_args([*GEN, "--temp", "0", "--top-p", "1", "--min-p", "0", "--top-k", "1024", "--ctx", "1048576",
                      "-n", "0", "--seed", str((1 << 64) - 1), "--logprobs-top-k", "128"])
    assert (a.temp, a.top_p, a.min_p, a.top_k, a.ctx, a.tokens, a.seed, a.logprobs_top_k) == \
        (0.0, 1.0, 0.0, 1024, 1048576, 0, (1 << 64) - 1, 128)


@pytest.mark.parametrize("argv, command, expect", [
    (["generate", "-m", "m.gguf", "-p", "x", "--bogus"], "generate", "unrecognized arguments: --bogus"),
    (["kv", "ls", "dir", "--bogus"], "kv ls", "unrecognized arguments: --bogus"),
    (["tokenize", "-m", "m.gguf", "--text", "a", "--nope", "1"], "tokenize", "unrecognized arguments: --nope 1"),
    (["inspect"], "inspect", "the following arguments are required: path"),
    (["generate", "-p", "x"], "generate", "the following arguments are required: -m/--model"),
])
def test_usage_errors_show_the_subcommand_usage(capsys, argv, command, expect):
    assert expect in _usage_error(capsys, argv, command)


def test_version(capsys):
    import mlx.core as mx

    import ds4_mlx

    assert main(["--version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"ds4-mlx {ds4_mlx.__version__}"
    assert len(lines) == 3 and lines[1].startswith(f"mlx {mx.__version__}, backend ")
    assert lines[2].startswith("load plan: ") and "experts " in lines[2] and "kernels " in lines[2]


def test_building_the_parser_loads_no_array_or_model_libraries():
    """`ds4-mlx --help`, `download`, `kv` build every command's parser: numpy, regex and mlx load
    only in the command that runs (they were a second of start-up on a busy machine)."""
    code = ("import sys; from ds4_mlx.frontends.cli import build_parser; build_parser(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'numpy', 'regex', 'mlx'}))")
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_default_token_limit_is_256():
    args = build_parser().parse_args(GEN)
    assert args.tokens == 256
    sub = build_parser()._subparsers._group_actions[0].choices["generate"]
    help_text = " ".join(sub.format_help().split())
    assert "default 256" in help_text and "raise it for long reasoning" in help_text


# -- prompt sources --------------------------------------------------------------------------------


def test_prompt_file_dash_reads_stdin(tiny_model_path):
    from ds4_mlx.formats.gguf import GGUFFile
    from ds4_mlx.tokenizer import Tokenizer

    text = "héllo, wörld ☃"
    proc = _cli("generate", "-m", str(tiny_model_path), "--prompt-file", "-", "--raw", "--temp", "0", "-n", "1",
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(text.encode("utf-8"), timeout=600)
    assert proc.returncode == 0, err.decode()
    with GGUFFile(tiny_model_path) as f:
        want = len(Tokenizer.from_gguf(f).encode_rendered(text))
    assert int(STATS.search(err.decode()).group(1)) == want


def test_prompt_file_dash_rejects_non_utf8_stdin(capsys, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ok \xff\xfe")))
    assert main(["generate", "-m", "missing.gguf", "--prompt-file", "-"]) == 2
    err = capsys.readouterr().err
    assert err == "ds4-mlx generate: error: --prompt-file - (stdin) is not UTF-8 (byte 3)\n"


def test_prompt_file_missing_is_named(capsys, tmp_path):
    assert main(["generate", "-m", "missing.gguf", "--prompt-file", str(tmp_path / "nope.txt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds4-mlx generate: error: cannot read --prompt-file ") and "nope.txt" in err
    assert len(err.splitlines()) == 1


# -- --dump-logprobs checks happen before the model loads --------------------------------------------
# The model path does not exist: an error about the dump proves the check ran first; an error about
# the model proves the dump path passed.


def _dump(capsys, path, *extra: str) -> str:
    rc = main(["generate", "-m", "/nonexistent/model.gguf", "-p", "x", "--dump-logprobs", str(path), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    return err


def test_dump_logprobs_bad_paths_fail_before_loading(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    cases = {
        str(tmp_path): "is a directory",
        str(tmp_path / "missing" / "d.json"): "does not exist",
        str(tmp_path / "file" / "d.json"): "is not a directory",
        "": "needs a file name",
    }
    for path, why in cases.items():
        err = _dump(capsys, path)
        assert len(err.splitlines()) == 1 and err.startswith("ds4-mlx generate: error: --dump-logprobs"), err
        assert why in err and "model.gguf" not in err


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes anywhere")
def test_dump_logprobs_unwritable_dir(capsys, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        err = _dump(capsys, ro / "d.json")
    finally:
        ro.chmod(0o700)
    assert "cannot write --dump-logprobs" in err and "model.gguf" not in err


def test_dump_logprobs_check_leaves_files_alone(capsys, tmp_path):
    existing = tmp_path / "old.json"
    existing.write_text("keep me")
    fresh = tmp_path / "new.json"
    for path in (existing, fresh):
        err = _dump(capsys, path)
        assert "model.gguf" in err  # the path check passed; the model was next
    assert existing.read_text() == "keep me" and not fresh.exists()


def test_dump_logprobs_says_temperature_is_ignored(capsys, tmp_path):
    err = _dump(capsys, tmp_path / "d.json", "--temp", "0.7")
    assert "ds4-mlx: --dump-logprobs decodes greedily: --temp 0.7 is ignored\n" in err
    assert "ignored" not in _dump(capsys, tmp_path / "d.json")  # default temperature: nothing to say
    assert "ignored" not in _dump(capsys, tmp_path / "d.json", "--temp", "0")


# -- Ctrl-C and closed pipes -----------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["tokenize", "-m", "m.gguf", "--text", "a"], ["kv", "ls", "."],
                                  ["inspect", "m.gguf"]])
def test_ctrl_c_in_any_command_is_one_line_and_130(capsys, monkeypatch, argv):
    def interrupted(args):
        raise KeyboardInterrupt

    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[argv[0]]
    sub.set_defaults(func=interrupted)
    monkeypatch.setattr("ds4_mlx.frontends.cli.build_parser", lambda: parser)
    try:
        rc = main(argv)
    except KeyboardInterrupt:  # (uncaught, it would stop the whole pytest session)
        pytest.fail("KeyboardInterrupt escaped cli.main")
    assert rc == 130
    assert capsys.readouterr().err == f"ds4-mlx {argv[0]}: interrupted\n"


def _sigint_after(proc: subprocess.Popen, ready, limit: float = 300.0) -> tuple[int, str]:
    """Read stderr until ``ready(text_so_far)``, send SIGINT, return (exit status, all stderr)."""
    os.set_blocking(proc.stderr.fileno(), False)
    err = b""
    deadline = time.monotonic() + limit
    while not ready(err.decode(errors="replace")):
        assert proc.poll() is None, err.decode(errors="replace")
        assert time.monotonic() < deadline, "command never got ready"
        err += proc.stderr.read() or b""
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    os.set_blocking(proc.stderr.fileno(), True)
    err += proc.stderr.read()
    return proc.returncode, err.decode(errors="replace")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigint_during_demo_exits_130(tiny_model_path):
    proc = _cli("demo", "--model", str(tiny_model_path), "-n", "100000",
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rc, err = _sigint_after(proc, lambda e: "ds4-mlx demo: model" in e)
    assert rc == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    # The signal lands while the model loads (one line saying so) or, on a fast load, during the
    # prefill or generation, which stop within a token and still print the stats line (as generate).
    last = err.strip().splitlines()[-1]
    assert "interrupted" in last or (last.startswith("ds4-mlx: prompt:") and "generation:" in last), err


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigint_during_generation_exits_130(tiny_model_path, tmp_path):
    out = tmp_path / "out.txt"
    with open(out, "wb") as fh:
        proc = _cli("generate", "-m", str(tiny_model_path), "-p", "Count to a thousand.", "--nothink",
                    "-n", "100000", "--ctx", "4096", stdout=fh, stderr=subprocess.PIPE)
        rc, err = _sigint_after(proc, lambda e: out.stat().st_size > 0)
    assert rc == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


def test_closed_stdout_is_silent(tiny_model_path, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("hello world\n" * 50000, encoding="utf-8")
    proc = _cli("tokenize", "-m", str(tiny_model_path), "--file", str(big),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, err
    assert first.startswith(b"33310\t") and err == ""


def test_model_option_choices_match_the_model_layer():
    """args restates the loader's choices (importing them would load mlx at parser build): they must agree."""
    from ds4_mlx.frontends.args import DISTRIBUTED_MODES, EXPERT_STRATEGIES
    from ds4_mlx.model.device_experts import STRATEGIES
    from ds4_mlx.model.pipeline import MODES

    assert set(EXPERT_STRATEGIES) == set(STRATEGIES) and set(DISTRIBUTED_MODES) == set(MODES)
