"""ds4_mlx.hub and `ds4-mlx download` against a fake hub on 127.0.0.1 (no real network anywhere).

The fake hub answers the two requests huggingface_hub's real client makes for a file: a HEAD on
``/{repo}/resolve/{revision}/{file}`` (commit, ETag, size headers; the hub's X-Error-Code headers
for failures) and a GET, honouring ``Range: bytes=S-`` and ``bytes=S-E`` so resuming is exercised.
It can cut a transfer (the server hangs up mid-body) or stall one (for Ctrl-C tests).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ds4_mlx import hub
from ds4_mlx.errors import HubError
from ds4_mlx.frontends import cli

REPO_ROOT = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "someone/ds4-test"


class FakeHub:
    """A minimal hub: files by (repo, filename); per-file failure modes; a log of requests."""

    def __init__(self):
        self.files: dict[tuple[str, str], bytes] = {}
        self.errors: dict[str, tuple[int, dict[str, str]]] = {}  # filename -> (status, headers)
        self.drop_first_get_at: int | None = None  # cut the first GET's body after this many bytes
        self.after_drop_status: int | None = None  # status of every GET after the cut
        self.stall_first_get_at: int | None = None  # send this many bytes of the first GET, then wait
        self.release = threading.Event()  # ends a stalled GET (the connection is then closed)
        self.etags: dict[str, str] = {}  # filename -> ETag to send instead of the sha256 (a non-LFS file)
        self.log: list[tuple[str, str, str | None]] = []  # (method, filename, Range header)
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> "FakeHub":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # keep test output clean
                pass

            def _lookup(self):
                parts = self.path.split("?")[0].lstrip("/").split("/")
                if len(parts) < 5 or parts[2] != "resolve":
                    return None, None
                return "/".join(parts[:2]), "/".join(parts[4:])

            def _send(self, status, headers, body=b""):
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command == "GET" and body:
                    self.wfile.write(body)

            def _handle(self):
                repo, name = self._lookup()
                rng = self.headers.get("Range")
                fake.log.append((self.command, name, rng))
                if name in fake.errors:
                    status, hdrs = fake.errors[name]
                    self._send(status, {"Content-Length": "0", "X-Repo-Commit": COMMIT, **hdrs})
                    return
                data = fake.files.get((repo, name))
                if data is None:
                    self._send(404, {"Content-Length": "0", "X-Error-Code": "RepoNotFound"})
                    return
                etag = fake.etags.get(name) or hashlib.sha256(data).hexdigest()
                base = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
                if self.command == "HEAD":
                    self._send(200, {**base, "Content-Length": str(len(data))})
                    return
                gets = sum(1 for m, n, _ in fake.log if m == "GET" and n == name)
                if fake.after_drop_status is not None and gets > 1:
                    self._send(fake.after_drop_status, {"Content-Length": "0"})
                    return
                start, last = 0, len(data) - 1
                if rng:
                    first, _, end = rng.removeprefix("bytes=").partition("-")
                    start, last = int(first), min(int(end), len(data) - 1) if end else len(data) - 1
                body = data[start:last + 1]
                status = 206 if rng else 200
                headers = {**base, "Content-Length": str(len(body))}
                if rng:
                    headers["Content-Range"] = f"bytes {start}-{last}/{len(data)}"
                cut = fake.drop_first_get_at if fake.drop_first_get_at is not None else fake.stall_first_get_at
                if cut is not None and gets == 1:
                    # Promise the whole body, send part of it, (stall, then) hang up: a dropped transfer.
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(body[:cut])
                    self.wfile.flush()
                    if fake.stall_first_get_at is not None:
                        fake.release.wait(60)
                    self.close_connection = True
                    return
                self._send(status, headers, body)

            do_HEAD = _handle
            do_GET = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self):
        self.release.set()
        self._server.shutdown()
        self._server.server_close()

    def gets(self, name: str) -> list[str | None]:
        return [r for m, n, r in self.log if m == "GET" and n == name]


@pytest.fixture()
def fake_hub(monkeypatch, tmp_path):
    """A running fake hub; HF_ENDPOINT points at it and the HF cache is a fresh temporary folder."""
    from huggingface_hub import constants as hf_constants

    h = FakeHub().start()
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def small_bytes(small_model_path) -> bytes:
    return Path(small_model_path).read_bytes()


def _cli(argv, capsys) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("ds4-mlx download: error: "), err
    return lines[0]


# -- the table and names ---------------------------------------------------------------------------


# ds4's download_model.sh (Sep 2026), its DeepSeek V4 Flash targets, with the exact file names.
DS4_0731_FILES = {
    "ds4f-q2": "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix-0731.gguf",
    "ds4f-q2-q4": "DeepSeek-V4-Flash-Layers37-42Q4KExperts-OtherExpertLayersIQ2XXSGateUp-Q2KDown-AProjQ8-SExpQ8-"
                  "OutQ8-chat-v2-imatrix-fixed-0731.gguf",
    "ds4f-q4": "DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2-imatrix-"
               "0731.gguf",
    "ds4f-mxfp4": "DeepSeek-V4-Flash-MXFP4Experts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2-"
                  "mxfp4-0731.gguf",
    "ds4f-dspark": "DeepSeek-V4-Flash-DSpark-support-0731.gguf",
}
# ds4's May script (the preview checkpoint), kept as legacy names.
DS4_PREVIEW_FILES = {
    "preview-q2-imatrix": "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix.gguf",
    "preview-q2-q4-imatrix": "DeepSeek-V4-Flash-Layers37-42Q4KExperts-OtherExpertLayersIQ2XXSGateUp-Q2KDown-"
                             "AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix-fixed.gguf",
    "preview-q4-imatrix": "DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-"
                          "chat-v2-imatrix.gguf",
    "preview-q2": "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2.gguf",
    "preview-q4": "DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2.gguf",
    "preview-mtp": "DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf",
}


def test_table_is_ds4s_current_targets_then_the_legacy_preview_files():
    assert {n: t.filename for n, t in hub.TARGETS.items()} == {**DS4_0731_FILES, **DS4_PREVIEW_FILES}
    assert list(hub.TARGETS)[:5] == list(DS4_0731_FILES)  # ds4's order, the current files first
    assert {t.repo for t in hub.TARGETS.values()} == {"antirez/deepseek-v4-gguf"}
    assert hub.DEFAULT_TARGET == "ds4f-q2"
    assert [t.name for t in hub.TARGETS.values() if t.recommended] == ["ds4f-q2", "ds4f-q2-q4", "ds4f-q4",
                                                                         "ds4f-mxfp4"]
    assert all(t.about.startswith("legacy") for n, t in hub.TARGETS.items() if n.startswith("preview-"))
    assert {n: t.kind for n, t in hub.TARGETS.items() if t.kind != "model"} == {"ds4f-dspark": "dspark",
                                                                                "preview-mtp": "mtp"}
    # A table file named in full keeps its kind (the MTP file must not be checked as a full model).
    assert hub.parse_target(hub.TARGETS["preview-mtp"].spec) is hub.TARGETS["preview-mtp"]


@pytest.mark.parametrize("old, new", [("q2-imatrix", "preview-q2-imatrix"), ("q4-imatrix", "preview-q4-imatrix"),
                                      ("q2", "preview-q2"), ("q4", "preview-q4"), ("mtp", "preview-mtp")])
def test_old_names_still_name_the_same_preview_files(old, new):
    # Scripts written against the old table must get the file they always got, not a new checkpoint.
    assert hub.parse_target(old) is hub.TARGETS[new]
    assert hub.parse_target("hf:" + old) is hub.TARGETS[new]


@pytest.mark.parametrize("name", ["ds4f-dspark", "preview-mtp", "mtp"])
def test_a_drafter_is_refused_as_a_model_before_any_download(name, monkeypatch):
    monkeypatch.setattr(hub, "download", lambda *a, **k: pytest.fail("nothing may be fetched"))
    with pytest.raises(HubError, match="drafter .* not a model"):
        hub.resolve_model("hf:" + name)


@pytest.mark.parametrize("spec", [
    "", "hf:", "hf:q3", "hf:owner", "hf:owner/repo", "hf:owner/repo/", "hf:owner//x.gguf",
    "hf:owner/repo/../x.gguf", "hf:owner/repo/./x.gguf", "hf:owner/repo/x.bin", "hf:owner/repo/a b.gguf",
    "hf:owner/repo/x.gguf\x00", "hf:owner/repo/x.gguf\n", "hf:/etc/passwd.gguf", "hf:ow\\ner/repo/x.gguf",
    "hf:owner/repo/-x.gguf", "model.gguf", "/abs/model.gguf", None, 7,
])
def test_resolve_model_rejects_bad_specs(spec):
    with pytest.raises(HubError) as ei:
        hub.resolve_model(spec)
    assert "\n" not in str(ei.value)


def test_list_prints_every_target_with_size_and_hardware(capsys):
    rc, out, _ = _cli(["download", "--list"], capsys)
    assert rc == 0
    for t in hub.TARGETS.values():
        line = next(line for line in out.splitlines() if line.startswith(t.name + " "))
        assert f"{t.approx_gb:g} GB" in line and t.hardware in line


# -- acceptance: offline and unreachable, through the real command -----------------------------------


def _run_cli(args, env_extra, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(PYTHONPATH=str(REPO_ROOT), HF_HUB_CACHE=str(tmp_path / "hf-cache"), **env_extra)
    return subprocess.run([sys.executable, "-m", "ds4_mlx.frontends.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("env_extra, expect", [
    ({"HF_HUB_OFFLINE": "1"}, "is not on disk and HF_HUB_OFFLINE is set"),
    ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "cannot reach http://127.0.0.1:9"),
])
def test_cli_offline_or_unreachable_is_one_line(tmp_path, env_extra, expect):
    d = tmp_path / "models"
    p = _run_cli(["download", "q2", "--dir", str(d)], env_extra, tmp_path)
    assert p.returncode != 0
    line = _one_error_line(p.stderr)
    assert expect in line
    assert p.stdout == ""
    assert not (d / hub.parse_target("q2").filename).exists()


# -- downloads from the fake hub -------------------------------------------------------------------


def test_download_into_dir_verifies_and_is_not_fetched_twice(fake_hub, small_bytes, tmp_path):
    fake_hub.files[(REPO, "small.gguf")] = small_bytes
    d = tmp_path / "models"
    r = hub.download(f"{REPO}/small.gguf", dir=d, progress=False)
    assert r.path == d / "small.gguf" and r.fetched and r.size == len(small_bytes)
    assert r.path.read_bytes() == small_bytes
    assert "layout OK" in r.check
    again = hub.download(f"{REPO}/small.gguf", dir=d, progress=False)
    assert again.path == r.path and not again.fetched
    assert len(fake_hub.gets("small.gguf")) == 1
    # resolve_model: the same file, from disk, no request.
    n = len(fake_hub.log)
    assert hub.resolve_model(f"hf:{REPO}/small.gguf", dir=d) == r.path
    assert len(fake_hub.log) == n


def test_resolve_model_uses_the_hf_cache(fake_hub, small_bytes, tmp_path):
    fake_hub.files[(REPO, "sub/small.gguf")] = small_bytes
    p = hub.resolve_model(f"hf:{REPO}/sub/small.gguf", progress=False)
    assert isinstance(p, Path) and p.read_bytes() == small_bytes
    assert str(p).startswith(str(tmp_path / "hf-cache"))
    n = len(fake_hub.log)
    assert hub.resolve_model(f"hf:{REPO}/sub/small.gguf", progress=False) == p
    assert len(fake_hub.log) == n  # found in the cache: the hub is not asked again


def test_dropped_transfer_resumes_with_range(fake_hub, small_bytes, tmp_path, monkeypatch):
    from huggingface_hub import constants as hf_constants

    # The client keeps what it had written when a transfer drops, in whole read chunks (10 MB by
    # default, more than the small model): smaller chunks let a 4 MB file show the resume.
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    cut = len(small_bytes) // 3
    fake_hub.files[(REPO, "small.gguf")] = small_bytes
    fake_hub.drop_first_get_at = cut
    r = hub.download(f"{REPO}/small.gguf", dir=tmp_path, progress=False)
    assert r.path.read_bytes() == small_bytes
    gets = fake_hub.gets("small.gguf")
    assert gets[0] is None and len(gets) == 2
    start = int(gets[1].removeprefix("bytes=").removesuffix("-"))  # the retry continued, not restarted
    assert 0 < start <= cut


def test_failed_transfer_leaves_no_file_under_the_final_name(fake_hub, small_bytes, tmp_path):
    fake_hub.files[(REPO, "small.gguf")] = small_bytes
    fake_hub.drop_first_get_at = len(small_bytes) // 3
    fake_hub.after_drop_status = 500
    with pytest.raises(HubError, match="HTTP 500") as ei:
        hub.download(f"{REPO}/small.gguf", dir=tmp_path, progress=False)
    assert "\n" not in str(ei.value)
    assert not (tmp_path / "small.gguf").exists()
    assert len(fake_hub.gets("small.gguf")) == 2


def test_cli_download_prints_path_check_and_next_command(fake_hub, small_bytes, tmp_path, capsys):
    fake_hub.files[(REPO, "small.gguf")] = small_bytes
    rc, out, err = _cli(["download", f"{REPO}/small.gguf", "--dir", str(tmp_path)], capsys)
    assert rc == 0, err
    assert err == ""  # not a terminal: no progress bar, nothing on stderr
    path = tmp_path / "small.gguf"
    assert f"downloaded: {path}" in out
    assert "verified: DS4 Flash GGUF, layout OK" in out
    assert f"next: ds4-mlx generate -m {path} -p" in out
    rc, out, _ = _cli(["download", f"{REPO}/small.gguf", "--dir", str(tmp_path)], capsys)
    assert rc == 0 and f"already downloaded: {path}" in out


def test_download_that_is_not_a_ds4_gguf_is_reported(fake_hub, tmp_path):
    fake_hub.files[(REPO, "junk.gguf")] = b"GGUF" + b"\xff" * 100
    with pytest.raises(HubError, match="not a usable DS4 GGUF"):
        hub.download(f"{REPO}/junk.gguf", dir=tmp_path, progress=False)


def test_mtp_target_is_checked_as_an_mtp_file(fake_hub, small_bytes, tmp_path, monkeypatch):
    # A full model is not an MTP component: the MTP check must look for MTP tensors, not a layout.
    mtp = hub.TARGETS["preview-mtp"]
    fake_hub.files[(mtp.repo, mtp.filename)] = small_bytes
    with pytest.raises(HubError, match="not a DS4 MTP component"):
        hub.download("preview-mtp", dir=tmp_path, progress=False)


def test_dspark_target_is_checked_as_a_drafter(fake_hub, small_bytes, tmp_path):
    t = hub.TARGETS["ds4f-dspark"]
    fake_hub.files[(t.repo, t.filename)] = small_bytes
    with pytest.raises(HubError, match="not a DSpark drafter"):
        hub.download("ds4f-dspark", dir=tmp_path, progress=False)


# -- failures with their own lines -----------------------------------------------------------------


@pytest.mark.parametrize("status, headers, expect", [
    (401, {"X-Error-Message": "Invalid credentials in Authorization header"}, "HTTP 401): the token is missing"),
    (401, {"X-Error-Code": "RepoNotFound"}, f"repository {REPO} not found"),
    (403, {}, "HTTP 403): this token has no access"),
    (403, {"X-Error-Code": "GatedRepo"}, "is gated"),
    (404, {"X-Error-Code": "EntryNotFound"}, "not found on"),
    (404, {}, "HTTP 404"),
    (503, {}, "answered HTTP 503"),
])
def test_http_errors_get_their_own_line(fake_hub, tmp_path, capsys, status, headers, expect):
    fake_hub.errors["small.gguf"] = (status, headers)
    rc, out, err = _cli(["download", f"{REPO}/small.gguf", "--dir", str(tmp_path / "d")], capsys)
    assert rc == 2 and out == ""
    assert expect in _one_error_line(err)
    assert not (tmp_path / "d" / "small.gguf").exists()


def test_not_enough_disk_is_refused_before_downloading(fake_hub, small_bytes, tmp_path, monkeypatch, capsys):
    fake_hub.files[(REPO, "small.gguf")] = small_bytes
    real = hub.shutil.disk_usage
    monkeypatch.setattr(hub.shutil, "disk_usage", lambda p: real(p)._replace(free=len(small_bytes) - 1))
    rc, out, err = _cli(["download", f"{REPO}/small.gguf", "--dir", str(tmp_path / "new" / "dir")], capsys)
    assert rc == 2
    assert "not enough disk space" in _one_error_line(err)
    assert fake_hub.gets("small.gguf") == []  # refused before any byte was fetched


def test_dir_that_is_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    rc, _, err = _cli(["download", "q2", "--dir", str(f)], capsys)
    assert rc == 2 and "not a directory" in _one_error_line(err)


def test_offline_still_finds_files_already_downloaded(fake_hub, small_bytes, tmp_path, monkeypatch):
    from huggingface_hub import constants as hf_constants

    fake_hub.files[(REPO, "small.gguf")] = small_bytes
    in_dir = hub.download(f"{REPO}/small.gguf", dir=tmp_path / "d", progress=False).path
    in_cache = hub.resolve_model(f"hf:{REPO}/small.gguf", progress=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    n = len(fake_hub.log)
    assert hub.resolve_model(f"hf:{REPO}/small.gguf", dir=tmp_path / "d") == in_dir
    assert hub.resolve_model(f"hf:{REPO}/small.gguf") == in_cache
    assert len(fake_hub.log) == n
    with pytest.raises(HubError, match="HF_HUB_OFFLINE is set"):
        hub.resolve_model(f"hf:{REPO}/other.gguf")


# -- resuming across runs, and the integrity check -------------------------------------------------

# The hub library keeps what it has written in whole read chunks (10 MB by default, more than the
# 4 MB small model): smaller chunks let a run cut at a third of the file leave bytes behind.
_SMALL_CHUNKS = 64 * 1024
_CLI_WITH_SMALL_CHUNKS = (
    "import sys; from huggingface_hub import constants as c; "
    f"c.DOWNLOAD_CHUNK_SIZE = {_SMALL_CHUNKS}; "
    "from ds4_mlx.frontends.cli import main; sys.exit(main(['download', *sys.argv[1:]]))"
)


def _download_cmd(args, hub_url, tmp_path) -> tuple[list[str], dict]:
    """`ds4-mlx download ARGS` as a subprocess (with small read chunks) against the fake hub."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(PYTHONPATH=str(REPO_ROOT), HF_HUB_CACHE=str(tmp_path / "hf-cache"), HF_ENDPOINT=hub_url)
    return [sys.executable, "-c", _CLI_WITH_SMALL_CHUNKS, *args], env


