"""Getting ds4's published GGUFs from the Hugging Face hub.

ds4 publishes its model files in one hub repository (see ds4's ``download_model.sh``); ``TARGETS``
is that script's table. :func:`download` fetches one of them (or any ``owner/repo/file.gguf``) with
``huggingface_hub.hf_hub_download``, into a chosen folder (``local_dir``) or the HF cache, and
:func:`resolve_model` turns an ``hf:`` model spec into a local path, downloading only when the file
is not already there. ``HF_TOKEN``, ``HF_ENDPOINT``, ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` work as
in every hub client because the hub library reads them.

Why a metadata request before the download: it is the one place where "no network", "no access"
and "no such file" can be told apart and reported as one clear line, and it gives the file size so
a download that cannot fit on the disk is refused before it starts (the hub library only warns).

Resuming: the hub library retries a dropped transfer from where it stopped (HTTP Range) inside one
run, and a completed file is never fetched again; the file only appears under its final name once
complete, so an interrupted run never leaves a truncated file that looks finished.

Nothing here prints: results and failures come back as values and ``HubError``.
"""

from __future__ import annotations

import os
import re
import shutil
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
    kind: str  # "model" (a full DS4 Flash GGUF) or "mtp" (the optional speculative-decoding component)
    about: str

    @property
    def spec(self) -> str:
        return f"{HF_PREFIX}{self.repo}/{self.filename}"


# ds4's download_model.sh, in the order it lists them (the preferred imatrix files first).
TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("q2-imatrix", DS4_REPO, "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix.gguf",
           81, "96 or 128 GB RAM", True, "model", "2-bit routed experts, imatrix (preferred)"),
    Target("q4-imatrix", DS4_REPO,
           "DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2-imatrix.gguf",
           153, "256 GB RAM or more", True, "model", "4-bit routed experts, imatrix (preferred)"),
    Target("q2", DS4_REPO, "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2.gguf",
           81, "96 or 128 GB RAM", False, "model", "2-bit routed experts, legacy (prefer q2-imatrix)"),
    Target("q4", DS4_REPO,
           "DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2.gguf",
           153, "256 GB RAM or more", False, "model", "4-bit routed experts, legacy (prefer q4-imatrix)"),
    Target("mtp", DS4_REPO, "DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf",
           3.5, "any (with a q2/q4 model)", False, "mtp", "optional speculative-decoding (MTP) component"),
)}

# ds4's script recommends the imatrix files and q2 is the one that fits the most machines (96-128 GB).
DEFAULT_TARGET = "q2-imatrix"

_MTP_MARKER_TENSOR = "mtp.0.e_proj.weight"  # one of the tensors ds4 requires in an MTP file
_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class Download:
    """What :func:`download` did: the local file, whether it was fetched now, and its check."""

    target: Target
    path: Path
    size: int
    fetched: bool  # False when the file was already on disk
    check: str  # what the post-download verification found, one line


# -- names ----------------------------------------------------------------------------------------


def parse_target(text: str) -> Target:
    """A table name (``q2-imatrix``) or ``owner/repo/path/file.gguf`` (an ``hf:`` prefix is allowed)."""
    if not isinstance(text, str):
        raise HubError(f"model name must be a string, not {type(text).__name__}")
    raw = text[len(HF_PREFIX):] if text.startswith(HF_PREFIX) else text
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
    """Local path of an ``hf:owner/repo/file.gguf`` or ``hf:q2-imatrix`` model: the file already on
    disk (in ``dir`` or the HF cache), else downloaded there first. Raises HubError."""
    if not isinstance(spec, str) or not spec.startswith(HF_PREFIX):
        raise HubError(f"{spec!r} is not a hub model spec (expected 'hf:owner/repo/file.gguf' or 'hf:q2-imatrix')")
    return download(spec, dir=dir, token=token, progress=progress).path


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
    fetched = False
    if path is None:
        from huggingface_hub import constants as hf_constants

        if _offline():
            raise HubError(f"{t.filename} is not on disk and HF_HUB_OFFLINE is set: unset it to download, "
                           f"or download the file elsewhere and pass its path")
        size = _remote_size(t, token, endpoint)
        if size is not None:
            _check_space(size, local_dir if local_dir is not None else Path(hf_constants.HF_HUB_CACHE),
                         t)
        path = _fetch(t, local_dir, token, progress, endpoint)
        fetched = True
    return Download(t, path, path.stat().st_size, fetched, verify(path, t))


def verify(path: str | os.PathLike, target: Target | None = None) -> str:
    """Open ``path`` as a GGUF (header and tensor directory, by mmap: nothing big is read) and check it
    is a DS4 Flash model (or, for the MTP target, an MTP component). Returns one line saying so."""
    from ds4_mlx.formats.gguf import GGUFFile
    from ds4_mlx.formats.layout import load_model_file

    kind = target.kind if target is not None else "model"
    try:
        if kind == "mtp":
            with GGUFFile(path) as f:
                if _MTP_MARKER_TENSOR not in f.tensors:
                    raise HubError(f"{path}: a GGUF, but not a DS4 MTP component (no {_MTP_MARKER_TENSOR})")
                return f"DS4 MTP GGUF, {len(f.tensors)} tensors"
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


def _remote_size(t: Target, token: str | None, endpoint: str | None) -> int | None:
    """The file's size from the hub's metadata (one HEAD request); also where access problems show."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    url = hf_hub_url(t.repo, t.filename, endpoint=endpoint)
    try:
        meta = get_hf_file_metadata(url, token=token)
    except Exception as exc:  # every hub or transport failure becomes one clear line
        raise _as_hub_error(exc, t, endpoint) from None
    return meta.size


def _check_space(size: int, where: Path, t: Target) -> None:
    probe = where
    while not probe.exists() and probe != probe.parent:  # the folder may not exist yet
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return  # cannot tell: let the download try
    if free < size:
        raise HubError(f"not enough disk space for {t.filename}: it needs {_gb(size)} and {where} has "
                       f"{_gb(free)} free; free some space or choose another folder with --dir")


def _fetch(t: Target, local_dir: Path | None, token: str | None, progress: bool,
           endpoint: str | None) -> Path:
    from huggingface_hub import hf_hub_download

    kwargs = {} if progress else {"tqdm_class": _silent_bar_class()}
    try:
        got = hf_hub_download(t.repo, t.filename, local_dir=local_dir, token=token, endpoint=endpoint, **kwargs)
    except Exception as exc:
        raise _as_hub_error(exc, t, endpoint) from None
    return Path(got)


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
    host = endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    # hf_hub_download reports a failed metadata request as "not found locally", caused by the real error.
    if isinstance(exc, hf_errors.LocalEntryNotFoundError) and exc.__cause__ is not None:
        exc = exc.__cause__
    status = getattr(getattr(exc, "response", None), "status_code", None)

    if isinstance(exc, hf_errors.OfflineModeIsEnabled):
        return HubError(f"{t.filename} is not on disk and HF_HUB_OFFLINE is set: unset it to download, "
                        f"or download the file elsewhere and pass its path")
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


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


__all__ = ["TARGETS", "DEFAULT_TARGET", "Target", "Download", "parse_target", "resolve_model", "download",
           "verify"]
