"""Build a ``Model`` from a DS4 Flash GGUF: every shape from the metadata, every weight by name.

Small tensors (norms, HC scale/base, sinks, APE, router bias) become float32 MLX arrays; matmul
weights become ``linear`` objects that keep the GGUF bytes mmap-backed; the embedding stays an
F16 mmap view gathered row by row.
"""

from __future__ import annotations

import dataclasses
import os

import mlx.core as mx
import numpy as np

from ds4_mlx import native
from ds4_mlx.errors import LayoutError
from ds4_mlx.formats.config import DEFAULT_CTX, ModelConfig
from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.formats.gguf import GGUFFile
from ds4_mlx.formats.layout import load_model_file
from ds4_mlx.model.attention import Attention
from ds4_mlx.model.compiled_decode import CompiledDecoder, probe_compiler
from ds4_mlx.model.compressor import Compressor
from ds4_mlx.model.device_experts import DEVICE_ROUTING, DeviceExpertWeights
from ds4_mlx.model.expert_budget import parse_experts_cache, plan_cache
from ds4_mlx.model.expert_cache import CachedDeviceExpertWeights, ExpertCacheSet, check_policy
from ds4_mlx.model.expert_cache_policy import DEFAULT_POLICY
from ds4_mlx.model.experts import EXPERT_CACHE, ExpertWeights, routed_resident_nbytes
from ds4_mlx.model.host_step import HOST_ROUTING, HostStepDecoder
from ds4_mlx.model.hyper_connection import HyperConnection, OutputHC
from ds4_mlx.model.indexer import Indexer
from ds4_mlx.model.linear import DenseWeight
from ds4_mlx.model.moe import MoE
from ds4_mlx.model import distributed as dist, expert_parallel, load_plan, memory_plan, pipeline
from ds4_mlx.model.load_plan import LoadPlan
from ds4_mlx.model.ops import DefaultOps, Numerics, ops_for
from ds4_mlx.model.rope import Rope
from ds4_mlx.model.transformer import Block, Model


def _open(path: str | os.PathLike) -> tuple[GGUFFile, ModelConfig]:
    f, cfg, _report = load_model_file(path)
    return f, cfg


def parse_numerics(numerics: str | Numerics) -> Numerics:
    try:
        return Numerics(numerics)
    except ValueError:
        raise LayoutError(f"unknown numerics mode {numerics!r}; expected one of "
                          f"{[n.value for n in Numerics]}") from None


# How ``_block`` / ``_build`` take each tensor (``tensor_kind``): small float32 arrays by these
# name endings, the embedding and the hash table as mmap views, routed experts, the rest dense.
_F32_SUFFIXES = ("_norm.weight", "_scale.weight", "_base.weight", "_ape.weight", "_sinks.weight", ".bias")
EMBEDDING = "token_embd.weight"


def tensor_kind(name: str) -> str:
    """How the loader builds tensor ``name``: "embedding" or "table" (mmap views, gathered from),
    "experts" (``ExpertWeights``), "f32" (a float32 MLX array), "dense" (``DenseWeight``).
    ``test_pipeline_split`` checks it against what ``_Weights`` records while building the model."""
    if name == EMBEDDING:
        return "embedding"
    if name.endswith("_tid2eid.weight"):
        return "table"
    if name.endswith("_exps.weight"):
        return "experts"
    if name.endswith(_F32_SUFFIXES):
        return "f32"
    return "dense"


