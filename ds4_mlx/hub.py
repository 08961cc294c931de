"""Getting ds4's published GGUFs from the Hugging Face hub.

ds4 publishes its model files in one hub repository (see ds4's ``download_model.sh``); ``TARGETS``
is that script's table. :func:`download` fetches one of them (or any ``owner/repo/file.gguf``) with
huggingface_hub's building blocks, into a chosen folder (``local_dir``) or the HF cache, and
:func:`resolve_model` turns an ``hf:`` model spec into a local path, downloading only when the file
is not already there. ``HF_TOKEN``, ``HF_ENDPOINT``, ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` work as
in every hub client because the hub library reads them.

Why a metadata request before the download: it is the one place where "no network", "no access"
and "no such file" can be told apart and reported as one clear line, and it gives the file size so
a download that cannot fit on the disk is refused before it starts (the hub library only warns).

Resuming across runs (ds4's script does ``curl -C -``; an 81 GB transfer cut at 70 GB must not start
over): ``hf_hub_download`` deletes its uniquely named temporary file when a run fails, so the bytes
go to our own part file instead, ``<dest>.part``, with a sidecar ``<dest>.part.json`` naming the
remote file it belongs to (etag, commit, size). The next run asks the hub again and continues the
part with an HTTP Range request when the etag and size still match, or discards it when the remote
file changed. The transfer itself is the hub library's ``http_get`` (its session, retries inside a
run, auth headers from ``build_hf_headers``, so HF_TOKEN and the saved login work as everywhere).
With ``--dir`` the part sits next to the final file. In the HF cache it is ``blobs/<etag>.part``:
the etag names the content, so a part can never be continued with another file's bytes, it is on
the same volume as the finished blob (the final rename is atomic), and deleting the repository from
the cache (``hf cache delete``) takes it along.

Integrity: the finished part is checked before it gets its final name. For LFS files the hub's
etag is the file's sha256, so the whole file is hashed and compared (minutes for 81 GB); a mismatch
deletes the part. Files without a sha256 etag get a size check only, and the result says so.

The file only appears under its final name once complete and checked, so an interrupted run never
leaves a truncated file that looks finished; a completed file is never fetched again.

Nothing here prints except the progress bars asked for with ``progress=True`` (on stderr): results
and failures come back as values, ``HubError``, and ``DownloadInterrupted`` for Ctrl-C.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ds4_mlx.errors import Ds4Error, HubError

HF_PREFIX = "hf:"
DS4_REPO = "antirez/deepseek-v4-gguf"


@dataclass(frozen=True)
class Target:
    """One downloadable file: where it lives on the hub and what it is for."""

    name: str
    repo: str
    filename: str
    approx_gb: float  # decimal GB on disk, as ds4's script states it; the hub's metadata has the exact size
    hardware: str
    recommended: bool
    kind: str  # "model" (a full DS4 Flash GGUF), or a drafter: "mtp" (the preview's), "dspark" (0731's)
    about: str

    @property
    def spec(self) -> str:
        return f"{HF_PREFIX}{self.repo}/{self.filename}"


# ds4's download_model.sh (its DeepSeek V4 Flash rows, Sep 2026), in the order it lists them: the Flash
# 0731 files first, then the preview (May 2026) files under names that say they are legacy. Sizes are
# the script's "about N GB"; the hub's metadata has the exact byte counts (checked on download).
_F0731 = "DeepSeek-V4-Flash-{}-0731.gguf"
_PREVIEW = "DeepSeek-V4-Flash-{}.gguf"
_Q2 = "IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2"
_Q4 = "Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2"
_MXFP4 = "MXFP4Experts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2"
_Q2Q4 = "Layers37-42Q4KExperts-OtherExpertLayersIQ2XXSGateUp-Q2KDown-AProjQ8-SExpQ8-OutQ8-chat-v2"
TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("ds4f-q2", DS4_REPO, _F0731.format(f"{_Q2}-imatrix"), 81, "96 or 128 GB RAM", True, "model",
           "Flash 0731, IQ2_XXS gate/up + Q2_K down routed experts (ds4's default)"),
    Target("ds4f-q2-q4", DS4_REPO, _F0731.format(f"{_Q2Q4}-imatrix-fixed"), 98, "128 GB RAM", True, "model",
           "Flash 0731, q2 routed experts with the last six layers (37-42) at Q4_K"),
    Target("ds4f-q4", DS4_REPO, _F0731.format(f"{_Q4}-imatrix"), 153, "256 GB RAM or more", True, "model",
           "Flash 0731, Q4_K routed experts"),
    Target("ds4f-mxfp4", DS4_REPO, _F0731.format(f"{_MXFP4}-mxfp4"), 156, "256 GB RAM or more", True, "model",
           "Flash 0731, DeepSeek's released MXFP4 routed experts (not requantized)"),
    Target("ds4f-dspark", DS4_REPO, "DeepSeek-V4-Flash-DSpark-support-0731.gguf", 6,
           "any (with a Flash 0731 model)", False, "dspark",
           "optional DSpark speculative-decoding drafter for Flash 0731"),
    Target("preview-q2-imatrix", DS4_REPO, _PREVIEW.format(f"{_Q2}-imatrix"), 81, "96 or 128 GB RAM", False,
           "model", "legacy: Flash preview (May 2026), q2 routed experts"),
    Target("preview-q2-q4-imatrix", DS4_REPO, _PREVIEW.format(f"{_Q2Q4}-imatrix-fixed"), 98, "128 GB RAM",
           False, "model", "legacy: Flash preview, q2 with layers 37-42 at Q4_K"),
    Target("preview-q4-imatrix", DS4_REPO, _PREVIEW.format(f"{_Q4}-imatrix"), 153, "256 GB RAM or more", False,
           "model", "legacy: Flash preview, Q4_K routed experts"),
    Target("preview-q2", DS4_REPO, _PREVIEW.format(_Q2), 81, "96 or 128 GB RAM", False, "model",
           "legacy: Flash preview, q2 without imatrix"),
    Target("preview-q4", DS4_REPO, _PREVIEW.format(_Q4), 153, "256 GB RAM or more", False, "model",
           "legacy: Flash preview, Q4_K without imatrix"),
    Target("preview-mtp", DS4_REPO, "DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf", 3.5,
           "any (with a preview model)", False, "mtp", "legacy: the preview's one-step MTP drafter"),
)}

# The names this table had before the 0731 files (scripts and notebooks written against them keep
# working; they name the same preview files as before, never silently a different checkpoint).
ALIASES: dict[str, str] = {"q2-imatrix": "preview-q2-imatrix", "q4-imatrix": "preview-q4-imatrix",
                           "q2": "preview-q2", "q4": "preview-q4", "mtp": "preview-mtp"}

# ds4's default target since August (its script and docs/MODELS.md): the 0731 q2, which fits the most
# machines (96-128 GB).
DEFAULT_TARGET = "ds4f-q2"

_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# One HTTP request covers at most this many bytes: huggingface_hub's http_get refuses a plain request
# for a file over 50 GB (its CDN limit), and a bounded Range is how it expects larger files to be read.
_WINDOW = 8 * 1000**3
_HASH_BLOCK = 16 * 1024 * 1024
_SIDECAR_VERSION = 1


@dataclass(frozen=True)
class Download:
    """What :func:`download` did: the local file, whether it was fetched now, and its check."""

    target: Target
    path: Path
    size: int
    fetched: bool  # False when the file was already on disk
    check: str  # what the post-download verification found, one line
    integrity: str = ""  # how the bytes were checked against the hub (sha256 or size), one line; "" if not fetched now


class DownloadInterrupted(KeyboardInterrupt):
    """Ctrl-C during a download: the part file and its sidecar stay, and the same call resumes them.
    A KeyboardInterrupt, so code that does not know about it still stops as it would on Ctrl-C."""

    def __init__(self, target: "Target", part: Path, have: int, size: int):
        super().__init__(f"download of {target.filename} interrupted at {have} of {size} bytes; {part} is kept")
        self.target, self.part, self.have, self.size = target, part, have, size


# -- names ----------------------------------------------------------------------------------------


def parse_target(text: str) -> Target:
    """A table name (``ds4f-q2``, or an old name from ``ALIASES``) or ``owner/repo/path/file.gguf`` (an ``hf:`` prefix is allowed)."""
    if not isinstance(text, str):
        raise HubError(f"model name must be a string, not {type(text).__name__}")
    raw = text[len(HF_PREFIX):] if text.startswith(HF_PREFIX) else text
    raw = ALIASES.get(raw, raw)
    if raw in TARGETS:
        return TARGETS[raw]
    parts = raw.split("/")
    if len(parts) < 3 or not all(parts):
        names = ", ".join(TARGETS)
        raise HubError(f"{text!r} is neither a known model ({names}) nor 'owner/repo/file.gguf'")
    for part in parts:
        if not _SEGMENT.fullmatch(part) or part in (".", ".."):
            raise HubError(f"{text!r}: bad path segment {part!r} (letters, digits, '.', '_', '-' only)")
    if not parts[-1].lower().endswith(".gguf"):
        raise HubError(f"{text!r}: not a .gguf file")
    repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
    for t in TARGETS.values():  # a table file named in full keeps its kind (the MTP file is not a model)
        if (t.repo, t.filename) == (repo, filename):
            return t
    return Target(f"{repo}/{filename}", repo, filename, 0, "unknown", False, "model", "")


def resolve_model(spec: str, *, dir: str | os.PathLike | None = None, token: str | None = None,
                  progress: bool = True) -> Path:
    """Local path of an ``hf:owner/repo/file.gguf`` or ``hf:ds4f-q2`` model: the file already on
    disk (in ``dir`` or the HF cache), else downloaded there first. Raises HubError."""
    if not isinstance(spec, str) or not spec.startswith(HF_PREFIX):
        raise HubError(f"{spec!r} is not a hub model spec (expected 'hf:owner/repo/file.gguf' or 'hf:ds4f-q2')")
    t = parse_target(spec)
    if t.kind != "model":  # before 6 GB are fetched only to fail as "not a DS4 Flash GGUF"
        raise HubError(f"{spec}: {t.name} is a speculative-decoding drafter ({t.kind}), not a model to load")
    return download(t, dir=dir, token=token, progress=progress).path


# -- download -------------------------------------------------------------------------------------


def download(target: Target | str, dir: str | os.PathLike | None = None, token: str | None = None,
             progress: bool = True, *, endpoint: str | None = None) -> Download:
    """Fetch ``target`` into ``dir`` (the file keeps its hub name there) or the HF cache, unless it is
    already there, then check that it is what it claims to be. ``token`` overrides HF_TOKEN;
    ``endpoint`` overrides HF_ENDPOINT. Every failure is a one-line HubError."""
    t = target if isinstance(target, Target) else parse_target(target)
    local_dir = None if dir is None else Path(dir).expanduser()
    if local_dir is not None and local_dir.exists() and not local_dir.is_dir():
        raise HubError(f"--dir {local_dir}: exists and is not a directory")
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None

    path = _already_here(t, local_dir)
    fetched, integrity = False, ""
    if path is None:
        if _offline():
            raise _offline_error(t)
        remote = _remote(t, token, endpoint)
        path, integrity = _fetch(t, remote, local_dir, token, progress, endpoint)
        fetched = True
    return Download(t, path, path.stat().st_size, fetched, verify(path, t), integrity)


def _verify_drafter(path, want) -> str:
    """A drafter download: the kind ds4 recognises [support_model_detect] and its layout checked
    against the dims its own tensors imply (the target is not known here)."""
    from ds4_mlx.errors import DrafterError
    from ds4_mlx.formats.drafter_layout import DrafterKind, drafter_kind, validate_drafter_file
    from ds4_mlx.formats.gguf import GGUFFile

    what = "a DS4 MTP component" if want is DrafterKind.MTP else "a DSpark drafter"
    with GGUFFile(path) as f:
        try:
            found = drafter_kind(f)
        except DrafterError as exc:
            why = _one_line(exc).removeprefix(f"{f.path}: ")
            raise HubError(f"{path}: a GGUF, but not {what} ({why})") from None
        if found is not want:
            raise HubError(f"{path}: a GGUF, but not {what} (it is {found.title})")
        _, n = validate_drafter_file(f, found)
    return f"{'DS4 MTP' if want is DrafterKind.MTP else 'DSpark drafter'} GGUF, layout OK ({n} tensors checked)"


def verify(path: str | os.PathLike, target: Target | None = None) -> str:
    """Open ``path`` as a GGUF (header and tensor directory, by mmap: nothing big is read) and check it
    is a DS4 Flash model (or, for a drafter target, that drafter with a consistent layout). Returns one
    line saying so."""
    from ds4_mlx.formats.drafter_layout import DrafterKind
    from ds4_mlx.formats.layout import load_model_file

    kind = target.kind if target is not None else "model"
    try:
        if kind in ("mtp", "dspark"):
            return _verify_drafter(path, DrafterKind(kind))
        f, cfg, report = load_model_file(path)
        with f:
            return (f"DS4 Flash GGUF, layout OK ({report.n_checked} tensors checked), "
                    f"{report.routed_quant_bits}-bit routed experts")
    except HubError:
        raise
    except Ds4Error as exc:
        raise HubError(f"{path} is on disk but is not a usable DS4 GGUF ({_one_line(exc)}); "
                       f"delete it and download again") from None


def _already_here(t: Target, local_dir: Path | None) -> Path | None:
    """The complete file if a previous run left it (no network). Partial transfers live under
    temporary names until complete, so a file under the final name is a finished one."""
    if local_dir is not None:
        p = local_dir / t.filename
        return p if p.is_file() else None
    from huggingface_hub import try_to_load_from_cache

    hit = try_to_load_from_cache(t.repo, t.filename)
    return Path(hit) if isinstance(hit, str) and Path(hit).is_file() else None


def _offline() -> bool:
    from huggingface_hub import constants as hf_constants

    check = getattr(hf_constants, "is_offline_mode", None)
    return bool(check() if check is not None else hf_constants.HF_HUB_OFFLINE)


@dataclass(frozen=True)
class _Remote:
    """The exact remote file a part belongs to: the hub's metadata for it."""

    etag: str  # sha256 for LFS files, git blob sha1 otherwise
    commit: str
    size: int

    def matches(self, sidecar: dict) -> bool:
        # The etag names the content, so a new commit that left this file alone keeps the part valid.
        return (sidecar.get("version") == _SIDECAR_VERSION and sidecar.get("etag") == self.etag
                and sidecar.get("size") == self.size)


