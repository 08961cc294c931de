"""`ds4-mlx bench`: ds4-bench's context-frontier throughput sweep (``ds4_mlx.engine.bench``).

The text of ``--prompt-file`` is tokenized as plain text (no chat template, no BOS, as ds4-bench's
``--prompt-file``) and its first ``--ctx-max`` tokens are walked to the frontiers ``--ctx-start``,
``+ --ctx-step``, ..., ``--ctx-max``. At each one only the newest interval is prefilled, then
``--gen`` tokens are decoded greedily (EOS skipped) from a snapshot that is restored afterwards.

A text shorter than ``--ctx-max`` tokens is refused, as ds4-bench refuses it: repeating it would
measure a different, repetitive workload, and numbers must compare with ds4's.

Output: a table on stdout, one line per frontier as it completes; ``--csv`` writes ds4-bench's
columns (``ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes``) plus
``rss_peak_bytes`` (process high-water mark, ru_maxrss) and ``mlx_peak_bytes`` (MLX allocator peak
within the row), flushed row by row; ``--plot`` draws prefill and generation t/s against the context
(two y axes) as PNG or SVG with matplotlib (``pip install 'ds4-mlx[plot]'``).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from ds4_mlx.frontends.args import UsageError, add_model_options, check_number, model_options, read_text_file

PLOT_SUFFIXES = (".png", ".svg")
# (dest, flag, lowest value); --ctx-max >= --ctx-start is checked in _validate
INT_OPTIONS = (("ctx_start", "--ctx-start", 1), ("ctx_step", "--ctx-step", 1), ("ctx_max", "--ctx-max", 1),
               ("gen", "--gen", 0))


def register(sub) -> None:
    p = sub.add_parser("bench", help="prefill / generation throughput at growing context sizes",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p)
    p.add_argument("--prompt-file", required=True,
                   help="benchmark text (UTF-8), at least --ctx-max tokens long; its token sequence is sliced "
                        "at each frontier")
    # Integers are checked in run() (args.check_number) so that a bad value gets our one-line error, not
    # argparse's usage dump.
    p.add_argument("--ctx-start", default="2048", metavar="N", help="first frontier (default 2048)")
    p.add_argument("--ctx-step", "--step-incr", dest="ctx_step", default="2048", metavar="N",
                   help="distance between frontiers (default 2048)")
    p.add_argument("--ctx-max", default="32768", metavar="N",
                   help="last frontier; always measured (default 32768)")
    p.add_argument("--gen", "--gen-tokens", dest="gen", default="128", metavar="N",
                   help="greedy tokens decoded at each frontier, EOS skipped (default 128; 0 = prefill only)")
    p.add_argument("--csv", metavar="FILE", help="also write the rows as CSV (ds4-bench's columns first)")
    p.add_argument("--plot", metavar="FILE", help="draw t/s against context to FILE (.png or .svg; needs matplotlib)")
    p.set_defaults(func=run)


def _parse_ints(args) -> dict[str, int]:
    try:
        return {dest: check_number(getattr(args, dest), flag, int, lo) for dest, flag, lo in INT_OPTIONS}
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _validate(args, n: dict[str, int]) -> None:
    if n["ctx_max"] < n["ctx_start"]:
        raise UsageError(f"--ctx-max ({n['ctx_max']}) must be >= --ctx-start ({n['ctx_start']})")
    if args.plot is not None and Path(args.plot).suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"--plot {args.plot}: the file name must end in .png or .svg")


def _require_matplotlib() -> None:
    """Checked before the sweep: finding out after minutes of benchmarking would waste them."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'ds4-mlx[plot]' (or pip install matplotlib)") from None


def _read_text(path: str) -> str:
    text = read_text_file(path, "--prompt-file")
    if not text:
        raise UsageError(f"--prompt-file {path} is empty")
    return text


def _open_csv(path: str):
    try:
        return open(path, "w", encoding="utf-8", newline="")
    except OSError as exc:
        raise UsageError(f"cannot write --csv {path}: {exc.strerror or exc}") from None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


TABLE_HEADER = (f"{'ctx':>8} {'prefill':>8} {'prefill t/s':>12} {'gen':>5} {'gen t/s':>9} "
                f"{'kv MiB':>9} {'rss peak MiB':>13} {'mlx peak MiB':>13}")


def _table_line(row) -> str:
    return (f"{row.ctx_tokens:>8} {row.prefill_tokens:>8} {row.prefill_tps:>12.2f} {row.gen_tokens:>5} "
            f"{row.gen_tps:>9.2f} {_mib(row.kvcache_bytes):>9} {_mib(row.rss_peak_bytes):>13} "
            f"{_mib(row.mlx_peak_bytes):>13}")


