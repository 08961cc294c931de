"""Speculative decoding (engine/speculative.py, engine/drafter.py, ModelCache.rollback) on the oracle's tiny
model: the output equals plain decoding's (ds4-cpu: every logit row the loop chose from, bit for bit, and
ds4's golden rows where dumped; default: the same tokens), the cache rolled back into a verify chunk is
bit for bit the plain one (across ratio-4 and ratio-128 windows and the raw ring's edge; the tiny model has
n_swa 32), snapshots / payloads / the disk cache never hold a draft, and bad drafts or options fail clearly.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import ds4_mlx
from ds4_mlx.engine.disk_cache import DiskCache
from ds4_mlx.engine.drafter import Drafter, ScriptedDrafter
from ds4_mlx.engine.kvstore_policy import KVStoreOptions
from ds4_mlx.engine.speculative import DraftLength, check_draft_k, load_drafter
from ds4_mlx.errors import DraftError, InferenceError
from ds4_mlx.engine.session import Session

from oracle_golden import Logits, golden_json, row_sha256

CASES = ("raw_short", "chat_nothink", "dev_long")


@pytest.fixture(scope="module")
def cpu(tiny_model_path):
    return ds4_mlx.load(tiny_model_path, numerics="ds4-cpu")


@pytest.fixture(scope="module")
def dflt(tiny_model_path):
    return ds4_mlx.load(tiny_model_path)


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32)


def same_bits(a, b) -> bool:
    return bits(a).shape == bits(b).shape and bool(np.array_equal(bits(a), bits(b)))


def prompt_session(eng, tokens, ctx=2048):
    """A session holding ``tokens`` and a kept snapshot of them, so each generation from it reuses the
    prefill (sync restores the snapshot)."""
    s = eng.new_session(ctx)
    s.sync(tokens)
    s.snapshot(keep=True)
    return s


def run(eng, session, prompt, n, **kw):
    """generate's tokens and the logits rows it chose every token from (a recording logits processor)."""
    rows = []

    def record(generated, logits):
        rows.append(np.array(logits, copy=True))
        return logits

    res = ds4_mlx.generate(eng, prompt, max_tokens=n, session=session, logits_processors=[record], **kw)
    return res, rows


# -- the cache rolled back into a verify chunk ---------------------------------------------------------


@pytest.mark.parametrize("p0,L", [(125, 5),   # crosses the ratio-128 window end (127) and ratio-4 ones
                                  (29, 6)])   # crosses the raw ring's edge (n_swa = 32) and 32 = 8·4
def test_rollback_state_is_plain_decodings(cpu, p0, L):
    """For every cut of a verify chunk: the rolled-back cache's every state array equals the cache plain
    decoding of the kept tokens has, bit for bit, and the chunk's logits rows equal the decode steps'."""
    net = cpu.network
    toks = np.random.default_rng(p0).integers(0, 5000, p0 + L).tolist()
    r = Session(net, 4096)
    r.append(toks[:p0])
    mark = r.state.mark()
    plain_states, plain_logits = [r.state.state], []
    for t in toks[p0:]:
        r.eval(t)
        plain_states.append(r.state.state)
        plain_logits.append(r.logits())
    logits, H, post = net.forward_verify(np.array(toks[p0:]), mark)
    assert H.shape == (L, net.config.n_hc, net.config.n_embd)
    for i in range(L):
        assert same_bits(logits[i], plain_logits[i]), i
    for n_keep in range(p0, p0 + L + 1):
        c = post.copy()
        c.rollback(mark, n_keep)
        assert c.n_tokens == n_keep
        got, want = c.state, plain_states[n_keep - p0]
        assert len(got) == len(want)
        assert all(same_bits(a, b) for a, b in zip(got, want)), n_keep
    # the mark itself is untouched, and a cache whose last call was not a verify refuses
    assert all(same_bits(a, b) for a, b in zip(mark.state, plain_states[0]))
    with pytest.raises(InferenceError, match="recording chunk"):
        r.state.rollback(mark, p0 + 1)


def test_default_numerics_chunk_rows_are_the_compiled_steps_up_to_rounding(dflt):
    """Default numerics: plain decoding runs the compiled one-token step, a verify the chunk path; their
    logits differ by BLAS rounding only (measured ~5e-6 on the tiny model)."""
    net = dflt.network
    toks = np.random.default_rng(9).integers(0, 5000, 45).tolist()
    r = Session(net, 4096)
    r.append(toks[:40])
    mark = r.state.mark()
    steps = []
    for t in toks[40:]:
        r.eval(t)
        steps.append(r.logits())
    logits = np.asarray(net.forward_verify(np.array(toks[40:]), mark)[0])
    for i, row in enumerate(steps):
        assert np.abs(logits[i] - row).max() < 1e-3 and int(np.argmax(logits[i])) == int(np.argmax(row)), i