def _part(path: Path) -> tuple[Path, Path]:
    part = path.with_name(path.name + ".part")
    return part, part.with_name(part.name + ".json")


def _start(rng: str | None) -> int:
    assert rng is not None and rng.startswith("bytes=") and rng.endswith("-"), rng
    return int(rng.removeprefix("bytes=").removesuffix("-"))


@pytest.fixture()
def small_chunks(monkeypatch):
    from huggingface_hub import constants as hf_constants

    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", _SMALL_CHUNKS)


def _cut_run(fake_hub, tmp_path, data: bytes, name="small.gguf", **kw) -> int:
    """Run 1, in this process: the server hangs up a third of the way and then answers 500, so the run
    fails. Returns the size of the part it left."""
    fake_hub.files[(REPO, name)] = data
    fake_hub.drop_first_get_at = len(data) // 3
    fake_hub.after_drop_status = 500
    with pytest.raises(HubError, match="HTTP 500"):
        hub.download(f"{REPO}/{name}", progress=False, **kw)
    fake_hub.drop_first_get_at = fake_hub.after_drop_status = None
    fake_hub.log.clear()
    return len(data) // 3


@pytest.mark.parametrize("name", [f"{REPO}/small.gguf", "ds4f-q2"])
def test_cut_transfer_resumes_in_the_next_run(fake_hub, small_bytes, tmp_path, name):
    # "ds4f-q2": the default 0731 target by its table name, resumed under its exact hub file name.
    t = hub.parse_target(name)
    fake_hub.files[(t.repo, t.filename)] = small_bytes
    fake_hub.drop_first_get_at = len(small_bytes) // 3
    fake_hub.after_drop_status = 500
    cmd, env = _download_cmd([name, "--dir", str(tmp_path)], fake_hub.url, tmp_path)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and p.stdout == ""
    assert "HTTP 500" in _one_error_line(p.stderr)
    final = tmp_path / t.filename
    part, sidecar = _part(final)
    assert not final.exists()
    kept = part.stat().st_size
    assert 0 < kept <= len(small_bytes) // 3
    assert part.read_bytes() == small_bytes[:kept]
    meta = json.loads(sidecar.read_text())
    assert meta["etag"] == hashlib.sha256(small_bytes).hexdigest() and meta["size"] == len(small_bytes)
    assert meta["commit"] == COMMIT

    fake_hub.drop_first_get_at = fake_hub.after_drop_status = None
    fake_hub.log.clear()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert fake_hub.gets(t.filename) == [f"bytes={kept}-"]  # continued, not restarted
    assert final.read_bytes() == small_bytes
    assert not part.exists() and not sidecar.exists()
    assert f"checked: sha256 matches the hub's ({hashlib.sha256(small_bytes).hexdigest()})" in p.stdout


