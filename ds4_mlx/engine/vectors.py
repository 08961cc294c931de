"""ds4's official-vector check (``ds4_test --logprob-vectors``): greedy continuations of a few prompts
compared with what the DeepSeek API answered for them.

The vectors are the API's answers at temperature 0 with thinking disabled and ``top_logprobs=20``
(ds4's ``tests/test-vectors/fetch_official_vectors.py``). The API gives no logits, so a case checks
a short greedy continuation, step by step, as ds4's ``test_logprob_vector_case`` does:

* the prompt is ds4's CLI chat prompt with an empty system text and thinking off
  (``ds4_encode_chat_prompt(engine, "", prompt, DS4_THINK_NONE)``: BOS, User, the prompt as plain
  BPE, Assistant, ``</think>``), prefilled into a session of the case's context size;
* at each step the argmax token's *bytes* must equal the official selected token's bytes (bytes,
  not ids: the API names tokens by text);
* every official top-logprob entry (ds4 keeps those with logprob > -1000 and non-empty bytes, the
  filter of its ``official.vec`` writer) must be among our 20 best by token bytes, with
  |local logprob - official| <= 4.0, both as float32 (ds4 compares with ``fabsf`` on floats; the
  official value is the float its fixture's ``%.9g`` text reads back as);
* then the *argmax* token (ours, not the official one) is fed for the next step, and the case goes
  on after a failed step, so every failing step is reported, as ds4 logs each and carries on.

ds4 skips ``long_memory_archive`` (``test_logprob_vector_case_disabled``: after ds4 adopted the
official Hadamard+FP4 indexer this long case matches the public API less, while the official graph
scores a slightly lower perplexity; ds4 keeps the official graph) for the preview set, and so do
we; its 0731 fixture runs all five.

Sets. The vectors ship in the package, one folder per model checkpoint under
``ds4_mlx/vectors_data/`` (``preview``: the May 2026 DeepSeek V4 Flash the vectors were captured
from; ``0731``: ds4's ``flash-0731`` fixture, captured 2026-08-03 from the API serving 0731). A folder holds ds4's ``manifest.json``, ``prompts/<id>.txt`` and the API's records
``official/<id>.official.json`` (stored as ``.json.xz``; either is read). A manifest entry may give
``ctx``; otherwise the context is ds4's for that id (``CTX_BY_ID``, which its fixture writer uses).
``load_vector_dir`` reads any folder of that layout (the tests write one from the tiny model).

The comparisons (``official_steps``, ``check_step``) are pure functions of the vectors and of our
top scores, separate from the file reading and from the model run.
"""

from __future__ import annotations

import json
import lzma
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds4_mlx.chat.template import ThinkMode, encode_chat_prompt
from ds4_mlx.errors import Ds4Error

SETS_ROOT = Path(__file__).resolve().parents[1] / "vectors_data"
DEFAULT_SET = "preview"
MANIFEST_SCHEMA = "ds4-test-vector-manifest-v1"
RECORD_SCHEMA = "ds4-official-logprobs-v1"
TOP_K = 20  # ds4 asks ds4_session_top_logprobs for 20, the API's top_logprobs
LOGPROB_TOLERANCE = np.float32(4.0)
# ds4's official.vec writer drops entries at or below this (the API's -9999 placeholders)
MIN_OFFICIAL_LOGPROB = -1000.0
# fetch_official_vectors.py's CTX_BY_ID: the session size of each official case
CTX_BY_ID = {
    "short_italian_fact": 16384,
    "short_code_completion": 4096,
    "short_reasoning_plain": 4096,
    "long_memory_archive": 16384,
    "long_code_audit": 16384,
}
# ds4_test.c test_logprob_vector_case_disabled (see the module docstring)
DS4_SKIPPED = {"long_memory_archive": "ds4 skips it: API/official graph mismatch"}
# ds4 skips that case for its pre-0731 fixture only (tests/ds4_test.c, Aug 2026): the 0731 set runs all.
SKIPPED_BY_SET = {"preview": DS4_SKIPPED}