def _remote(t: Target, token: str | None, endpoint: str | None) -> _Remote:
    """The file's etag, commit and size from the hub (one HEAD request); also where access problems show."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    url = hf_hub_url(t.repo, t.filename, endpoint=endpoint)
    try:
        meta = get_hf_file_metadata(url, token=token)
    except Exception as exc:  # every hub or transport failure becomes one clear line
        raise _as_hub_error(exc, t, endpoint) from None
    host = _host(endpoint)
    missing = [name for name, v in (("ETag", meta.etag), ("X-Repo-Commit", meta.commit_hash), ("size", meta.size))
               if not v and v != 0]
    if missing:
        raise HubError(f"{host} gave no {'/'.join(missing)} for {t.repo}/{t.filename}: it does not answer like a "
                       f"Hugging Face hub (check HF_ENDPOINT and any proxy)")
    if not re.fullmatch(r"[0-9A-Za-z._-]{1,128}", meta.etag):  # it becomes a file name in the HF cache
        raise HubError(f"{host} gave an unusable ETag {meta.etag[:80]!r} for {t.repo}/{t.filename}")
    return _Remote(meta.etag, meta.commit_hash, int(meta.size))


def _check_space(size: int, where: Path, t: Target) -> None:
    probe = where
    while not probe.exists() and probe != probe.parent:  # the folder may not exist yet
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return  # cannot tell: let the download try
    if free < size:
        raise HubError(f"not enough disk space for {t.filename}: it needs {_gb(size)} more and {where} has "
                       f"{_gb(free)} free; free some space or choose another folder with --dir")


def _fetch(t: Target, remote: _Remote, local_dir: Path | None, token: str | None, progress: bool,
           endpoint: str | None) -> tuple[Path, str]:
    """Download into the part file (continuing it when it belongs to ``remote``), check it, and give it
    its final name. Returns (final path, integrity line)."""
    from huggingface_hub import constants as hf_constants

    if local_dir is not None:
        final = local_dir / t.filename
        blob = final
    else:  # the HF cache layout: blobs/<etag> holds the bytes, snapshots/<commit>/<file> links to it
        storage = Path(hf_constants.HF_HUB_CACHE) / ("models--" + t.repo.replace("/", "--"))
        blob = storage / "blobs" / remote.etag
        final = storage / "snapshots" / remote.commit / t.filename
    part = blob.with_name(blob.name + ".part")
    sidecar = part.with_name(part.name + ".json")
    try:
        part.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HubError(f"cannot create {part.parent}: {exc.strerror or exc}") from None

    if blob.is_file() and blob.stat().st_size == remote.size:
        integrity = "already complete in the cache"  # a previous run stopped before linking it
    else:
        integrity = _fill_part(t, remote, part, sidecar, token, progress, endpoint)
        os.replace(part, blob)
        sidecar.unlink(missing_ok=True)
    if blob != final:
        _link_in_cache(blob, final, storage, remote.commit)
    return final, integrity


def _fill_part(t: Target, remote: _Remote, part: Path, sidecar: Path, token: str | None, progress: bool,
               endpoint: str | None) -> str:
    """Bring ``part`` to the whole remote file and check it. Holds an exclusive lock on the part so two
    runs cannot append to it at once."""
    kept = part.stat().st_size if part.is_file() and remote.matches(_read_sidecar(sidecar)) else 0
    _check_space(remote.size - min(kept, remote.size), part.parent, t)  # before anything is written
    try:
        f = open(part, "a+b")  # append mode: every write lands at the end, where the Range continues
    except OSError as exc:
        raise HubError(f"cannot write {part}: {exc.strerror or exc}") from None
    with f:
        _lock(f, part, t)
        have = f.seek(0, os.SEEK_END)
        if have and (not remote.matches(_read_sidecar(sidecar)) or have > remote.size):
            # The part is of another version of the file (or of unknown origin): its bytes are useless.
            f.truncate(0)
            have = 0
        _write_sidecar(sidecar, t, remote)
        try:
            if have < remote.size:
                _transfer(t, remote, f, have, token, progress, endpoint)
            f.flush()
            integrity = _check_bytes(t, remote, f, part, sidecar, progress)
        except KeyboardInterrupt:
            f.flush()
            raise DownloadInterrupted(t, part, f.seek(0, os.SEEK_END), remote.size) from None
    return integrity


def _lock(f, part: Path, t: Target) -> None:
    try:
        import fcntl
    except ImportError:  # no advisory locks on this platform: one download at a time is then up to the user
        return
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise HubError(f"another download of {t.filename} is writing {part}: wait for it to finish") from None


def _read_sidecar(sidecar: Path) -> dict:
    try:
        data = json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_sidecar(sidecar: Path, t: Target, remote: _Remote) -> None:
    data = {"version": _SIDECAR_VERSION, "repo": t.repo, "filename": t.filename, "etag": remote.etag,
            "commit": remote.commit, "size": remote.size}
    tmp = sidecar.with_name(sidecar.name + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, sidecar)
    except OSError as exc:
        raise HubError(f"cannot write {sidecar}: {exc.strerror or exc}") from None


def _transfer(t: Target, remote: _Remote, f, have: int, token: str | None, progress: bool,
              endpoint: str | None) -> None:
    """Append bytes ``have..size`` of the remote file to ``f`` with the hub library's http_get, one
    bounded Range window at a time. The URL names the commit, so every window reads the same file
    even if the branch moves meanwhile."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(t.repo, t.filename, revision=remote.commit, endpoint=endpoint)
    headers = build_hf_headers(token=token)
    with _quiet_retries(), _ctrl_c_sticks() as pressed:
        _transfer_windows(t, remote, f, have, url, headers, _bar_class(progress, pressed), endpoint, pressed)