class _HiddenRecorder(ScriptedDrafter):
    """A scripted drafter that wants the target's rows and keeps what ``accept`` gave it."""

    wants_hidden = True

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = []

    def accept(self, tokens, hidden):
        self.calls.append((list(tokens), hidden))
        super().accept(tokens, hidden)

    def propose(self, k):
        # like an MTP head: nothing to draft from until a row came
        return super().propose(k) if any(h is not None for _, h in self.calls) else []


def test_hidden_rows_are_the_rows_that_chose_each_token(cpu):
    """The protocol's convention: hidden[i] is the target's last-block output at the position before
    tokens[i], so the output head on it gives the logits that chose tokens[i] (greedy: its argmax)."""
    g = golden_json("raw_short")
    prompt, want = g["prompt_tokens"], g["greedy_generated"]
    # all drafts right (with wrong ones the timed draft length may back off to plain steps on a busy
    # machine, leaving too few rows to check)
    d = _HiddenRecorder(prompt + want, 0.0, seed=2, n_vocab=cpu.config.n_vocab)
    res = ds4_mlx.generate(cpu, prompt, max_tokens=12, temperature=0, draft=d)
    assert res.tokens == want[:12] and res.stats.drafted_tokens > 0
    net, n = cpu.network, 0
    # the first tokens: chosen from the prompt's prefill and plain steps (calibration), no rows kept
    assert d.calls[0][1] is None
    for tokens, hidden in d.calls:
        if hidden is None:
            continue
        assert hidden.shape == (len(tokens), net.config.n_hc, net.config.n_embd)
        chose = np.argmax(np.asarray(net.head(hidden)), axis=-1).tolist()
        assert chose == tokens
        n += len(tokens)
    # every token after the first came with its row (those of the last verify are not reported: the
    # generation ended, the drafter is reset before the next one)
    assert n >= 6, n


def test_session_refuses_to_save_a_pending_verify(cpu):
    s = cpu.new_session(256)
    s.sync([1, 2, 3, 4])
    s.verify([5, 6, 7])
    assert s.pos == 7 and s.verify_pending
    for call in (s.snapshot, s.payload_chunks, lambda: s.append([8]), lambda: s.sync([1, 2])):
        with pytest.raises(InferenceError, match="pending"):
            call()
    s.commit(2)
    assert s.tokens == [1, 2, 3, 4, 5, 6] and not s.verify_pending
    ref = cpu.new_session(256)
    ref.sync([1, 2, 3, 4, 5, 6])
    assert same_bits(s.logits(), ref.logits())
    assert all(same_bits(a, b) for a, b in zip(s.snapshot().state.state, ref.snapshot().state.state))


# -- temperature 0: the oracle cases -----------------------------------------------------------------


@pytest.mark.parametrize("case", ["raw_short", "chat_nothink",
                                  pytest.param("dev_long", marks=pytest.mark.slow)])
def test_ds4cpu_speculation_is_plain_decoding_bit_for_bit(cpu, case):
    """Scripted drafts (ds4's greedy continuation) with error rates 0 / 50 / 100 %: the same tokens as
    plain decoding and ds4, and every logits row the loop chose from has plain decoding's bits and,
    where the oracle dumped it, ds4's."""
    g = golden_json(case)
    prompt, want = g["prompt_tokens"], g["greedy_generated"]
    n = len(want)
    s = prompt_session(cpu, prompt)
    plain, plain_rows = run(cpu, s, prompt, n, temperature=0, draft=False)
    assert plain.tokens == want
    golden = Logits(case)
    dumped = [(i, k) for i, k in enumerate(golden.steps) if k < len(plain_rows)]
    assert dumped and all(np.array_equal(row_sha256(plain_rows[k][None])[0], golden.sha256[i]) for i, k in dumped)
    for err in (0.0, 0.5, 1.0):
        d = ScriptedDrafter(prompt + want, err, seed=7, n_vocab=cpu.config.n_vocab)
        res, rows = run(cpu, s, prompt, n, temperature=0, draft=d)
        assert res.tokens == want, err
        assert len(rows) == len(plain_rows) and all(same_bits(a, b) for a, b in zip(rows, plain_rows)), err
        assert res.stats.drafted_tokens > 0 and res.stats.verify_steps > 0
        if err == 0.0:
            assert res.stats.accepted_tokens == res.stats.drafted_tokens
        if err == 1.0:
            assert res.stats.accepted_tokens == 0
        # the session holds what plain decoding leaves: the prompt and every generated token but the last
        assert s.tokens == prompt + want[:-1]


