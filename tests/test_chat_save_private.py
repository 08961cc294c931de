"""``/save`` in ``ds4-mlx chat`` (issue #26 item 8): the saved conversation is the user's alone
(mode 0600 whatever the umask), and a symlink planted at any name the save writes - the final
names or the old fixed ``NAME.json.tmp`` / ``NAME.session.tmp`` - is never followed."""

from __future__ import annotations

import io
import os
import stat
import sys

import pytest

from ds4_mlx.frontends.cli import main


def _chat(monkeypatch, capsys, tmp_path, model, lines):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    rc = main(["chat", "-m", str(model), "-n", "3", "--temp", "0", "--numerics", "ds4-cpu",
               "--chat-dir", str(tmp_path / "chats")])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _private(path) -> bool:
    st = os.lstat(path)
    return stat.S_ISREG(st.st_mode) and st.st_mode & 0o077 == 0


def test_saves_are_private_files(monkeypatch, capsys, tmp_path, tiny_model_path, umask_022):
    rc, out, err = _chat(monkeypatch, capsys, tmp_path, tiny_model_path, ["/nothink", "Hello there", "/save mine"])
    assert rc == 0 and "saved mine" in err, err
    chats = tmp_path / "chats"
    assert _private(chats / "mine.json") and _private(chats / "mine.session")
    assert sorted(p.name for p in chats.iterdir()) == ["mine.json", "mine.session"]  # no temp left behind
    # saving over an existing save keeps it private
    rc, out, err = _chat(monkeypatch, capsys, tmp_path, tiny_model_path, ["/load mine", "More", "/save mine"])
    assert rc == 0, err
    assert _private(chats / "mine.json") and _private(chats / "mine.session")


def test_planted_symlinks_are_not_followed(monkeypatch, capsys, tmp_path, tiny_model_path, umask_022):
    chats = tmp_path / "chats"
    chats.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    names = ["x.json", "x.session", "x.json.tmp", "x.session.tmp"]
    for name in names:
        os.symlink(victim, chats / name)
    rc, out, err = _chat(monkeypatch, capsys, tmp_path, tiny_model_path, ["/nothink", "Hello there", "/save x"])
    assert rc == 0 and "saved x" in err, err
    assert victim.read_text() == "precious\n" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    # the final names now hold the save itself (the links were replaced, not written through)
    assert _private(chats / "x.json") and _private(chats / "x.session")
    # the load reads the save back
    rc, out, err = _chat(monkeypatch, capsys, tmp_path, tiny_model_path, ["/load x", "/quit"])
    assert rc == 0 and "loaded" in err.lower(), err