class _DropRetryWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and record.getMessage().startswith("Error while downloading"))


@contextlib.contextmanager
def _quiet_retries():
    """http_get logs a multi-line warning on each dropped connection it retries; a retry that works
    needs no words, and one that fails becomes our one-line HubError, so these are dropped (only
    these, only while our transfer runs)."""
    from huggingface_hub.file_download import logger

    flt = _DropRetryWarnings()
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


@contextlib.contextmanager
def _ctrl_c_sticks():
    """Within the block Ctrl-C raises KeyboardInterrupt as usual, and also sets the yielded event,
    which the transfer checks after every chunk and window: a KeyboardInterrupt that some layer
    of the HTTP stack turns into a "dropped connection" and retries (the hub library resumes
    dropped transfers itself) still stops the download. SIGINT is also unblocked and handled
    here even when the process was started with it ignored or blocked (a download's Ctrl-C must
    work). Off the main thread (no signal handlers there) the event is never set."""
    import signal
    import threading

    pressed = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield pressed
        return

    def handler(signum, frame):
        pressed.set()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def _transfer_windows(t: Target, remote: _Remote, f, have: int, url: str, headers: dict, bar,
                      endpoint: str | None, pressed=None) -> None:
    from huggingface_hub.file_download import http_get

    barren = 0  # transport failures in a row that brought no bytes
    while have < remote.size:
        if pressed is not None and pressed.is_set():
            raise KeyboardInterrupt
        end = min(have + _WINDOW, remote.size)
        # http_get turns resume_size into "Range: bytes=<have>-", keeping the end given here; the last
        # window is open-ended like curl -C -, and a window starting at 0 covering the file is a plain GET.
        window = dict(headers) if end == remote.size else {**headers, "Range": f"bytes=0-{end - 1}"}
        try:
            http_get(url, f, resume_size=have, headers=window, expected_size=end,
                     displayed_filename=t.filename, tqdm_class=bar)
        except HubError:
            raise
        except Exception as exc:
            f.flush()
            now = f.seek(0, os.SEEK_END)
            # A dropped connection: continue from the bytes kept. http_get does this itself since
            # huggingface_hub 1.20; older versions raise, and this keeps the run going. Progress resets
            # the count; a few failures in a row that bring nothing are final.
            if isinstance(exc, _network_error_types()) and now < end and (now > have or barren < 2):
                barren = 0 if now > have else barren + 1
                have = now
                time.sleep(0 if barren == 0 else 1)
                continue
            raise _as_hub_error(exc, t, endpoint) from None
        if pressed is not None and pressed.is_set():
            raise KeyboardInterrupt  # pressed during a window the HTTP stack then finished anyway
        have = f.seek(0, os.SEEK_END)
        if have != end:
            raise HubError(f"download of {t.repo}/{t.filename} stopped at byte {have} instead of {end}: "
                           f"run the same command again to resume")


