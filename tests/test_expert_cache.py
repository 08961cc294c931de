"""The bounded device expert cache (``load(..., experts="device", experts_cache=...)``):
the replacement policies as bookkeeping, the budget's parsing and sizing, outputs identical to the
unbounded device strategy in both numerics, and the budget holding in MLX memory over a prefill and
a decode (where the unbounded strategy, measured the same way, does not)."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.errors import LayoutError
from ds4_mlx.frontends.cli import main
from ds4_mlx.model import experts as experts_mod
from ds4_mlx.model.device_experts import DEVICE_ROUTING, DeviceExpertWeights
from ds4_mlx.model.host_step import HOST_ROUTING
from ds4_mlx.model.expert_budget import Budget, parse_experts_cache, plan_cache
from ds4_mlx.model.expert_cache import CachedDeviceExpertWeights
from ds4_mlx.model.expert_cache_policy import LFUPolicy, LRUPolicy, make_policy
from ds4_mlx.model.loader import load
from ds4_mlx.engine.session import Session
from small_model import build_small_model

# -- policies -----------------------------------------------------------------------------------------


def _consistent(p) -> None:
    held = p.expert_in[p.expert_in >= 0]
    assert np.unique(held).size == held.size
    for s, e in enumerate(p.expert_in):
        if e >= 0:
            assert p.slot_of[e] == s
    assert (p.slot_of >= 0).sum() == held.size <= p.n_slots


def test_lru_evicts_the_least_recent_and_pins_hits():
    p = LRUPolicy(3, 10)
    a = p.access([1, 2, 3])
    assert a.misses == 3 and a.hits == 0 and sorted(a.load_experts.tolist()) == [1, 2, 3]
    p.access([1])      # 1 is now the most recent, 2 the least
    a = p.access([1, 4])
    assert a.hits == 1 and a.load_experts.tolist() == [4]
    assert p.slot_of[2] == -1 and p.slot_of[3] >= 0 and p.slot_of[1] >= 0
    assert (a.slots >= 0).all()
    _consistent(p)


def test_lfu_keeps_the_frequent_expert_over_a_recent_one():
    p = LFUPolicy(2, 10, decay=1.0)
    for _ in range(5):
        p.access([7])
    p.access([8])
    a = p.access([9])  # 8 (once) goes, 7 (5 times) stays
    assert p.slot_of[7] >= 0 and p.slot_of[8] == -1 and p.slot_of[9] >= 0 and a.misses == 1
    lru = LRUPolicy(2, 10)
    for _ in range(5):
        lru.access([7])
    lru.access([8])
    lru.access([9])
    assert lru.slot_of[7] == -1  # LRU drops it


def test_lfu_aging_forgets_an_old_burst():
    p = LFUPolicy(1, 4, decay=0.5)
    p.access([0], [100])
    for _ in range(12):  # 100 * 0.5**12 < 1: a steady expert overtakes the burst
        p.access([1])
    assert p.slot_of[1] >= 0


def test_an_access_larger_than_the_cache_admits_the_most_routed():
    """A prefill chunk: more experts than slots; the slots go to the experts with most pairs."""
    p = LRUPolicy(3, 16)
    experts = np.arange(10)
    counts = np.array([1, 9, 1, 1, 7, 1, 1, 8, 1, 1])
    a = p.access(experts, counts)
    assert sorted(experts[a.slots >= 0].tolist()) == [1, 4, 7]
    assert a.misses == 10 and (a.slots < 0).sum() == 7
    # the next chunk: the warm experts are hits
    a = p.access(np.array([1, 4, 7, 12]), np.array([5, 5, 5, 1]))
    assert a.hits == 3
    _consistent(p)


@pytest.mark.parametrize("name", ["lru", "lfu"])
def test_random_accesses_keep_the_bookkeeping_consistent(name):
    rng = np.random.default_rng(1)
    p = make_policy(name, 5, 32)
    for i in range(300):
        n = 4 if i % 7 else 20
        e = rng.choice(32, size=n, replace=False)
        a = p.access(e, rng.integers(1, 5, size=n))
        assert a.hits + a.misses == n
        if n <= 5:
            assert (a.slots >= 0).all() and p.slot_of[e].min() >= 0
        _consistent(p)
    assert p.hits + p.misses == sum(4 if i % 7 else 20 for i in range(300))


def test_policy_rejects_bad_accesses():
    p = LRUPolicy(2, 4)
    with pytest.raises(ValueError, match="distinct"):
        p.access([1, 1])
    with pytest.raises(ValueError, match="outside"):
        p.access([4])
    with pytest.raises(ValueError, match="unknown expert cache policy"):
        make_policy("fifo", 2, 4)


# -- the budget ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    ("256", Budget("experts", 256)), (" 12 ", Budget("experts", 12)), ("8GB", Budget("bytes", 8 << 30)),
    ("8gib", Budget("bytes", 8 << 30)), ("512MiB", Budget("bytes", 512 << 20)), ("1.5G", Budget("bytes", 3 << 29)),
    ("4096b", Budget("bytes", 4096)), (1 << 30, Budget("bytes", 1 << 30)), (None, None),
])
def test_budget_parses(value, expected):
    assert parse_experts_cache(value) == expected


@pytest.mark.parametrize("bad", [0, -1, "0", "-5", "abc", "", "nan", float("nan"), float("inf"), -2.0, True,
                                 "1.5", "8 GBs", "0GB", [8], "1e9"])
def test_hostile_budgets_are_one_line_errors(bad):
    with pytest.raises(LayoutError) as info:
        parse_experts_cache(bad)
    assert "\n" not in str(info.value) and "experts_cache" in str(info.value)


def test_plan_splits_a_count_over_layers_and_keeps_the_prefill_reserve_of_a_size():
    trip = [1000, 1000, 2000]  # per-layer bytes of one expert's gate + up + down
    assert plan_cache(Budget("experts", 30), triplet_nbytes=trip, n_expert=16, n_used=4).slots == 10
    assert plan_cache(Budget("experts", 48), triplet_nbytes=trip, n_expert=16, n_used=4).slots is None  # all
    assert plan_cache(Budget("experts", 10 ** 6), triplet_nbytes=trip, n_expert=16, n_used=4).slots is None
    with pytest.raises(LayoutError, match="at least 12"):
        plan_cache(Budget("experts", 11), triplet_nbytes=trip, n_expert=16, n_used=4)
    # bytes over 11 layers: two full layers (the largest: 16 * 2000) reserved, the rest in slots of
    # 12000 bytes (one expert in every layer)
    trip = [1000] * 10 + [2000]
    p = plan_cache(Budget("bytes", 64000 + 5 * 12000 + 10), triplet_nbytes=trip, n_expert=16, n_used=4)
    assert p.slots == 5 and p.cache_nbytes == 60000 and p.prefill_reserve_nbytes == 64000
    assert plan_cache(Budget("bytes", 16 * 12000), triplet_nbytes=trip, n_expert=16, n_used=4).slots is None
    with pytest.raises(LayoutError, match="prefill reserve"):
        plan_cache(Budget("bytes", 64000 + 3 * 12000), triplet_nbytes=trip, n_expert=16, n_used=4)


# -- the model ----------------------------------------------------------------------------------------

# 4 layers (one hash layer), 64 experts of which 4 per token: 27 MiB of routed experts on a tiny
# dense part, so resident expert bytes dominate the MLX memory the budget test measures
ROUTED_ARGS = ["--n-expert", "64", "--n-expert-used", "4", "--n-ff-exp", "512", "--n-hash-layer", "1"]
SLOTS = 8  # per layer: 8 of 64 resident


@pytest.fixture(scope="module")
def routed_model(tmp_path_factory):
    return build_small_model(tmp_path_factory.mktemp("routed") / "routed.gguf", extra_args=ROUTED_ARGS)


def _count(path) -> str:
    return str(SLOTS * load(path, experts="host").config.n_layer)


PROMPT = [int(t) for t in np.random.default_rng(3).integers(3, 500, size=70)]


def _run(model, n_decode: int = 6, chunk: int = 32):
    """Prefill PROMPT in chunks, then greedy (compiled, in default numerics) decode steps: (logits
    per step, tokens, the session)."""
    s = Session(model, 128, chunk=chunk)
    s.append(PROMPT)
    out, toks = [s.logits()], []
    for _ in range(n_decode):
        toks.append(int(np.argmax(out[-1])))
        s.eval(toks[-1])
        out.append(s.logits())
    return out, toks, s


def test_option_checks(routed_model):
    with pytest.raises(LayoutError, match="device strategy"):
        load(routed_model, experts="host", experts_cache="16")
    with pytest.raises(LayoutError, match="needs an experts_cache"):
        load(routed_model, experts="device", experts_cache_policy="lfu")
    with pytest.raises(LayoutError, match="unknown expert cache policy"):
        load(routed_model, experts="device", experts_cache="16", experts_cache_policy="mru")
    with pytest.raises(LayoutError, match="a token routes to 4"):
        load(routed_model, experts="device", experts_cache="8")
    # all the experts or more: the unbounded strategy, as it is
    eng = load(routed_model, experts="device", experts_cache="100000")
    assert eng.expert_cache is None
    assert all(b.ffn.routing is DEVICE_ROUTING and type(b.ffn.gate_exps) is DeviceExpertWeights for b in eng.blocks)


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_cli_option_is_checked_while_parsing(capsys, command):
    rc = main([command, "-m", "x.gguf", "--experts", "device", "--experts-cache", "abc"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "--experts-cache" in err and "'abc'" in err


@pytest.mark.parametrize("numerics", ["ds4-cpu", "default"])
def test_bounded_outputs_equal_the_unbounded(routed_model, numerics):
    """ds4-cpu: the same integer arithmetic on the same blocks (from slots or the mapping): equal
    bits. Default: the bounded layer routes on the host (numpy top-k, Sinkhorn on the host), the
    unbounded one on the device; the expert products are the same per-pair arithmetic: the same
    greedy tokens, logits equal to rounding."""
    count = _count(routed_model)
    ref, ref_toks, _ = _run(load(routed_model, numerics=numerics, experts="device"))
    eng = load(routed_model, numerics=numerics, experts="device", experts_cache=count)
    cache = eng.expert_cache
    assert cache.n_slots == SLOTS and eng.expert_strategy == "device"
    for b in eng.blocks:
        assert b.ffn.routing is HOST_ROUTING and isinstance(b.ffn.gate_exps, CachedDeviceExpertWeights)
    got, toks, _ = _run(eng)
    assert toks == ref_toks
    if numerics == "ds4-cpu":
        assert all(a.tobytes() == b.tobytes() for a, b in zip(ref, got))
    else:
        for a, b in zip(ref, got):
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-3)
    c = cache.counters()
    assert c.misses > 0 and c.hits > 0 and c.bytes_read > 0
    # every miss read its expert's three tensors at most once (admitted or transient)
    layers = list(cache.layers.values())
    assert c.bytes_read <= c.misses * max(sum(m.expert_nbytes for m in lc.members) for lc in layers)


def _measure(path, **kw):
    """MLX memory of loading ``path`` and running ``_run``: (peak over base, active at the end over
    base, the session's KV bytes, the engine)."""
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    eng = load(path, experts="device", **kw)
    _, toks, s = _run(eng, n_decode=8)
    mx.eval(*s.state.arrays())
    kv = sum(a.nbytes for a in s.state.arrays())
    return mx.get_peak_memory() - base, mx.get_active_memory() - base, kv, eng, toks


@pytest.mark.parametrize("numerics", ["default", "ds4-cpu"])
def test_the_budget_holds_in_mlx_memory(routed_model, monkeypatch, numerics):
    """Peak MLX memory over a chunked prefill and a decode <= dense weights + budget + KV + slack.

    The slack is what the run needs besides its resident state: the same model's transient working
    set without a cache (the unbounded run's peak over its end state: activations, the dequantized
    groups of DEFAULT numerics' grouped products, 1 MiB here by DS4_MLX_EXPERT_GROUP_MB, ds4-cpu's parts)
    plus the cache's stated prefill working set, ds4's two full layers of raw blocks. The dense part
    is the bounded run's end state minus its slots (the cache's own accounting) and KV. The
    unbounded device strategy, measured the same way, exceeds that bound: the test can fail."""
    monkeypatch.setenv("DS4_MLX_EXPERT_GROUP_MB", "1")  # the load plan passes it to every expert tensor
    count = _count(routed_model)
    kw = {"numerics": numerics}
    experts_mod.EXPERT_CACHE.clear()
    peak_all, end_all, _, eng_all, toks_all = _measure(routed_model, **kw)
    resident = sum(b.ffn.gate_exps.resident_nbytes + b.ffn.up_exps.resident_nbytes
                   + b.ffn.down_exps.resident_nbytes for b in eng_all.blocks)
    working = peak_all - end_all  # the run's transients, above what stays resident
    del eng_all
    experts_mod.EXPERT_CACHE.clear()
    peak, end, kv, eng, toks = _measure(routed_model, experts_cache=count, **kw)
    assert toks == toks_all
    cache = eng.expert_cache
    plan = cache.plan
    # the cache's own accounting: slot arrays of exactly the planned size, allocated once
    assert cache.nbytes == plan.cache_nbytes == SLOTS * sum(plan.triplet_nbytes)
    budget = cache.nbytes
    dense = end - budget - kv
    slack = working + plan.prefill_reserve_nbytes
    bound = dense + budget + kv + slack
    assert peak <= bound, (peak / 2**20, bound / 2**20)
    assert resident > budget + plan.prefill_reserve_nbytes  # a model where the bound means something
    assert peak_all > bound, (peak_all / 2**20, bound / 2**20)
    experts_mod.EXPERT_CACHE.clear()


# -- stats --------------------------------------------------------------------------------------------


def test_stats_line_and_metrics_report_the_cache():
    from ds4_mlx.engine.generate import GenerationStats
    from ds4_mlx.frontends.server.metrics import Metrics

    st = GenerationStats(prompt_tokens=10, generation_tokens=4, decode_s=1.0, expert_hits=18, expert_misses=6,
                         expert_bytes_read=4 << 20, expert_prefill_misses=40, expert_prefill_bytes_read=30 << 20)
    assert st.expert_hit_rate == 0.75 and st.expert_bytes_per_token == 1 << 20
    line = st.summary()
    assert "experts cache: decode 75.0 % hits, 1.00 MiB read/token, prefill 30 MiB read" in line
    assert "experts cache" not in GenerationStats(prompt_tokens=3).summary()
    m = Metrics()
    m.generation(finish="stop", prompt=10, cached=0, completion=4, source="none", prefill_s=1.0, decode_s=1.0,
                 expert_hits=18, expert_misses=6, expert_bytes=(30 << 20, 4 << 20))
    text = m.render(queue_depth=0, busy=False)
    assert "ds4_expert_cache_hits_total 18" in text and "ds4_expert_cache_misses_total 6" in text
    assert f'ds4_expert_cache_bytes_read_total{{phase="decode"}} {4 << 20}' in text
    assert f'ds4_expert_cache_bytes_read_total{{phase="prefill"}} {30 << 20}' in text


def test_generate_reports_the_cache(tiny_model_path):
    """The engine's stats of a generation with a bounded cache: decode and prefill counters."""
    import ds4_mlx

    eng = ds4_mlx.load(tiny_model_path, experts="device", experts_cache="30")
    res = ds4_mlx.generate(eng, "Tell me about caches", max_tokens=4, temperature=0, raw=True)
    st = res.stats
    # the generated tokens but the last are fed back: 3 decode steps, k=4 experts on every layer
    assert st.expert_hits + st.expert_misses == 3 * 4 * eng.config.n_layer
    assert st.expert_prefill_bytes_read > 0 and st.expert_bytes_read == st.expert_bytes_per_token * 4
    assert "experts cache: decode" in st.summary()


def test_server_reports_the_prefill_reads_of_its_one_sync(tiny_model_path):
    """The server's session pool runs a request's prefill and generation continues from there: the
    expert-cache bytes read by that prefill are the request's prefill reads (not a no-op sync's 0)."""
    import threading

    from ds4_mlx.frontends.server import EngineBackend
    from ds4_mlx.frontends.server.events import ChatRequest, Done

    # the server's way: the backend loads, generates and releases MLX on one worker thread of its own
    # (``_release_mlx`` ends that thread's MLX streams, which must not be the test's)
    out = {}

    def work():
        b = EngineBackend(str(tiny_model_path), ctx=256, experts="device", experts_cache="30")
        b._load()
        try:
            req = ChatRequest([{"role": "user", "content": "Tell me about caches"}], max_tokens=2, temperature=0)
            out["done"] = [e for e in b._generate(req, threading.Event()) if isinstance(e, Done)][-1]
        finally:
            b._release_mlx()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    done = out["done"]
    assert done.finish in ("length", "stop") and done.expert_prefill_bytes_read > 0
