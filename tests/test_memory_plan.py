"""The memory plan before loading (issue #24): its arithmetic on DS4 Flash's real dims, the KV it
counts against what the cache allocates, the refusal before any weight is read, the machine
readings (macOS injected), and the CLI (``--simulate-memory``, ``inspect --plan``).

The real-dims file is the 43-layer q2 model's header with its tensor data left as a hole: a sparse
file of ~81 GiB holding ~100 KiB, so the plan runs on the real tensor directory and a load that
read its weights instead of refusing would copy tens of GiB (the tests spy on that, never risk it).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from ds4_mlx.model import load_plan
from ds4_mlx.errors import MemoryPlanError
from ds4_mlx.frontends.cli import main
from ds4_mlx.model import loader, memory_plan as mp
from ds4_mlx.model.memory_plan import GiB, MiB

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def flash_path(tmp_path_factory):
    """DS4 Flash's real dims and q2 experts (IQ2_XXS gate/up, Q2_K down), 43 layers, data a hole."""
    from ds4_mlx import synth
    from ds4_mlx.formats.gguf_writer import GGUFWriter

    path = tmp_path_factory.mktemp("flash") / "flash-q2-dims.gguf"
    cfg = synth.preset_config("medium", n_layer=43, tokenizer=False, name="ds4-flash-dims")
    w = GGUFWriter(path)
    for key, vtype, value, sub in synth.model_metadata(cfg, None):
        w.add(key, vtype, value, sub)
    for spec in synth.tensor_plan(cfg):
        w.add_tensor(spec.name, spec.ggml_type, spec.ne)
    header = w.header_bytes()
    data_offset = -(-len(header) // w.alignment) * w.alignment
    last = w.tensors[-1]
    w.abort()  # the writer writes nothing: the header by hand, the data as a hole
    with open(path, "wb") as fh:
        fh.write(header)
        fh.truncate(data_offset + last.rel_offset + last.nbytes)
    return path


@pytest.fixture(scope="module")
def flash(flash_path):
    from ds4_mlx.formats.layout import load_model_file

    f, cfg, _ = load_model_file(flash_path)
    yield f, cfg
    f.close()


def machine(gib: float) -> mp.Machine:
    return mp.simulated_machine(gib)


# -- the arithmetic on the real dims -------------------------------------------------------------------


def test_q2_on_64gb_refuses_device_with_every_expert_and_fits_host(flash):
    f, cfg = flash
    assert cfg.n_layer == 43
    device = loader.plan_memory(f, cfg, load_plan.resolve(backend="cpu", experts="device"), simulate_memory=64)
    host = loader.plan_memory(f, cfg, load_plan.resolve(backend="cpu", experts="host"), simulate_memory=64)
    # the numbers against the file: routed experts ~90 % of its ~81 GiB, all of them resident with device
    size = f.file_size
    assert 80 * GiB < size < 82 * GiB
    w = device.weights
    assert 0.85 * size < w.experts_gguf < 0.95 * size
    assert w.experts_resident == w.experts_gguf == device.experts_bytes
    assert host.weights.experts_resident == 0 and host.experts_bytes == 0
    # one layer's routed experts: 256 experts x 3 projections (IQ2_XXS 2.06 bits, Q2_K 2.625 bits)
    per_layer = 256 * 4096 * 2048 * (66 + 66 + 84) // 256
    assert w.layer_experts == per_layer and w.experts_gguf == 43 * per_layer
    # dense weights on MLX's CPU backend: the Q8_0 ones become float32 (34 bytes -> 32 floats)
    q8 = next(d for d in w.dense if d.label == "dense Q8_0 weights")
    assert q8.resident_bytes == pytest.approx(q8.gguf_bytes * 128 / 34, rel=1e-9)
    assert device.fits is False and host.fits is True
    assert device.total > w.experts_gguf + w.dense_bytes > 90 * GiB
    assert 20 * GiB < host.total < 40 * GiB
    with pytest.raises(MemoryPlanError) as e:
        device.check()
    msg = str(e.value)
    assert "\n" not in msg
    assert "flash-q2-dims.gguf does not fit in memory (device experts" in msg
    assert f"routed experts {mp.size_text(w.experts_gguf)}" in msg and "64 GiB, --simulate-memory 64" in msg
    assert f"--experts host ({mp.size_text(host.total)})" in msg
    host.check()  # fits: no error


def test_metal_plan_and_the_wired_limit(flash):
    """A 64 GiB and a 128 GiB Mac (readings injected): the device strategy's q2 plan against the
    Metal working-set limit macOS sets by default (~75 % of RAM); the advice raises it with sysctl
    when the machine has the memory."""
    f, cfg = flash
    metal = loader.weight_bytes(f, cfg, load_plan.resolve(backend="metal", experts="device"))
    cpu = loader.weight_bytes(f, cfg, load_plan.resolve(backend="cpu", experts="device"))
    assert metal.dense_bytes < 0.5 * cpu.dense_bytes  # 8-bit affine, not float32
    host = loader.weight_bytes(f, cfg, load_plan.resolve(backend="metal", experts="host"))

    def mac(gib: int, working_set_gib: float) -> mp.Machine:
        return mp.machine_from_readings("Darwin", gpu=True, mem_total=gib * GiB,
                                        working_set=int(working_set_gib * GiB), wired_limit_mb=0)

    small = mp.plan(cfg, metal, ctx=32768, machine=mac(64, 48), host=host, name="q2.gguf")
    assert small.machine.wired and "wired limit" in small.machine.source
    assert small.fits is False  # ~73 GiB of experts alone
    assert "--experts host" in small.advice() and "sysctl" not in small.advice()  # it is over 64 GiB anyway
    big = mp.plan(cfg, metal, ctx=32768, machine=mac(128, 96), host=host, name="q2.gguf")
    assert big.fits is True
    tight = mp.plan(cfg, metal, ctx=32768, machine=mac(96, 72), host=host, name="q2.gguf")
    assert tight.fits is False and tight.total < 96 * GiB
    mb = -(-tight.total // GiB) * 1024
    with pytest.raises(MemoryPlanError, match=rf"sudo sysctl iogpu\.wired_limit_mb={mb} \(of 98304 MiB\)"):
        tight.check()


def test_the_advice_names_a_halved_ctx_that_fits(flash):
    f, cfg = flash
    host = loader.weight_bytes(f, cfg, load_plan.resolve(backend="cpu", experts="host"))
    at_1m = mp.plan(cfg, host, ctx=1 << 20, machine=machine(33))
    assert at_1m.kv_total > 10 * GiB  # ~13 GiB of compressed KV at the full context
    assert at_1m.fits is False
    smaller = at_1m._fitting_ctx()
    assert smaller is not None and smaller.fits and not at_1m._with(ctx=2 * smaller.ctx).fits
    assert f"--ctx {smaller.ctx} ({mp.size_text(smaller.total)})" in at_1m.advice()
    hopeless = mp.plan(cfg, host, ctx=4096, machine=machine(8))
    assert hopeless.advice().startswith("nothing smaller fits: even --experts host at the smallest --ctx needs")


def test_default_experts_cache_bytes(flash, monkeypatch):
    f, cfg = flash
    device = loader.weight_bytes(f, cfg, load_plan.resolve(backend="metal", experts="device"))
    everything = mp.plan(cfg, device, ctx=32768, machine=machine(200))
    assert everything.fits and mp.default_experts_cache_bytes(everything) is None
    p = mp.plan(cfg, device, ctx=32768, machine=machine(48))
    n = mp.default_experts_cache_bytes(p)
    assert mp.MIN_CACHE_LAYERS * device.layer_experts <= n < device.experts_gguf
    with_cache = p._with(experts_cache_bytes=n)
    assert with_cache.fits and with_cache.device_cache_bytes == n and with_cache.experts_bytes == 0
    assert with_cache.cache_bytes == n and with_cache.lru_bytes == 0  # the bounded cache keeps no dequantized expert
    assert [r.nbytes for r in with_cache.rows() if r.label == "expert cache"] == [n]
    assert not p._with(experts_cache_bytes=n + 1).fits  # the largest that fits
    host_metal = loader.weight_bytes(f, cfg, load_plan.resolve(backend="metal", experts="host"))
    assert mp.default_experts_cache_bytes(mp.plan(cfg, host_metal, ctx=32768,
                                                  machine=machine(48))) is None  # host: no device cache
    floor = 2 * device.layer_experts + 6 * device.experts_gguf // 256
    assert n >= floor
    with pytest.raises(MemoryPlanError, match=r"even with the smallest device expert cache \(2 layers of prefill reserve and 6 slots per layer"):
        mp.default_experts_cache_bytes(mp.plan(cfg, device, ctx=32768, machine=machine(12)))
    # the advice offers the cache, its budget written to 0.1 GB rounded down, which the cache's own
    # parser reads back as a budget that still fits
    from ds4_mlx.model.expert_budget import parse_experts_cache

    advised = re.search(r"--experts-cache (\d+\.\d)GB", p.advice())
    assert advised, p.advice()
    budget = parse_experts_cache(advised.group(1) + "GB").amount
    assert n - GiB // 10 < budget <= n and p._with(experts_cache_bytes=budget).fits
    monkeypatch.setattr(mp, "EXPERTS_CACHE_OPTION", None)
    assert "--experts-cache" not in p.advice()


def test_a_bounded_cache_load_is_planned_with_its_bytes(tiny_model_path):
    """``experts_cache=`` (``model.expert_cache``): the plan counts its slots and prefill reserve,
    not every expert, and no dequantized LRU."""
    import ds4_mlx
    from ds4_mlx.formats.layout import load_model_file

    f, cfg, _ = load_model_file(tiny_model_path)
    try:
        cache_plan = loader.expert_cache_plan(f, cfg, "32")
    finally:
        f.close()
    assert cache_plan.slots is not None
    engine = ds4_mlx.load(tiny_model_path, experts="device", experts_cache="32", ctx=64)
    plan = engine.memory_plan
    assert plan.experts_cache_bytes == cache_plan.cache_nbytes + cache_plan.prefill_reserve_nbytes
    assert plan.experts_bytes == 0 and plan.lru_bytes == 0 and plan.device_cache_bytes == plan.experts_cache_bytes
    assert plan.device_cache_bytes < plan.weights.experts_resident
    with pytest.raises(MemoryPlanError, match=r"\(device experts, default numerics\).*expert cache"):
        ds4_mlx.load(tiny_model_path, experts="device", experts_cache="32", simulate_memory=0.05)


def test_largest_fitting_is_the_boundary():
    for floor in (mp.SCRATCH_MIN, 3 * GiB + 5):
        for limit in (0, GiB - 1, GiB, 3 * GiB, 11 * GiB - 1, 11 * GiB, 11 * GiB + 7, 48 * GiB + 12345):
            x = mp._largest_fitting(limit, floor)
            if x < 0:
                assert limit < floor
                continue
            assert x + mp.scratch_bytes(x, floor) <= limit < x + 1 + mp.scratch_bytes(x + 1, floor)


def test_scratch_floor_is_a_prefill_chunk_at_real_dims(flash, tiny_cfg):
    """At DS4 Flash's dims a 2048-token chunk's activations (~2.8 GiB) are the floor; the tiny
    model's are far below 1 GiB; the Session's default chunk is the one planned for."""
    from ds4_mlx.engine.session import DEFAULT_CHUNK

    _, cfg = flash
    assert mp.PREFILL_CHUNK == DEFAULT_CHUNK
    real = mp.prefill_bytes(cfg)
    assert real == 6 * 4 * (4 * 4096 + 64 * 512 + 6 * 2048) * 2048
    assert 2 * GiB < real < 4 * GiB and mp.prefill_bytes(tiny_cfg) < GiB // 2
    w = mp.WeightBytes("host", "default", "cpu", (), 0, 0, 0, 0)
    assert mp.plan(cfg, w, ctx=64, machine=machine(64)).scratch == real
    assert mp.plan(tiny_cfg, w, ctx=64, machine=machine(64)).scratch == mp.SCRATCH_MIN


# -- KV at ctx: what the cache allocates ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_cfg(tiny_model_path):
    from ds4_mlx.formats.layout import load_model_file

    f, cfg, _ = load_model_file(tiny_model_path)
    f.close()
    return cfg


@pytest.mark.parametrize("ctx", [2, 64, 4096, 4097, 5000, 20000])
def test_kv_bytes_are_the_cache_buffers_at_ctx(tiny_cfg, ctx):
    """Per layer type, the bytes of the buffers a ModelCache holds once a call at position ctx - 1
    reserved them (the growth path, not the plan's formula)."""
    from ds4_mlx.model.cache import ModelCache

    cache = ModelCache.empty(tiny_cfg)
    cache.reserve(ctx - 1)
    measured: dict[int, tuple[int, int]] = {}
    for il, lc in enumerate(cache.layers):
        r = tiny_cfg.compress_ratio(il)
        layers, total = measured.get(r, (0, 0))
        measured[r] = (layers + 1, total + lc.nbytes)
    assert mp.kv_bytes(tiny_cfg, ctx) == dict(sorted(measured.items()))
    assert set(measured) == {0, 4, 128}  # every layer type is checked


def test_a_session_holds_the_planned_kv(tiny_model_path):
    """A real session on the tiny model, prefilled: its live cache is the plan's KV at its ctx."""
    import ds4_mlx

    engine = ds4_mlx.load(tiny_model_path, ctx=64)
    plan = engine.memory_plan
    assert plan.ctx == 64 and engine.default_ctx() == 64
    s = engine.new_session()
    assert s.ctx == 64
    s.append(list(range(10, 50)))
    assert s.memory_bytes() == plan.kv_total > 0
    rows = dict(__import__("ds4_mlx.engine.describe", fromlist=["engine_rows"]).engine_rows(engine))
    assert rows["memory plan"].startswith("fits: ")


# -- the refusal comes before any weight is read --------------------------------------------------------


def test_refused_before_any_weight_is_read(flash_path, monkeypatch):
    """The real-dims file with the device strategy on 64 GiB: MemoryPlanError, and neither the model
    builder nor any of its tensor readers ever ran (were they reached, the device strategy would copy
    ~73 GiB of expert blocks)."""
    import ds4_mlx

    touched = []

    def spy(what):
        def reader(*a, **k):
            touched.append(what)
            raise AssertionError(f"{what} ran: the plan must refuse first")
        return reader

    monkeypatch.setattr(loader, "_build", spy("_build"))
    for name in ("f32", "dense", "experts"):
        monkeypatch.setattr(loader._Weights, name, spy(f"_Weights.{name}"))
    # an explicit cache too large for 64 GiB: refused, with what would fit
    with pytest.raises(MemoryPlanError) as e:
        ds4_mlx.load(flash_path, experts="device", backend="cpu", experts_cache="60GB", simulate_memory=64)
    assert touched == [] and "it would fit with --experts-cache 32.4GB" in str(e.value)
    # no cache given, and not even the smallest default cache fits beside the float32 dense weights
    with pytest.raises(MemoryPlanError, match="even with the smallest device expert cache"):
        ds4_mlx.load(flash_path, experts="device", backend="cpu", simulate_memory=24)
    assert touched == []
    with pytest.raises(MemoryPlanError, match=r"\(host experts, ds4-cpu numerics\).*> 16 GiB"):
        loader.load(flash_path, numerics="ds4-cpu", experts="host", simulate_memory=16)
    assert touched == []


def test_bad_simulated_memory_is_refused_before_the_file_is_opened(tiny_model_path, tmp_path):
    missing = tmp_path / "missing.gguf"  # a bad value is named, not the file
    for bad in (-1, 0, float("nan"), float("inf"), 1e30, "8", True, None.__class__):
        with pytest.raises(MemoryPlanError, match="simulate_memory must be"):
            loader.load(missing, simulate_memory=bad)
    assert mp.simulated_machine(0.5).limit == GiB // 2


# -- the machine -------------------------------------------------------------------------------------


def test_machine_readings():
    linux = mp.machine_from_readings("Linux", gpu=False, mem_total=24 * GiB)
    assert (linux.limit, linux.source, linux.wired) == (24 * GiB, "MemTotal", False)
    capped = mp.machine_from_readings("Linux", gpu=False, mem_total=24 * GiB, cgroup_limit=8 * GiB)
    assert (capped.limit, capped.source) == (8 * GiB, "the cgroup memory limit")
    assert mp.machine_from_readings("Linux", gpu=False, mem_total=24 * GiB, cgroup_limit=64 * GiB).limit == 24 * GiB
    mac_cpu = mp.machine_from_readings("Darwin", gpu=False, mem_total=64 * GiB, working_set=48 * GiB)
    assert (mac_cpu.limit, mac_cpu.source, mac_cpu.wired) == (64 * GiB, "hw.memsize", False)
    mac = mp.machine_from_readings("Darwin", gpu=True, mem_total=64 * GiB, working_set=48 * GiB, wired_limit_mb=0)
    assert (mac.limit, mac.wired) == (48 * GiB, True) and "macOS's default wired limit" in mac.source
    raised = mp.machine_from_readings("Darwin", gpu=True, mem_total=64 * GiB, working_set=56 * GiB,
                                      wired_limit_mb=57344)
    assert raised.limit == 56 * GiB and "iogpu.wired_limit_mb=57344" in raised.source
    sysctl_only = mp.machine_from_readings("Darwin", gpu=True, mem_total=64 * GiB, wired_limit_mb=40960)
    assert (sysctl_only.limit, sysctl_only.wired) == (40 * GiB, True)
    cuda = mp.machine_from_readings("Linux", gpu=True, mem_total=128 * GiB, gpu_memory=80 * GiB)
    assert (cuda.limit, cuda.source) == (80 * GiB, "the GPU's memory")
    assert mp.machine_from_readings("Linux", gpu=False, mem_total=128 * GiB, gpu_memory=80 * GiB).limit == 128 * GiB
    assert mp.machine_from_readings("Linux", gpu=True, mem_total=64 * GiB, gpu_memory=80 * GiB).limit == 64 * GiB
    unread = mp.machine_from_readings("Linux", gpu=False, mem_total=None)
    assert unread.limit is None


def test_cgroup_limit_files():
    v1 = "4:memory:/process_api/abc\n1:cpu,cpuacct:/\n0::/\n"
    assert mp.cgroup_limit_files(v1) == ["/sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes",
                                         "/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]
    assert mp.cgroup_limit_files("0::/user.slice/app.scope\n")[0] == "/sys/fs/cgroup/user.slice/app.scope/memory.max"
    assert mp.cgroup_limit_files("") == ["/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]


def test_an_unread_machine_refuses_nothing(tiny_cfg):
    w = mp.WeightBytes("host", "default", "cpu", (), 0, 0, 0, 0)
    p = mp.plan(tiny_cfg, w, ctx=64, machine=mp.Machine(None, "no reading"))
    assert p.fits is None and p.verdict().startswith("unknown")
    p.check()


def test_this_machine_is_read():
    m = mp.read_machine(gpu=False)
    assert m.limit is not None and 1 * GiB < m.limit <= (m.total or m.limit)


def test_the_cli_restates_the_simulated_limit():
    from ds4_mlx.frontends import args

    assert args.MAX_SIMULATED_GIB == mp.MAX_SIMULATED_GIB


# -- the command line ----------------------------------------------------------------------------------


def test_generate_with_a_small_simulated_machine_is_one_clean_line(tiny_model_path):
    r = subprocess.run([sys.executable, "-m", "ds4_mlx.frontends.cli", "generate", "-m", str(tiny_model_path),
                        "-p", "hi", "-n", "2", "--simulate-memory", "0.05"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode != 0 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("ds4-mlx generate: error: ") and "does not fit in memory" in lines[0]
    assert "51.2 MiB, --simulate-memory 0.05" in lines[0] and "KV at ctx 32768" in lines[0]


@pytest.mark.parametrize("value, why", [("-1", "must be in (0, 1048576]"), ("0", "must be in (0"),
                                        ("nan", "must be a finite number"), ("abc", "must be a number"),
                                        ("1e30", "must be in (0, 1048576]"), ("inf", "must be a finite number")])
def test_hostile_simulate_memory_values(capsys, tiny_model_path, value, why):
    for cmd in (["generate", "-m", str(tiny_model_path), "-p", "hi"], ["inspect", "--plan", str(tiny_model_path)]):
        assert main([*cmd, "--simulate-memory", value]) == 2
        err = capsys.readouterr().err
        assert f"--simulate-memory {why}" in err and "Traceback" not in err


def test_ctx_reaches_the_plan(capsys, tiny_model_path):
    """generate's --ctx is the plan's ctx: a small machine's refusal names it."""
    rc = main(["generate", "-m", str(tiny_model_path), "-p", "hi", "--ctx", "5000", "--simulate-memory", "0.05"])
    err = capsys.readouterr().err
    assert rc == 2 and "KV at ctx 5000" in err and len(err.strip().splitlines()) == 1


def test_inspect_plan(capsys, tiny_model_path):
    assert main(["inspect", "--plan", str(tiny_model_path), "--experts", "device", "--ctx", "4096"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("load plan: numerics default, backend ") and "experts device" in lines[0]
    lines = lines[1:]
    assert lines[0].startswith(f"memory plan: {tiny_model_path.name}, device experts, default numerics")
    assert lines[0].endswith("ctx 4096")
    for label in ("dense Q8_0 weights", "routed experts", "expert cache", "KV at ctx 4096", "scratch", "total",
                  "available"):
        assert any(line.strip().startswith(label) for line in lines), (label, out)
    kv = [line for line in lines if "KV at ctx 4096" in line]
    assert [("ratio 0" in x, "ratio 4)" in x, "ratio 128" in x) for x in kv] == [
        (True, False, False), (False, True, False), (False, False, True)]
    assert lines[-1].startswith("verdict: fits: ")
    assert main(["inspect", "--plan", str(tiny_model_path), "--simulate-memory", "0.05", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] is False and doc["limit_bytes"] == int(0.05 * GiB) and doc["ctx"] == 32768
    assert doc["load_plan"].startswith("load plan: ")
    assert doc["verdict"].startswith("does not fit: ") and sum(r["bytes"] for r in doc["rows"]) == doc["total_bytes"]


def test_plan_options_without_plan_are_refused(capsys, tiny_model_path):
    assert main(["inspect", str(tiny_model_path), "--ctx", "4096"]) == 2
    assert "--ctx only applies with --plan" in capsys.readouterr().err


def test_size_text():
    assert mp.size_text(0) == "0 B" and mp.size_text(1536) == "1.5 KiB"
    assert mp.size_text(GiB - 40) == "1 GiB" and mp.size_text(512 * MiB) == "512 MiB"
    assert mp.size_text(1100 * GiB) == "1100 GiB"


def test_chat_ctx_is_planned_too(monkeypatch, capsys, tmp_path, tiny_model_path):
    """chat's ``/ctx N`` after the load: a KV that does not fit is one line naming a /ctx that does."""
    import io

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "stdin", io.StringIO("/ctx 1000000\n/ctx 4096\n/quit\n"))
    rc = main(["chat", "-m", str(tiny_model_path), "--ctx", "64", "--simulate-memory", "1.5",
               "--chat-dir", str(tmp_path / "chats")])
    err = capsys.readouterr().err
    assert rc == 0 and "Traceback" not in err
    refusal = [line for line in err.splitlines() if "/ctx 1000000" in line]
    assert len(refusal) == 1 and "does not fit in memory" in refusal[0] and "> 1.5 GiB" in refusal[0]
    smaller = int(refusal[0].split("; /ctx ")[1].split()[0])
    assert 4096 <= smaller < 1000000 and "ctx 4096: new session" in err


def test_serve_hands_the_plan_and_cache_options_to_the_load(tiny_model_path):
    """serve builds its model on a worker thread from its own keywords, not ``model_options``:
    --ctx, --simulate-memory and --experts-cache must all reach ``ds4_mlx.load``."""
    from ds4_mlx.frontends.cli import build_parser
    from ds4_mlx.frontends.cmd_serve import server_parts

    args = build_parser().parse_args(["serve", "-m", str(tiny_model_path), "--ctx", "4096", "--simulate-memory",
                                      "0.05", "--experts", "device", "--experts-cache", "32"])
    backend, _ = server_parts(args)
    assert (backend.ctx, backend.simulate_memory, backend.experts_cache) == (4096, 0.05, "32")
    with pytest.raises(MemoryPlanError, match=r"KV at ctx 4096 .*--simulate-memory 0\.05"):
        backend._load()


def test_device_experts_that_do_not_fit_get_the_bounded_cache_that_does(tiny_model_path):
    """The issue's default: no ``experts_cache`` given and every expert does not fit beside the
    dense weights, the KV and the scratch -> the load bounds the device strategy at
    ``default_experts_cache_bytes`` (and plans it so) instead of refusing; same greedy tokens."""
    import ds4_mlx
    from ds4_mlx.formats.layout import load_model_file

    f, cfg, _ = load_model_file(tiny_model_path)
    try:
        everything = loader.plan_memory(f, cfg, load_plan.resolve(experts="device"), ctx=64, simulate_memory=1024)
    finally:
        f.close()
    # a machine a quarter of the routed experts short of holding them all (a bounded cache keeps no
    # dequantized-expert LRU, which the unbounded strategy has on the CPU)
    limit = (everything.total - everything.lru_bytes - everything.weights.experts_resident // 4) / GiB
    bounded = ds4_mlx.load(tiny_model_path, experts="device", ctx=64, simulate_memory=limit)
    assert bounded.network.expert_cache is not None
    plan = bounded.memory_plan
    assert plan.fits and plan.experts_bytes == 0 and 0 < plan.device_cache_bytes < everything.weights.experts_resident
    unbounded = ds4_mlx.load(tiny_model_path, experts="device", ctx=64, simulate_memory=1024)
    assert unbounded.network.expert_cache is None
    want = ds4_mlx.generate(unbounded, "Tell me about caches", max_tokens=6, temperature=0, raw=True)
    got = ds4_mlx.generate(bounded, "Tell me about caches", max_tokens=6, temperature=0, raw=True)
    assert got.tokens == want.tokens
    # an explicit budget is the user's: never replaced by the default
    explicit = ds4_mlx.load(tiny_model_path, experts="device", experts_cache="32", ctx=64, simulate_memory=1024)
    assert explicit.network.expert_cache.plan.slots == loader.expert_cache_plan(
        explicit.network.source, cfg, "32").slots


def test_inspect_plan_shows_the_cache_the_load_would_build(capsys, tiny_model_path):
    """``inspect --plan`` goes through ``loader.plan_load``: an explicit ``--experts-cache`` is
    planned with its bytes, and without one a machine too small for every expert gets the default
    bounded cache's plan (what the load would build), not a refusal."""
    import ds4_mlx

    engine = ds4_mlx.load(tiny_model_path, experts="device", experts_cache="32", ctx=64)
    assert main(["inspect", "--plan", str(tiny_model_path), "--experts", "device", "--experts-cache", "32",
                 "--ctx", "64", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["total_bytes"] == engine.memory_plan.total
    f_plan = loader.plan_memory(engine.network.source, engine.config, load_plan.resolve(experts="device"), ctx=64,
                                simulate_memory=1024)
    limit = (f_plan.total - f_plan.lru_bytes - f_plan.weights.experts_resident // 4) / GiB
    assert main(["inspect", "--plan", str(tiny_model_path), "--experts", "device", "--ctx", "64",
                 "--simulate-memory", f"{limit:.6f}", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] is True and doc["total_bytes"] < f_plan.total
    assert main(["inspect", "--plan", str(tiny_model_path), "--experts", "host", "--experts-cache", "32"]) == 2
    assert "--experts-cache bounds the device strategy" in capsys.readouterr().err
    assert main(["inspect", str(tiny_model_path), "--experts-cache", "32"]) == 2
    assert "--experts-cache only applies with --plan" in capsys.readouterr().err
