"""Disk KV store throughput: ``KVStore.store`` (crc32 + write + fsync + rename) and ``KVStore.load``
(read + crc32 + hit update) against plain write+fsync / read and bare crc32 of the same bytes.

    python benchmarks/bench_kvstore.py                    # 16, 64, 256 MiB payloads in a temp dir
    python benchmarks/bench_kvstore.py --sizes 1024 --dir /path/on/the/real/disk --json

Reads are usually served by the page cache (the file was just written); ``--drop-caches`` asks
the kernel to drop it first (Linux, root only) to measure the disk. Reported figures are MiB/s of
payload, best of ``--repeats``. The restore-vs-prefill comparison needs the model and lives
elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import zlib

import numpy as np

from ds4_mlx.engine.kvstore import KVStore
from ds4_mlx.engine.kvstore_policy import KVStoreOptions

MIB = 1 << 20


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def best_of(repeats: int, fn) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_size(directory: str, size_mb: int, repeats: int, drop: bool) -> dict:
    payload = np.random.default_rng(size_mb).integers(0, 256, size_mb * MIB, dtype=np.uint8)
    tokens = list(range(30000))
    text = b"<|User|>benchmark " * 2000
    store = KVStore(directory, 4 * size_mb + 64, model_id=b"bench", quant_bits=2, ctx=65536,
                    options=KVStoreOptions(cold_max_tokens=0))
    counter = [0]

    def do_store():
        counter[0] += 1  # a new key each time so nothing is skipped as already stored
        store.store(tokens, text + str(counter[0]).encode(), payload, "cold")

    t_store = best_of(repeats, do_store)
    entry = store.lookup(rendered_text=text + str(counter[0]).encode())

    def do_load():
        if drop:
            drop_caches()
        store.load(store.lookup(rendered_text=text + str(counter[0]).encode()))

    t_load = best_of(repeats, do_load)
    plain = os.path.join(directory, "plain.bin")

    def plain_write():
        with open(plain, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())

    def plain_read():
        if drop:
            drop_caches()
        buf = bytearray(payload.nbytes)
        with open(plain, "rb", buffering=0) as f:
            f.readinto(buf)

    t_pw = best_of(repeats, plain_write)
    t_pr = best_of(repeats, plain_read)
    t_crc = best_of(repeats, lambda: zlib.crc32(payload))
    os.remove(plain)
    for e in store.entries():
        e.path.unlink()
    mb = payload.nbytes / MIB
    return {"payload_mib": size_mb, "file_bytes": entry.file_size,
            "store_mib_s": mb / t_store, "load_mib_s": mb / t_load,
            "plain_write_fsync_mib_s": mb / t_pw, "plain_read_mib_s": mb / t_pr,
            "crc32_mib_s": mb / t_crc, "store_s": t_store, "load_s": t_load}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,64,256", help="payload sizes in MiB, comma separated")
    ap.add_argument("--dir", default=None, help="directory to write in (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before reads")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        dropped = args.drop_caches and drop_caches()
        rows = [bench_size(d, s, args.repeats, bool(dropped)) for s in sizes]
    if args.json:
        print(json.dumps({"page_cache_dropped": bool(dropped), "rows": rows}, indent=2))
        return
    print(f"page cache {'dropped before reads' if dropped else 'warm'}; MiB/s of payload, best of {args.repeats}")
    print(f"{'MiB':>6} {'store':>9} {'load':>9} {'write+fsync':>12} {'read':>9} {'crc32':>9}")
    for r in rows:
        print(f"{r['payload_mib']:>6} {r['store_mib_s']:>9.0f} {r['load_mib_s']:>9.0f} "
              f"{r['plain_write_fsync_mib_s']:>12.0f} {r['plain_read_mib_s']:>9.0f} {r['crc32_mib_s']:>9.0f}")


if __name__ == "__main__":
    main()