class VectorError(Ds4Error):
    """A vector set that cannot be used: not shipped, a missing or malformed file, an unknown id."""


@dataclass(frozen=True)
class OfficialTop:
    token: bytes
    logprob: float  # the float32 value ds4's test compares


@dataclass(frozen=True)
class OfficialStep:
    selected: bytes
    top: tuple[OfficialTop, ...]


@dataclass(frozen=True)
class VectorCase:
    id: str
    ctx: int
    prompt: str
    steps: tuple[OfficialStep, ...]
    kind: str = ""
    api_prompt_tokens: int | None = None  # the API's usage.prompt_tokens for this prompt, if recorded


@dataclass(frozen=True)
class VectorSet:
    name: str
    model: str
    root: Path
    cases: tuple[VectorCase, ...]
    # the checkpoint the vectors were captured from: the manifest's "checkpoint" (ds4 writes it
    # since its 0731 fixture), "preview" for the earlier manifests that have none
    checkpoint: str = "preview"

    @property
    def skipped(self) -> Mapping[str, str]:
        """The cases ds4 skips for this set's checkpoint, with the reason."""
        return SKIPPED_BY_SET.get(self.checkpoint, {})

    @property
    def ids(self) -> list[str]:
        return [c.id for c in self.cases]

    def select(self, only: Iterable[str] | None) -> tuple[VectorCase, ...]:
        """The cases named by ``only`` (in the set's order), all of them for None."""
        if only is None:
            return self.cases
        wanted = list(only)
        unknown = [i for i in wanted if i not in self.ids]
        if unknown:
            raise VectorError(f"no case {unknown[0]!r} in vector set {self.name!r} (its cases: {', '.join(self.ids)})")
        return tuple(c for c in self.cases if c.id in wanted)


@dataclass(frozen=True)
class Mismatch:
    """One failed check at ``step``: ``kind`` "selected" (our argmax token has other bytes than the
    official choice), "missing" (an official top token is not among our 20 best) or "logprob" (it
    is, more than 4.0 away). ``token``: the official token's bytes; ``local_token``: our argmax
    (selected); the two logprobs where they exist."""

    step: int
    kind: str
    token: bytes
    local_token: bytes | None = None
    local_logprob: float | None = None
    official_logprob: float | None = None

    @property
    def message(self) -> str:
        if self.kind == "selected":
            return f"step {self.step}: selected token mismatch: local {show_bytes(self.local_token)} " \
                   f"official {show_bytes(self.token)}"
        if self.kind == "missing":
            return f"step {self.step}: official top token {show_bytes(self.token)} " \
                   f"(logprob {self.official_logprob:g}) missing from the local top-{TOP_K}"
        return f"step {self.step}: logprob delta too high for {show_bytes(self.token)}: " \
               f"local={self.local_logprob:g} official={self.official_logprob:g}"

    def to_json(self) -> dict:
        return {"step": self.step, "kind": self.kind, "message": self.message,
                "official_bytes": list(self.token),
                "local_bytes": None if self.local_token is None else list(self.local_token),
                "local_logprob": self.local_logprob, "official_logprob": self.official_logprob}


@dataclass(frozen=True)
class VectorResult:
    """One case's outcome: ``status`` "pass", "fail" or "skipped" (``reason`` says why);
    ``chosen``: our argmax token's bytes at each step; ``failures``: every failed check in order;
    ``prompt_tokens``: our prompt's length, ``api_prompt_tokens`` the API's (not a check of ds4's,
    but a differing count points at the template or the tokenizer)."""

    id: str
    ctx: int
    steps: int
    status: str
    prompt_tokens: int = 0
    api_prompt_tokens: int | None = None
    chosen: tuple[bytes, ...] = ()
    failures: tuple[Mismatch, ...] = ()
    reason: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def first_failure(self) -> Mismatch | None:
        return self.failures[0] if self.failures else None

    def to_json(self) -> dict:
        return {"id": self.id, "ctx": self.ctx, "steps": self.steps, "result": self.status,
                "reason": self.reason, "prompt_tokens": self.prompt_tokens,
                "api_prompt_tokens": self.api_prompt_tokens,
                "chosen": [b.decode("utf-8", "backslashreplace") for b in self.chosen],
                "failures": [f.to_json() for f in self.failures]}


