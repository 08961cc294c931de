"""Terminal sessions for tests, started without forking the test process.

pexpect.spawn forks the pytest process and runs Python in the child before exec; once earlier tests
have loaded a model in-process, that process has MLX and OpenBLAS worker threads, and a fork taken
while one of them holds a lock can leave the child stuck before exec (seen in CI: a chat session that
printed nothing for 300 s). Here the process is started by subprocess (fork+exec in C), as a small
single-threaded launcher that gives the program a real pseudo-terminal with ``pty.spawn`` and relays
bytes; Ctrl-C and Ctrl-D are sent as the terminal characters they are (the pty's line discipline
turns ^C into SIGINT for the program, as a real terminal does)."""

from __future__ import annotations

import signal
import sys

from pexpect.popen_spawn import PopenSpawn

# Default SIGINT/SIGHUP/SIGQUIT first, as a terminal session starts: a test run started in the background
# (nohup, `&` in a script) ignores them, and a program that starts with SIGINT ignored never sees Ctrl-C at
# its readline prompt.
_LAUNCHER = ("import os, pty, signal, sys\n"
             "for s in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT): signal.signal(s, signal.SIG_DFL)\n"
             "status = pty.spawn(sys.argv[1:])\n"
             "sys.exit(os.waitstatus_to_exitcode(status) if status is not None else 0)\n")

CTRL_C, CTRL_D = "\x03", "\x04"


def spawn(argv: list[str], env: dict, timeout: float = 300) -> PopenSpawn:
    """A session running ``argv`` on a pseudo-terminal; use expect/send/sendline, and
    ``send(CTRL_C)`` / ``send(CTRL_D)``. ``exitstatus`` after ``expect(pexpect.EOF)`` and ``wait()``."""
    return PopenSpawn([sys.executable, "-c", _LAUNCHER, *argv], env=env, encoding="utf-8", timeout=timeout)


def finish(child: PopenSpawn) -> int | None:
    """The session's exit status; a session still running (a failed or timed-out expect) is killed
    first, so a stuck program fails its test instead of hanging it in ``wait()`` (killing the
    launcher closes the terminal, and the program gets SIGHUP)."""
    if child.proc.poll() is None and not child.flag_eof:
        child.kill(signal.SIGKILL)
    return child.wait()