@pytest.mark.parametrize("case", CASES)
def test_default_numerics_speculation_gives_plain_tokens(dflt, case):
    g = golden_json(case)
    prompt = g["prompt_tokens"]
    n = len(g["greedy_generated"])
    s = prompt_session(dflt, prompt)
    plain = ds4_mlx.generate(dflt, prompt, max_tokens=n, temperature=0, session=s, draft=False)
    for err in (0.0, 0.5, 1.0):
        d = ScriptedDrafter(prompt + plain.tokens, err, seed=3, n_vocab=dflt.config.n_vocab)
        res = ds4_mlx.generate(dflt, prompt, max_tokens=n, temperature=0, session=s, draft=d)
        assert res.tokens == plain.tokens, err
        assert "draft: " in res.stats.summary()


# -- temperature > 0 --------------------------------------------------------------------------------


def test_sampling_is_exact_and_seed_identical(cpu, dflt):
    """The exact semantics: the target's draw from its own distribution decides, one RNG draw per token as
    plain decoding. ds4-cpu: the same seed gives the same tokens and rows with any drafter. Default, over
    many seeds: the tokens drawn from verify rows (drafted from a continuation, accepted or not) follow
    plain sampling's distribution — seed for seed the same tokens but for a rare rounding flip."""
    g = golden_json("raw_short")
    prompt = g["prompt_tokens"]
    s = prompt_session(cpu, prompt)
    plain, plain_rows = run(cpu, s, prompt, 8, temperature=1.0, seed=11, draft=False)
    d = ScriptedDrafter(prompt + plain.tokens, 0.3, seed=1, n_vocab=cpu.config.n_vocab)
    res, rows = run(cpu, s, prompt, 8, temperature=1.0, seed=11, draft=d)
    assert res.tokens == plain.tokens and all(same_bits(a, b) for a, b in zip(rows, plain_rows))
    assert res.stats.drafted_tokens > 0

    s2 = prompt_session(dflt, prompt)
    firsts_plain, firsts_spec = [], []
    for seed in range(1, 17):
        a = ds4_mlx.generate(dflt, prompt, max_tokens=5, temperature=1.5, min_p=0.0, seed=seed, session=s2,
                             draft=False).tokens
        # tokens 0, 1: plain (the draft length's calibration); the draft for token 3 is the plain run's
        # own draw, accepted whenever speculation draws it too
        d = ScriptedDrafter(prompt + a, 0.0, n_vocab=dflt.config.n_vocab)
        b = ds4_mlx.generate(dflt, prompt, max_tokens=5, temperature=1.5, min_p=0.0, seed=seed, session=s2,
                             draft=d)
        assert b.stats.drafted_tokens == 1  # token 3 is the drafted position (token 4 comes from its row)
        assert b.tokens[:3] == a[:3]
        firsts_plain.append(a[3:])
        firsts_spec.append(b.tokens[3:])
    # default numerics: the verify rows carry BLAS rounding (~5e-6), which moves a draw that lands within
    # that of a CDF step to the neighbouring token; so equal up to a rare such flip
    flips = sum(a != b for a, b in zip(firsts_spec, firsts_plain))
    assert flips <= 2, (firsts_spec, firsts_plain)
    assert len({t[0] for t in firsts_plain}) > 1  # a real distribution, not a constant


# -- snapshots, payloads, the disk cache ---------------------------------------------------------------


def test_restored_session_speculates_again(cpu, tmp_path):
    g = golden_json("chat_nothink")
    prompt, want = g["prompt_tokens"], g["greedy_generated"]
    d = ScriptedDrafter(prompt + want, 0.2, seed=5, n_vocab=cpu.config.n_vocab)
    s = cpu.new_session(512)
    first = ds4_mlx.generate(cpu, prompt, max_tokens=8, temperature=0, session=s, draft=d)
    assert first.tokens == want[:8]
    path = tmp_path / "s.kv"
    s.save(path)
    snap = s.snapshot()
    for restore in (lambda t: t.restore(snap), lambda t: t.load(path)):
        t = cpu.new_session(512)
        restore(t)
        assert t.tokens == prompt + want[:7]
        # continue the same conversation: the prompt is what the session holds plus the 8th token
        res = ds4_mlx.generate(cpu, t.tokens + [want[7]], max_tokens=8, temperature=0, session=t, draft=d)
        assert res.tokens == want[8:16]
        assert res.stats.cached_tokens == len(prompt) + 7 and res.stats.drafted_tokens > 0


