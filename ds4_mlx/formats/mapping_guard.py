"""Name the model file when its mapping kills the process: a file truncated while mapped ends in SIGBUS.

Reading a page of a ``mmap`` past the file's new end raises SIGBUS inside whatever C code touches it
(numpy, MLX, a BLAS thread). Python cannot recover from that: a ``signal.signal`` handler only runs
between bytecodes, and the faulting instruction re-executes before it ever could. So there are two
layers:

1. ``GGUFFile.check_intact()`` (an ``fstat``) is called where weights are about to be read (at load,
   before each layer of a forward pass): a file that shrank raises a ``GGUFError`` naming it, and
   the process lives on. That covers truncation that happens between reads.
2. For the race that remains (the file shrinks while a layer is reading it), ``watch()`` points
   ``faulthandler`` (C-level, async-signal-safe: it only ``write()``s) at a pipe whose other end is
   read by a small watcher process. When the process dies, the watcher reads what faulthandler
   wrote; if a watched file is now shorter than when it was opened (or gone), it prints one line
   naming the file instead of a Python stack dump, also when the dump was cut short (two threads
   faulting at once: the native products read the mapping on several). Any other fatal error's
   dump is passed through unchanged (after a line naming the mapped files, for a bus error with no
   file shrunk).
   The dying process still ends by SIGBUS (exit status 135 in a shell): nothing can be recovered.
   The line comes from the watcher, a few milliseconds after the death (a shell may show its
   prompt first); a parent reading our stderr to its end gets it, as the watcher holds stderr too.

Residual limits: the watcher checks sizes after the death, so a file truncated and re-grown in
between gets the generic line (naming the mapped files) plus the dump; if ``faulthandler`` is
already enabled (``python -X faulthandler``, pytest) it is left alone, its owner gets the dump; if
the watcher cannot be started (no processes or file descriptors left) there is only layer 1.
"""

from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
import threading

# Registration records start with a NUL, which never begins a faulthandler dump; one record is
# written by one write() of well under PIPE_BUF bytes, so it is never interleaved with a dump.
_WATCH, _FORGET = b"\0W", b"\0F"

# The watcher, run with ``python -I -S -c``: no site, no package import, so it starts in ~20 ms.
_WATCHER = r"""
import json, os
files, dump, buf = {}, bytearray(), b""
while True:
    chunk = os.read(0, 65536)
    if not chunk:
        break
    buf += chunk
    while not dump and buf.startswith(b"\0"):
        nl = buf.find(b"\n")
        if nl < 0:
            break
        op, rec, buf = buf[:2], json.loads(buf[2:nl]), buf[nl + 1:]
        if op == b"\0W":
            files[rec["path"]] = rec["size"]
        else:
            files.pop(rec["path"], None)
    if buf and not buf.startswith(b"\0"):
        dump += buf
        buf = b""
lines = []
if dump and files:
    # A watched file that shrank or vanished names the cause even when the dump is cut short: two
    # threads (the native products read the mapping on several) can fault at once, and the second
    # SIGBUS, after faulthandler has handed the signal back, ends the process mid-dump.
    for path, size in files.items():
        try:
            now = os.stat(path).st_size
        except OSError as exc:
            now = None
            why = "was removed or became unreadable (%s)" % (exc.strerror or exc)
        if now is None or now < size:
            if now is not None:
                why = "shrank from %d to %d bytes" % (size, now)
            lines.append("ds4-mlx: fatal: model file %s %s while it was in use (truncated or rewritten "
                         "in place); the process was killed by SIGBUS reading it\n" % (ascii(path)[1:-1], why))
    if not lines and b"Bus error" in dump:
        lines.append("ds4-mlx: fatal: bus error (SIGBUS) while these model files were mapped: %s; was one "
                     "of them changed on disk?\n" % ", ".join(ascii(p)[1:-1] for p in files))
        lines.append(dump.decode("utf-8", "replace"))
    elif not lines:
        lines.append(dump.decode("utf-8", "replace"))
elif dump:
    lines.append(dump.decode("utf-8", "replace"))
if lines:
    try:
        os.write(2, "".join(lines).encode("utf-8", "replace"))
    except OSError:
        pass
"""

_lock = threading.Lock()
_pipe = None  # (write file object, watcher Popen) once started; False when it could not be
_watched: dict[str, list[int]] = {}  # path -> [size when opened, open GGUFFiles watching it]


def _start() -> bool:
    """Start the watcher and point faulthandler at it (once per process); False if not possible."""
    global _pipe
    if _pipe is None:
        _pipe = False
        if faulthandler.is_enabled():
            return False  # someone (python -X faulthandler, pytest) wants the dumps: theirs
        try:
            r, w = os.pipe()
            try:
                # its own session: Ctrl-C and other terminal signals to our process group never reach it;
                # it ends when the pipe does (every holder of the write end, us included, is gone)
                proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHER], stdin=r,
                                        stdout=subprocess.DEVNULL, close_fds=True, start_new_session=True)
            finally:
                os.close(r)
            wfile = os.fdopen(w, "wb", buffering=0)
            faulthandler.enable(file=wfile, all_threads=True)
        except (OSError, ValueError, RuntimeError):
            return False
        _pipe = (wfile, proc)
    return bool(_pipe)


def _send(op: bytes, path: str, size: int = 0) -> None:
    wfile, _proc = _pipe
    try:
        os.write(wfile.fileno(), op + json.dumps({"path": path, "size": size}).encode() + b"\n")
    except OSError:
        pass  # the watcher is gone: only the fstat checks are left


def watch(gguf_file) -> bool:
    """Name ``gguf_file`` (an open GGUFFile) if a bus error kills the process while it is mapped.
    True when the watcher runs."""
    path = os.path.abspath(gguf_file.path)
    with _lock:
        if not _start():
            return False
        entry = _watched.setdefault(path, [gguf_file.file_size, 0])
        entry[1] += 1
        _send(_WATCH, path, gguf_file.file_size)
    return True


def forget(gguf_file) -> None:
    """Stop naming ``gguf_file`` (it was closed)."""
    path = os.path.abspath(gguf_file.path)
    with _lock:
        entry = _watched.get(path)
        if not _pipe or entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _watched[path]
            _send(_FORGET, path)