def _check_bytes(t: Target, remote: _Remote, f, part: Path, sidecar: Path, progress: bool) -> str:
    """Compare the finished part with the hub's etag (its sha256 for LFS files) before it is renamed.
    A mismatch deletes the part: resuming it could never give the right file."""
    size = f.seek(0, os.SEEK_END)
    if size != remote.size:
        _discard(part, sidecar)
        raise HubError(f"{t.filename}: downloaded {size} bytes but the hub says {remote.size}; the partial "
                       f"file was deleted, run the same command again to download it afresh")
    if not _SHA256.fullmatch(remote.etag):
        return f"size matches the hub's ({remote.size} bytes); the hub gives no sha256 for this file (not LFS)"
    h = hashlib.sha256()
    f.seek(0)
    with _bar_class(progress)(total=size, unit="B", unit_scale=True,
                              desc="checking sha256 (minutes for a large file)") as bar:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
            bar.update(len(block))
    if h.hexdigest() != remote.etag:
        _discard(part, sidecar)
        raise HubError(f"{t.filename}: sha256 {h.hexdigest()[:16]}... does not match the hub's "
                       f"{remote.etag[:16]}...; the corrupt partial file was deleted, run the same command "
                       f"again to download it afresh")
    return f"sha256 matches the hub's ({remote.etag})"


