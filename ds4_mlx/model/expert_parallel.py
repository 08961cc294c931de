"""Expert-parallel runs over ``mx.distributed`` (``--distributed experts``): every rank holds all the
dense weights and 1/ranks of each layer's routed experts.

    every rank      embedding, attention, HC, router, shared expert, head: the whole dense model
    rank r          routed experts ``owners(n_expert, ranks)[r]`` of every layer (hash layers too)

Every rank runs the same forward pass on its own full ``ModelCache``: rank 0 sends each command
(the position and the token ids, ``model.distributed``) and no hidden state crosses ranks. In each
MoE layer every rank computes the selected experts it owns (``OwnedExperts``: the pairs of the others
are exact zeros), one ``mx.distributed.all_sum`` per layer of the routed outputs [T, k, n_embd]
(``RankGather``, injected as the MoE's ``gather``) gives every rank all k outputs, and each rank
sums them and adds its own (identical) shared expert, so the ranks stay in step with no other message.
Only rank 0 computes the head's logits.

Sessions: each rank keeps its own copy of every state rank 0 keeps (snapshots, checkpoints, other
sessions: ``DistributedModel.feeding`` and the STATE command, as for a pipeline). A payload or disk
KV entry is saved from rank 0's cache alone (it is the whole state) and, loaded, is sent whole to
every rank (SCATTER), so the files are the ones one process writes and load on any split.

Why this split: a decode step is bound by reading the routed experts' bytes; here each machine reads
only its own experts' bytes for the token, so every machine's memory bandwidth works on every token
(a pipeline leaves all but one rank idle per token). The price: the dense weights (attention, shared
experts, embedding, head) are on every rank, and every layer waits for one all_sum of [T, n_embd].

Memory: ``OwnedExperts`` wraps an expert tensor built over the rank's own slice ``raw[lo:hi]`` of the
mapping, so the host strategy's slab reads and the device strategy's resident copy (``resident_nbytes``)
touch only the rank's experts: its routed-expert memory is ~1/ranks of the single-process figure.

Numerics: bit-identical to one process. Every pair (token, expert) is computed by its owner with the
one-process arithmetic (``OwnedExperts`` keeps each expert's pairs and their order), the all_sum adds
exact zeros to it, and the sum over k and the shared expert run as in one process. Why not the
cheaper all_sum of each rank's partial sum [T, n_embd] (plus the shared expert on rank 0): it sums in
another order, and in ds4-cpu numerics the next layer's Q8_K re-quantization of the activations turns
those last-bit differences into logprob differences of up to 0.094 on the tiny model (default
numerics: 0.001), beyond the 0.02 the issue allows. The price is k times the bytes per layer: at the
real dims a decode step sends 6 x 4096 x 4 = 96 KiB per layer (4 MiB per token over 43 layers), a
2048-token prefill chunk 192 MiB per layer.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import DistributedError, LayoutError, NonFiniteError
from ds4_mlx.model.cache import ModelCache
from ds4_mlx.model.device_experts import DEVICE_MAX_PAIRS
from ds4_mlx.model.distributed import CHUNK, STEP, Command, DistributedModel
from ds4_mlx.model.experts import ExpertWeights, check_expert_call


def owners(n_expert: int, n_ranks: int) -> list[range]:
    """The routed experts each rank owns: contiguous id ranges, rank by rank, sizes differing by at
    most one (the first ``n_expert % n_ranks`` ranks take one more). All experts of a tensor have the
    same bytes, so equal counts are equal bytes; contiguous ranges keep each rank's slice one span of
    the mapping. Every rank must own at least one expert."""
    if not isinstance(n_ranks, int) or isinstance(n_ranks, bool) or n_ranks < 1:
        raise DistributedError(f"the number of ranks must be an integer >= 1, got {n_ranks!r}")
    if not isinstance(n_expert, int) or isinstance(n_expert, bool) or n_expert < 1:
        raise DistributedError(f"the number of experts must be an integer >= 1, got {n_expert!r}")
    if n_ranks > n_expert:
        raise DistributedError(f"{n_ranks} ranks but the model has only {n_expert} routed experts per layer: "
                               f"expert parallelism needs at least one expert per rank")
    base, extra = divmod(n_expert, n_ranks)
    out, lo = [], 0
    for r in range(n_ranks):
        hi = lo + base + (1 if r < extra else 0)
        out.append(range(lo, hi))
        lo = hi
    return out


class OwnedExperts:
    """One rank's part of a routed-expert tensor: ``inner`` is the expert class (host ``ExpertWeights``
    or device ``DeviceExpertWeights``) built over the owned slice ``raw[owned]`` only; calls take the
    global expert ids and return [T, k, out] with exact zeros for the pairs of experts owned elsewhere."""

    def __init__(self, inner, n_expert: int, owned: range):
        self.inner, self.owned = inner, owned
        self.name = inner.name
        self.shape = (int(n_expert), inner.shape[1], inner.shape[2])

    @classmethod
    def from_gguf(cls, expert_cls, gguf_file, name: str, owned: range, **options) -> "OwnedExperts":
        """``expert_cls`` built over the owned slice (``options``: its constructor's, the loader's)."""
        info = gguf_file.tensor(name)
        if len(info.shape) != 3:
            raise LayoutError(f"tensor {name!r}: expected a 3-D expert tensor, got shape {info.shape}")
        n_expert = int(gguf_file.tensor_array(name).shape[0])
        if owned.stop > n_expert:
            raise LayoutError(f"tensor {name!r}: {n_expert} experts, this rank owns {owned.start}..{owned.stop - 1}")
        raw = gguf_file.tensor_array(name)[owned.start: owned.stop]  # a view: nothing else is touched
        return cls(expert_cls(name, info.ggml_type, raw, info.shape[2], **options), n_expert, owned)

    @property
    def resident_nbytes(self) -> int:
        """Bytes this rank holds in MLX memory for the tensor (0 for the host strategy)."""
        return int(getattr(self.inner, "resident_nbytes", 0))

    @property
    def expert_nbytes(self) -> int:
        return self.inner.expert_nbytes

    @property
    def bytes_read(self) -> int:
        """Bytes copied out of the mapping (only ever the owned slice's)."""
        return self.inner.bytes_read

    def reset_counters(self) -> None:
        self.inner.reset_counters()

    def __call__(self, x: mx.array, ids) -> mx.array:
        if isinstance(ids, mx.array) and ids.ndim == 2 and ids.size <= DEVICE_MAX_PAIRS:
            return self._masked(x, ids)
        # A call one process would group by expert (host ids, or more pairs than a device step):
        # the owned pairs go through that same grouping, never through the device strategy's
        # per-pair matvec, which a handful of owned pairs would otherwise pick (another arithmetic).
        return self._owned_pairs(x, ids, functools.partial(ExpertWeights.__call__, self.inner))

    def ds4_cpu(self, x: mx.array, ids) -> mx.array:
        return self._owned_pairs(x, ids, self.inner.ds4_cpu)

    def _masked(self, x: mx.array, ids: mx.array) -> mx.array:
        """Device ids, never read on the host (a compiled decode step): a foreign expert's pair runs on
        the rank's first expert and is then zeroed. Its bytes are the rank's own, read once per step."""
        local = ids.astype(mx.int32) - self.owned.start
        mine = (local >= 0) & (local < len(self.owned))
        y = self.inner(x, mx.where(mine, local, 0))
        return mx.where(mine[:, :, None], y, mx.zeros((), dtype=y.dtype))

    def _owned_pairs(self, x: mx.array, ids, multiply) -> mx.array:
        """The owned pairs only, each as a [1, 1] call row (the grouping by expert inside ``multiply``
        sees the same pairs per expert in the same order as one process), scattered back into zeros."""
        n_expert, out_dim, n_in = self.shape
        ids_np = check_expert_call(self.name, self.shape, x, ids)
        T, k = ids_np.shape
        flat_ids = ids_np.reshape(-1)
        pairs = np.flatnonzero((flat_ids >= self.owned.start) & (flat_ids < self.owned.stop))
        if pairs.size == 0:
            return mx.zeros((T, k, out_dim), dtype=mx.float32)
        rows = pairs if x.shape[1] == k else pairs // k
        xs = mx.take(x.reshape(-1, n_in), mx.array(rows.astype(np.int32)), axis=0)[:, None, :]
        local = (flat_ids[pairs] - self.owned.start).astype(np.int32)[:, None]
        y = multiply(xs, local).reshape(pairs.size, out_dim).astype(mx.float32)
        where = np.zeros(T * k, dtype=np.int32)  # 0: the zero row; i + 1: the i-th owned pair
        where[pairs] = np.arange(1, pairs.size + 1, dtype=np.int32)
        full = mx.concatenate([mx.zeros((1, out_dim), dtype=mx.float32), y], axis=0)
        return mx.take(full, mx.array(where), axis=0).reshape(T, k, out_dim)


class RankGather:
    """The MoE's ``gather`` on one rank: the routed outputs [T, k, n_embd] of the pairs it owns (exact
    zeros elsewhere) joined with every other rank's by one ``all_sum``. Each pair is nonzero on exactly
    one rank and x + 0 is x, so every rank gets the one-process tensor bit for bit (module docstring)."""

    def __init__(self, group):
        self.group = group

    def __call__(self, down: mx.array) -> mx.array:
        return mx.distributed.all_sum(down, group=self.group)


class ExpertParallelModel(DistributedModel):
    """One rank of an expert-parallel group, wrapping the whole dense model whose MoEs are built over
    ``OwnedExperts`` and joined by ``RankGather``. Rank 0 uses it as a ``Model``; the others call
    ``follow()``, running the same forward (the wrapped model's) on their own cache without the head."""

    mode = "experts"

    def __init__(self, model, *, group, experts: range):
        super().__init__(model, group=group)
        self.owned_experts = experts  # the routed expert ids this rank owns, in every layer

    # -- rank 0: the command first, then the same forward as every rank --------------------------

    def forward_chunk(self, tokens: np.ndarray, cache: ModelCache,
                      want_logits: bool = True) -> tuple[mx.array | None, ModelCache]:
        self._driver_only()
        self._claim(cache)
        # The command goes first (every rank joins each layer's all_sum), so the cache it feeds is a
        # copy made here, tagged by ``feeding`` with the state it becomes: calling feeding on the
        # caller's own cache would make the old cache look like the new state. ``Model.forward_chunk``
        # copies ``work`` again (cheap: buffers are shared) and the result carries work's tag.
        work = cache.copy()
        self.feeding(work, origin=cache)
        self.command(Command(CHUNK, cache.n_tokens, np.asarray(tokens, dtype=np.int64).reshape(-1), want_logits))
        with self.transport.collective():
            return self.model.forward_chunk(tokens, work, want_logits)

    def step(self, token: int, cache: ModelCache, *, evaluate: bool = True) -> mx.array:
        # ``evaluate`` is accepted for the Model interface; every layer is evaluated here anyway
        self._driver_only()
        self._claim(cache)
        self.feeding(cache)  # the step runs in place: ``cache`` is the state being fed
        self.command(Command(STEP, cache.n_tokens, np.array([token], dtype=np.int64), True))
        H = self._decode(int(token), cache)
        # Lazy, as ``Model.step``'s: a caller that never reads them skips the head. (The compiled
        # decode's head function is the finish function plus this head; eager and compiled give
        # the same bits, ``compiled_decode``.)
        return self.model.head(H)[0]

    def _decode(self, token: int, cache: ModelCache) -> mx.array:
        """The compiled decode step without the head, evaluated: every layer's all_sum runs now, on
        every rank, whether or not rank 0 ever reads this step's logits (a rank that skipped its
        last layer's all_sum would leave the others waiting for it)."""
        with self.transport.collective():
            H = self.model.decoder().run(token, cache, until="H", evaluate=False)
            mx.eval(H, *cache.arrays())
        return H

    # -- whole states (payloads, the disk KV cache) -----------------------------------------------
    # Every rank holds every layer's state, so saving needs nothing from the other ranks; loading
    # sends each of them the whole state (``DistributedModel.scatter_state``: ``state_layers`` and
    # ``later_ranks_hold`` keep their defaults, all layers), kept under an id like a snapshot.

    def gather_state(self, cache: ModelCache) -> ModelCache:
        """Rank 0: ``cache`` itself. Rank 0 runs the whole forward pass on its own full cache (only
        the experts are split, and their outputs are summed onto every rank), so its cache is the
        complete state: nothing is transferred."""
        self._driver_only()
        return cache

    # -- the other ranks ----------------------------------------------------------------------

    def follow_chunk(self, cmd: Command) -> None:
        cache = self.live_cache(cmd)
        try:
            with self.transport.collective():
                _, self.cache = self.model.forward_chunk(cmd.tokens, cache, want_logits=False)
        except NonFiniteError:
            pass  # rank 0 computed the same values, raised the same error and keeps its cache too

    def follow_step(self, cmd: Command) -> None:
        self._decode(int(cmd.tokens[0]), self.live_cache(cmd))
