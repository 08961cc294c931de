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
import os
import time
from datetime import datetime, timezone
from pathlib import Path

from ds4_mlx.engine.kvstore import (
    EXT_DS4_MLX,
    EXT_RESPONSES_VISIBLE,
    EXT_THINKING_VISIBLE,
    EXT_TOOL_MAP,
    HEADER_BYTES,
    TAIL_BYTES,
    TAIL_MAGIC,
    TEXT_LEN_BYTES,
    Entry,
    KVC_MAGIC,
    KVFileRejected,
    RawHeader,
    RawTail,
    SaveReason,
    clean_stale_temps,
    directory_lock,
    evict_to_budget,
    eviction_scores,
    key_kind_of,
    read_contents,
    open_regular,
    read_entry,
    scan_dir,
)
from ds4_mlx.engine.kvstore_policy import DEFAULT_OPTIONS, MIB, KVStoreOptions
from ds4_mlx.errors import KVStoreError

PREVIEW_CHARS = 40
MAX_BUDGET_MB = 2**30  # 1 PiB: far beyond any disk, small enough to stay exact in bytes
_EXT_NAMES = [(EXT_TOOL_MAP, "tool-map"), (EXT_RESPONSES_VISIBLE, "responses-visible"),
              (EXT_THINKING_VISIBLE, "thinking-visible"), (EXT_DS4_MLX, "ds4-mlx")]


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


def escape_text(text: str) -> str:
    """Printable characters as is; backslash, controls and undecodable bytes as escapes."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif 0xDC80 <= code <= 0xDCFF:  # a byte that was not valid UTF-8 (surrogateescape)
            out.append(f"\\x{code - 0xDC00:02x}")
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(repr(ch)[1:-1])
    return "".join(out)


def _read_at(path: Path, offset: int, n: int) -> bytes:
    f, _ = open_regular(path, follow=True)  # never blocks on a FIFO swapped in after the listing
    with f:
        return os.pread(f.fileno(), n, offset)


def text_preview(path: Path, text_bytes: int, chars: int = PREVIEW_CHARS) -> tuple[str, str]:
    """(first, last) ``chars`` characters of the key text, escaped; last is "" when short."""
    window = 8 * chars  # enough bytes for ``chars`` characters of up to 4 bytes, plus a cut one
    start = HEADER_BYTES + TEXT_LEN_BYTES
    if text_bytes <= 2 * window:
        text = _read_at(path, start, text_bytes).decode("utf-8", "surrogateescape")
        if len(text) <= 2 * chars:
            return escape_text(text), ""
        return escape_text(text[:chars]), escape_text(text[-chars:])
    head = _read_at(path, start, window).decode("utf-8", "surrogateescape")
    tail = _read_at(path, start + text_bytes - window, window).decode("utf-8", "surrogateescape")
    return escape_text(head[:chars]), escape_text(tail[-chars:])


def human_size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def utc(ts: int) -> str:
    if ts <= 0:
        return "-"
    try:
        return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return f"@{ts}"


def scoring_options(args: argparse.Namespace) -> KVStoreOptions:
    return KVStoreOptions.ds4_head() if args.ds4_head else DEFAULT_OPTIONS


def ext_names(flags: int) -> list[str]:
    names = [name for bit, name in _EXT_NAMES if flags & bit]
    unknown = flags & ~sum(bit for bit, _ in _EXT_NAMES)
    return names + ([f"unknown:{unknown:#04x}"] if unknown else [])


def _entry_json(e: Entry, head: str, tail: str) -> dict:
    return {
        "file": e.name, "path": str(e.path), "valid": True, "problem": None,
        "tokens": e.tokens, "size": e.file_size, "reason": e.reason.label, "hits": e.hits,
        "created": e.created_at, "last_used": e.last_used, "last_used_utc": utc(e.last_used),
        "ctx_size": e.ctx_size, "quant_bits": e.quant_bits, "key_kind": e.key_kind,
        "text_bytes": e.text_bytes, "payload_bytes": e.payload_bytes,
        "model_id": e.model_id.hex(), "payload_version": e.payload_version,
        "text_head": head, "text_tail": tail,
    }


# -- ls ------------------------------------------------------------------------------------------


def _cache_dir(arg: str) -> Path:
    directory = Path(arg)
    if not directory.exists():
        raise KVStoreError(f"{directory}: KV cache directory does not exist")
    if not directory.is_dir():
        raise KVStoreError(f"{directory}: not a directory (a KV cache is a directory of .kv files)")
    return directory


def run_ls(args: argparse.Namespace) -> int:
    directory = _cache_dir(args.dir)
    scan = scan_dir(directory)
    scores = eviction_scores([*scan.entries, *scan.invalid], time.time(), scoring_options(args))
    rows = []
    for e in sorted(scan.entries, key=lambda e: (-e.last_used, e.name)):
        try:
            head, tail = text_preview(e.path, e.text_bytes)
        except OSError:
            head, tail = "?", ""
        rows.append(_entry_json(e, head, tail))
    for bad in scan.invalid:
        rows.append({"file": bad.path.name, "path": str(bad.path), "valid": False,
                     "problem": bad.reason, "size": bad.file_size})
    for r in rows:
        s = scores[r["file"]]
        r.update(score=s.score, base_score=s.base, score_note=s.note,
                 superseded_by=list(s.superseded_by))
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
    total = scan.total_bytes
    print(f"{len(scan.entries)} valid, {len(scan.invalid)} invalid, {human_size(total)} in total")
    if any(r["score_note"] for r in rows):
        print("* score = ds4's score times an anchor bonus or a superseded-prefix demotion "
              "(--json: base_score, score_note)")
    return 0


# -- inspect -------------------------------------------------------------------------------------


def inspect_report(path: Path) -> dict:
    """Every field that can be decoded, plus ``problems`` (empty when the file is fully valid)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise KVStoreError(f"{path}: does not exist") from None
    except OSError as exc:
        raise KVStoreError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not path.is_file():
        raise KVStoreError(f"{path}: not a regular file")
    try:
        magic = _read_at(path, 0, len(KVC_MAGIC))
    except OSError as exc:
        raise KVStoreError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if magic != KVC_MAGIC:
        # Decoding anything further would print garbage fields (a GGUF read as a header).
        raise KVStoreError(f"{path}: not a ds4-mlx KV cache file (bad magic {magic!r}, "
                           f"expected {KVC_MAGIC!r})")
    report: dict = {"file": str(path), "size": size, "header": None, "text_bytes": None,
                    "text_head": None, "text_tail": None, "trailer": None, "tool_map_entries": None,
                    "file_crc": "not checked", "problems": [], "notes": []}
    if size >= HEADER_BYTES:
        h = RawHeader.unpack(_read_at(path, 0, HEADER_BYTES))
        report["header"] = {
            "magic": h.magic.decode("latin-1"), "version": h.version, "quant_bits": h.quant_bits,
            "reason": SaveReason(h.reason_code).label if h.reason_code <= SaveReason.AGENT_SESSION
            else "unknown", "reason_code": h.reason_code,
            "ext_flags": h.ext_flags, "ext_names": ext_names(h.ext_flags),
            "key_kind": key_kind_of(h.ext_flags), "reserved": h.reserved, "tokens": h.tokens,
            "hits": h.hits, "ctx_size": h.ctx_size, "header_crc": f"{h.header_crc:#010x}",
            "header_crc_ok": h.crc_ok, "created": h.created_at, "created_utc": utc(h.created_at),
            "last_used": h.last_used, "last_used_utc": utc(h.last_used),
            "payload_bytes": h.payload_bytes,
        }
    if size >= HEADER_BYTES + TEXT_LEN_BYTES:
        text_bytes = int.from_bytes(_read_at(path, HEADER_BYTES, TEXT_LEN_BYTES), "little")
        report["text_bytes"] = text_bytes
        if HEADER_BYTES + TEXT_LEN_BYTES + text_bytes <= size:
            report["text_head"], report["text_tail"] = text_preview(path, text_bytes)
    if size >= TAIL_BYTES:
        t = RawTail.unpack(_read_at(path, size - TAIL_BYTES, TAIL_BYTES))
        if t.magic == TAIL_MAGIC:
            report["trailer"] = {
                "version": t.version, "payload_version": t.payload_version,
                "model_id": t.model_id_field[:t.model_id_len].hex(), "token_key": t.token_key.hex(),
                "file_crc": f"{t.file_crc:#010x}",
            }
    try:
        entry = read_entry(path)
    except KVFileRejected as rej:
        report["problems"].append(rej.reason)
        return report
    if not entry.key:
        report["notes"].append("file name is not <sha1>.kv: the text-hash check is skipped")
    report["tool_map_bytes"] = entry.tool_map_bytes
    try:
        contents = read_contents(entry)
    except KVFileRejected as rej:
        report["problems"].append(rej.reason)
        report["file_crc"] = "mismatch" if "checksum" in rej.reason else "not checked"
        return report
    report["file_crc"] = "ok"
    report["tool_map_entries"] = len(contents.tool_map)
    return report