def run(args) -> int:
    from ds4_mlx.engine import bench
    from ds4_mlx.engine.engine import Engine

    n = _parse_ints(args)
    _validate(args, n)
    if args.plot is not None:
        _require_matplotlib()
    # Output folders are checked before the model loads, not found missing after the sweep.
    for flag, path in (("--csv", args.csv), ("--plot", args.plot)):
        if path is not None and not Path(path).parent.is_dir():
            raise UsageError(f"cannot write {flag} {path}: {Path(path).parent} is not a directory")
    text = _read_text(args.prompt_file)
    # Checked before the model loads: a path that is not a file would otherwise fail deep in the opener.
    if not Path(args.model).is_file():
        raise UsageError(f"-m {args.model}: no such model file")

    # the sweep's one session holds ctx_max + gen + 1 tokens (engine.bench.run_sweep): the plan's KV
    engine = Engine.open(args.model, **model_options(args, ctx=n["ctx_max"] + n["gen"] + 1))
    context_length = engine.context_length
    if n["ctx_max"] + n["gen"] > context_length:
        raise UsageError(f"--ctx-max + --gen = {n['ctx_max'] + n['gen']} exceeds the model's context of "
                            f"{context_length} tokens")
    tokens = engine.tokenizer.encode(text)
    if len(tokens) < n["ctx_max"]:
        raise UsageError(f"--prompt-file {args.prompt_file} has {len(tokens)} tokens, --ctx-max needs at least "
                            f"{n['ctx_max']}: use a longer text or a lower --ctx-max")

    backend = bench.backend_name(engine)
    fronts = bench.frontiers(n["ctx_start"], n["ctx_step"], n["ctx_max"])
    csv_file = _open_csv(args.csv) if args.csv is not None else None
    print(f"ds4-mlx bench: {Path(args.model).name}, {backend}, numerics {args.numerics}; {len(tokens)} text tokens, "
          f"{len(fronts)} frontiers {fronts[0]}..{fronts[-1]}, {n['gen']} generated tokens each", file=sys.stderr)
    writer = csv.writer(csv_file, lineterminator="\n") if csv_file is not None else None
    if writer is not None:
        writer.writerow(bench.CSV_COLUMNS)
        csv_file.flush()
    print(TABLE_HEADER, flush=True)

    def on_row(row) -> None:
        print(_table_line(row), flush=True)
        if writer is not None:
            writer.writerow(row.csv_values())
            csv_file.flush()  # rows survive an interrupted run, as ds4-bench's fflush per row

    try:
        rows = bench.run_sweep(engine, tokens, ctx_start=n["ctx_start"], ctx_step=n["ctx_step"],
                               ctx_max=n["ctx_max"], gen_tokens=n["gen"], on_row=on_row)
    finally:
        if csv_file is not None:
            csv_file.close()
    if args.csv is not None:
        print(f"ds4-mlx bench: wrote {len(rows)} rows to {args.csv}", file=sys.stderr)
    if args.plot is not None:
        plot_rows(rows, args.plot, title=f"{Path(args.model).name} - {backend}, numerics {args.numerics}")
        print(f"ds4-mlx bench: wrote plot to {args.plot}", file=sys.stderr)
    return 0


def _axis_top(values) -> float:
    """Headroom above the highest point, so the line does not run along the frame (and 1 for all-zero rates)."""
    top = max(values, default=0.0)
    return top * 1.15 if top > 0 else 1.0


def plot_rows(rows, path: str, *, title: str) -> None:
    """Prefill t/s (left axis) and generation t/s (right axis) against the context, as ds4's
    speed-bench/plot_speed.py draws them: two scales because the two rates differ by orders of magnitude."""
    _require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot's import
    import matplotlib.pyplot as plt

    ctx = [r.ctx_tokens for r in rows]
    fig, ax = plt.subplots(figsize=(9.6, 5.4), dpi=100)
    try:
        p1 = ax.plot(ctx, [r.prefill_tps for r in rows], color="#2563eb", marker="o", linewidth=2, label="prefill")
        ax.set_xlabel("context size (tokens)")
        ax.set_ylabel("prefill t/s", color="#2563eb")
        ax.set_ylim(0, _axis_top([r.prefill_tps for r in rows]))
        ax.set_xlim(left=0)
        ax.grid(True, color="#e2e8f0")
        ax2 = ax.twinx()
        p2 = ax2.plot(ctx, [r.gen_tps for r in rows], color="#dc2626", marker="o", linewidth=2, label="generation")
        ax2.set_ylabel("generation t/s", color="#dc2626")
        ax2.set_ylim(0, _axis_top([r.gen_tps for r in rows]))
        ax.legend(p1 + p2, [p.get_label() for p in p1 + p2], loc="upper right")
        ax.set_title(title)
        fig.tight_layout()
        try:
            fig.savefig(path, format=Path(path).suffix.lower().lstrip("."))
        except OSError as exc:
            raise UsageError(f"cannot write --plot {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
