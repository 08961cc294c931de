"""Open a speculative-decoding drafter GGUF for a loaded target model: check it belongs to it, build it.

A drafter is validated like the main file (``formats.drafter_layout``: every tensor ds4 binds, its
type and dims, here derived from the *target's* config) and refused with a ``DrafterError`` when it
does not belong to the target: the preview's MTP head with a Flash 0731 target, the DSpark file with
a preview target, another model's dims, a main model file passed as the drafter. The MTP head is
built by the target loader's weight-by-name code (``loader._block`` with the ``mtp.0.`` prefix), the
DSpark stages likewise (``mtp.0.`` .. ``mtp.2.``), both run as the dense layer ``MTP_LAYER``.
"""

from __future__ import annotations

import os

from ds4_mlx.errors import DrafterError
from ds4_mlx.formats.checkpoint import Checkpoint, detect_checkpoint, parse_checkpoint
from ds4_mlx.formats.config import ModelConfig
from ds4_mlx.formats.drafter_layout import (DSPARK_MARKOV_RANK, DSPARK_STAGES, MTP_PREFIX, DrafterKind,
                                            drafter_kind, dspark_params, validate_drafter_layout)
from ds4_mlx.formats.gguf import GGUFFile
from ds4_mlx.model.hyper_connection import OutputHC
from ds4_mlx.model.loader import _block, _Weights
from ds4_mlx.model.dspark import DSparkHead, bf16_to_f32
from ds4_mlx.model.mtp import MTP_LAYER, MTPHead

# Metadata a drafter may declare (ds4 reads none from the MTP file); when present it must agree
# with the target's config.
_DIM_KEYS = {"deepseek4.embedding_length": "n_embd", "deepseek4.vocab_size": "n_vocab",
             "deepseek4.expert_count": "n_expert", "deepseek4.hyper_connection.count": "n_hc"}


def _check_metadata(f: GGUFFile, cfg: ModelConfig) -> None:
    arch = f.metadata.get("general.architecture")
    if arch is not None and arch != "deepseek4":
        raise DrafterError(f"{f.path}: general.architecture is {str(arch)[:40]!r}, not 'deepseek4': "
                           f"not a DeepSeek V4 Flash drafter")
    for key, field in _DIM_KEYS.items():
        v = f.metadata.get(key)
        if v is not None and v != getattr(cfg, field):
            raise DrafterError(f"{f.path}: metadata {key} is {str(v)[:24]}, the loaded model's {field} is "
                               f"{getattr(cfg, field)}: the drafter belongs to a model of other dims")


def _check_checkpoint(f: GGUFFile, kind: DrafterKind, checkpoint: Checkpoint) -> None:
    if kind is DrafterKind.MTP and checkpoint is Checkpoint.F0731:
        raise DrafterError(f"{f.path}: {kind.title} belongs to the preview checkpoint, but the loaded model is "
                           f"{checkpoint.title}; its drafter is the DSpark file (ds4f-dspark)")
    if kind is DrafterKind.DSPARK and checkpoint is Checkpoint.PREVIEW:
        raise DrafterError(f"{f.path}: {kind.title} belongs to Flash 0731, but the loaded model is "
                           f"{checkpoint.title}; its drafter is the MTP head (preview-mtp)")


def open_drafter(path: str | os.PathLike, target, checkpoint=None) -> tuple[GGUFFile, DrafterKind]:
    """Open and validate the drafter at ``path`` for ``target`` (a loaded ``Model``); ``checkpoint``:
    the target's ("preview" / "0731"; None: decided from the target's file as the engine does).
    Returns the open, guarded file and its kind; closes it and raises on any problem."""
    cfg = target.config
    if checkpoint is None:
        checkpoint = detect_checkpoint(target.source.metadata, target.source.path).checkpoint
    checkpoint = parse_checkpoint(checkpoint)
    f = GGUFFile(path)
    try:
        kind = drafter_kind(f)
        _check_checkpoint(f, kind, checkpoint)
        _check_metadata(f, cfg)
        validate_drafter_layout(f, cfg, kind)
        f.guard()
    except BaseException:
        f.close()
        raise
    return f, kind