def run_inspect(args: argparse.Namespace) -> int:
    report = inspect_report(Path(args.file))
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
    directory = _cache_dir(args.dir)
    if not 0 <= args.budget_mb <= MAX_BUDGET_MB:  # also false for nan
        raise KVStoreError(f"--budget-mb {args.budget_mb}: must be a number of MiB from 0 to "
                           f"{MAX_BUDGET_MB} (0 removes every file)")
    budget = int(args.budget_mb * MIB)
    now = time.time()
    with directory_lock(directory):  # a writer in another process must not refill it meanwhile
        temps = clean_stale_temps(directory, now)
        removed = evict_to_budget(directory, budget, now, options=scoring_options(args))
        scan = scan_dir(directory)
    kept = len(scan.entries) + len(scan.invalid)
    rc = 0 if scan.total_bytes <= budget else 1
    if args.json:
        print(json.dumps({
            "budget_bytes": budget, "total_bytes": scan.total_bytes, "kept_files": kept,
            "removed": [{"file": ev.path.name, "size": ev.file_size, "tokens": ev.tokens,
                         "hits": ev.hits, "score": ev.score, "score_note": ev.note, "why": ev.why}
                        for ev in removed],
            "temps_removed": [os.fspath(p.name) for p in temps],
        }, indent=2))
        return rc
    for p in temps:
        print(f"removed temp {p.name}")
    for ev in removed:
        print(f"removed {ev.path.name} tokens={ev.tokens} size={human_size(ev.file_size)} "
              f"hits={ev.hits} score={ev.score:.6g}{f' [{ev.note}]' if ev.note else ''} ({ev.why})")
    print(f"{len(removed)} removed, {kept} kept, {human_size(scan.total_bytes)} "
          f"<= budget {human_size(budget)}" if scan.total_bytes <= budget else
          f"{len(removed)} removed, {kept} kept, {human_size(scan.total_bytes)} still over budget "
          f"{human_size(budget)} (files that could not be removed)")
    return rc