class _Weights:
    """Name-checked access to the GGUF tensors, built as the load plan ``lp`` says (its backend's
    dense forms, its expert strategy, kernel dialect and expert group size: passed to every weight
    explicitly); ``kinds`` records how each was taken."""

    def __init__(self, f: GGUFFile, lp: LoadPlan, owned: range | None = None,
                 caches: ExpertCacheSet | None = None):
        self.f = f
        self.plan = lp
        self.caches = caches  # a bounded device expert cache (``expert_cache``): slots per layer
        self.kw = {"backend": lp.backend}
        self.ekw = {"backend": lp.backend, "use_kernels": lp.kernels or False,
                    "group_bytes": lp.expert_group_bytes}
        self.strategy = lp.experts
        self.expert_cls = DeviceExpertWeights if lp.experts == "device" else ExpertWeights
        # Where the MoEs choose their experts, and the decode step that follows from it: on the device
        # when every expert is resident (the whole layer compiles), on the host otherwise (the host
        # strategy; a bounded cache, whose misses are read from the file).
        on_device = lp.experts == "device" and caches is None
        self.routing = DEVICE_ROUTING if on_device else HOST_ROUTING
        self.decoder = CompiledDecoder if on_device else HostStepDecoder
        self.owned = owned  # an expert-parallel rank's routed experts (None: all of them)
        self.kinds: dict[str, str] = {}

    def has(self, name: str) -> bool:
        return name in self.f.tensors

    def resident_nbytes(self, name: str, numerics: str | Numerics, lru_bytes: int = 0,
                        rows: range | None = None) -> int:
        """Bytes tensor ``name`` will hold in memory once used in ``numerics`` (beyond the mapping),
        decided by the same classes that build it: ``DenseWeight.resident_nbytes`` for a dense
        weight (its backend resolved as when built; ``rows``: of those output rows only, as
        ``dense(name, rows)`` builds it), ``routed_resident_nbytes`` for routed experts
        (``lru_bytes``: the tensor's share of the expert LRU), 4 per element for the float32 arrays,
        0 for the mmap views (the embedding is gathered row by row, never resident as a whole)."""
        kind = tensor_kind(name)
        numerics = parse_numerics(numerics)
        try:
            if kind == "dense":
                w = DenseWeight.from_gguf(self.f, name, rows=rows, **self.kw)
                if name == pipeline.HEAD and host_head(dataclasses.replace(self.plan, numerics=numerics.value),
                                                       w.qtype):
                    # no cached form, but the whole matrix is read every token: its pages stay mapped
                    return w.nbytes
                return w.ds4_cpu_resident_nbytes() if numerics is Numerics.DS4_CPU else w.resident_nbytes()
            if kind == "experts":
                e = ExpertWeights.from_gguf(self.f, name, **self.ekw)  # a view; decides use_kernels as built
                # only DEFAULT's dequantized path fills the LRU (ds4-cpu re-reads, the kernels read blocks)
                keeps = numerics is Numerics.DEFAULT and not e.use_kernels
                return routed_resident_nbytes(e.qtype, e.shape, device=self.strategy == "device",
                                              lru_bytes=lru_bytes if keeps else 0)
        except LayoutError:
            # not a tensor the model takes in this form (an extra tensor the loader ignores): it
            # holds nothing; if the model does need it, building the rank fails with this error
            return 0
        if kind == "f32":
            return 4 * int(np.prod(self.f.tensor(name).shape))
        return 0

    def f32(self, name: str, shape: tuple[int, ...] | None = None) -> mx.array:
        if name not in self.f.tensors:
            raise LayoutError(f"{self.f.path}: tensor {name!r} is missing")
        self.kinds[name] = "f32"
        a = np.asarray(self.f.tensor_array(name)).astype(np.float32)
        if shape is not None:
            if a.size != int(np.prod(shape)):
                raise LayoutError(f"{self.f.path}: tensor {name!r} has {a.size} elements, expected shape {shape}")
            a = a.reshape(shape)
        return mx.array(a)

    def dense(self, name: str, rows: range | None = None) -> DenseWeight:
        """A dense weight; ``rows``: only those output rows, read and held (a pipeline rank's share)."""
        if name not in self.f.tensors:
            raise LayoutError(f"{self.f.path}: tensor {name!r} is missing")
        self.kinds[name] = "dense"
        return DenseWeight.from_gguf(self.f, name, rows=rows, **self.kw)

    def experts(self, name: str) -> ExpertWeights:
        if name not in self.f.tensors:
            raise LayoutError(f"{self.f.path}: tensor {name!r} is missing")
        self.kinds[name] = "experts"
        if self.owned is not None:
            return expert_parallel.OwnedExperts.from_gguf(self.expert_cls, self.f, name, self.owned, **self.ekw)
        if self.caches is not None:
            layer = self.caches.layer(int(name.split(".")[1]))
            return CachedDeviceExpertWeights.from_gguf(self.f, name, layer, **self.ekw)
        return self.expert_cls.from_gguf(self.f, name, **self.ekw)