@pytest.mark.parametrize("how", ["remote changed", "sidecar garbage", "sidecar missing"])
def test_part_of_another_remote_file_is_discarded(fake_hub, small_bytes, tmp_path, small_chunks, how):
    old = bytes(b ^ 0x5A for b in small_bytes)  # another version of the file, same size
    _cut_run(fake_hub, tmp_path, old if how == "remote changed" else small_bytes, dir=tmp_path)
    part, sidecar = _part(tmp_path / "small.gguf")
    assert part.stat().st_size > 0
    if how == "sidecar garbage":
        sidecar.write_bytes(b"\xff{not json" * 3)
    elif how == "sidecar missing":
        sidecar.unlink()
    fake_hub.files[(REPO, "small.gguf")] = small_bytes
    r = hub.download(f"{REPO}/small.gguf", dir=tmp_path, progress=False)
    assert fake_hub.gets("small.gguf") == [None]  # the whole file again, from byte 0
    assert r.path.read_bytes() == small_bytes
    assert not part.exists() and not sidecar.exists()


def test_corrupt_part_is_caught_by_sha256_and_deleted(fake_hub, small_bytes, tmp_path, small_chunks, capsys):
    _cut_run(fake_hub, tmp_path, small_bytes, dir=tmp_path)
    part, sidecar = _part(tmp_path / "small.gguf")
    data = bytearray(part.read_bytes())
    data[1000:1010] = bytes(b ^ 0xFF for b in data[1000:1010])  # bit rot in the kept bytes
    part.write_bytes(bytes(data))
    rc, out, err = _cli(["download", f"{REPO}/small.gguf", "--dir", str(tmp_path)], capsys)
    assert rc == 2 and out == ""
    line = _one_error_line(err)
    assert "sha256" in line and "does not match" in line and "deleted" in line
    assert fake_hub.gets("small.gguf") == [f"bytes={len(data)}-"]
    assert not (tmp_path / "small.gguf").exists()
    assert not part.exists() and not sidecar.exists()
    # and the next run downloads it afresh, correctly
    r = hub.download(f"{REPO}/small.gguf", dir=tmp_path, progress=False)
    assert r.path.read_bytes() == small_bytes