def _discard(part: Path, sidecar: Path) -> None:
    part.unlink(missing_ok=True)
    sidecar.unlink(missing_ok=True)


def _link_in_cache(blob: Path, pointer: Path, storage: Path, commit: str) -> None:
    """Make the finished blob visible the way every hub client looks for it: the snapshot link and the
    ref of the branch we resolved (``main``), as in the hub library's cache layout."""
    try:
        pointer.parent.mkdir(parents=True, exist_ok=True)
        if not pointer.exists():
            try:
                pointer.unlink(missing_ok=True)  # a dangling link left by a deleted blob
                pointer.symlink_to(os.path.relpath(blob, pointer.parent))
            except OSError:  # no symlinks here: the snapshot holds the file itself
                os.replace(blob, pointer)
        ref = storage / "refs" / "main"
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    except OSError as exc:
        raise HubError(f"cannot place the finished file in the HF cache at {pointer}: {exc.strerror or exc}") \
            from None


def _bar_class(progress: bool, pressed=None):
    """The progress bar class for http_get and the sha256 check: the hub library's own bar (it honours
    HF_HUB_DISABLE_PROGRESS_BARS) that clears itself when done, so the window bars follow each other
    on one line; or one that never draws. With ``pressed`` (see ``_ctrl_c_sticks``) every update
    after a Ctrl-C raises KeyboardInterrupt again."""
    if not progress:
        base = _silent_bar_class()
    else:
        from huggingface_hub.utils import tqdm as hf_tqdm

        class base(hf_tqdm):
            def __init__(self, *args, **kwargs):
                kwargs["leave"] = False
                super().__init__(*args, **kwargs)

    if pressed is None:
        return base

    class Bar(base):
        def update(self, n=1):
            if pressed.is_set():
                raise KeyboardInterrupt
            return super().update(n)

    return Bar


