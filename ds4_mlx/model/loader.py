"""Build a ``Model`` from a DS4 Flash GGUF: every shape from the metadata, every weight by name.

Small tensors (norms, HC scale/base, sinks, APE, router bias) become float32 MLX arrays; matmul
weights become ``linear`` objects that keep the GGUF bytes mmap-backed; the embedding stays an
F16 mmap view gathered row by row.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np

from ds4_mlx import native
from ds4_mlx.errors import LayoutError
from ds4_mlx.formats.config import ModelConfig
from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.formats.gguf import GGUFFile
from ds4_mlx.formats.layout import load_model_file
from ds4_mlx.model.attention import Attention
from ds4_mlx.model.compiled_decode import probe_compiler
from ds4_mlx.model.compressor import Compressor
from ds4_mlx.model.device_experts import DeviceExpertWeights, resolve_strategy
from ds4_mlx.model.experts import EXPERT_CACHE, ExpertWeights, routed_resident_nbytes
from ds4_mlx.model.hyper_connection import HyperConnection, OutputHC
from ds4_mlx.model.indexer import Indexer
from ds4_mlx.model.linear import Backend, DenseWeight, resolve_backend
from ds4_mlx.model.moe import MoE
from ds4_mlx.model import distributed as dist, expert_parallel, pipeline
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
    """Name-checked access to the GGUF tensors; ``kinds`` records how each was taken."""

    def __init__(self, f: GGUFFile, backend: str | None = None, experts: str = "host",
                 owned: range | None = None):
        self.f = f
        self.backend = backend
        self.kw = {} if backend is None else {"backend": backend}
        self.strategy = experts
        self.expert_cls = DeviceExpertWeights if experts == "device" else ExpertWeights
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
                if name == pipeline.HEAD and host_head(numerics, self.strategy, self.backend, w.qtype):
                    # no cached form, but the whole matrix is read every token: its pages stay mapped
                    return w.nbytes
                return w.ds4_cpu_resident_nbytes() if numerics is Numerics.DS4_CPU else w.resident_nbytes()
            if kind == "experts":
                e = ExpertWeights.from_gguf(self.f, name, **self.kw)  # a view; decides use_kernels as built
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
            return expert_parallel.OwnedExperts.from_gguf(self.expert_cls, self.f, name, self.owned, self.backend)
        return self.expert_cls.from_gguf(self.f, name, **self.kw)


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
              ops=ops, gather=gather)
    return Block(il, hc("attn"), attn, hc("ffn"), ffn)


def host_head(numerics: str | Numerics, strategy: str, backend: str | None, qtype: GGMLType | int) -> bool:
    """Whether the output matrix is multiplied on the host by the native library, from its Q8_0 blocks
    (``DenseWeight.host_product``; ``Model.host_head``) instead of by MLX as float32: DEFAULT numerics
    with the host expert strategy on MLX's CPU, a Q8_0 head and the native library built
    (``DS4_MLX_NATIVE=off`` keeps MLX's). ds4-cpu numerics keep their exact arithmetic, a GPU its own
    matmul (the logits stay on the device there)."""
    return (parse_numerics(numerics) is Numerics.DEFAULT and strategy == "host"
            and GGMLType(qtype) == GGMLType.Q8_0 and resolve_backend(backend) is Backend.CPU
            and mx.default_device().type == mx.DeviceType.cpu and native.library() is not None)


def resident_split(f: GGUFFile, cfg: ModelConfig, n_ranks: int, numerics: str | Numerics = "default",
                   backend: str | None = None, strategy: str = "host") -> pipeline.PipelineSplit:
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
    the environment can differ by host (a compiler for the native experts, the backend)."""
    mode = parse_numerics(numerics)
    strategy = resolve_strategy(strategy)
    w = _Weights(f, backend, strategy)
    # the routed-expert tensors the blocks take (``_block``): another tensor named like one builds
    # nothing, and must not take a share of the budget from them
    routed = {n: int(f.tensor(n).nbytes) for il in range(cfg.n_layer) for part in ("gate", "up", "down")
              if (n := f"blk.{il}.ffn_{part}_exps.weight") in f.tensors}
    total = sum(routed.values())
    budget = EXPERT_CACHE.limit_bytes if EXPERT_CACHE.explicit else EXPERT_CACHE.default_bytes
    if strategy == "host" and native.library() is not None:
        budget = 0  # the native products read the blocks in place: the LRU never fills (ds4_mlx.native)

    def nbytes(name: str, rows: range | None = None) -> int:
        lru = budget * routed[name] // total if name in routed else 0
        return w.resident_nbytes(name, mode, lru, rows)

    return pipeline.tensor_split(f, cfg.n_layer, n_ranks, nbytes, cfg.n_vocab)


def load(path: str | os.PathLike, numerics: str | Numerics = "default", backend: str | None = None,
         experts: str = "auto", distributed: str | None = None, join_timeout: float | None = None) -> Model:
    """Open a DS4 Flash GGUF (mmap) and build the model; raises a Ds4Error subclass on bad input.

    ``numerics``: "default" (fast path) or "ds4-cpu" (ds4.c's CPU reference arithmetic).
    ``backend``: where the default-mode matmuls run ("cpu" / "metal"; None = MLX's default device).
    ``experts``: the routed-expert strategy (``model.device_experts``). "host": routing in numpy,
    slabs copied out of the mmap, a dequantized-expert LRU (small resident memory). "device": every
    expert's raw blocks copied into MLX memory at load (the GGUF's routed-expert bytes stay resident,
    ~80 GiB for the 2-bit DS4 Flash) and routing on the device, so a decode step has no host break.
    "auto" (default): device on a GPU backend (Metal, CUDA), host on MLX's CPU backend, where the
    device strategy doubles the expert memory and re-dequantizes the selected experts every step.
    Both strategies give ds4-cpu's exact bits; in default numerics they agree to rounding.
    ``distributed``: None, or join the ranks ``mlx.launch`` started (waiting at most ``join_timeout``
    seconds) and build this rank's part: "pipeline", only its layers (``model.pipeline``);
    "experts", every dense weight and only its share of each layer's routed experts
    (``model.expert_parallel``).
    """
    mode = parse_numerics(numerics)
    strategy = resolve_strategy(experts)  # bad values fail before the file is opened
    if distributed is not None and distributed not in dist.MODES:
        raise LayoutError(f"unknown distributed mode {distributed!r}; expected one of {list(dist.MODES)}")
    f, cfg = _open(path)
    try:
        if distributed is not None:
            size = f"{f.file_size / (1 << 20):,.0f} MiB" if f.file_size >= 1 << 20 else f"{f.file_size:,} bytes"
            group = dist.join(join_timeout, distributed, [
                ("model file", f"{os.path.basename(f.path)}, {size}, content {f.fingerprint()}"),
                ("numerics", mode.value)])
            if distributed == "experts":
                owned = expert_parallel.owners(cfg.n_expert, group.size())[group.rank()]
                model = _build(f, cfg, mode, backend, strategy, group=group, experts=owned)
            else:
                split = resident_split(f, cfg, group.size(), mode, backend, strategy)
                split = pipeline.PipelineSplit.from_ints(dist.rank0s(group, split.to_ints()), cfg.n_vocab)
                model = _build(f, cfg, mode, backend, strategy, group=group, split=split)
        else:
            model = _build(f, cfg, mode, backend, strategy)
        f.check_intact()  # truncated while loading: a clean error naming it, before any use
        probe_compiler()  # MLX's compiler check ignores Ctrl-C while it runs: at load, not mid-answer
        return model
    except BaseException:
        f.close()
        raise


def _build(f: GGUFFile, cfg: ModelConfig, mode: Numerics, backend: str | None, strategy: str = "host",
           group=None, split: pipeline.PipelineSplit | None = None, experts: range | None = None) -> Model:
    """The whole model, or with ``group``: one pipeline rank's part of ``split`` (its layers only;
    the output mix and norm on the last rank, the head's rows split between rank 0 and the last
    rank), so the rank never builds, copies or reads the other layers or rows; or one
    expert-parallel rank's (all layers, only the routed ``experts`` it owns; the head on rank 0 only)."""
    w = _Weights(f, backend, strategy, owned=experts)
    emb_name = EMBEDDING
    if not w.has(emb_name):
        raise LayoutError(f"{f.path}: tensor {emb_name!r} is missing")
    w.kinds[emb_name] = "embedding"
    embedding = f.tensor_array(emb_name)
    if embedding.dtype != np.float16 or embedding.shape != (cfg.n_vocab, cfg.n_embd):
        raise LayoutError(f"{f.path}: {emb_name} must be F16 of shape {(cfg.n_vocab, cfg.n_embd)}, "
                          f"found {embedding.dtype} {embedding.shape}")
    ops = ops_for(mode)  # the numerics, bound once: every module gets this object
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
                 output=output, source=f,
                 host_head=output is not None and host_head(mode, strategy, backend, output.qtype))
    if group is None:
        return Model(cfg, ops, **parts)
    if experts is not None:
        return expert_parallel.ExpertParallelModel(cfg, ops, group=group, experts=experts, **parts)
    return pipeline.PipelineModel(cfg, ops, group=group, layers=own, head_rows=rows, **parts)
