"""The watchdog of ``distributed.join``, run as its own small process: ``mx.distributed.init`` blocks
inside C with the GIL held, so no thread of ours could run to end a wait for a rank that never comes.

    python -I join_watchdog.py PID LIMIT MESSAGE

waits up to LIMIT seconds for stdin to become readable (the joining process closes its end once
``init`` returns: EOF); if it never does, writes MESSAGE to stderr and SIGKILLs PID. Standard
library only, so the script starts fast and in isolated mode (``-I``).
"""

from __future__ import annotations

import os
import select
import signal
import sys


def main(argv: list[str]) -> None:
    pid, limit, msg = int(argv[1]), float(argv[2]), argv[3]
    ready, _, _ = select.select([sys.stdin], [], [], limit)
    if not ready:
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()
        os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv)