def _block(cfg: ModelConfig, w: _Weights, il: int, ops: DefaultOps, gather=None, prefix: str | None = None,
           hash_routed: bool | None = None) -> Block:
    """Layer ``il`` from the tensors named ``blk.{il}.*``; ``prefix``: another name prefix (a
    drafter's ``mtp.0.``, run as layer ``il``), ``hash_routed``: override ``cfg.is_hash_layer(il)``
    (a drafter block routes by scores whatever layer it runs as)."""
    p = f"blk.{il}." if prefix is None else prefix
    eps, n_hc = cfg.rms_eps, cfg.n_hc
    ratio = cfg.compress_ratio(il)

    def hc(kind: str) -> HyperConnection:
        return HyperConnection(w.dense(f"{p}hc_{kind}_fn.weight"), w.f32(f"{p}hc_{kind}_scale.weight", (3,)),
                               w.f32(f"{p}hc_{kind}_base.weight", (cfg.hc_mix,)), n_hc, cfg.hc_sinkhorn_iter,
                               cfg.hc_eps, eps, ops)

    rope = Rope(cfg, il)
    compressor = index_compressor = indexer = None
    if ratio:
        coff = cfg.coff(il)
        compressor = Compressor(w.dense(f"{p}attn_compressor_kv.weight"), w.dense(f"{p}attn_compressor_gate.weight"),
                                w.f32(f"{p}attn_compressor_ape.weight", (ratio, coff * cfg.head_dim)),
                                w.f32(f"{p}attn_compressor_norm.weight", (cfg.head_dim,)),
                                ratio, cfg.head_dim, rope, cfg.n_nope, eps, coff, ops)
    if ratio == 4:
        di = cfg.indexer_head_dim
        index_compressor = Compressor(w.dense(f"{p}indexer_compressor_kv.weight"),
                                      w.dense(f"{p}indexer_compressor_gate.weight"),
                                      w.f32(f"{p}indexer_compressor_ape.weight", (4, coff * di)),
                                      w.f32(f"{p}indexer_compressor_norm.weight", (di,)),
                                      4, di, rope, None, eps, coff, ops)
        indexer = Indexer(w.dense(f"{p}indexer.attn_q_b.weight"), w.dense(f"{p}indexer.proj.weight"),
                          cfg.n_indexer_head, di, cfg.indexer_top_k, ops)

    attn = Attention(cfg, il,
                     attn_norm=w.f32(f"{p}attn_norm.weight", (cfg.n_embd,)),
                     q_a=w.dense(f"{p}attn_q_a.weight"),
                     q_a_norm=w.f32(f"{p}attn_q_a_norm.weight", (cfg.q_lora_rank,)),
                     q_b=w.dense(f"{p}attn_q_b.weight"),
                     kv=w.dense(f"{p}attn_kv.weight"),
                     kv_norm=w.f32(f"{p}attn_kv_a_norm.weight", (cfg.head_dim,)),
                     sinks=w.f32(f"{p}attn_sinks.weight", (cfg.n_head,)),
                     out_a=w.dense(f"{p}attn_output_a.weight"),
                     out_b=w.dense(f"{p}attn_output_b.weight"),
                     compressor=compressor, index_compressor=index_compressor, indexer=indexer, ops=ops)

    tid2eid = None
    hashed = cfg.is_hash_layer(il) if hash_routed is None else hash_routed
    if hashed:
        name = f"{p}ffn_gate_tid2eid.weight"
        if not w.has(name):
            raise LayoutError(f"{w.f.path}: hash layer {il} needs tensor {name!r}")
        w.kinds[name] = "table"
        tid2eid = np.asarray(w.f.tensor_array(name)).reshape(-1, cfg.n_expert_used)
        if tid2eid.min(initial=0) < 0 or tid2eid.max(initial=0) >= cfg.n_expert:
            raise LayoutError(f"{w.f.path}: {name} holds expert ids outside 0..{cfg.n_expert - 1}")
    bias = w.f32(f"{p}exp_probs_b.bias", (cfg.n_expert,)) if w.has(f"{p}exp_probs_b.bias") else None
    ffn = MoE(ffn_norm=w.f32(f"{p}ffn_norm.weight", (cfg.n_embd,)),
              router=w.dense(f"{p}ffn_gate_inp.weight"), bias=bias, tid2eid=tid2eid,
              gate_exps=w.experts(f"{p}ffn_gate_exps.weight"), up_exps=w.experts(f"{p}ffn_up_exps.weight"),
              down_exps=w.experts(f"{p}ffn_down_exps.weight"),
              gate_sh=w.dense(f"{p}ffn_gate_shexp.weight"), up_sh=w.dense(f"{p}ffn_up_shexp.weight"),
              down_sh=w.dense(f"{p}ffn_down_shexp.weight"),
              n_used=cfg.n_expert_used, weight_scale=cfg.expert_weights_scale, clamp=cfg.swiglu_clamp[il], eps=eps,
              ops=ops, routing=w.routing, gather=gather)
    return Block(il, hc("attn"), attn, hc("ffn"), ffn)