def test_file_without_sha256_etag_is_checked_by_size_and_says_so(fake_hub, small_bytes, tmp_path):
    fake_hub.etags["small.gguf"] = "0123456789abcdef0123456789abcdef01234567"  # a git blob id, not LFS
    fake_hub.files[(REPO, "small.gguf")] = small_bytes
    r = hub.download(f"{REPO}/small.gguf", dir=tmp_path, progress=False)
    assert r.path.read_bytes() == small_bytes
    assert "size matches" in r.integrity and "no sha256" in r.integrity


def test_cut_transfer_in_the_hf_cache_resumes_from_the_blob_part(fake_hub, small_bytes, tmp_path, small_chunks):
    _cut_run(fake_hub, tmp_path, small_bytes, name="sub/small.gguf")
    etag = hashlib.sha256(small_bytes).hexdigest()
    blobs = tmp_path / "hf-cache" / f"models--{REPO.replace('/', '--')}" / "blobs"
    part, sidecar = _part(blobs / etag)
    kept = part.stat().st_size
    assert kept > 0 and sidecar.is_file()
    p = hub.resolve_model(f"hf:{REPO}/sub/small.gguf", progress=False)
    assert fake_hub.gets("sub/small.gguf") == [f"bytes={kept}-"]
    assert p.read_bytes() == small_bytes and p.resolve() == (blobs / etag).resolve()
    assert not part.exists() and not sidecar.exists()
    n = len(fake_hub.log)
    assert hub.resolve_model(f"hf:{REPO}/sub/small.gguf", progress=False) == p  # found, no request
    assert len(fake_hub.log) == n


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _block_sigint() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