def _silent_bar_class():
    from tqdm import tqdm

    class SilentBar(tqdm):
        """A progress bar that never draws (``progress=False``), without touching the hub library's
        process-wide progress-bar switch."""

        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return SilentBar


# -- errors ---------------------------------------------------------------------------------------


def _network_error_types() -> tuple[type[BaseException], ...]:
    """Transport failures of whichever HTTP stack this huggingface_hub uses (httpx2, httpx, requests)."""
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for mod, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                       ("requests.exceptions", ("ConnectionError", "Timeout"))):
        try:
            m = __import__(mod, fromlist=list(names))
        except ImportError:
            continue
        types += [getattr(m, n) for n in names if isinstance(getattr(m, n, None), type)]
    return tuple(types)


def _as_hub_error(exc: BaseException, t: Target, endpoint: str | None) -> HubError:
    """One line saying what failed and what to do, for any error the hub library raises."""
    from huggingface_hub import errors as hf_errors

    what = f"{t.repo}/{t.filename}"
    host = _host(endpoint)
    # hf_hub_download reports a failed metadata request as "not found locally", caused by the real error.
    if isinstance(exc, hf_errors.LocalEntryNotFoundError) and exc.__cause__ is not None:
        exc = exc.__cause__
    status = getattr(getattr(exc, "response", None), "status_code", None)

    if isinstance(exc, hf_errors.OfflineModeIsEnabled):
        return _offline_error(t)
    if isinstance(exc, hf_errors.GatedRepoError):
        return HubError(f"{t.repo} is gated: accept its terms at https://huggingface.co/{t.repo} and set HF_TOKEN "
                        f"(or --token) to a token of that account")
    if isinstance(exc, hf_errors.RepositoryNotFoundError):
        return HubError(f"repository {t.repo} not found on {host} (HTTP {status}), or it is private and "
                        f"HF_TOKEN/--token has no access to it")
    if isinstance(exc, (hf_errors.EntryNotFoundError, hf_errors.RevisionNotFoundError)) or status == 404:
        return HubError(f"{what} not found on {host} (HTTP 404): check the file name "
                        f"(`ds4-mlx download --list` shows ds4's files)")
    if status == 401:
        return HubError(f"{host} refused {what} (HTTP 401): the token is missing or invalid; "
                        f"set HF_TOKEN or pass --token")
    if status == 403:
        return HubError(f"{host} refused {what} (HTTP 403): this token has no access to {t.repo}; "
                        f"use a token with read access (HF_TOKEN or --token)")
    if status is not None:
        return HubError(f"{host} answered HTTP {status} for {what}: try again later, or download the file "
                        f"elsewhere and pass its path")
    if isinstance(exc, _network_error_types()):
        return HubError(f"cannot reach {host} to download {what} ({_one_line(exc) or type(exc).__name__}): "
                        f"check the network and proxy, set HF_HUB_OFFLINE=1 to use only files already on disk, "
                        f"or download the file elsewhere and pass its path")
    if isinstance(exc, OSError) and exc.errno is not None and exc.errno == 28:
        return HubError(f"disk full while downloading {what}: free some space or choose another folder with --dir")
    return HubError(f"download of {what} failed: {type(exc).__name__}: {_one_line(exc)}")


def _offline_error(t: Target) -> HubError:
    return HubError(f"{t.filename} is not on disk and HF_HUB_OFFLINE is set: unset it to download, "
                    f"or download the file elsewhere and pass its path")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _host(endpoint: str | None) -> str:
    """The hub named in messages: ``endpoint`` (download() fills it from HF_ENDPOINT), else huggingface.co."""
    return endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


__all__ = ["TARGETS", "DEFAULT_TARGET", "Target", "Download", "DownloadInterrupted", "parse_target",
           "resolve_model", "download", "verify"]
