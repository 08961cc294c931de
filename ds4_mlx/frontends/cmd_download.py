"""`ds4-mlx download [TARGET] [--dir D] [--token T] [--list]`: fetch one of ds4's GGUFs from the hub.

TARGET is one of ds4's published files (`--list` shows them with sizes and the hardware each
needs) or any `owner/repo/file.gguf`. The default is ds4f-q2, ds4's default since August: the
DeepSeek V4 Flash 0731 checkpoint with 2-bit routed experts, which runs on 96-128 GB machines, the
widest audience; machines with 256 GB or more can take ds4f-q4 or ds4f-mxfp4. The May preview
checkpoint's files stay available as preview-* (the old names q2-imatrix, q4-imatrix, q2, q4 and
mtp still name them).

Without --dir the file goes to the Hugging Face cache (HF_HUB_CACHE, shared with every hub client);
a finished file is never fetched again. An interrupted download (Ctrl-C, a dropped connection)
resumes where it stopped when the same command runs again: the bytes so far are kept in
FILE.part next to the destination (blobs/ETAG.part in the cache) until the file is complete and its
sha256 matches the hub's; a part of a file that changed on the hub since is discarded. HF_TOKEN (or --token) is used for access; HF_ENDPOINT
selects a mirror; HF_HUB_OFFLINE=1 forbids the network. A progress bar is drawn on a terminal
only. On success the final path and the command to run next are printed on stdout.
"""

from __future__ import annotations

import argparse
import sys

from ds4_mlx.hub import DEFAULT_TARGET, TARGETS, DownloadInterrupted, download

DRAFTER_KINDS = {"mtp": "The preview's MTP head", "dspark": "The 0731 DSpark file"}


def register(subparsers) -> None:
    p = subparsers.add_parser("download", help="download a DS4 Flash GGUF from the Hugging Face hub",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", nargs="?", default=DEFAULT_TARGET,
                   help=f"{' | '.join(TARGETS)} | owner/repo/file.gguf (default {DEFAULT_TARGET})")
    p.add_argument("--dir", metavar="D", help="put the file in this folder instead of the HF cache")
    p.add_argument("--token", metavar="T", help="Hugging Face token (default: HF_TOKEN or the saved login)")
    p.add_argument("--list", action="store_true", help="list ds4's files with sizes and hardware, then exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.list:
        sys.stdout.write(format_table())
        return 0
    out = sys.stdout
    try:
        # Progress goes to stderr and only on a terminal: a piped run prints just the result lines.
        result = download(args.target, dir=args.dir, token=args.token, progress=sys.stderr.isatty())
    except DownloadInterrupted as exc:
        print(f"ds4-mlx download: interrupted at {_size(exc.have)} of {_size(exc.size)}; kept in {exc.part}: "
              f"run the same command again to resume", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("ds4-mlx download: interrupted before the transfer started; run the same command again",
              file=sys.stderr)
        return 130
    t = result.target
    out.write(f"{'downloaded' if result.fetched else 'already downloaded'}: {result.path} "
              f"({_size(result.size)})\n")
    if result.integrity:
        out.write(f"checked: {result.integrity}\n")
    out.write(f"verified: {result.check}\n")
    if t.kind in DRAFTER_KINDS:
        out.write(f"{DRAFTER_KINDS[t.kind]} is an optional speculative-decoding drafter; "
                  "ds4-mlx does not use it yet.\n")
    else:
        out.write(f'next: ds4-mlx generate -m {_quote(str(result.path))} -p "Hello"\n')
    return 0


def format_table() -> str:
    rows = [("name", "size", "needs", "", "what")]
    for t in TARGETS.values():
        size = f"{t.approx_gb:g} GB"
        mark = "*" if t.name == DEFAULT_TARGET else ("+" if t.recommended else "")
        rows.append((t.name, size, t.hardware, mark, t.about))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
    lines.append("")
    lines.append(f"* default, + recommended by ds4. Files from https://huggingface.co/{next(iter(TARGETS.values())).repo}")
    lines.append("download: ds4-mlx download NAME [--dir D]   use: ds4-mlx generate -m PATH -p ...  "
                 "or ds4_mlx.load(\"hf:NAME\")")
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _quote(path: str) -> str:
    import shlex

    return shlex.quote(path)