def load_drafter(path: str | os.PathLike, target, checkpoint=None) -> MTPHead | DSparkHead:
    """The drafter at ``path`` built for ``target`` (``open_drafter`` checks it): the preview's MTP
    head or 0731's DSpark stages and heads, its weights in the forms of the target's load plan (a
    target built without the loader: the CPU forms, as its own weights)."""
    if not target.can_verify or target.output is None or target.output_hc is None:
        raise DrafterError("a drafter needs a single-process target model (it shares its embedding and "
                           "output matrix); a pipeline or expert-parallel rank cannot draft")
    cfg = target.config
    if cfg.n_layer <= MTP_LAYER or cfg.compress_ratio(MTP_LAYER) != 0:
        raise DrafterError(f"the loaded model's layer {MTP_LAYER} is not a dense layer; ds4 runs the MTP block "
                           f"with that layer's attention (raw window only) and RoPE")
    f, kind = open_drafter(path, target, checkpoint)
    try:
        ops = target.ops
        # the target's plan: the drafter's weights take its backend, forms, kernels and expert strategy
        w = _Weights(f, target.load_plan)
        if kind is DrafterKind.DSPARK:
            head = _dspark_head(f, w, cfg, ops)
            f.check_intact()
            return head
        p = MTP_PREFIX
        head = MTPHead(
            cfg, ops,
            e_proj=w.dense(p + "e_proj.weight"), h_proj=w.dense(p + "h_proj.weight"),
            enorm=w.f32(p + "enorm.weight", (cfg.n_embd,)), hnorm=w.f32(p + "hnorm.weight", (cfg.n_embd,)),
            norm=w.f32(p + "norm.weight", (cfg.n_embd,)),
            output_hc=OutputHC(w.dense(p + "hc_head_fn.weight"), w.f32(p + "hc_head_scale.weight", (1,)),
                               w.f32(p + "hc_head_base.weight", (cfg.n_hc,)), cfg.hc_eps, cfg.rms_eps, ops),
            block=_block(cfg, w, MTP_LAYER, ops, prefix=p, hash_routed=False),
            source=f)
        f.check_intact()
        return head
    except BaseException:
        f.close()
        raise


def _dspark_head(f: GGUFFile, w: _Weights, cfg: ModelConfig, ops) -> DSparkHead:
    """DSpark's stages and heads bound by name [dspark_weights_bind]; every stage runs as the dense,
    score-routed layer ``MTP_LAYER`` (ratio 0: base-theta RoPE without YaRN, as ds4 runs them)."""
    params = dspark_params(f, cfg)
    E, V, R = cfg.n_embd, cfg.n_vocab, DSPARK_MARKOV_RANK
    last = f"mtp.{DSPARK_STAGES - 1}."

    def bf16(name: str, shape: tuple[int, ...]):
        return bf16_to_f32(f.tensor_array(name)).reshape(shape)

    return DSparkHead(
        cfg, ops, params,
        main_proj=w.dense("mtp.0.main_proj.weight"), main_norm=w.f32("mtp.0.main_norm.weight", (E,)),
        stages=[_block(cfg, w, MTP_LAYER, ops, prefix=f"mtp.{s}.", hash_routed=False) for s in range(DSPARK_STAGES)],
        output_hc=OutputHC(w.dense(last + "hc_head_fn.weight"), w.f32(last + "hc_head_scale.weight", (1,)),
                           w.f32(last + "hc_head_base.weight", (cfg.n_hc,)), cfg.hc_eps, cfg.rms_eps, ops),
        norm=w.f32(last + "norm.weight", (E,)),
        markov_w1=bf16(last + "markov_head.markov_w1.weight", (V, R)),
        markov_w2=bf16(last + "markov_head.markov_w2.weight", (V, R)),
        confidence=bf16(last + "confidence_head.proj.weight", (E + R,)),
        source=f)