# started as from a shell's background job (SIGINT ignored) or from a thread that blocks it: the
# download still stops at Ctrl-C (twice a CI run saw a Ctrl-C go unanswered and the run finish)
@pytest.mark.parametrize("start", [None, _ignore_sigint, _block_sigint], ids=["plain", "ignored", "blocked"])
def test_ctrl_c_keeps_the_part_and_the_next_run_resumes(fake_hub, small_bytes, tmp_path, small_chunks, start):
    fake_hub.files[(REPO, "small.gguf")] = small_bytes
    fake_hub.stall_first_get_at = len(small_bytes) // 3
    final = tmp_path / "small.gguf"
    part, sidecar = _part(final)
    cmd, env = _download_cmd([f"{REPO}/small.gguf", "--dir", str(tmp_path)], fake_hub.url, tmp_path)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=start)
    try:
        deadline = time.monotonic() + 60
        while not (part.is_file() and part.stat().st_size >= _SMALL_CHUNKS):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        fake_hub.release.set()
    assert proc.returncode == 130, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "interrupted" in lines[0] and "resume" in lines[0] and str(part) in lines[0]
    assert out == "" and not final.exists() and sidecar.is_file()
    kept = part.stat().st_size
    assert 0 < kept <= len(small_bytes) // 3 and part.read_bytes() == small_bytes[:kept]

    fake_hub.stall_first_get_at = None
    fake_hub.log.clear()
    r = hub.download(f"{REPO}/small.gguf", dir=tmp_path, progress=False)
    assert fake_hub.gets("small.gguf") == [f"bytes={kept}-"]
    assert r.path.read_bytes() == small_bytes and not part.exists()


def test_large_file_is_read_in_bounded_range_windows(fake_hub, small_bytes, tmp_path, monkeypatch):
    # Over 50 GB the hub library refuses one plain request; a smaller window shows the same path here.
    monkeypatch.setattr(hub, "_WINDOW", 1_500_000)
    fake_hub.files[(REPO, "small.gguf")] = small_bytes
    r = hub.download(f"{REPO}/small.gguf", dir=tmp_path, progress=False)
    assert r.path.read_bytes() == small_bytes
    n = len(small_bytes)
    want = [f"bytes={s}-{min(s + 1_500_000, n) - 1}" for s in range(0, n, 1_500_000)]
    want[-1] = f"bytes={want[-1].split('=')[1].split('-')[0]}-"
    assert fake_hub.gets("small.gguf") == want
