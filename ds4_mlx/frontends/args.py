"""Strict argparse pieces shared by every ``ds4-mlx`` command.

``ranged(...)`` makes an argparse *action* that parses an int or a float and checks its range while
the command line is read, so a bad value stops the command before anything is loaded, as one line
naming the option the user typed, the allowed range, the value, and why the range is what it is::

    ds4-mlx generate: error: --top-p must be in (0, 1], got 5: it is a probability mass

An action (not a ``type=`` callable) because only an action knows which spelling of the option was
used (``-n`` or ``--tokens``); argparse prints the error with the command's own usage and exits 2.

NaN passes every comparison, so floats are also required to be finite: ``--temp nan`` would
otherwise slip through any ``< 0`` check and sample from garbage.

``was_given(args, dest)`` tells a default from an explicit value (for warnings such as "--temp is
ignored by --dump-logprobs", which must not fire on the default temperature).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from ds4_mlx.errors import Ds4Error

# DS4 Flash's context length (the GGUF's deepseek4.context_length; its YaRN rope scaling is
# defined up to there).
MAX_CTX = 1 << 20
# ds4 clamps top_k to 1024 in its sampler (as engine/sampling.py's TOP_K_CAP); the CLI refuses a
# larger value instead of clamping it silently.
MAX_TOP_K = 1024
MAX_SEED = (1 << 64) - 1
# engine/speculative.py's MAX_DRAFT_K (not imported: building the parsers loads no mlx)
MAX_DRAFT_K = 16

_GIVEN = "_ds4_given"


class UsageError(Ds4Error):
    """A bad command-line value found after parsing (a file that cannot be read, options that do not
    go together): ``cli.main`` prints it as one line and exits 2."""


def read_text_file(path: str, flag: str, *, stdin: bool = False) -> str:
    """The UTF-8 text of the file option ``flag`` names; with ``stdin``, ``-`` reads standard input.
    Any failure is one ``UsageError`` line naming the option and the file."""
    if stdin and path == "-":
        name = "- (stdin)"
        try:
            if sys.stdin is None:
                raise OSError("stdin is closed")
            if sys.stdin.isatty():  # otherwise a silent wait looks like a hang
                print("ds4-mlx: reading the prompt from stdin (end it with Ctrl-D)", file=sys.stderr)
            data = sys.stdin.buffer.read()
        except OSError as exc:
            raise UsageError(f"cannot read {flag} {name}: {exc.strerror or exc}") from None
    else:
        name = path
        try:
            data = Path(path).read_bytes()
        except IsADirectoryError:
            raise UsageError(f"cannot read {flag} {name}: it is a directory") from None
        except OSError as exc:
            raise UsageError(f"cannot read {flag} {name}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{flag} {name} is not UTF-8 (byte {exc.start})") from None


def _fmt(v: float | int) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _range_text(lo, hi, lo_open: bool, hi_open: bool) -> str:
    if hi is None:
        return f"{'>' if lo_open else '>='} {_fmt(lo)}"
    if lo is None:
        return f"{'<' if hi_open else '<='} {_fmt(hi)}"
    return f"in {'(' if lo_open else '['}{_fmt(lo)}, {_fmt(hi)}{')' if hi_open else ']'}"


def check_number(text: str, name: str, kind: type, lo=None, hi=None, *, lo_open: bool = False,
                 hi_open: bool = False, why: str = ""):
    """Parse ``text`` as ``kind`` (int or float) and check it against the range; raise
    ``ValueError`` with the one-line message otherwise."""
    reason = f": {why}" if why else ""
    try:
        value = kind(text)
    except (TypeError, ValueError):
        noun = "an integer" if kind is int else "a number"
        raise ValueError(f"{name} must be {noun}, got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {text!r}")
    low = lo is not None and (value <= lo if lo_open else value < lo)
    high = hi is not None and (value >= hi if hi_open else value > hi)
    if low or high:
        raise ValueError(f"{name} must be {_range_text(lo, hi, lo_open, hi_open)}, got {text}{reason}")
    return value


def ranged(kind: type, lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False,
           why: str = "") -> type[argparse.Action]:
    """An argparse action storing a ``kind`` value within ``lo``..``hi`` (inclusive unless open)."""
    if kind not in (int, float):
        raise TypeError(f"ranged() takes int or float, not {kind!r}")

    class _Ranged(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            name = option_string or self.dest
            try:
                value = check_number(values, name, kind, lo, hi, lo_open=lo_open, hi_open=hi_open, why=why)
            except ValueError as exc:
                # ArgumentError(None, ...) keeps argparse from prefixing "argument -n/--tokens: ",
                # the message already names the option as typed.
                raise argparse.ArgumentError(None, str(exc)) from None
            setattr(namespace, self.dest, value)
            given = set(getattr(namespace, _GIVEN, ()))
            given.add(self.dest)
            setattr(namespace, _GIVEN, given)

    _Ranged.__name__ = f"ranged_{kind.__name__}"
    return _Ranged


def was_given(args: argparse.Namespace, dest: str) -> bool:
    """Whether option ``dest`` (a ``ranged`` one) was on the command line, not just defaulted."""
    return dest in getattr(args, _GIVEN, ())


# The options several commands share, with one wording everywhere.
_CTX_RANGE = dict(lo=2, hi=MAX_CTX, why=f"DS4 Flash's context length is {MAX_CTX}")
CTX = ranged(int, **_CTX_RANGE)
SEED = ranged(int, 0, MAX_SEED, why="a 64-bit unsigned seed (0 = time-based)")
TOKENS = ranged(int, 0, why="a count of tokens")
# The memory plan's simulated machine (``model.memory_plan.MAX_SIMULATED_GIB``, restated: importing
# it loads mlx, and ``ds4-mlx --help`` builds every parser; test_memory_plan checks they agree).
MAX_SIMULATED_GIB = 1 << 20
SIMULATE_MEMORY = ranged(float, 0, MAX_SIMULATED_GIB, lo_open=True, why="a memory size in GiB (at most 1 PiB)")


def check_ctx(text: str, name: str) -> int:
    """A context size typed somewhere other than the command line (chat's ``/ctx N``), checked as
    ``--ctx`` is; ``ValueError`` with the one-line message."""
    return check_number(text, name, int, **_CTX_RANGE)


# The model layer's choices (``model.device_experts.STRATEGIES``, ``model.distributed.MODES``), restated
# because importing those modules loads mlx, and ``ds4-mlx --help`` builds every command's parser;
# test_cli_args checks that the two agree.
EXPERT_STRATEGIES = ("auto", "device", "host")
DISTRIBUTED_MODES = ("pipeline", "experts")


def add_model_options(p: argparse.ArgumentParser, *, distributed: bool = False) -> None:
    """``-m/--model`` (required), ``--numerics`` and ``--experts`` (``distributed``: also
    ``--distributed``): every command that loads the weights. ``model_options(args)`` turns them
    into the loader's keywords."""
    p.add_argument("-m", "--model", required=True, help="DS4 Flash GGUF file")
    p.add_argument("--numerics", choices=["default", "ds4-cpu"], default="default",
                   help="arithmetic: fast path, or ds4's CPU reference arithmetic")
    p.add_argument("--experts", choices=EXPERT_STRATEGIES, default="auto",
                   help="routed experts: device (blocks resident in GPU memory, routing on the device), "
                        "host (routing on the CPU, slabs read from the mmap); auto = device on a GPU, "
                        "host on the CPU (default)")
    p.add_argument("--experts-cache", action=ExpertsCacheAction, default=None, metavar="N|SIZE",
                   help="--experts device: keep at most this many routed experts resident, as ds4's "
                        "--ssd-streaming-cache-experts: N expert triplets over all layers, or a size "
                        "(8GB, 512MiB; two full layers of it kept for prefill); misses are read from the "
                        "file (default: all resident when the memory plan says they fit, else the "
                        "largest cache that fits)")
    p.add_argument("--experts-cache-policy", choices=["lru", "lfu"], default=None,
                   help="replacement policy of --experts-cache: lfu (aged frequency, the default) or lru")
    p.add_argument("--checkpoint", choices=["preview", "0731"], default=None,
                   help="which DeepSeek V4 Flash checkpoint the file holds, for a file whose name and "
                        "metadata do not say (default: decided from the file; ds4's 0731 files are named *-0731.gguf)")
    p.add_argument("--simulate-memory", action=SIMULATE_MEMORY, default=None, metavar="GB",
                   help="plan the load for a machine of GB GiB instead of this one's memory (the load is "
                        "refused before any weight is read when weights, expert cache, KV at --ctx and "
                        "scratch do not fit; `ds4-mlx inspect --plan` prints the plan)")
    if distributed:
        p.add_argument("--distributed", choices=DISTRIBUTED_MODES, default=None,
                       help="run over the ranks started by mlx.launch (rank 0 prints; e.g. mlx.launch -n 2 "
                            "--backend ring -- ds4-mlx generate ... --distributed pipeline). pipeline: split the "
                            "layers; experts: every rank holds the dense weights and its share of the routed experts")
    else:
        p.set_defaults(distributed=None)


class ExpertsCacheAction(argparse.Action):
    """``--experts-cache``: checked while parsing (``model.expert_budget``, no MLX import)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from ds4_mlx.model.expert_budget import parse_experts_cache

        try:
            parse_experts_cache(values)
        except Ds4Error as exc:
            raise argparse.ArgumentError(None, f"{option_string}: {exc}") from None
        setattr(namespace, self.dest, values)


def model_options(args: argparse.Namespace, ctx: int | None = None) -> dict:
    """The ``ds4_mlx.load`` / ``Engine.open`` keywords of the options ``add_model_options`` added
    (the expert cache's only when given, so a loader without them is not handed None), with the
    context the command's sessions will use for the memory plan: ``ctx``, else the command's
    ``--ctx`` (None: the default session context)."""
    opts = {"numerics": args.numerics, "experts": args.experts, "distributed": args.distributed,
            "checkpoint": getattr(args, "checkpoint", None),
            "ctx": ctx if ctx is not None else getattr(args, "ctx", None),
            "simulate_memory": getattr(args, "simulate_memory", None)}
    for name in ("experts_cache", "experts_cache_policy"):
        if getattr(args, name, None) is not None:
            opts[name] = getattr(args, name)
    return opts


def add_draft_options(p: argparse.ArgumentParser) -> None:
    """``--draft FILE`` (``--mtp FILE``, ds4's spelling) and ``--draft-k N``: speculative decoding
    (``engine/speculative.py``) for generate, chat and serve. ``draft_options(args)`` turns them into
    ``Engine.open`` keywords."""
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--draft", "--mtp", dest="draft", metavar="FILE", default=None,
                   help="draft model (the preview's MTP GGUF, or 0731's DSpark file): the target verifies its "
                        "guesses in batches; the output is the one plain decoding gives")
    g.add_argument("--draft-k", action=ranged(int, 1, MAX_DRAFT_K, why="the most drafts one verify step checks"),
                   default=None, metavar="N", help="most draft tokens per verify step (default 4; adaptive below it)")


def draft_options(args: argparse.Namespace) -> dict:
    """The ``Engine.open`` keywords of ``add_draft_options``'s options."""
    return {"draft": getattr(args, "draft", None), "draft_k": getattr(args, "draft_k", None)}


def add_system_option(p: argparse.ArgumentParser) -> None:
    """``-sys/--system`` into ``args.system``; None means ds4's default system prompt."""
    p.add_argument("-sys", "--system", default=None,
                   help='system prompt; "" disables it (default: "You are a helpful assistant")')


def add_ctx_option(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument("--ctx", action=CTX, default=default, metavar="N",
                   help=f"context size in tokens, 2..{MAX_CTX} (default {default})")


def add_disk_cache_options(p: argparse.ArgumentParser):
    """``--kv-disk-dir`` and ``--kv-disk-space-mb`` in a "disk KV cache" group, returned so a
    command can add its own tuning options to it."""
    kv = p.add_argument_group("disk KV cache")
    kv.add_argument("--kv-disk-dir", metavar="DIR", help="reuse and save prompt prefixes in this directory")
    kv.add_argument("--kv-disk-space-mb", action=ranged(float, 0, why="a size in MiB"), default=4096, metavar="MB",
                    help="size budget of the directory in MiB (default 4096)")
    return kv


def add_think_options(p: argparse.ArgumentParser, help_prefix: str = "") -> None:
    """``--think`` (the default: thinking at the checkpoint's default level, True) |
    ``--think-low`` | ``--think-high`` | ``--think-max`` | ``--nothink``, into ``args.think`` (True
    or a level name, which the loaded checkpoint's rules read: chat/effort.py); one definition for
    every command that renders a chat prompt. ``help_prefix`` says when the options apply
    (``tokenize``: "--chat: ")."""
    think = p.add_mutually_exclusive_group()
    think.add_argument("--think", dest="think", action="store_const", const=True,
                       help=f"{help_prefix}thinking at the checkpoint's default level (default; preview: high, 0731: low)")
    think.add_argument("--think-low", dest="think", action="store_const", const="low",
                       help=f"{help_prefix}thinking, level low (0731: no effort prefix; the preview has no low: high)")
    think.add_argument("--think-high", dest="think", action="store_const", const="high",
                       help=f"{help_prefix}thinking, level high (0731: the 'Absolute maximum' effort prefix)")
    think.add_argument("--think-max", dest="think", action="store_const", const="max",
                       help=f"{help_prefix}Think Max when --ctx >= 393216, else level high")
    think.add_argument("--nothink", dest="think", action="store_const", const="none",
                       help=f"{help_prefix}answer directly (the assistant turn starts with </think>)")
    p.set_defaults(think=True)


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    """ds4's sampler knobs with its CLI defaults (temperature 1, top-p 1, min-p 0.05, top-k off)."""
    p.add_argument("--temp", action=ranged(float, 0, 100, why="a temperature (0 = greedy; ds4's limit is 100)"),
                   default=1.0, metavar="T", help="temperature, 0..100; 0 = greedy (default 1)")
    p.add_argument("--top-p", action=ranged(float, 0, 1, lo_open=True, why="it is a probability mass"),
                   default=1.0, metavar="P", help="nucleus probability mass, (0, 1] (default 1 = off)")
    p.add_argument("--min-p", action=ranged(float, 0, 1, why="it is a fraction of the best token's probability"),
                   default=0.05, metavar="P", help="min probability relative to the best, [0, 1] (default 0.05)")
    p.add_argument("--top-k", action=ranged(int, 0, MAX_TOP_K, why=f"ds4 samples among at most {MAX_TOP_K}"),
                   default=0, metavar="K", help=f"sample among the K best (0 = off, max {MAX_TOP_K})")
