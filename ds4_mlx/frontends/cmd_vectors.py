"""`ds4-mlx vectors -m MODEL [--set NAME | --dir DIR] [--only ID ...] [--json]`: ds4's official-vector
check (``ds4_test --logprob-vectors``), the first thing to run with real weights to trust the install.

Each case prompts the model with ds4's chat template (no system text, thinking off) and compares a
short greedy continuation with the DeepSeek API's answer for it: the argmax token's bytes at every
step, and each official top-logprob within 4.0 of ours (``ds4_mlx.engine.vectors`` has the exact
rules). On the preview set ``long_memory_archive`` is skipped, as ds4 skips it there.

The vectors ship with the package by checkpoint: ``--set preview`` (the May 2026 DeepSeek V4 Flash)
and ``--set 0731`` (Flash 0731, ds4's ``flash-0731`` fixture). The default is the set of the model
file's own checkpoint (``inspect`` shows it; ds4's rule: a 0731 file must be checked against the
0731 vectors, a mismatch is an invalid test). ``--dir DIR`` reads a folder of the same layout.

Output: a table (case, steps, result, the first failure with its step and values), then the totals;
``--json`` prints every case's result and every failure instead. Exit status 0 when every case that
ran passed, 1 when one failed, 2 for an error (unknown set or case, unreadable files).
"""

from __future__ import annotations

import argparse
import json
import sys

from ds4_mlx.frontends.args import add_model_options, model_options

EXIT_FAILED = 1


def register(sub) -> None:
    p = sub.add_parser("vectors", help="check the model against ds4's official API vectors",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--set", dest="vector_set", default=None, metavar="NAME",
                     help="shipped vector set, by model checkpoint: preview, 0731 (default: the model's checkpoint)")
    src.add_argument("--dir", metavar="DIR", help="read the vectors from DIR (manifest.json, prompts/, official/)")
    p.add_argument("--only", nargs="+", action="extend", metavar="ID", help="run only these cases (repeatable)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from ds4_mlx.engine.engine import Engine
    from ds4_mlx.engine.vectors import all_passed, load_vector_dir, load_vector_set, run_vectors
    from ds4_mlx.formats.checkpoint import detect_checkpoint
    from ds4_mlx.formats.gguf import GGUFFile

    # The vectors are read and the ids checked before the model loads: a typo costs no load.
    if args.dir:
        vset = load_vector_dir(args.dir)
    else:
        name = args.vector_set
        if name is None:  # the file's own checkpoint, from its header
            with GGUFFile(args.model) as header:
                name = detect_checkpoint(header.metadata, args.model, args.checkpoint).checkpoint.value
        vset = load_vector_set(name)
    cases = vset.select(args.only)
    # the memory plan sizes the KV for the largest case's session (one at a time)
    engine = Engine.open(args.model, **model_options(args, ctx=max((c.ctx for c in cases), default=None)))
    tty = sys.stderr.isatty()

    def announce(case) -> None:
        if tty:  # a long case prefills thousands of tokens: say which one runs
            print(f"ds4-mlx: vector {case.id} ({len(case.steps)} steps, ctx {case.ctx})", file=sys.stderr, flush=True)

    results = run_vectors(engine, cases, skip=vset.skipped, on_case=announce)
    if args.json:
        doc = {"set": vset.name, "model": vset.model, "passed": all_passed(results),
               "cases": [r.to_json() for r in results]}
        print(json.dumps(doc, ensure_ascii=False, indent=1))
    else:
        print(format_table(results))
    return 0 if all_passed(results) else EXIT_FAILED


def format_table(results) -> str:
    """The results as an aligned table and a totals line."""
    from ds4_mlx.engine.vectors import summary_line

    rows = [("case", "steps", "result", "first failure")]
    for r in results:
        if r.status == "skipped":
            detail = f"({r.reason})"
        elif r.failures:
            more = len(r.failures) - 1
            detail = r.first_failure.message + (f" (+{more} more)" if more else "")
        else:
            detail = ""
        rows.append((r.id, str(r.steps), r.status.upper() if r.status == "fail" else r.status, detail))
    w0 = max(len(row[0]) for row in rows)
    w1 = max(len(row[1]) for row in rows)
    w2 = max(len(row[2]) for row in rows)
    lines = [f"{a:<{w0}}  {b:>{w1}}  {c:<{w2}}  {d}".rstrip() for a, b, c, d in rows]
    return "\n".join(lines + [summary_line(results)])
