"""`ds4-mlx kv ls DIR | inspect FILE | prune DIR --budget-mb MB`: look after a disk KV cache.

``ls``       one row per ``<sha1>.kv`` file, most recently used first: tokens, size, save reason,
             hits, last use (UTC), eviction score (the effective one, lowest goes first; its
             factors in the JSON) and the first / last 40 characters of the key text (escaped).
             Only headers and trailers are checked (cheap); damaged files are listed as INVALID.
``inspect``  every header and trailer field of one file and a full verdict: the whole file is read
             and its checksums verified. Exit status 1 when the file is not valid.
``prune``    delete files in ds4's eviction order (damaged first, then lowest score) until the
             directory fits the budget (MiB; 0 empties it), and remove dead writers' temp files.

Scores are ds4-mlx's (cold / evict / shutdown x2, continued prefixes of a newer entry demoted);
``--ds4-head`` uses ds4 HEAD's plain score instead.

``--json`` prints the same information as JSON.

Exit status: 0 when the command did what it was asked; 1 when ``inspect`` finds the file invalid
or ``prune`` could not bring the directory within the budget (a file it could not delete); 2 with
one ``ds4-mlx: ...`` line for bad input: a missing directory or file, a file that is not a KV cache
file at all (bad magic: nothing else of it is printed), a numeric option out of range. Cache
failures during ``generate`` (``--kv-disk-dir``) do not change its exit status: see
``engine/disk_cache.py`` (exit 0, one stderr line per failed save).
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from ds4_mlx.errors import KVStoreError
from ds4_mlx.frontends.terminal_text import escape_text, human_size

if TYPE_CHECKING:  # the file reader (numpy) loads when a subcommand runs, not for `ds4-mlx --help`
    from ds4_mlx.engine.kvstore_admin import ListedFile
    from ds4_mlx.engine.kvstore_policy import KVStoreOptions

MAX_BUDGET_MB = 2**30  # 1 PiB: far beyond any disk, small enough to stay exact in bytes


def register(subparsers) -> None:
    p = subparsers.add_parser("kv", help="list, inspect and prune disk KV cache files",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="kv_command", metavar="SUBCOMMAND", required=True)
    ls = sub.add_parser("ls", help="list the checkpoints of a KV cache directory")
    ls.add_argument("dir", help="KV cache directory")
    ls.add_argument("--json", action="store_true", help="print a JSON list")
    ls.add_argument("--ds4-head", action="store_true", help="show ds4 HEAD's eviction score")
    ins = sub.add_parser("inspect", help="show every field of one .kv file and verify it")
    ins.add_argument("file", help=".kv file")
    ins.add_argument("--json", action="store_true", help="print a JSON object")
    pr = sub.add_parser("prune", help="evict checkpoints until the directory fits a budget")
    pr.add_argument("dir", help="KV cache directory")
    pr.add_argument("--budget-mb", type=float, required=True,
                    help=f"budget in MiB, 0..{MAX_BUDGET_MB} (0 removes all)")
    pr.add_argument("--json", action="store_true", help="print a JSON object")
    pr.add_argument("--ds4-head", action="store_true", help="evict in ds4 HEAD's order")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return {"ls": run_ls, "inspect": run_inspect, "prune": run_prune}[args.kv_command](args)


# -- formatting helpers --------------------------------------------------------------------------


def scoring_options(args: argparse.Namespace) -> KVStoreOptions:
    from ds4_mlx.engine.kvstore_policy import DEFAULT_OPTIONS, KVStoreOptions

    return KVStoreOptions.ds4_head() if args.ds4_head else DEFAULT_OPTIONS


def _row_json(f: ListedFile) -> dict:
    from ds4_mlx.engine.kvstore_admin import utc

    s = f.score
    scores = {"score": s.score, "base_score": s.base, "score_note": s.note,
              "superseded_by": list(s.superseded_by)}
    e = f.entry
    if e is None:
        return {"file": f.name, "path": str(f.path), "valid": False, "problem": f.problem,
                "size": f.size, **scores}
    head, tail = ("?", "") if f.text_head is None else (escape_text(f.text_head), escape_text(f.text_tail))
    return {
        "file": e.name, "path": str(e.path), "valid": True, "problem": None,
        "tokens": e.tokens, "size": e.file_size, "reason": e.reason.label, "hits": e.hits,
        "created": e.created_at, "last_used": e.last_used, "last_used_utc": utc(e.last_used),
        "ctx_size": e.ctx_size, "quant_bits": e.quant_bits, "key_kind": e.key_kind,
        "text_bytes": e.text_bytes, "payload_bytes": e.payload_bytes,
        "model_id": e.model_id.hex(), "payload_version": e.payload_version,
        "text_head": head, "text_tail": tail, **scores,
    }


# -- ls ------------------------------------------------------------------------------------------


def run_ls(args: argparse.Namespace) -> int:
    from ds4_mlx.engine.kvstore_admin import list_entries

    listing = list_entries(args.dir, scoring_options(args))
    rows = [_row_json(f) for f in listing.files]
    if args.json:
        print(json.dumps(rows, indent=2, ensure_ascii=False))
        return 0
    table = [("FILE", "TOKENS", "SIZE", "REASON", "HITS", "LAST USE (UTC)", "SCORE", "TEXT")]
    for r in rows:
        score = f"{r['score']:.4g}" + ("*" if r["score_note"] else "")
        if r["valid"]:
            text = r["text_head"] + (f" … {r['text_tail']}" if r["text_tail"] else "")
            table.append((r["file"], str(r["tokens"]), human_size(r["size"]), r["reason"],
                          str(r["hits"]), r["last_used_utc"], score, text))
        else:
            table.append((r["file"], "-", human_size(r["size"]), "-", "-", "-", score,
                          f"INVALID: {r['problem']}"))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    right = {1, 2, 4, 6}
    for row in table:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        print("  ".join(cells + [row[-1]]))
    print(f"{listing.valid} valid, {listing.invalid} invalid, {human_size(listing.total_bytes)} in total")
    if any(r["score_note"] for r in rows):
        print("* score = ds4's score times an anchor bonus or a superseded-prefix demotion "
              "(--json: base_score, score_note)")
    return 0


# -- inspect -------------------------------------------------------------------------------------


def run_inspect(args: argparse.Namespace) -> int:
    from ds4_mlx.engine.kvstore_admin import inspect_file

    report = inspect_file(args.file)
    if report["text_head"] is not None:
        report["text_head"], report["text_tail"] = (escape_text(report["text_head"]),
                                                    escape_text(report["text_tail"]))
    valid = not report["problems"]
    report["valid"] = valid
    if args.json:
        print(json.dumps(report, indent=2, ensure_ascii=False))
        return 0 if valid else 1
    rows: list[tuple[str, str]] = [("file", report["file"]), ("size", f"{report['size']} bytes")]
    h = report["header"]
    if h:
        rows += [
            ("magic", h["magic"]), ("version", str(h["version"])), ("quant bits", str(h["quant_bits"])),
            ("reason", f"{h['reason']} ({h['reason_code']})"),
            ("ext flags", f"{h['ext_flags']:#04x} ({', '.join(h['ext_names']) or 'none'})"),
            ("key kind", h["key_kind"]), ("tokens", str(h["tokens"])), ("hits", str(h["hits"])),
            ("ctx size", str(h["ctx_size"])),
            ("header crc", f"{h['header_crc']} ({'ok' if h['header_crc_ok'] else 'MISMATCH'})"),
            ("created", f"{h['created_utc']} UTC ({h['created']})"),
            ("last used", f"{h['last_used_utc']} UTC ({h['last_used']})"),
            ("payload bytes", str(h["payload_bytes"])),
        ]
    if report["text_bytes"] is not None:
        rows.append(("text bytes", str(report["text_bytes"])))
    if report["text_head"] is not None:
        tail = f" … {report['text_tail']}" if report["text_tail"] else ""
        rows.append(("text", f"{report['text_head']}{tail}"))
    if report.get("tool_map_bytes"):
        count = report["tool_map_entries"]
        rows.append(("tool map", f"{report['tool_map_bytes']} bytes"
                     + (f", {count} entries" if count is not None else "")))
    t = report["trailer"]
    if t:
        rows += [("trailer version", str(t["version"])), ("model id", t["model_id"]),
                 ("payload version", str(t["payload_version"])), ("token key", t["token_key"]),
                 ("file crc", f"{t['file_crc']} ({report['file_crc']})")]
    for note in report["notes"]:
        rows.append(("note", note))
    rows.append(("verdict", "valid" if valid else "INVALID: " + "; ".join(report["problems"])))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}")
    return 0 if valid else 1


# -- prune ---------------------------------------------------------------------------------------


def run_prune(args: argparse.Namespace) -> int:
    from ds4_mlx.engine.kvstore_admin import cache_dir, prune
    from ds4_mlx.engine.kvstore_policy import MIB

    cache_dir(args.dir)  # a missing directory is named before a bad budget
    if not 0 <= args.budget_mb <= MAX_BUDGET_MB:  # also false for nan
        raise KVStoreError(f"--budget-mb {args.budget_mb}: must be a number of MiB from 0 to "
                           f"{MAX_BUDGET_MB} (0 removes every file)")
    budget = int(args.budget_mb * MIB)
    from ds4_mlx.model.load_plan import kv_lock_timeout

    report = prune(args.dir, budget, scoring_options(args), lock_timeout=kv_lock_timeout())
    removed, temps, kept, total = (report.removed, report.temps_removed, report.kept_files,
                                   report.total_bytes)
    rc = 0 if report.within_budget else 1
    if args.json:
        print(json.dumps({
            "budget_bytes": budget, "total_bytes": total, "kept_files": kept,
            "removed": [{"file": ev.path.name, "size": ev.file_size, "tokens": ev.tokens,
                         "hits": ev.hits, "score": ev.score, "score_note": ev.note, "why": ev.why}
                        for ev in removed],
            "temps_removed": [p.name for p in temps],
        }, indent=2))
        return rc
    for p in temps:
        print(f"removed temp {p.name}")
    for ev in removed:
        print(f"removed {ev.path.name} tokens={ev.tokens} size={human_size(ev.file_size)} "
              f"hits={ev.hits} score={ev.score:.6g}{f' [{ev.note}]' if ev.note else ''} ({ev.why})")
    print(f"{len(removed)} removed, {kept} kept, {human_size(total)} "
          f"<= budget {human_size(budget)}" if total <= budget else
          f"{len(removed)} removed, {kept} kept, {human_size(total)} still over budget "
          f"{human_size(budget)} (files that could not be removed)")
    return rc