def test_disk_cache_saves_no_draft_and_a_hit_speculates(cpu, tmp_path):
    """Chunk 32 / continued step 64: generation from 110 tokens crosses the 128 frontier; the save made
    there under speculation is the plain run's, bit for bit; a later request hits it and speculates."""
    opts = KVStoreOptions(min_tokens=32, cold_max_tokens=30000, continued_interval_tokens=50,
                          boundary_trim_tokens=32, boundary_align_tokens=32)
    prompt = golden_json("dev_long")["prompt_tokens"][:110]
    out = {}
    for name, spec in (("plain", False), ("spec", True)):
        dc = DiskCache(cpu, tmp_path / name, 64, ctx=512, options=opts)
        s = cpu.new_session(512, chunk=32)
        draft = ScriptedDrafter(prompt + out["plain"].tokens, 0.25, seed=2,
                                n_vocab=cpu.config.n_vocab) if spec else False
        out[name] = ds4_mlx.generate(cpu, prompt, max_tokens=24, temperature=0, session=s, kv_cache=dc,
                                     draft=draft)
        out[name + "_files"] = {e.tokens: dc.store.load(e).payload for e in dc.store.entries()}
        out[name + "_dc"] = dc
    assert out["spec"].tokens == out["plain"].tokens and out["spec"].stats.drafted_tokens > 0
    assert sorted(out["spec_files"]) == sorted(out["plain_files"]) and 128 in out["spec_files"]
    assert all(bytes(out["spec_files"][n]) == bytes(out["plain_files"][n]) for n in out["plain_files"])

    longer = prompt + out["plain"].tokens[:22]  # a later turn: the prompt grew past the 128 checkpoint
    s = cpu.new_session(512, chunk=32)
    ref = cpu.new_session(512, chunk=32)
    plain = ds4_mlx.generate(cpu, longer, max_tokens=8, temperature=0, session=ref, draft=False)
    d = ScriptedDrafter(longer + plain.tokens, 0.25, seed=4, n_vocab=cpu.config.n_vocab)
    res = ds4_mlx.generate(cpu, longer, max_tokens=8, temperature=0, session=s, kv_cache=out["spec_dc"], draft=d)
    assert res.stats.cache_source == "disk-tokens" and res.stats.cached_tokens == 128
    assert res.tokens == plain.tokens and res.stats.drafted_tokens > 0


# -- draft length -------------------------------------------------------------------------------------


def test_draft_length_cost_model():
    """Timed: a verify of k drafts costs c0 + c1·k; k maximises expected tokens per second."""
    dl = DraftLength(4)
    dl.timed(0, 1.0)
    dl.timed(1, 1.6)
    dl.timed(3, 2.8)  # 0.6 per draft: a draft pays for itself only when it is kept well over half the time
    assert abs(dl.cost(2) - 2.2) < 1e-9 and abs(dl.cost(4) - 3.4) < 1e-9
    for _ in range(20):
        dl.update(4, 4)
    assert dl.acceptance > 0.9 and dl.best() == 4 and dl.k == 4
    for _ in range(20):
        dl.update(2, 1)  # acceptance 1/2
    assert dl.best() == 0 and dl.k == 0 and dl.next() == 0  # backed off
    dl = DraftLength(4)
    dl.timed(0, 1.0)
    dl.timed(1, 2.0)  # a verify of one draft costs two plain steps (the tiny model on the CPU) ...
    for _ in range(20):
        dl.update(1, 1)
    assert dl.best() == 4  # ... but more drafts may cost little more: tried (10 % of c0 per draft)
    dl.timed(4, 2.3)
    assert dl.best() == 4 and abs(dl.cost(2) - 2.1) < 1e-9
    dl = DraftLength(4)
    dl.timed(0, 1.0)
    dl.timed(2, 1.1)  # a GPU-like verify: nearly free
    for _ in range(20):
        dl.update(2, 1)
    assert dl.best() >= 2


def test_draft_length_backs_off_and_grows():
    dl = DraftLength(4)
    verifies = 0
    for _ in range(400):  # a drafter that is always wrong
        k = dl.next()
        if k:
            verifies += 1
            dl.update(k, 0)
    assert verifies <= 6, verifies
    dl = DraftLength(4)
    for _ in range(10):  # always right
        dl.update(dl.next(), dl.next())
    assert dl.next() == 4
    dl.update(4, 1)
    assert dl.next() == 2


# -- hostile input -------------------------------------------------------------------------------------


