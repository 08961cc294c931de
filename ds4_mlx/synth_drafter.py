"""Random-weight drafter GGUFs for a generated model (``synth``): the preview's MTP head and a
DSpark file, in the real tensor layouts (``formats.drafter_layout``) at the model's dims.

* MTP, as ds4's ``DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf``: ``mtp.0.*`` in ds4's binding order
  [mtp_weights_bind], routed experts Q4_K, projections and shared experts Q8_0, everything else
  F32 (the file's name lists no F16: its plain HC mixers, router and head mix are F32 here).
* DSpark, as the 0731 support file: ``mtp.0.main_proj``/``main_norm``, three blocks, the last
  stage's head, Markov factors (BF16 [256, vocab]) and confidence projection (BF16 [n_embd + 256]),
  and its ``deepseek4.dspark.*`` parameters: ds4's (block 5, rank 256, noise token 128799, target
  layers 40-42) where the model is big enough, else the last token id and the last three layers.

Metadata: ds4 reads none from an MTP file; these files carry ``general.*`` and the dims the loader
cross-checks with the target (``model.drafter_loader``: embedding_length, vocab_size, expert_count,
hyper_connection.count). Content follows ``synth``'s conventions (each tensor's values decided by
its name and the seed), so the same config always gives the same bytes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ds4_mlx.formats.drafter_layout import (DSPARK_BLOCK, DSPARK_MARKOV_RANK, DSPARK_NOISE_TOKEN, DSPARK_STAGES,
                                            DSPARK_TARGET_LAYERS, MTP_PREFIX)
from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.formats.gguf import ValueType
from ds4_mlx.formats.gguf_writer import GGUFWriter
from ds4_mlx.synth import ARCH, TensorPlanner, TensorSpec, TinyModelConfig

DRAFTER_KINDS = ("mtp", "dspark")
_Q4 = (GGMLType.Q4_K, GGMLType.Q4_K, GGMLType.Q4_K)


def _bf16(planner: TensorPlanner, name: str, ne: tuple[int, ...], std: float) -> None:
    """A Gaussian BF16 tensor (round to nearest even of the float32 bits)."""
    def chunks() -> Iterator[np.ndarray]:
        x = (std * planner.rng(name).standard_normal(int(np.prod(ne)))).astype(np.float32)
        bits = x.view(np.uint32)
        yield ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    planner.specs.append(TensorSpec(name, GGMLType.BF16, ne, chunks))


def mtp_plan(cfg: TinyModelConfig) -> list[TensorSpec]:
    """The MTP head's tensors in ds4's binding order."""
    t = TensorPlanner(cfg)
    E, p = cfg.n_embd, MTP_PREFIX
    t.head_hc(p + "hc_head", GGMLType.F32)
    # ds4 binds base, fn, scale; head_hc writes fn, scale, base: put them in ds4's order
    fn, scale, base = t.specs[-3:]
    t.specs[-3:] = [base, fn, scale]
    t.q8(p + "e_proj.weight", E, E, cfg.gain / np.sqrt(E))
    t.q8(p + "h_proj.weight", E, E, cfg.gain / np.sqrt(E))
    t.norm_w(p + "enorm.weight", E)
    t.norm_w(p + "hnorm.weight", E)
    t.norm_w(p + "norm.weight", E)
    t.layer(p, 0, bias=True, hash_table=False, expert_types=_Q4, plain=GGMLType.F32)
    return t.specs


def dspark_plan(cfg: TinyModelConfig) -> list[TensorSpec]:
    """The DSpark file's tensors: stage 0's inputs, the three blocks, the last stage's heads."""
    t = TensorPlanner(cfg)
    E, V, R = cfg.n_embd, cfg.n_vocab, DSPARK_MARKOV_RANK
    nt = len(DSPARK_TARGET_LAYERS)
    t.q8("mtp.0.main_proj.weight", nt * E, E, cfg.gain / np.sqrt(nt * E))
    t.norm_w("mtp.0.main_norm.weight", E)
    for s in range(DSPARK_STAGES):
        t.layer(f"mtp.{s}.", 0, bias=True, hash_table=False, expert_types=_Q4, plain=GGMLType.F32)
    last = f"mtp.{DSPARK_STAGES - 1}."
    t.head_hc(last + "hc_head", GGMLType.F32)
    t.norm_w(last + "norm.weight", E)
    _bf16(t, last + "markov_head.markov_w1.weight", (R, V), 1.0 / np.sqrt(R))
    _bf16(t, last + "markov_head.markov_w2.weight", (R, V), 1.0 / np.sqrt(R))
    _bf16(t, last + "confidence_head.proj.weight", (E + R,), 1.0 / np.sqrt(E + R))
    return t.specs


