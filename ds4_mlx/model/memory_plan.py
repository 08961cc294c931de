"""The memory plan of a load: what the model will hold, checked against the machine before any weight is read.

    total = dense weights (per form) + routed experts + expert cache + KV at ctx + scratch
    scratch = max(1 GiB, a prefill chunk's activations, total_before_scratch / 10)
    fits  <=>  total <= machine.limit

* Dense weights: each tensor's resident form as the loader builds it (``loader._Weights.resident_nbytes``:
  float32 on MLX's CPU backend, ~3.8x a Q8_0 weight's GGUF bytes; 8-bit affine on Metal; ds4-cpu's
  decomposition), grouped by GGUF type. The embedding and the hash-routing tables are gathered row
  by row from the mapping and never resident as a whole: 0.
* Routed experts (~90 % of the 2-bit file): the "device" strategy copies every expert's raw blocks
  into MLX memory (their GGUF bytes); "host" reads the selected ones out of the mapping: 0.
* Expert cache: the dequantized-expert LRU (``experts.EXPERT_CACHE``) where the arithmetic fills it
  (DEFAULT numerics on the MLX-ops path: neither the native host products nor the Metal kernels),
  and a bounded device expert cache of ``experts_cache_bytes`` (then the routed experts themselves
  are not all resident).
* KV at ctx: the buffers ``cache.LayerCache`` allocates for a context of ``ctx`` tokens
  (``cache.buffer_shapes`` at ``capacity_for(ctx - 1)``), per layer type: the raw window only
  (ratio 0), window + compressed rows (ratio 128), window + compressed rows + indexer rows (ratio 4).
  One session's live cache; each further live session (``serve --sessions``) or checkpoint holds
  up to one more.
* Scratch: what the plan cannot size buffer by buffer and a process still needs: MLX's buffer cache,
  a prefill chunk's activations and the expert groups it dequantizes (``DS4_MLX_EXPERT_GROUP_MB``),
  session checkpoints, Python, the tokenizer and the OS beside us. The largest of: 1 GiB (a small
  model's fixed costs, which do not shrink with it); ``prefill_bytes``, a 2048-token chunk's
  activations, PREFILL_COPIES float32 copies of a token's widest rows (residual streams, query
  heads, routed intermediates), which do not grow with the layers (measured at real dims on the
  4-layer model: 3.5 to 4.6 copies over the planned buffers at the peak, benchmarks/NOTES.md);
  10 % of the rest, which grows with the model like the allocator's cache does.

The machine's limit: on Linux MemTotal, or the process's cgroup limit when lower; on macOS with a
GPU backend the Metal working-set limit (``recommendedMaxWorkingSetSize`` = the GPU wired limit,
``sysctl iogpu.wired_limit_mb``), which MLX's buffers must fit in, else hw.memsize; on a CUDA GPU its
memory when smaller than the host's (MLX's buffers live there);
``simulate_memory`` (GiB) replaces the reading (tests, and users checking a smaller machine). Unlike
ds4's ``--simulate-used-memory``, which locks that much memory away, it only changes the plan's
limit. ``read_machine`` is the one function here that reads the system; everything else is
arithmetic on its result, so the macOS branches are tested on this Linux box by injecting readings.

A plan that does not fit raises ``MemoryPlanError`` with one line naming the numbers and what would
fit: ``--experts host``, a bounded device expert cache (``--experts-cache``, ``model.expert_cache``:
``default_experts_cache_bytes``), a smaller ``--ctx``, or raising the GPU wired limit.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
from dataclasses import dataclass, field, replace

from ds4_mlx.errors import MemoryPlanError
from ds4_mlx.formats.config import ModelConfig
from ds4_mlx.model.cache import buffer_shapes, capacity_for

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SCRATCH_MIN = GiB
SCRATCH_FRACTION = 10  # scratch = 1/10 of the rest, at least the floor (module docstring)
# A prefill chunk (ds4's 2048 tokens, the Session's default, engine.session.DEFAULT_CHUNK: restated,
# the model layer does not import the engine; test_memory_plan checks they agree) and how many
# float32 copies of a token's widest activations are alive at its peak (module docstring).
PREFILL_CHUNK = 2048
PREFILL_COPIES = 6
MAX_SIMULATED_GIB = 1 << 20  # 1 PiB: anything larger is a typo, not a machine
# A bounded device expert cache holds at least two layers' routed experts (ds4 keeps two layers
# for a prefill: one computing while the next one's experts arrive).
MIN_CACHE_LAYERS = 2
# The bounded device expert cache's command-line option (``model.expert_cache``), which the refusal's
# advice offers with ``default_experts_cache_bytes`` of it (None: no such option, no such advice).
EXPERTS_CACHE_OPTION: str | None = "--experts-cache"


def size_text(n: int) -> str:
    """``n`` bytes as GiB / MiB / KiB / bytes, 3 significant digits."""
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit - unit // 2000:  # 1023.99 MiB reads as 1 GiB
            return f"{n / unit:.3g} {name}" if n < 1000 * unit else f"{n / unit:.0f} {name}"
    return f"{n} B"


# -- the machine -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    """The memory a plan must fit in: ``limit`` bytes (None: it could not be read, nothing is
    refused), read from ``source``; ``total``: physical memory; ``wired``: the limit is macOS's GPU
    wired limit (it can be raised with ``sudo sysctl iogpu.wired_limit_mb=N`` up to near ``total``)."""

    limit: int | None
    source: str
    total: int | None = None
    wired: bool = False


def machine_from_readings(system: str, *, gpu: bool, mem_total: int | None, cgroup_limit: int | None = None,
                          working_set: int | None = None, wired_limit_mb: int | None = None,
                          gpu_memory: int | None = None) -> Machine:
    """The ``Machine`` of these readings (bytes, None when unread): ``system`` as ``platform.system()``;
    ``gpu``: MLX computes on a GPU (Metal, CUDA); ``working_set``: Metal's
    recommendedMaxWorkingSetSize; ``wired_limit_mb``: ``sysctl iogpu.wired_limit_mb`` (0: macOS's
    default); ``gpu_memory``: a CUDA device's memory (MLX's buffers live there, not in host RAM)."""
    if system == "Darwin" and gpu:
        if working_set:
            why = (f"iogpu.wired_limit_mb={wired_limit_mb}" if wired_limit_mb
                   else "macOS's default wired limit")
            return Machine(int(working_set), f"the GPU wired limit ({why})", mem_total, wired=True)
        if wired_limit_mb:
            return Machine(int(wired_limit_mb) * MiB, f"the GPU wired limit (iogpu.wired_limit_mb={wired_limit_mb})",
                           mem_total, wired=True)
        return Machine(mem_total, "hw.memsize (the GPU wired limit could not be read)", mem_total)
    if system == "Darwin":
        return Machine(mem_total, "hw.memsize", mem_total)
    host = (Machine(int(cgroup_limit), "the cgroup memory limit", mem_total)
            if cgroup_limit is not None and mem_total is not None and cgroup_limit < mem_total
            else Machine(mem_total, "MemTotal" if system == "Linux" else "physical memory", mem_total))
    if gpu and gpu_memory and (host.limit is None or gpu_memory < host.limit):
        return Machine(int(gpu_memory), "the GPU's memory", mem_total)
    return host


def simulated_machine(gib) -> Machine:
    """A machine of ``gib`` GiB (``simulate_memory``); a bad value is a one-line ``MemoryPlanError``."""
    if isinstance(gib, bool) or not isinstance(gib, (int, float)):
        raise MemoryPlanError(f"simulate_memory must be a size in GiB, got {gib!r}")
    if not math.isfinite(gib) or not 0 < gib <= MAX_SIMULATED_GIB:
        raise MemoryPlanError(f"simulate_memory must be a finite size in GiB in (0, {MAX_SIMULATED_GIB}], "
                              f"got {gib!r}")
    n = int(gib * GiB)
    return Machine(n, f"--simulate-memory {gib:g}", n)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as fh:
            text = fh.read().strip()
        return int(text) if text.isdigit() else None  # "max": no limit
    except (OSError, ValueError):
        return None


def cgroup_limit_files(proc_self_cgroup: str) -> list[str]:
    """The files that may hold this process's cgroup memory limit, from ``/proc/self/cgroup``'s
    text: its v2 group's ``memory.max``, its v1 memory group's ``memory.limit_in_bytes``, then the
    roots' (a container often shows its own group as the root)."""
    out = []
    for line in proc_self_cgroup.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        path = path.strip().rstrip("/")
        if controllers == "":
            out.append(f"/sys/fs/cgroup{path}/memory.max")
        elif "memory" in controllers.split(","):
            out.append(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
    out += ["/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]
    return list(dict.fromkeys(out))


def _linux_readings() -> tuple[int | None, int | None]:
    total = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * KiB
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/proc/self/cgroup") as fh:
            groups = fh.read()
    except OSError:
        groups = ""
    # no limit reads as "max" (v2) or a huge number (v1): larger than the memory, so never the limit
    limits = [n for n in map(_read_int, cgroup_limit_files(groups)) if n]
    return total, min(limits) if limits else None


def _sysctl_int(name: str) -> int | None:
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
        return int(out.stdout.strip()) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def _device_info(key: str) -> int | None:
    """An integer of MLX's GPU ``device_info`` (Metal: max_recommended_working_set_size, CUDA:
    total_memory); None when MLX does not report it."""
    import mlx.core as mx

    info = getattr(mx, "device_info", None) or mx.metal.device_info
    try:
        return int(info().get(key) or 0) or None
    except Exception:  # a reading only: without it the plan uses the host's memory
        return None


def read_machine(gpu: bool) -> Machine:
    """This machine's ``Machine`` (the one function of the plan that reads the system)."""
    system = platform.system()
    if system == "Linux":
        total, cgroup = _linux_readings()
        return machine_from_readings(system, gpu=gpu, mem_total=total, cgroup_limit=cgroup,
                                     gpu_memory=_device_info("total_memory") if gpu else None)
    total = None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        pass
    if system != "Darwin":
        return machine_from_readings(system, gpu=gpu, mem_total=total)
    total = _sysctl_int("hw.memsize") or total
    working_set = wired_mb = None
    if gpu:
        working_set = _device_info("max_recommended_working_set_size")
        wired_mb = _sysctl_int("iogpu.wired_limit_mb")
    return machine_from_readings(system, gpu=gpu, mem_total=total, working_set=working_set,
                                 wired_limit_mb=wired_mb)


# -- what the model holds -----------------------------------------------------------------------------


@dataclass(frozen=True)
class DenseForm:
    """Tensors of one GGUF type and kind that the loader holds in one resident form."""

    label: str  # e.g. "dense Q8_0", "float32 vectors", "mapped"
    count: int
    gguf_bytes: int
    resident_bytes: int


@dataclass(frozen=True)
class WeightBytes:
    """What one load's weights hold for one expert strategy (``loader.weight_bytes`` fills it).

    ``experts_gguf``: the routed-expert tensors' GGUF bytes; ``experts_resident``: what the strategy
    copies into memory (device: all raw blocks; host: 0); ``expert_lru``: the host LRU's budget the
    arithmetic can fill (0 where it keeps none); ``layer_experts``: the largest layer's routed-expert
    GGUF bytes (a bounded device cache's unit)."""

    strategy: str
    numerics: str
    backend: str
    dense: tuple[DenseForm, ...]
    experts_gguf: int
    experts_resident: int
    expert_lru: int
    layer_experts: int

    @property
    def dense_bytes(self) -> int:
        return sum(d.resident_bytes for d in self.dense)


LAYER_TYPES = {0: "raw window (ratio 0)", 4: "window + rows/4 + indexer (ratio 4)",
               128: "window + rows/128 (ratio 128)"}


def kv_bytes(cfg: ModelConfig, ctx: int) -> dict[int, tuple[int, int]]:
    """KV buffers of a session at ``ctx`` tokens per compress ratio: {ratio: (layers, bytes)}, as
    ``cache.LayerCache`` allocates them once its last position ctx - 1 is reserved."""
    cap = capacity_for(max(int(ctx) - 1, 0))
    out: dict[int, tuple[int, int]] = {}
    for il in range(cfg.n_layer):
        r = cfg.compress_ratio(il)
        n = sum(4 * a * b for a, b in buffer_shapes(cfg, il, cap))  # float32
        layers, total = out.get(r, (0, 0))
        out[r] = (layers + 1, total + n)
    return dict(sorted(out.items()))


def prefill_bytes(cfg: ModelConfig, chunk: int = PREFILL_CHUNK) -> int:
    """A prefill chunk's activations at their peak (module docstring): ``PREFILL_COPIES`` float32
    copies, per token, of the hyper-connection streams, the query heads and the routed experts'
    intermediates."""
    widest = cfg.n_hc * cfg.n_embd + cfg.n_head * cfg.head_dim + cfg.n_expert_used * cfg.n_ff_exp
    return PREFILL_COPIES * 4 * widest * int(chunk)


def scratch_bytes(rest: int, floor: int = SCRATCH_MIN) -> int:
    """Runtime scratch beside ``rest`` planned bytes: 10 % of it, at least ``floor``."""
    return max(floor, rest // SCRATCH_FRACTION)


def _largest_fitting(limit: int, floor: int = SCRATCH_MIN) -> int:
    """The largest x with x + scratch_bytes(x, floor) <= limit (-1 when even 0 does not fit)."""
    x = limit - floor
    if x < 0:
        return -1
    if scratch_bytes(x, floor) == floor:
        return x
    x = limit * SCRATCH_FRACTION // (SCRATCH_FRACTION + 1)
    while x + scratch_bytes(x, floor) > limit:
        x -= 1
    while x + 1 + scratch_bytes(x + 1, floor) <= limit:
        x += 1
    return x


# -- the plan ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    label: str
    detail: str
    nbytes: int


@dataclass(frozen=True)
class MemoryPlan:
    """One load's plan (``plan``); ``check()`` raises the one-line refusal when it does not fit."""

    cfg: ModelConfig = field(repr=False, compare=False)
    weights: WeightBytes
    ctx: int
    machine: Machine
    experts_cache_bytes: int | None = None
    host: WeightBytes | None = field(default=None, repr=False, compare=False)  # for the advice
    name: str = "the model"

    # -- the numbers -------------------------------------------------------------------------------

    @property
    def experts_bytes(self) -> int:
        """Routed experts held outside any cache."""
        return 0 if self.experts_cache_bytes is not None else self.weights.experts_resident

    @property
    def device_cache_bytes(self) -> int:
        """A bounded device expert cache's bytes (at most every expert's); 0 without one."""
        if self.experts_cache_bytes is None:
            return 0
        return min(int(self.experts_cache_bytes), self.weights.experts_gguf)

    @property
    def lru_bytes(self) -> int:
        """The dequantized-expert LRU's: none beside a bounded device cache (``expert_cache``: its
        grouped paths keep no dequantized expert)."""
        return 0 if self.experts_cache_bytes is not None else self.weights.expert_lru

    @property
    def cache_bytes(self) -> int:
        """Every expert cache: the bounded device cache and the dequantized-expert LRU."""
        return self.device_cache_bytes + self.lru_bytes

    @property
    def kv(self) -> dict[int, tuple[int, int]]:
        return kv_bytes(self.cfg, self.ctx)

    @property
    def kv_total(self) -> int:
        return sum(b for _, b in self.kv.values())

    @property
    def planned(self) -> int:
        """Everything but the scratch."""
        return self.weights.dense_bytes + self.experts_bytes + self.cache_bytes + self.kv_total

    @property
    def scratch_floor(self) -> int:
        """The scratch's least: 1 GiB, or a prefill chunk's activations when larger."""
        return max(SCRATCH_MIN, prefill_bytes(self.cfg))

    @property
    def scratch(self) -> int:
        return scratch_bytes(self.planned, self.scratch_floor)

    @property
    def total(self) -> int:
        return self.planned + self.scratch

    @property
    def fits(self) -> bool | None:
        """None when the machine's memory is unknown (nothing is refused then)."""
        return None if self.machine.limit is None else self.total <= self.machine.limit

    def rows(self) -> list[Row]:
        w = self.weights
        out = []
        for d in w.dense:
            ratio = f", held x{d.resident_bytes / d.gguf_bytes:.2f}" if d.gguf_bytes and d.resident_bytes else ""
            out.append(Row(d.label, f"{d.count} tensors, {size_text(d.gguf_bytes)} in the file{ratio}",
                           d.resident_bytes))
        if self.experts_cache_bytes is not None:
            how = "device strategy, bounded cache: the rest stays in the mapping"
        elif w.strategy == "device":
            how = "device strategy: every expert's raw blocks copied into MLX memory"
        else:
            how = "host strategy: read from the mapping"
        out.append(Row("routed experts", f"{size_text(w.experts_gguf)} in the file; {how}", self.experts_bytes))
        if self.experts_cache_bytes is not None:
            out.append(Row("expert cache", f"bounded device cache: slots and prefill working set, "
                                           f"{size_text(int(self.experts_cache_bytes))} (raw blocks)",
                           self.device_cache_bytes))
        else:
            what = ("dequantized-expert LRU (DS4_MLX_EXPERT_CACHE_MB)" if w.expert_lru
                    else "no dequantized-expert LRU (this arithmetic reads the blocks)")
            out.append(Row("expert cache", what, self.lru_bytes))
        for r, (layers, nbytes) in self.kv.items():
            out.append(Row(f"KV at ctx {self.ctx}", f"{LAYER_TYPES.get(r, f'ratio {r}')}, {layers} layers", nbytes))
        out.append(Row("scratch", f"the most of 1 GiB, a {PREFILL_CHUNK}-token prefill chunk's activations "
                                  f"({size_text(prefill_bytes(self.cfg))}) and 10 % of the rest: "
                                  f"MLX's buffer cache, Python, the OS", self.scratch))
        return out

    def verdict(self) -> str:
        m = self.machine
        if m.limit is None:
            return f"unknown: the machine's memory could not be read ({m.source}); not checked"
        room = f"{size_text(self.total)} of {size_text(m.limit)}, {m.source}"
        return f"fits: {room}" if self.fits else f"does not fit: {room}; {self.advice()}"

    def to_dict(self) -> dict:
        return {"ctx": self.ctx, "strategy": self.weights.strategy, "numerics": self.weights.numerics,
                "backend": self.weights.backend, "experts_cache_bytes": self.experts_cache_bytes,
                "rows": [{"label": r.label, "detail": r.detail, "bytes": r.nbytes} for r in self.rows()],
                "total_bytes": self.total, "limit_bytes": self.machine.limit, "limit_source": self.machine.source,
                "fits": self.fits, "verdict": self.verdict()}

    # -- the refusal ---------------------------------------------------------------------------------

    def _with(self, **changes) -> "MemoryPlan":
        return replace(self, **changes)

    def _fitting_ctx(self) -> "MemoryPlan | None":
        """This plan at the largest halving of its ctx that fits (None: none does; the KV stops
        shrinking at the cache's smallest capacity, so the halving stops there)."""
        ctx = self.ctx // 2
        while ctx >= 2:
            smaller = self._with(ctx=ctx)
            if smaller.fits:
                return smaller
            if capacity_for(ctx - 1) == capacity_for(0):
                return None
            ctx //= 2
        return None

    def advice(self) -> str:
        """What would fit, as one clause: other options of this load, smallest change first."""
        ways = []
        if self.weights.strategy == "device" and self.experts_cache_bytes is None and self.host is not None:
            host = self._with(weights=self.host)
            if host.fits:
                ways.append(f"--experts host ({size_text(host.total)})")
            elif (smaller := host._fitting_ctx()) is not None:
                ways.append(f"--experts host --ctx {smaller.ctx} ({size_text(smaller.total)})")
        if EXPERTS_CACHE_OPTION and self.weights.strategy == "device":
            try:
                n = default_experts_cache_bytes(self._with(experts_cache_bytes=None))
            except MemoryPlanError:
                n = None
            if n is not None:
                n = math.floor(n / GiB * 10) * GiB // 10  # written to 0.1 GB, rounded down: it still fits
                ways.append(f"{EXPERTS_CACHE_OPTION} {n / GiB:.1f}GB "
                            f"({size_text(self._with(experts_cache_bytes=n).total)})")
        if (smaller := self._fitting_ctx()) is not None:
            ways.append(f"--ctx {smaller.ctx} ({size_text(smaller.total)})")
        m = self.machine
        if m.wired and m.total and self.total <= m.total:
            mb = -(-self.total // (1 << 30)) * 1024  # whole GiB, in MiB
            ways.append(f"raise the GPU wired limit: sudo sysctl iogpu.wired_limit_mb={mb} "
                        f"(of {m.total // MiB} MiB)")
        if not ways:
            best = self._with(weights=self.host or self.weights, experts_cache_bytes=None, ctx=2)
            return f"nothing smaller fits: even --experts host at the smallest --ctx needs {size_text(best.total)}"
        return "it would fit with " + ", or ".join(ways)

    def summary(self) -> str:
        """The sum in one clause: every part and the total."""
        kv = self.kv_total
        return (f"dense weights {size_text(self.weights.dense_bytes)} + routed experts {size_text(self.experts_bytes)}"
                f" + expert cache {size_text(self.cache_bytes)} + KV at ctx {self.ctx} {size_text(kv)}"
                f" + scratch {size_text(self.scratch)} = {size_text(self.total)}")

    def check_ctx(self, ctx: int, what: str = "ctx") -> None:
        """Raise ``MemoryPlanError`` unless this load fits with sessions of ``ctx`` tokens (a chat's
        ``/ctx N`` after the load), naming the largest halving that does; ``what`` names the option."""
        at = self._with(ctx=min(int(ctx), self.cfg.context_length))
        if at.fits is False:
            smaller = at._fitting_ctx()
            hint = f"; {what} {smaller.ctx} fits ({size_text(smaller.total)})" if smaller is not None else ""
            raise MemoryPlanError(f"{what} {ctx} does not fit in memory: {at.summary()} > "
                                  f"{size_text(self.machine.limit)}, {self.machine.source}{hint}")

    def check(self) -> None:
        """Raise ``MemoryPlanError`` (one line: the sum, the limit, what would fit) unless it fits."""
        if self.fits is False:
            raise MemoryPlanError(f"{self.name} does not fit in memory ({self.weights.strategy} experts, "
                                  f"{self.weights.numerics} numerics): {self.summary()} > "
                                  f"{size_text(self.machine.limit)}, {self.machine.source}; {self.advice()}")


def plan(cfg: ModelConfig, weights: WeightBytes, *, ctx: int, machine: Machine, experts_cache_bytes: int | None = None,
         host: WeightBytes | None = None, name: str = "the model") -> MemoryPlan:
    """The plan of a load (module docstring). ``ctx``: the sessions' context (capped at the model's);
    ``experts_cache_bytes``: a bounded device expert cache (None: every routed expert resident with
    the device strategy); ``host``: the same weights with the host strategy (the advice's figure)."""
    if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 1:
        raise MemoryPlanError(f"the plan's ctx must be a positive integer, got {ctx!r}")
    if experts_cache_bytes is not None and (isinstance(experts_cache_bytes, bool)
                                            or not isinstance(experts_cache_bytes, int) or experts_cache_bytes < 0):
        raise MemoryPlanError(f"experts_cache_bytes must be a byte count >= 0, got {experts_cache_bytes!r}")
    return MemoryPlan(cfg, weights, min(ctx, cfg.context_length), machine, experts_cache_bytes, host, name)


def default_experts_cache_bytes(p: MemoryPlan) -> int | None:
    """The bounded device expert cache's default for plan ``p``'s load (issue #24): None (every
    expert resident, no bound) when they all fit; else the budget (``experts_cache`` bytes: slots
    plus ds4's prefill reserve) that fits beside the dense weights, the KV at ``p.ctx`` and the
    scratch, at least ``MIN_CACHE_LAYERS`` layers' routed experts plus the k slots per layer a
    token needs; a ``MemoryPlanError`` when even that does not fit."""
    every = p._with(experts_cache_bytes=None)
    if every.weights.strategy != "device" or every.fits is not False:
        return None
    base = p.weights.dense_bytes + p.kv_total  # a bounded cache keeps no dequantized expert
    n = _largest_fitting(p.machine.limit, p.scratch_floor) - base
    # ds4's prefill reserve of two full layers, plus the k slots per layer a token needs
    # (``expert_budget.plan_cache`` refuses fewer)
    floor = MIN_CACHE_LAYERS * p.weights.layer_experts + p.cfg.n_expert_used * p.weights.experts_gguf // p.cfg.n_expert
    if n < floor:
        need = p._with(experts_cache_bytes=floor)
        raise MemoryPlanError(f"{p.name} does not fit in memory even with the smallest device expert cache "
                              f"({MIN_CACHE_LAYERS} layers of prefill reserve and {p.cfg.n_expert_used} slots per "
                              f"layer, {size_text(floor)}): {need.summary()} > "
                              f"{size_text(p.machine.limit)}, {p.machine.source}")
    return min(n, p.weights.experts_gguf)
