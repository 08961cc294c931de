"""How many Python calls a decoded token passes through before it reaches attention: ours from
``Session.eval``, the peer's (mlx-lm's DeepSeek V4 port, PR #1192) from ``generate_step``.

    python benchmarks/bench_call_depth.py --model tiny.gguf [--peer /tmp/mlx-lm-pr1192] [--json]

Counted, not read off the source: the attention module's ``__call__`` is wrapped with a function that
walks the Python stack back to the starting frame and counts the frames in between plus the
attention's own (C++ frames, e.g. ``mx.compile`` calling a traced body, are not Python frames and do not
count). Ours is counted on the first decode step of a fresh model for each expert strategy (the step
that traces the compiled functions, so their Python bodies run: later steps replay the graph and no
Python runs at all between the step and the attention's kernels) and, for ds4-cpu numerics, on its
uncompiled chunk path.

The peer is counted from its ``Model.__call__`` (a decode step ``model(y[None], cache=cache)``) to its
attention, the same way; mlx-lm's ``generate_step`` adds two frames above that (``_step`` and
``_model_call``, mlx_lm/generate.py), which are added to the figure: generate.py imports the
tokenizer stack (``transformers``), which this script does not need.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import ds4_mlx  # noqa: E402  (first: binds MLX to OpenBLAS)
import mlx.core as mx  # noqa: E402

from ds4_mlx.engine.session import Session  # noqa: E402
from ds4_mlx.model.attention import Attention  # noqa: E402

# mlx-lm's generate_step -> _step -> _model_call -> model(...): the two frames above the model's call
PEER_GENERATE_FRAMES = 2


class counting:
    """``with counting(start_code, cls) as depths:`` wraps ``cls.__call__`` for the block: each call
    appends the frames from the innermost frame running ``start_code`` (exclusive) to the
    attention's ``__call__`` (inclusive)."""

    def __init__(self, start_code, cls):
        self.start, self.cls, self.depths = start_code, cls, []

    def __enter__(self) -> list[int]:
        orig = self.orig = self.cls.__call__
        start, depths = self.start, self.depths

        def wrapped(module, *args, **kwargs):
            frame, n = sys._getframe(1), 1  # the attention's own __call__ counts as one
            while frame is not None and frame.f_code is not start:
                n += 1
                frame = frame.f_back
            if frame is not None:
                depths.append(n)
            return orig(module, *args, **kwargs)

        self.cls.__call__ = wrapped
        return depths

    def __exit__(self, *exc) -> None:
        self.cls.__call__ = self.orig


def ours(model_path: str) -> dict[str, int]:
    out = {}
    for label, kw in (("host strategy, compiled", dict()), ("device strategy, compiled", dict(experts="device")),
                      ("ds4-cpu, chunk path", dict(numerics="ds4-cpu"))):
        net = ds4_mlx.load(model_path, **kw).network
        s = Session(net, ctx=256)
        s.sync(list(range(100, 120)))
        s.logits()
        with counting(Session.eval.__code__, Attention) as depths:
            s.eval(7)
            s.logits()
        if not depths:
            raise SystemExit(f"{label}: attention was not reached from Session.eval (nothing traced?)")
        out[label] = max(depths)
    return out


def peer(peer_root: str, model_path: str) -> int:
    import bench_peer
    from ds4_mlx.formats.layout import load_model_file

    mod = bench_peer.import_peer(peer_root)
    f, cfg, _ = load_model_file(model_path)
    model = bench_peer.build_peer(mod, f, cfg)
    attn_classes = {type(layer.attn) for layer in model.layers}
    cache = model.make_cache()
    model(mx.array([[100, 101, 102]], dtype=mx.int32), cache=cache)
    start = type(model).__call__.__code__
    with contextlib.ExitStack() as stack:
        # every attention class the layers use (the port builds one per kind of layer)
        found = [stack.enter_context(counting(start, cls)) for cls in attn_classes]
        mx.eval(model(mx.array([[7]], dtype=mx.int32), cache=cache))
    depths = [d for f in found for d in f]
    # from Model.__call__ (exclusive) to attention, plus Model.__call__ itself and generate_step's two frames
    return max(depths) + 1 + PEER_GENERATE_FRAMES


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.environ.get("DS4_MLX_TINY_MODEL"))
    ap.add_argument("--peer", help="an mlx-lm checkout of PR #1192 (bench_peer.py's docstring says how)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not args.model:
        ap.error("--model (or DS4_MLX_TINY_MODEL) is required")
    result = {"ours (Session.eval -> Attention.__call__)": ours(args.model)}
    if args.peer:
        result["peer (generate_step -> attention)"] = peer(args.peer, args.model)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