def host_head(lp: LoadPlan, qtype: GGMLType | int) -> bool:
    """Whether the output matrix is multiplied on the host by the native library, from its Q8_0 blocks
    (``DenseWeight.host_product``; ``Model.host_head``) instead of by MLX as float32: DEFAULT numerics
    with the host expert strategy where the plan runs the native host products (MLX's CPU backend,
    ``DS4_MLX_NATIVE`` not off), a Q8_0 head and the native library built. ds4-cpu numerics keep
    their exact arithmetic, a GPU its own matmul (the logits stay on the device there)."""
    return (parse_numerics(lp.numerics) is Numerics.DEFAULT and lp.experts == "host"
            and GGMLType(qtype) == GGMLType.Q8_0 and lp.native and native.library() is not None)


def _lru_budget(lp: LoadPlan) -> int:
    """The expert LRU's budget a load with plan ``lp`` may fill (``EXPERT_CACHE`` once sized by it,
    ``ExpertCache.planned_bytes``); 0 for the host strategy with the native library, whose products
    read the blocks in place, so the LRU never fills (``ds4_mlx.native``)."""
    budget = EXPERT_CACHE.planned_bytes(lp.expert_cache_bytes, lp.expert_cache_explicit)
    return 0 if lp.experts == "host" and native.library() is not None else budget


def _routed_names(f: GGUFFile, cfg: ModelConfig) -> dict[str, int]:
    """The routed-expert tensors the blocks take (``_block``) and their GGUF bytes: another tensor
    named like one builds nothing, and must not take a share of the LRU budget from them."""
    return {n: int(f.tensor(n).nbytes) for il in range(cfg.n_layer) for part in ("gate", "up", "down")
            if (n := f"blk.{il}.ffn_{part}_exps.weight") in f.tensors}


