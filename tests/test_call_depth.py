"""A decoded token's way to attention (issue 23): from ``Session.eval`` to ``Attention.__call__`` it
passes no more Python calls than mlx-lm's DeepSeek V4 port from ``generate_step`` to its attention.

The peer's figure, 6, was counted by ``benchmarks/bench_call_depth.py --peer`` on PR #1192's code
(``_step``, ``_model_call``, ``Model.__call__``, ``DeepseekV4Model.__call__``, the decoder layer's
``__call__``, the attention's ``__call__``); the peer is not a dependency, so the figure is a constant
here. Ours is counted by the same code, on the first step of a fresh model (the one that traces the
compiled functions, so their Python bodies run). Before issue 23 it was 10 (host strategy), 11 (device)
and 9 (ds4-cpu's chunk path): Session.eval -> append -> _extend -> _feed -> Runner.prefill ->
Runner._decode -> Model.step -> CompiledDecoder.step -> run -> _layers -> ..."""

from __future__ import annotations

import bench_call_depth  # benchmarks/, on the path by conftest

PEER_GENERATE_STEP_TO_ATTENTION = 6


def test_a_decoded_token_reaches_attention_in_no_more_calls_than_mlx_lm(tiny_model_path):
    depths = bench_call_depth.ours(str(tiny_model_path))
    assert set(depths) == {"host strategy, compiled", "device strategy, compiled", "ds4-cpu, chunk path"}
    assert all(d <= PEER_GENERATE_STEP_TO_ATTENTION for d in depths.values()), depths
    # the device strategy's layer is Block.__call__ itself: one frame more than the host step, whose
    # cut layer function calls the attention directly
    assert depths["device strategy, compiled"] == depths["host strategy, compiled"] + 1, depths
