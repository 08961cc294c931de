"""A small but complete DS4 model in the oracle generator's exact bytes, and byte-level patch helpers.

The small model has hash layers 0-2, one ratio-4 (indexer) and one ratio-128 layer; it is 4 MiB and
built in ~0.5 s, with or without a synthetic 512-token vocabulary. The tests of the GGUF reader, the
config and layout checks, ``inspect`` and ``scripts/fuzz_gguf.py`` all start from it.

The patch helpers find metadata keys and tensor-info entries by searching for their encoded names,
not with the reader under test, so a test that corrupts a field does not depend on that reader.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

SMALL_MODEL_ARGS = [
    "--n-vocab", "512", "--n-layer", "4", "--n-embd", "256", "--n-head", "2", "--head-dim", "192",
    "--n-out-group", "1", "--q-lora", "64", "--o-lora", "32", "--n-expert", "4", "--n-expert-used", "2",
    "--n-ff-exp", "256", "--n-indexer-head", "2", "--indexer-top-k", "4", "--swa", "8",
]

# ds4 looks these up by string; the generator refuses a tokenizer without them.
_REQUIRED_TOKENS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                    "<think>", "</think>", "｜DSML｜"]


# The project's generator; with --oracle-bytes it writes what the oracle's make_tiny_gguf.py writes.
PROJECT_GENERATOR = REPO / "scripts" / "make_tiny_model.py"

# The oracle generator's summary names its config after the model's (ModelConfig) fields; ours after
# the generator's options. Tests compare the summary with ModelConfig, so it is given the oracle's names.
_ORACLE_CONFIG_NAMES = {
    "n_layer": "n_layer", "n_embd": "n_embd", "n_vocab": "n_vocab", "n_head": "n_head", "head_dim": "head_dim",
    "n_rot": "n_rot", "n_out_group": "n_out_group", "q_lora_rank": "q_lora", "o_lora_rank": "o_lora",
    "n_expert": "n_expert", "n_expert_used": "n_expert_used", "n_ff_exp": "n_ff_exp",
    "n_hash_layer": "n_hash_layer", "n_swa": "swa", "n_indexer_head": "n_indexer_head",
    "indexer_head_dim": "indexer_head_dim", "indexer_top_k": "indexer_top_k", "n_hc": "n_hc",
    "hc_sinkhorn_iter": "sinkhorn_iter", "seed": "seed",
}


def _oracle_style_summary(path: Path) -> None:
    """Rewrite our generator's summary with the oracle summary's config names (ours kept as
    ``generator_config``)."""
    info = json.loads(path.read_text())
    ours = info["config"]
    info["generator_config"] = ours
    info["config"] = {name: ours[field] for name, field in _ORACLE_CONFIG_NAMES.items()}
    info["config"].update(n_head_kv=1, n_expert_shared=1)
    path.write_text(json.dumps(info, indent=1) + "\n")


def write_small_tokenizer_json(path: Path, n_vocab: int = 512) -> Path:
    """A synthetic byte-level BPE tokenizer.json with ``n_vocab`` ids, multi-byte UTF-8 tokens
    and merges, so the model carries string arrays like the real vocabulary."""
    added = [{"id": i, "content": t, "special": True} for i, t in enumerate(_REQUIRED_TOKENS)]
    vocab: dict[str, int] = {}
    alphabet = [chr(c) for c in range(0x21, 0x7F)] + ["Ġ", "Ċ", "é", "ü", "ß", "中", "文", "Ω", "€", "🙂"]
    i = len(added)
    for ch in alphabet:
        vocab[ch] = i
        i += 1
    merges = []
    pairs = ((a, b) for a in alphabet for b in alphabet)  # 110² pairs, more than any test vocab needs
    while i < n_vocab:
        a, b = next(pairs)
        vocab[a + b] = i
        merges.append(f"{a} {b}")
        i += 1
    tj = {"model": {"type": "BPE", "vocab": vocab, "merges": merges}, "added_tokens": added}
    path.write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    return path


def build_small_model(out: Path, *, tokenizer: bool = True, extra_args: list[str] = (),
                      summary_json: Path | None = None) -> Path:
    """Write the small model with the project's ``scripts/make_tiny_model.py --oracle-bytes``: byte for
    byte what the oracle's generator writes for these dims. ``summary_json`` asks the generator for its
    description of what it wrote (config, with the oracle's names, and tensor list)."""
    out = Path(out)
    cmd = [sys.executable, str(PROJECT_GENERATOR), "--out", str(out), *SMALL_MODEL_ARGS, *extra_args,
           "--oracle-bytes", "--quiet"]
    if tokenizer:
        cmd += ["--tokenizer-json", str(write_small_tokenizer_json(out.with_suffix(".tokenizer.json")))]
    else:
        cmd += ["--no-tokenizer"]
    if summary_json is not None:
        cmd += ["--summary-json", str(summary_json)]
    # the script imports ds4_mlx: the tree these tests belong to, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    if summary_json is not None:
        _oracle_style_summary(Path(summary_json))
    return out


# -- byte patching (locations found by searching the encoded names, independent of our reader) ---


def _enc(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def kv_key_pos(data: bytes, key: str) -> int:
    """Offset of the metadata key's length prefix."""
    pos = data.find(_enc(key))
    if pos < 0:
        raise KeyError(key)
    return pos


def kv_value_pos(data: bytes, key: str) -> int:
    """Offset of the value (after the u32 value type); for arrays, of the element type."""
    return kv_key_pos(data, key) + 8 + len(key.encode()) + 4


def kv_type_pos(data: bytes, key: str) -> int:
    return kv_value_pos(data, key) - 4


def tensor_info_pos(data: bytes, name: str) -> int:
    """Offset of the tensor-info entry (its name's length prefix). Tensor infos follow the
    metadata, so the last occurrence is taken (a metadata string could hold the same bytes)."""
    pos = data.rfind(_enc(name))
    if pos < 0:
        raise KeyError(name)
    return pos


def tensor_info_fields(data: bytes, name: str) -> dict[str, int]:
    """Byte offsets of a tensor info's n_dims, dims, type and offset fields."""
    p = tensor_info_pos(data, name) + 8 + len(name.encode())
    (n_dims,) = struct.unpack_from("<I", data, p)
    return {"n_dims": p, "dims": p + 4, "n": n_dims, "type": p + 4 + 8 * n_dims, "offset": p + 8 + 8 * n_dims}


def patch(data: bytes, pos: int, fmt: str, value) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, pos, value)
    return bytes(b)


def rewrite_gguf(src: Path, dst: Path, *, drop: set[str] = frozenset(),
                 replace: dict[str, tuple[Any, Any]] | None = None,
                 add: dict[str, tuple[Any, Any]] | None = None,
                 metadata: dict[str, tuple[Any, Any, Any] | None] | None = None) -> Path:
    """Copy a GGUF through gguf-py's reader and writer with changes.

    ``replace`` / ``add``: tensor name -> (numpy array, GGMLQuantizationType) as GGUFWriter.add_tensor
    takes them (quantized: uint8 rows of bytes); added tensors go last. ``metadata``: key ->
    (value, GGUFValueType, sub_type), or None to delete; changed keys keep their place.
    """
    import gguf  # a dev dependency: only the tests rewrite files
    import numpy as np

    replace = replace or {}
    metadata = metadata or {}
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in metadata:
            spec = metadata[key]
            if spec is not None:
                value, vtype, sub = spec
                w.add_key_value(key, value, vtype, sub_type=sub)
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for key, spec in metadata.items():
        if spec is not None and key not in r.fields:
            value, vtype, sub = spec
            w.add_key_value(key, value, vtype, sub_type=sub)

    def put(name, arr, qtype):
        plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.I32)
        if qtype in plain:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=qtype)

    for t in r.tensors:
        if t.name in drop:
            continue
        if t.name in replace:
            put(t.name, *replace[t.name])
        else:
            put(t.name, np.array(t.data), t.tensor_type)
    for name, (arr, qtype) in (add or {}).items():
        put(name, arr, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