class _OutOfVocab(Drafter):
    def reset(self):
        pass

    def start(self, tokens, hidden):
        pass

    def accept(self, tokens, hidden):
        pass

    def propose(self, k):
        return [10 ** 9]


def test_bad_drafts_and_options_fail_clearly(dflt, tiny_model_path, tmp_path):
    from ds4_mlx.engine import speculative
    from ds4_mlx.frontends import args

    assert args.MAX_DRAFT_K == speculative.MAX_DRAFT_K
    for k in (-1, 0, 10 ** 6, 2.5, True):
        with pytest.raises(DraftError, match="draft_k"):
            check_draft_k(k)
        with pytest.raises(DraftError, match="draft_k"):
            ds4_mlx.generate(dflt, [1, 2, 3], max_tokens=2, draft_k=k)
    with pytest.raises(DraftError, match="no such file"):
        load_drafter(tmp_path / "missing.gguf", dflt)
    with pytest.raises(DraftError, match="no such file"):
        ds4_mlx.load(tiny_model_path, draft=str(tmp_path / "missing.gguf"))
    with pytest.raises(DraftError, match="Drafter"):
        ds4_mlx.generate(dflt, [1, 2, 3], max_tokens=2, draft=object())
    s = dflt.new_session(64)
    with pytest.raises(DraftError, match="outside|not a token id"):
        ds4_mlx.generate(dflt, [1, 2, 3], max_tokens=8, temperature=0, session=s, draft=_OutOfVocab())
    # the failed generation left the session usable (no verify pending)
    assert not s.verify_pending
    assert ds4_mlx.generate(dflt, [1, 2, 3], max_tokens=2, temperature=0, session=s, draft=False).tokens


# -- the product: CLI and server ---------------------------------------------------------------------


def test_cli_generate_with_a_draft(capsys, monkeypatch, tiny_model_path, tmp_path):
    """``--draft FILE`` through the real loader hook (here a scripted drafter that first learns the plain
    continuation): the same text as plain decoding, and the stats line reports the drafts."""
    from ds4_mlx.engine import speculative
    from ds4_mlx.frontends.cli import main

    draft_file = tmp_path / "mtp.gguf"
    draft_file.write_bytes(b"stand-in: the hook below returns the drafter")
    d = ScriptedDrafter([], 0.0)
    monkeypatch.setattr(speculative, "load_drafter", lambda path, model: d)
    argv = ["generate", "-m", str(tiny_model_path), "-p", "Hello there", "--temp", "0", "-n", "8", "--ctx", "512",
            "--nothink", "--mtp", str(draft_file), "--draft-k", "3"]
    assert main(argv) == 0
    out1, err1 = capsys.readouterr()
    assert "draft: 0/0 accepted" in err1  # nothing to propose yet
    d.script = list(d.context)  # the plain run's prompt and continuation (all but its last token)
    assert main(argv) == 0
    out2, err2 = capsys.readouterr()
    m = re.search(r"draft: (\d+)/(\d+) accepted \(100 %", err2)
    assert out2 == out1 and m and m.group(1) == m.group(2) != "0", err2  # how many: the timed draft length
    for bad, msg in ((["--draft-k", "0"], "--draft-k must be in"), (["--draft-k", "-1"], "--draft-k must be in"),
                     (["--draft-k", "100"], "--draft-k must be in")):
        assert main(argv[:-2] + bad) == 2
        assert msg in capsys.readouterr().err
    assert main(argv[:-4] + ["--draft", str(tmp_path / "nope.gguf")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_server_speculates_per_request(tiny_model_path):
    import openai
    from server_backend import LiveServer, http

    from ds4_mlx.frontends.server import EngineBackend, ServerConfig

    d = ScriptedDrafter([], 0.0)
    backend = EngineBackend(str(tiny_model_path), ctx=1024, draft=d, draft_k=3)
    with LiveServer(backend, ServerConfig(ctx=1024, keepalive_s=0.5)) as live:
        oai = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=120)
        kw = dict(model="deepseek-chat", messages=[{"role": "user", "content": "Tell me about the sea"}],
                  max_tokens=8, temperature=0)
        r1 = oai.chat.completions.create(**kw)
        d.script = list(d.context)
        r2 = oai.chat.completions.create(**kw)
        assert r2.choices[0].message.content == r1.choices[0].message.content
        details = r2.usage.completion_tokens_details
        n = details.accepted_prediction_tokens
        assert n > 0 and details.rejected_prediction_tokens == 0
        status, _, body = http(live.url, "GET", "/metrics")
        text = body.decode()
        assert status == 200 and f"ds4_spec_drafted_total {n}" in text and f"ds4_spec_accepted_total {n}" in text