def show_bytes(b: bytes | None) -> str:
    """A token for a one-line message: its text quoted when it is UTF-8, else the bytes literal."""
    if b is None:
        return "-"
    try:
        return repr(b.decode("utf-8"))
    except UnicodeDecodeError:
        return repr(b)


# -- the comparisons (pure) ----------------------------------------------------------------------------


def _f32(x: float) -> np.float32:
    return np.float32(x)


def official_logprob(value: float) -> float:
    """The float ds4's test holds for an official logprob: its fixture writes ``%.9g`` of the JSON
    double and ``sscanf("%f")`` reads that text back as a float."""
    return float(_f32(float(format(float(value), ".9g"))))


def _token_bytes(token, where: str) -> bytes:
    raw = token.get("bytes") if isinstance(token, Mapping) else None
    if not isinstance(raw, list) or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 256
                                            for x in raw):
        raise VectorError(f"{where}: token bytes must be a list of integers 0..255")
    return bytes(raw)


def official_steps(record: Mapping, where: str = "record") -> tuple[OfficialStep, ...]:
    """The steps of an official record (``ds4-official-logprobs-v1``) as ds4's fixture keeps them:
    the selected token's bytes and the top entries with logprob > -1000 and non-empty bytes."""
    steps = record.get("steps") if isinstance(record, Mapping) else None
    if not isinstance(steps, list) or not steps:
        raise VectorError(f"{where}: no steps")
    out = []
    for i, step in enumerate(steps):
        at = f"{where}: step {i}"
        if not isinstance(step, Mapping):
            raise VectorError(f"{at}: not an object")
        selected = _token_bytes(step.get("token"), f"{at} token")
        top = []
        alts = step.get("top_logprobs") or []
        if not isinstance(alts, list):
            raise VectorError(f"{at}: top_logprobs is not a list")
        for j, alt in enumerate(alts):
            if not isinstance(alt, Mapping):
                raise VectorError(f"{at} top {j}: not an object")
            lp = alt.get("logprob", -9999)
            if lp is None:  # an API null: no value to hold ours against (the writer's -9999 default)
                lp = -9999
            if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not np.isfinite(lp):
                raise VectorError(f"{at} top {j}: logprob {lp!r} is not a finite number")
            if lp <= MIN_OFFICIAL_LOGPROB:
                continue
            tok = _token_bytes(alt.get("token"), f"{at} top {j}")
            if tok:
                top.append(OfficialTop(tok, official_logprob(lp)))
        out.append(OfficialStep(selected, tuple(top)))
    return tuple(out)


def check_step(index: int, step: OfficialStep, argmax_token: bytes,
               local_top: Sequence[tuple[bytes, float]]) -> list[Mismatch]:
    """ds4's checks of one step: our argmax token's bytes, then each official top entry against
    ``local_top`` (our best ``TOP_K`` as (bytes, logprob), best first; the first entry with the
    official bytes is the one compared, as ds4 takes the first match)."""
    out = []
    if argmax_token != step.selected:
        out.append(Mismatch(index, "selected", step.selected, local_token=argmax_token))
    for top in step.top:
        local = next((lp for tok, lp in local_top if tok == top.token), None)
        if local is None:
            out.append(Mismatch(index, "missing", top.token, official_logprob=top.logprob))
        elif abs(_f32(local) - _f32(top.logprob)) > LOGPROB_TOLERANCE:
            out.append(Mismatch(index, "logprob", top.token, local_logprob=float(_f32(local)),
                                official_logprob=top.logprob))
    return out


# -- the files -----------------------------------------------------------------------------------------