def weight_bytes(f: GGUFFile, cfg: ModelConfig, lp: LoadPlan) -> memory_plan.WeightBytes:
    """What the weights of a one-process load with plan ``lp`` will hold (``memory_plan.WeightBytes``),
    from the tensor directory only (nothing of the data is read): each tensor's
    ``_Weights.resident_nbytes``, grouped by form, the routed experts' raw blocks and LRU share apart.
    The LRU budget is spread over the expert tensors as ``resident_split`` spreads it."""
    mode = parse_numerics(lp.numerics)
    w = _Weights(f, lp)
    routed = _routed_names(f, cfg)
    total, budget = sum(routed.values()), _lru_budget(lp)
    forms: dict[str, list[int]] = {}
    experts_resident = expert_lru = 0
    per_layer = [0] * cfg.n_layer
    for name, info in f.tensors.items():
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) > 2 and not (parts[1].isdigit() and int(parts[1]) < cfg.n_layer):
            continue  # a block the model does not have builds nothing
        kind = tensor_kind(name)
        if kind == "experts":
            if name not in routed:
                continue
            raw = w.resident_nbytes(name, mode, 0)
            experts_resident += raw
            expert_lru += w.resident_nbytes(name, mode, budget * routed[name] // total) - raw
            per_layer[int(parts[1])] += routed[name]
            continue
        nbytes = w.resident_nbytes(name, mode)
        if kind in ("embedding", "table"):
            label = "embedding, hash tables (gathered from the mapping)"
        elif kind == "f32":
            label = "float32 vectors (norms, scales, sinks, biases)"
        elif name == pipeline.HEAD and nbytes == info.nbytes:
            label = f"output head {info.ggml_type.name} (read in place, its pages stay mapped)"
        else:
            label = f"dense {info.ggml_type.name} weights"
        entry = forms.setdefault(label, [0, 0, 0])
        entry[0] += 1
        entry[1] += int(info.nbytes)
        entry[2] += nbytes
    dense = tuple(memory_plan.DenseForm(label, *entry) for label, entry in forms.items())
    return memory_plan.WeightBytes(lp.experts, mode.value, lp.backend, dense,
                                   total, experts_resident, expert_lru, max(per_layer, default=0))


def plan_memory(f: GGUFFile, cfg: ModelConfig, lp: LoadPlan, *, ctx: int | None = None,
                simulate_memory: float | None = None,
                experts_cache_bytes: int | None = None) -> memory_plan.MemoryPlan:
    """The memory plan of loading ``f`` with plan ``lp`` (``model.memory_plan``), against this
    machine (or a simulated one of ``simulate_memory`` GiB). ``ctx``: the sessions' context (None:
    ``DEFAULT_CTX`` capped at the model's, the default a session gets)."""
    machine = (memory_plan.simulated_machine(simulate_memory) if simulate_memory is not None
               else memory_plan.read_machine(gpu=lp.gpu))  # MLX's buffers on a GPU
    weights = weight_bytes(f, cfg, lp)
    host = weights if lp.experts == "host" else weight_bytes(f, cfg, dataclasses.replace(lp, experts="host"))
    ctx = min(DEFAULT_CTX, cfg.context_length) if ctx is None else ctx
    return memory_plan.plan(cfg, weights, ctx=ctx, machine=machine, experts_cache_bytes=experts_cache_bytes,
                            host=host, name=os.path.basename(f.path))


def resident_split(f: GGUFFile, cfg: ModelConfig, n_ranks: int, lp: LoadPlan) -> pipeline.PipelineSplit:
    """The pipeline's split for ``n_ranks`` (layer ranges and the output head's rows shared by rank 0
    and the last rank): ``pipeline.tensor_split`` over what each tensor will hold in memory
    (``_Weights.resident_nbytes``, the head by its rows), not its GGUF bytes. On MLX's CPU backend a
    Q8_0 dense weight becomes float32 (~3.8x its GGUF bytes) while the host strategy's routed experts
    stay in the mapping, so a split by GGUF bytes, dominated by the experts, puts the float32 head
    on a rank that also got its full share of layers.

    The expert LRU's budget is spread over the expert tensors in proportion to their GGUF bytes, as
    ``ExpertCache.scale_default`` gives each rank its share (an explicit budget is not scaled, so a
    rank may hold all of it; spread the same way it still weighs each layer alike). Every input is
    the file, the options and the environment the launcher gives every rank, so all ranks compute
    the same split; the loader still has every rank take rank 0's (``distributed.rank0s``), since
    the environment can differ by host (a compiler for the native experts, the backend).
    ``lp``: the load plan (numerics, backend, strategy, the LRU budget)."""
    mode = parse_numerics(lp.numerics)
    w = _Weights(f, lp)
    routed = _routed_names(f, cfg)
    total = sum(routed.values())
    budget = _lru_budget(lp)

    def nbytes(name: str, rows: range | None = None) -> int:
        lru = budget * routed[name] // total if name in routed else 0
        return w.resident_nbytes(name, mode, lru, rows)

    return pipeline.tensor_split(f, cfg.n_layer, n_ranks, nbytes, cfg.n_vocab)


def expert_cache_plan(f: GGUFFile, cfg: ModelConfig, experts_cache):
    """The bounded device expert cache's ``CachePlan`` for ``experts_cache`` (``expert_cache``) over
    this file's routed layers (their gate + up + down bytes per expert)."""
    budget = parse_experts_cache(experts_cache)
    trip = []
    for il in range(cfg.n_layer):
        names = [f"blk.{il}.ffn_{part}_exps.weight" for part in ("gate", "up", "down")]
        if all(n in f.tensors for n in names):
            trip.append(sum(int(f.tensor(n).nbytes) for n in names) // cfg.n_expert)
    return plan_cache(budget, triplet_nbytes=trip, n_expert=cfg.n_expert, n_used=cfg.n_expert_used)


def _expert_caches(f: GGUFFile, cfg: ModelConfig, experts_cache, policy: str | None):
    """The bounded device expert cache for budget ``experts_cache`` (None: unbounded) and the bytes
    the memory plan counts for it: (None, None) unbounded, else its ``ExpertCacheSet`` and its slot
    arrays plus the prefill working set ds4's budget keeps for it (two full layers)."""
    if experts_cache is None:
        return None, None
    cache_plan = expert_cache_plan(f, cfg, experts_cache)
    if cache_plan.slots is None:  # the budget holds every expert: unbounded
        return None, None
    caches = ExpertCacheSet(cache_plan, policy or DEFAULT_POLICY)  # slots built lazily
    return caches, cache_plan.cache_nbytes + cache_plan.prefill_reserve_nbytes


def plan_load(f: GGUFFile, cfg: ModelConfig, lp: LoadPlan, *,
              experts_cache=None, experts_cache_policy: str | None = None, ctx: int | None = None,
              simulate_memory: float | None = None):
    """The memory plan ``load`` goes by and the bounded expert cache it builds (or None): with
    ``experts_cache`` the user's budget; without, for the device strategy, every expert resident
    when they fit, else the largest bounded cache that fits beside the dense weights, the KV at
    ctx and the scratch (``memory_plan.default_experts_cache_bytes``; a ``MemoryPlanError`` when
    even the smallest does not). ``inspect --plan`` prints this same plan. ``lp``: the load plan, so
    the estimate takes the forms that will be built."""
    caches, cache_bytes = _expert_caches(f, cfg, experts_cache, experts_cache_policy)
    plan = plan_memory(f, cfg, lp, ctx=ctx, simulate_memory=simulate_memory, experts_cache_bytes=cache_bytes)
    if experts_cache is None and lp.experts == "device" and plan.fits is False:
        auto = memory_plan.default_experts_cache_bytes(plan)
        caches, cache_bytes = _expert_caches(f, cfg, auto, experts_cache_policy)
        plan = plan_memory(f, cfg, lp, ctx=ctx, simulate_memory=simulate_memory, experts_cache_bytes=cache_bytes)
    return plan, caches


def load(path: str | os.PathLike, numerics: str | Numerics = "default", backend: str | None = None,
         experts: str = "auto", distributed: str | None = None, join_timeout: float | None = None,
         experts_cache=None, experts_cache_policy: str | None = None, ctx: int | None = None,
         simulate_memory: float | None = None) -> Model:
    """Open a DS4 Flash GGUF (mmap) and build the model; raises a Ds4Error subclass on bad input.

    ``numerics``: "default" (fast path) or "ds4-cpu" (ds4.c's CPU reference arithmetic).
    ``backend``: where the default-mode matmuls run ("cpu" / "metal" / "cuda"; None = MLX's default
    device). The options and the machine are resolved once into ``model.load_plan`` (``load_plan``).
    ``experts``: the routed-expert strategy (``model.device_experts``). "host": routing in numpy,
    slabs copied out of the mmap, a dequantized-expert LRU (small resident memory). "device": every
    expert's raw blocks copied into MLX memory at load (the GGUF's routed-expert bytes stay resident,
    ~80 GiB for the 2-bit DS4 Flash) and routing on the device, so a decode step has no host break.
    "auto" (default): device on a GPU backend (Metal, CUDA), host on MLX's CPU backend, where the
    device strategy doubles the expert memory and re-dequantizes the selected experts every step.
    Both strategies give ds4-cpu's exact bits; in default numerics they agree to rounding.
    ``experts_cache``: bound the device strategy's resident experts (``model.expert_cache``): None
    (default) = all of them when the memory plan says they fit, else the bounded cache that fits
    (``memory_plan.default_experts_cache_bytes``); bytes (an int, "8GB", "512MiB"; ds4's NGB, two full layers of it kept
    for prefill) or an expert count ("1024": ds4's N, over all routed layers). Only with the device
    strategy: with the host strategy (explicit, or ``auto`` on the CPU) it is a ``LayoutError``, the
    host strategy never holding more than the experts a call selects. ``experts_cache_policy``:
    "lfu" (default, aged frequency; chosen by measurement) or "lru" (``model.expert_cache_policy``).
    ``distributed``: None, or join the ranks ``mlx.launch`` started (waiting at most ``join_timeout``
    seconds) and build this rank's part: "pipeline", only its layers (``model.pipeline``);
    "experts", every dense weight and only its share of each layer's routed experts
    (``model.expert_parallel``).
    ``ctx``: the context the sessions will use (None: ``DEFAULT_CTX`` capped at the model's) and
    ``simulate_memory``: a machine of that many GiB instead of this one's memory, for the memory
    plan (``model.memory_plan``): a load that does not fit raises ``MemoryPlanError`` (one line,
    the numbers and what would fit) before any weight is read. The plan is the model's
    ``memory_plan``. A distributed rank holds only its share: it is not planned (yet).
    """
    mode = parse_numerics(numerics)
    # the machine and the environment are read here, once; everything below gets the plan's values
    lp = load_plan.resolve(mode.value, backend, experts, distributed,  # bad values fail before the file opens
                           join_timeout=join_timeout)
    strategy = lp.experts
    if distributed is not None and distributed not in dist.MODES:
        raise LayoutError(f"unknown distributed mode {distributed!r}; expected one of {list(dist.MODES)}")
    bounded = parse_experts_cache(experts_cache) is not None  # bad values fail before the file is opened
    if experts_cache_policy is not None:
        if not bounded:
            raise LayoutError(f"experts_cache_policy={experts_cache_policy!r} needs an experts_cache budget")
        check_policy(experts_cache_policy)
    if bounded and strategy != "device":
        raise LayoutError(f"experts_cache bounds the device strategy's resident experts, and the expert "
                          f"strategy is {strategy} (experts={experts!r}; auto is host on MLX's CPU backend), "
                          f"which holds only the experts a call selects: pass experts='device'")
    if bounded and distributed is not None:
        raise LayoutError(f"experts_cache is not supported with distributed={distributed!r}")
    if simulate_memory is not None:
        memory_plan.simulated_machine(simulate_memory)  # a bad value fails before the file is opened
    f, cfg = _open(path)
    try:
        caches = plan = None
        if distributed is None:
            # Before ``_build`` reads any weight: the plan reads the tensor directory only.
            plan, caches = plan_load(f, cfg, lp, experts_cache=experts_cache,
                                     experts_cache_policy=experts_cache_policy, ctx=ctx,
                                     simulate_memory=simulate_memory)
            plan.check()
        EXPERT_CACHE.configure(lp.expert_cache_bytes, lp.expert_cache_explicit)  # sized by the plan
        if distributed is not None:
            size = f"{f.file_size / (1 << 20):,.0f} MiB" if f.file_size >= 1 << 20 else f"{f.file_size:,} bytes"
            group = dist.join(lp.join_timeout, distributed, [
                ("model file", f"{os.path.basename(f.path)}, {size}, content {f.fingerprint()}"),
                ("numerics", mode.value)])
            if distributed == "experts":
                owned = expert_parallel.owners(cfg.n_expert, group.size())[group.rank()]
                model = _build(f, cfg, lp, group=group, experts=owned)
            else:
                split = resident_split(f, cfg, group.size(), lp)
                split = pipeline.PipelineSplit.from_ints(dist.rank0s(group, split.to_ints()), cfg.n_vocab)
                model = _build(f, cfg, lp, group=group, split=split)
        else:
            model = _build(f, cfg, lp, caches=caches)
            model.memory_plan = plan  # a distributed rank's share is not planned
        f.check_intact()  # truncated while loading: a clean error naming it, before any use
        probe_compiler()  # MLX's compiler check ignores Ctrl-C while it runs: at load, not mid-answer
        return model
    except BaseException:
        f.close()
        raise


def _build(f: GGUFFile, cfg: ModelConfig, lp: LoadPlan, group=None, split: pipeline.PipelineSplit | None = None,
           experts: range | None = None, caches: ExpertCacheSet | None = None) -> Model:
    """The whole model, or with ``group``: one pipeline rank's part of ``split`` (its layers only;
    the output mix and norm on the last rank, the head's rows split between rank 0 and the last
    rank), so the rank never builds, copies or reads the other layers or rows; or one
    expert-parallel rank's (all layers, only the routed ``experts`` it owns; the head on rank 0 only)."""
    w = _Weights(f, lp, owned=experts, caches=caches)
    emb_name = EMBEDDING
    if not w.has(emb_name):
        raise LayoutError(f"{f.path}: tensor {emb_name!r} is missing")
    w.kinds[emb_name] = "embedding"
    embedding = f.tensor_array(emb_name)
    if embedding.dtype != np.float16 or embedding.shape != (cfg.n_vocab, cfg.n_embd):
        raise LayoutError(f"{f.path}: {emb_name} must be F16 of shape {(cfg.n_vocab, cfg.n_embd)}, "
                          f"found {embedding.dtype} {embedding.shape}")
    ops = ops_for(parse_numerics(lp.numerics))  # the numerics, bound once: every module gets this object
    own = range(cfg.n_layer) if split is None else split.layers[group.rank()]
    gather = None if experts is None else expert_parallel.RankGather(group)
    blocks = [_block(cfg, w, il, ops, gather) for il in own]
    # The head. One process: all of it. A pipeline: the output mix and norm on the last rank, the
    # rows of the output matrix shared by rank 0 and the last rank (``split.head_rows``). Expert
    # parallel: all of it on rank 0 only, the one rank that computes logits (the others run every
    # layer but never the head, so they hold none of it).
    if experts is not None:
        mixes = group.rank() == 0
        rows = range(cfg.n_vocab) if mixes else range(0)
    else:
        mixes = own.stop == cfg.n_layer
        rows = range(cfg.n_vocab) if split is None else split.head_rows(group.rank())
    output_hc = output_norm = output = None
    if mixes:
        output_hc = OutputHC(w.dense("output_hc_fn.weight"), w.f32("output_hc_scale.weight", (1,)),
                             w.f32("output_hc_base.weight", (cfg.n_hc,)), cfg.hc_eps, cfg.rms_eps, ops)
        output_norm = w.f32("output_norm.weight", (cfg.n_embd,))
    if len(rows):
        output = w.dense("output.weight", rows)
    parts = dict(embedding=embedding, blocks=blocks, output_hc=output_hc, output_norm=output_norm,
                 output=output, source=f, decoder=w.decoder,
                 host_head=output is not None and host_head(lp, output.qtype))
    model = Model(cfg, ops, **parts)
    model.expert_cache = caches
    model.load_plan = lp
    # A distributed mode wraps this rank's model (composition: its stage runs these same blocks).
    if group is None:
        return model
    if experts is not None:
        return expert_parallel.ExpertParallelModel(model, group=group, experts=experts)
    return pipeline.PipelineModel(model, group=group, layers=own, head_rows=rows)
