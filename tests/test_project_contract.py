"""The README's test command is the one CI runs, and the README's set-up commands exist."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Set up on a fresh machine", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_readme_has_exactly_two_setup_commands():
    cmds = _readme_commands()
    assert len(cmds) == 2, cmds
    install, tests = cmds
    assert "pip install -e" in install and "ds4-mlx demo" in install
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command_last():
    ci = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()
          if ln.strip() and not ln.strip().startswith("#")]
    assert ci[-1] == _readme_commands()[1]