def available_sets() -> list[str]:
    """Names of the vector sets shipped with the package."""
    if not SETS_ROOT.is_dir():
        return []
    return sorted(p.name for p in SETS_ROOT.iterdir() if (p / "manifest.json").is_file())


def load_vector_set(name: str = DEFAULT_SET) -> VectorSet:
    """A shipped vector set by checkpoint name ("preview")."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith("."):
        raise VectorError(f"a vector set is named by its checkpoint (e.g. {DEFAULT_SET!r}), got {name!r}")
    root = SETS_ROOT / name
    if not (root / "manifest.json").is_file():
        have = ", ".join(available_sets()) or "none"
        raise VectorError(f"no vector set {name!r} ships with this ds4-mlx (shipped: {have})")
    return load_vector_dir(root, name=name)


def _read_json(path: Path) -> object:
    """JSON of ``path``, or of ``path.xz`` when only the compressed copy exists."""
    for p, unpack in ((path, False), (path.with_name(path.name + ".xz"), True)):
        if p.is_file():
            try:
                data = p.read_bytes()
                return json.loads(lzma.decompress(data) if unpack else data)
            except (OSError, lzma.LZMAError, ValueError) as exc:
                raise VectorError(f"cannot read {p}: {exc}") from None
    raise VectorError(f"{path} is missing")


def _inside(root: Path, rel, where: str) -> Path:
    if not isinstance(rel, str) or not rel:
        raise VectorError(f"{where}: not a file name")
    path = (root / rel).resolve()
    if root.resolve() not in path.parents:
        raise VectorError(f"{where}: {rel!r} is outside {root}")
    return path


def load_vector_dir(root: str | os.PathLike, *, name: str | None = None) -> VectorSet:
    """A vector set from a folder: ``manifest.json`` (ds4's schema), its prompt files and official
    records (see the module docstring)."""
    root = Path(root)
    if not root.is_dir():
        raise VectorError(f"vector directory {root} does not exist")
    manifest = _read_json(root / "manifest.json")
    where = root / "manifest.json"
    if not isinstance(manifest, Mapping) or manifest.get("schema") != MANIFEST_SCHEMA:
        raise VectorError(f"{where}: not a {MANIFEST_SCHEMA} manifest")
    entries = manifest.get("prompts")
    if not isinstance(entries, list) or not entries:
        raise VectorError(f"{where}: no prompts")
    cases, seen = [], set()
    for k, entry in enumerate(entries):
        at = f"{where}: prompts[{k}]"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("id"), str) or not entry["id"]:
            raise VectorError(f"{at}: an entry needs an id")
        cid = entry["id"]
        if cid in seen:
            raise VectorError(f"{at}: id {cid!r} repeats")
        seen.add(cid)
        ctx = entry.get("ctx", CTX_BY_ID.get(cid))
        if ctx is None:
            raise VectorError(f"{at}: case {cid!r} has no ctx (give one in the entry)")
        if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 2:
            raise VectorError(f"{at}: ctx must be an integer >= 2, got {ctx!r}")
        prompt_path = _inside(root, entry.get("prompt_file"), f"{at} prompt_file")
        try:
            prompt = prompt_path.read_bytes().decode("utf-8")
        except OSError as exc:
            raise VectorError(f"cannot read {prompt_path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise VectorError(f"{prompt_path} is not UTF-8 (byte {exc.start})") from None
        record_path = _inside(root, entry.get("official_file"), f"{at} official_file")
        record = _read_json(record_path)
        if not isinstance(record, Mapping) or record.get("schema") != RECORD_SCHEMA:
            raise VectorError(f"{record_path}: not a {RECORD_SCHEMA} record")
        if record.get("id", cid) != cid:
            raise VectorError(f"{record_path}: holds case {record.get('id')!r}, the manifest says {cid!r}")
        # ds4 prompts the model with the prompt file; the record keeps what the API was sent
        if "prompt" in record and record["prompt"] != prompt:
            raise VectorError(f"{record_path}: its prompt differs from {prompt_path}")
        usage = record.get("usage")
        api_tokens = usage.get("prompt_tokens") if isinstance(usage, Mapping) else None
        cases.append(VectorCase(cid, ctx, prompt, official_steps(record, str(record_path)),
                                kind=str(entry.get("kind", "")),
                                api_prompt_tokens=api_tokens if isinstance(api_tokens, int) else None))
    model = manifest.get("model", "")
    checkpoint = manifest.get("checkpoint", "preview")
    return VectorSet(name or root.name, model if isinstance(model, str) else "", root, tuple(cases),
                     checkpoint if isinstance(checkpoint, str) else "preview")


# -- the run -------------------------------------------------------------------------------------------


def prompt_tokens(engine, case: VectorCase) -> list[int]:
    """ds4_encode_chat_prompt(engine, "", prompt, DS4_THINK_NONE)."""
    return encode_chat_prompt(engine.tokenizer, case.prompt, system="", think=ThinkMode.NONE, ctx=case.ctx)


def run_case(engine, case: VectorCase) -> VectorResult:
    """One case on ``engine`` (``ds4_mlx.load(...)``): see the module docstring."""
    tok = engine.tokenizer
    ids = prompt_tokens(engine, case)
    session = engine.new_session(ctx=case.ctx)
    session.sync(ids)
    chosen, failures = [], []
    for i, step in enumerate(case.steps):
        local_top = [(tok.token_text(s.id), s.logprob) for s in session.top_logprobs(TOP_K)]
        token = session.argmax()
        chosen.append(tok.token_text(token))
        failures += check_step(i, step, chosen[-1], local_top)
        if i + 1 < len(case.steps):
            session.eval(token)  # our choice, not the official one, as ds4 does
    return VectorResult(case.id, case.ctx, len(case.steps), "fail" if failures else "pass",
                        prompt_tokens=len(ids), api_prompt_tokens=case.api_prompt_tokens,
                        chosen=tuple(chosen), failures=tuple(failures))


def run_vectors(engine, cases: VectorSet | Sequence[VectorCase] | None = None, *,
                vector_set: str = DEFAULT_SET, only: Iterable[str] | None = None,
                skip: Mapping[str, str] | None = None,
                on_case: Callable[[VectorCase], None] | None = None) -> list[VectorResult]:
    """Check ``engine`` against vectors: ``cases`` (a ``VectorSet`` or a list of cases; default the
    shipped set ``vector_set``), narrowed to the ids in ``only``. Cases whose id is in ``skip``
    (default: what ds4 skips for that set, ``SKIPPED_BY_SET``) are reported "skipped" with its
    reason, not run. ``on_case(case)``
    is called before each case runs."""
    from ds4_mlx.engine.engine import Engine

    if not isinstance(engine, Engine):
        raise VectorError(f"run_vectors needs the model ds4_mlx.load() returns, got {type(engine).__name__}")
    if cases is None:
        cases = load_vector_set(vector_set)
    if skip is None:
        skip = cases.skipped if isinstance(cases, VectorSet) else DS4_SKIPPED
    if isinstance(cases, VectorSet):
        chosen = cases.select(only)
    else:
        chosen = tuple(cases)
        if only is not None:
            chosen = VectorSet("given", "", Path("."), chosen).select(only)
    results = []
    for case in chosen:
        if case.id in skip:
            results.append(VectorResult(case.id, case.ctx, len(case.steps), "skipped", reason=skip[case.id]))
            continue
        if on_case is not None:
            on_case(case)
        results.append(run_case(engine, case))
    return results


def all_passed(results: Sequence[VectorResult]) -> bool:
    """Every case that ran passed (skipped ones do not count)."""
    return all(r.status != "fail" for r in results)


def summary_line(results: Sequence[VectorResult]) -> str:
    """The totals line, e.g. "3 passed, 1 failed, 1 skipped"."""
    n = {k: sum(r.status == k for r in results) for k in ("pass", "fail", "skipped")}
    return f"{n['pass']} passed, {n['fail']} failed, {n['skipped']} skipped"