def write_tiny_drafter(cfg: TinyModelConfig, out: str | os.PathLike, kind: str = "mtp") -> dict[str, Any]:
    """Write the ``kind`` ("mtp" / "dspark") drafter of the model ``cfg`` describes to ``out``
    (atomically, as ``synth.write_tiny_model``); return a summary (tensors, file size)."""
    if kind not in DRAFTER_KINDS:
        from ds4_mlx.errors import LayoutError
        raise LayoutError(f"drafter kind must be one of {', '.join(DRAFTER_KINDS)}, got {kind!r}")
    plan = mtp_plan(cfg) if kind == "mtp" else dspark_plan(cfg)
    U32 = ValueType.UINT32
    name = f"{cfg.name}-{'MTP' if kind == 'mtp' else 'DSpark-0731'}"
    meta = [
        ("general.architecture", ValueType.STRING, ARCH),
        ("general.name", ValueType.STRING, name),
        ("general.alignment", U32, 32),
        ("general.quantization_version", U32, 2),
        (f"{ARCH}.embedding_length", U32, cfg.n_embd),
        (f"{ARCH}.vocab_size", U32, cfg.n_vocab),
        (f"{ARCH}.expert_count", U32, cfg.n_expert),
        (f"{ARCH}.hyper_connection.count", U32, cfg.n_hc),
    ]
    if kind == "dspark":
        # ds4's defaults (noise 128799, layers 40-42) need the real vocabulary and depth; a smaller
        # model's file names its own: the last token id, the last three layers
        noise = DSPARK_NOISE_TOKEN if cfg.n_vocab > DSPARK_NOISE_TOKEN else cfg.n_vocab - 1
        n_tap = len(DSPARK_TARGET_LAYERS)
        layers = DSPARK_TARGET_LAYERS if cfg.n_layer > max(DSPARK_TARGET_LAYERS) else \
            tuple(range(max(cfg.n_layer - n_tap, 0), cfg.n_layer))
        meta += [(f"{ARCH}.dspark.block_size", U32, DSPARK_BLOCK),
                 (f"{ARCH}.dspark.markov_rank", U32, DSPARK_MARKOV_RANK),
                 (f"{ARCH}.dspark.noise_token_id", U32, noise),
                 (f"{ARCH}.dspark.target_layers", ValueType.ARRAY, list(layers), U32)]
    write_drafter_file(out, plan, meta)
    return {"kind": kind, "file": str(out), "file_bytes": os.path.getsize(out),
            "tensors": [{"name": s.name, "type": s.ggml_type.name, "dims": list(s.ne)} for s in plan]}


def write_drafter_file(out: str | os.PathLike, plan, meta) -> None:
    """A GGUF of ``meta`` ((key, type, value[, item type]) rows) and ``plan``'s tensors at ``out``
    (``write_tiny_drafter``'s writer; the tests use it for files with metadata of their own)."""
    with GGUFWriter(out) as w:
        for key, vtype, value, *sub in meta:
            w.add(key, vtype, value, *sub)
        for spec in plan:
            w.add_tensor(spec.name, spec.ggml_type, spec.ne)
        w.write_header()
        for spec in plan:
            w.write_tensor(spec.name, spec.chunks())
