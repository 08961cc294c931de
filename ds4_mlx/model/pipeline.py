"""Pipeline parallel runs over ``mx.distributed``: each rank holds a contiguous range of the layers.

    rank 0          embed, layers [0, a)      --H-->  rank 1   layers [a, b)  --H--> ... last rank
    rank 0  <--x--  last rank: layers [.., n_layer), output HC, norm: x (the normed hidden state)
    rank 0: head rows [0, c) · x   |   last rank: head rows [c, n_vocab) · x   (side by side)
    rank 0  <--its logits--  last rank;  rank 0 concatenates

The split (``split_pipeline`` over the loader's ``resident_split``: a tensor's resident bytes for
the numerics, backend and expert strategy) is contiguous layer ranges and a cut ``c`` of the output
matrix's rows, chosen together so that the largest rank holds as little as they allow: the head is
the model's largest tensor (the real one's 129280 x 4096 is 2 GiB as float32 on MLX's CPU backend), and
whole on the last rank it would outweigh several layers there. Each rank maps and touches only its
share of the GGUF: the loader builds only the rank's own blocks and head rows
(``loader.load(..., distributed="pipeline")``); the embedding is gathered only on rank 0.

Rank 0 drives (``model.distributed``: joining, the transport, the command protocol): each
``forward_chunk`` / ``step`` runs rank 0's layers, then sends the command (CHUNK or STEP: the
position and the token ids) and H to rank 1; each other rank's ``follow()`` receives the command,
relays it, receives H, runs its layers on its own ``ModelCache`` and passes H on. When logits are
wanted the last rank sends rank 0 the normed hidden state (``Model.head_hidden``, n_embd floats),
then the logits of its rows (``Model.head_logits``). So every rank computes exactly what one process
computes for its layers (same module code, same compiled decode functions), each logit is a dot
product of the same row and hidden state (its own in both numerics: ds4-cpu's per-row integer sums,
the CPU backend's GEMM per output column; ``tests/test_pipeline_split.py`` checks a row range against
the whole head), and the logits are bit-identical to a one-process run.

Every rank keeps its part of the states rank 0 keeps (snapshots, checkpoints, other sessions:
``DistributedModel.feeding``, the STATE command); payloads and disk KV entries gather every layer
to rank 0 and scatter them back (GATHER / SCATTER below). A rank that dies ends the others with
one line (``distributed.Transport``).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import DistributedError
from ds4_mlx.model.cache import LayerCache, ModelCache
# ``join`` and ``MODES`` are re-exported: they were first defined here, and callers still import them here.
from ds4_mlx.model.distributed import CHUNK, MODES, STEP, Command, DistributedModel, join  # noqa: F401
from ds4_mlx.model.distributed import GATHER, SCATTER
from ds4_mlx.model.experts import EXPERT_CACHE, routed_share


# -- the split -----------------------------------------------------------------------------------


def split_layers(layer_bytes: list[int], n_ranks: int, first_extra: int = 0, last_extra: int = 0) -> list[range]:
    """Contiguous layer ranges, one per rank in order, that minimise the largest rank's bytes
    (``first_extra`` counts on rank 0, ``last_extra`` on the last rank). Every rank gets at least
    one layer; among equal maxima the earliest cut points win, so the split is deterministic."""
    n = len(layer_bytes)
    if not isinstance(n_ranks, int) or n_ranks < 1:
        raise DistributedError(f"the number of ranks must be >= 1, got {n_ranks!r}")
    if n_ranks > n:
        raise DistributedError(f"{n_ranks} ranks but the model has only {n} layers: "
                               f"a pipeline needs at least one layer per rank")
    cum = [0]
    for b in layer_bytes:
        cum.append(cum[-1] + int(b))

    def load(r: int, i: int, j: int) -> int:  # bytes of rank r holding layers [i, j)
        return cum[j] - cum[i] + (first_extra if r == 0 else 0) + (last_extra if r == n_ranks - 1 else 0)

    # best[r][j]: the smallest max load of ranks 0..r covering layers [0, j); cut[r][j] its last cut
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_ranks)]
    cut = [[0] * (n + 1) for _ in range(n_ranks)]
    for j in range(1, n + 1):
        best[0][j] = load(0, 0, j)
    for r in range(1, n_ranks):
        for j in range(r + 1, n + 1):
            for i in range(r, j):
                v = max(best[r - 1][i], load(r, i, j))
                if v < best[r][j]:
                    best[r][j], cut[r][j] = v, i
    ranges, j = [], n
    for r in range(n_ranks - 1, 0, -1):
        i = cut[r][j]
        ranges.append(range(i, j))
        j = i
    ranges.append(range(0, j))
    return ranges[::-1]


HEAD = "output.weight"  # the output head: its rows are shared by rank 0 and the last rank


@dataclass(frozen=True)
class PipelineSplit:
    """What each pipeline rank holds: ``layers[r]`` (contiguous, in order, covering every layer) and
    the output head's rows, ``[0, head_cut)`` on rank 0 and ``[head_cut, n_vocab)`` on the last rank
    (``head_cut`` 0: the whole head on the last rank)."""

    layers: tuple[range, ...]
    head_cut: int
    n_vocab: int

    def head_rows(self, rank: int) -> range:
        """The head's rows ``rank`` holds (empty: none). One rank alone holds them all."""
        last = len(self.layers) - 1
        if rank == last:
            return range(0 if rank == 0 else self.head_cut, self.n_vocab)
        return range(0, self.head_cut) if rank == 0 else range(0)

    def to_ints(self) -> list[int]:
        """The split as int64s for ``distributed.rank0s``: every layer cut, then the head cut."""
        return [r.start for r in self.layers] + [self.layers[-1].stop, self.head_cut]

    @classmethod
    def from_ints(cls, values: list[int], n_vocab: int) -> "PipelineSplit":
        cuts = [int(v) for v in values[:-1]]
        return cls(tuple(range(a, b) for a, b in zip(cuts, cuts[1:])), int(values[-1]), n_vocab)


def split_pipeline(layer_bytes: list[int], n_ranks: int, first_extra: int = 0, last_extra: int = 0,
                   head_row_bytes: int = 0, n_vocab: int = 0) -> PipelineSplit:
    """The layer ranges and the head cut that minimise the largest rank's bytes: ``split_layers``,
    with ``n_vocab`` head rows of ``head_row_bytes`` each shared out between rank 0 and the last rank.

    Exact: for each choice of rank 0's last layer and the last rank's first one, the best head cut
    evens those two ranks out (the only two it moves bytes between), and the ranks between them take
    ``split_layers`` of the layers between; the smallest largest load over those choices wins (the
    first found among equal ones, so the split is deterministic). A cached form of a dense weight is
    the same bytes for each row (``linear.dense_resident_nbytes``), so a row range weighs its length
    times ``head_row_bytes``."""
    layers = split_layers(layer_bytes, n_ranks, first_extra, last_extra + head_row_bytes * n_vocab)
    if n_ranks == 1 or head_row_bytes <= 0 or n_vocab <= 0:
        return PipelineSplit(tuple(layers), 0, n_vocab)
    n = len(layer_bytes)
    cum = [0]
    for b in layer_bytes:
        cum.append(cum[-1] + int(b))
    rb, total = int(head_row_bytes), int(head_row_bytes) * n_vocab
    inner = n_ranks - 2  # ranks between rank 0 and the last one
    best = None  # (largest load, rank 0's stop, the last rank's start, head cut)
    for a in range(1, n - inner):
        for b in (range(a, a + 1) if inner == 0 else range(a + inner, n)):
            middle = 0
            if inner:
                between = layer_bytes[a:b]
                c_sum = [0]
                for x in between:
                    c_sum.append(c_sum[-1] + int(x))
                middle = max(c_sum[r.stop] - c_sum[r.start] for r in split_layers(between, inner))
            first, last = cum[a] + first_extra, cum[n] - cum[b] + last_extra
            # rank 0 first + c rb, the last rank last + total - c rb: even at c = (last + total - first) / 2rb
            even = (last + total - first) // (2 * rb)
            for c in (even, even + 1):
                c = min(max(c, 0), n_vocab)
                load = max(middle, first + c * rb, last + total - c * rb)
                if best is None or load < best[0]:
                    best = (load, a, b, c)
    _, a, b, c = best
    if inner:
        layers = [range(0, a)] + [range(r.start + a, r.stop + a) for r in split_layers(layer_bytes[a:b], inner)] \
            + [range(b, n)]
    else:
        layers = [range(0, a), range(a, n)]
    return PipelineSplit(tuple(layers), c, n_vocab)


def tensor_split(f, n_layer: int, n_ranks: int, nbytes, n_vocab: int = 0) -> PipelineSplit:
    """``split_pipeline`` over ``nbytes(name)`` of every tensor of the GGUF ``f``: ``blk.N.*`` count on
    layer N, the rest of the output head (``output*``: its mix and norm) on the last rank, the rest
    (the embedding) on rank 0. With ``n_vocab`` the head's rows are shared between rank 0 and the
    last rank, weighed ``nbytes(HEAD, rows)`` a row; without, the whole head counts on the last rank
    (``head_cut`` 0). ``nbytes`` must be a pure function of the file and the load options, so every
    rank computes the same split without talking to the others."""
    per_layer = [0] * n_layer
    first = last = 0
    for name in f.tensors:
        if name == HEAD and n_vocab:
            continue  # weighed by the row below
        b = int(nbytes(name))
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) > 2:
            if parts[1].isdigit() and int(parts[1]) < n_layer:
                per_layer[int(parts[1])] += b  # (a block the model does not have builds nothing)
        elif name.startswith("output"):
            last += b
        else:
            first += b
    row = int(nbytes(HEAD, range(0, 1))) if n_vocab and HEAD in f.tensors else 0
    return split_pipeline(per_layer, n_ranks, first, last, row, n_vocab)


def gguf_split(f, n_layer: int, n_ranks: int) -> list[range]:
    """``tensor_split`` over the GGUF's tensor bytes. The embedding is not counted: rank 0 gathers
    only the rows of the tokens it sees out of the mapping, so it never becomes resident as a whole.
    The loader splits by resident bytes instead (``loader.resident_split``): what a rank holds is not
    its GGUF bytes (float32 dense weights on the CPU backend, experts left in the mapping)."""
    def gguf_bytes(name: str) -> int:
        return int(f.tensor(name).nbytes) if name.startswith(("blk.", "output")) else 0

    return list(tensor_split(f, n_layer, n_ranks, gguf_bytes).layers)


# -- the model of one rank ---------------------------------------------------------------------


class PipelineModel(DistributedModel):
    """One rank's stage: the wrapped ``model``'s blocks are its layers (``layers``, a range); the
    output mix and norm exist on the last rank, the output matrix's rows ``head_rows`` on rank 0 and
    the last rank (``PipelineSplit.head_rows``; ``output`` is None on a rank that holds none). Rank 0
    uses it as a ``Model``; the others call ``follow()``. Each rank runs its blocks with the model's
    own ``run_blocks`` / ``forward_chunk`` / decoder: the stage adds only the messages."""

    mode = "pipeline"

    def __init__(self, model, *, group, layers: range, head_rows: range):
        super().__init__(model, group=group)
        self.layers = layers
        self.head_rows = head_rows
        # rank 0 holds the head's rows [0, cut), the last rank [cut, n_vocab): both sides know the cut
        self.head_cut = head_rows.stop if self.rank == 0 else head_rows.start
        if self.source is not None:  # the default expert-LRU budget: this rank's share (its docstring)
            EXPERT_CACHE.scale_default(routed_share(self.source, layers))

    @property
    def sent(self) -> dict[str, dict[str, int]]:
        """Bytes and messages this rank sent, by phase (``Transport.sent``): everything a pipeline
        exchanges is point-to-point, so this is all of its traffic."""
        return self.transport.sent

    def empty_cache(self) -> ModelCache:
        """An empty cache of this rank's layers only (the other entries None)."""
        return ModelCache.empty(self.config, self.layers)

    # -- rank 0 -------------------------------------------------------------------------------

    def _recv_logits(self) -> mx.array:
        """The logits of the position the last rank has just run: its normed hidden state arrives
        first (when rank 0 holds rows of the head) and rank 0 multiplies its rows while the last
        rank multiplies its own, which arrive next; concatenated in row order."""
        cfg, last = self.config, self.size - 1
        parts = []
        if self.head_cut:
            x = self.transport.recv_array((1, cfg.n_embd), last)
            with self.ops.stream():
                parts.append(self.model.head_logits(x)[0])
            mx.eval(parts[0])  # now, before waiting for the last rank's rows: the two run side by side
        if self.head_cut < cfg.n_vocab:
            parts.append(self.transport.recv_array((cfg.n_vocab - self.head_cut,), last))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)

    def forward_chunk(self, tokens: np.ndarray, cache: ModelCache,
                      want_logits: bool = True) -> tuple[mx.array | None, ModelCache]:
        self._driver_only()
        self._claim(cache)

        def later_ranks(H: mx.array, tokens: np.ndarray, p0: int, work: ModelCache, want: bool) -> mx.array | None:
            # The model ran rank 0's blocks on a copy of the caller's ``cache`` (on an error before
            # this point the caller keeps its cache, the other ranks theirs); the rest runs there.
            self.feeding(work, cache)
            self.command(Command(CHUNK, p0, np.asarray(tokens, dtype=np.int64), want))
            self.transport.send_array(H, 1)
            return self._recv_logits() if want else None

        return self.model.forward_chunk(tokens, cache, want_logits, logits_from=later_ranks)

    def step(self, token: int, cache: ModelCache, *, evaluate: bool = True) -> mx.array:
        # ``evaluate`` is accepted for the Model interface; H is evaluated here anyway, to be sent
        self._driver_only()
        self._claim(cache)
        p = cache.n_tokens
        model = self.model
        H = model.decoder().run(int(token), cache, until="H", evaluate=False)
        mx.eval(H, *cache.arrays())
        self.feeding(cache)
        self.command(Command(STEP, p, np.array([token], dtype=np.int64), True))
        self.transport.send_array(H, 1)
        return self._recv_logits()

    # -- whole states (payloads, the disk KV cache) -----------------------------------------------
    # A payload holds every layer's state. Saving one, rank 0 asks the other ranks for their layers'
    # part of the state (GATHER: each rank appends its layers to what the previous ones sent and the
    # last rank delivers them all to rank 0); loading one, rank 0 sends them theirs (SCATTER: each
    # takes its own layers and passes the later ones on) and they keep it under an id, like a
    # snapshot, until rank 0 feeds it. So a payload or a disk KV entry is the same file as one
    # process writes, whatever the split: it loads on any number of ranks, and in one process.

    def gather_state(self, cache: ModelCache) -> ModelCache:
        """Rank 0: ``cache`` with every layer's state, the other ranks' layers fetched from them."""
        self._driver_only()
        self.check_open()
        n = cache.n_tokens
        if n == 0:
            return cache
        self.command(Command(GATHER, n, arg=self.state_id(cache)))
        layers = list(cache.layers)
        for il, arrays in self._recv_layers(self.size - 1):
            layers[il] = LayerCache.from_state(self.config, il, n, arrays, cache.capacity)
        return ModelCache(layers, cache.capacity)

    def later_ranks_hold(self, il: int) -> bool:
        return il >= self.layers.stop  # the ranks after this one hold the layers after its range

    @property
    def state_layers(self) -> range:
        return self.layers

    # -- the other ranks ----------------------------------------------------------------------
    # The command came from rank - 1 (and was relayed on); H follows it on the same link, and this
    # rank's output goes to rank + 1 (after the command it relayed) or, from the last rank, when
    # logits are wanted: the normed hidden state, then the logits of its rows, to rank 0.

    def _recv_h(self, n: int) -> mx.array:
        cfg = self.config
        return self.transport.recv_array((n, cfg.n_hc, cfg.n_embd), self.rank - 1)

    def _send_head(self, x: mx.array) -> None:
        """The last rank: ``x`` ([1, n_embd], ``head_hidden``) to rank 0 first, so rank 0 multiplies
        its rows of the head while this rank multiplies its own; then those logits."""
        if self.head_cut:
            self.transport.send_array(x, 0)
        if self.model.output is not None:
            with self.ops.stream():  # the numerics' stream, as rank 0's rows (a step arrives outside it)
                logits = self.model.head_logits(x)[0]
            self.transport.send_array(logits, 0)

    def handlers(self):
        return {**super().handlers(), GATHER: self.follow_gather, SCATTER: self.follow_scatter}

    def follow_gather(self, cmd: Command) -> None:
        cache = self.cache if cmd.arg == 0 else self.kept.get(cmd.arg)
        if cache is None or cache.n_tokens != cmd.p0:
            raise DistributedError(f"rank {self.rank}: rank 0 asks for state {cmd.arg} of {cmd.p0} tokens, "
                                   "which this rank does not hold (out of step with rank 0)")
        before = self._recv_layers(self.rank - 1) if self.rank > 1 else []
        own = [(il, cache.layers[il].state) for il in self.layers]
        self._send_layers(before + own, 0 if self.is_last else self.rank + 1)

    def follow_chunk(self, cmd: Command) -> None:
        H = self._recv_h(len(cmd.tokens))
        cache = self.live_cache(cmd)
        with self.ops.stream():
            H = self.model.run_blocks(H, cmd.tokens, cache)
            if not self.is_last:
                self.transport.send_array(H, self.rank + 1)
            elif cmd.want:
                self._send_head(self.model.head_hidden(H[-1:]))

    def follow_step(self, cmd: Command) -> None:
        H = self._recv_h(1)
        cache = self.live_cache(cmd)
        y = self.model.decoder().run(int(cmd.tokens[0]), cache, H=H, until="hidden" if self.is_last else "H",
                                     evaluate=False)
        mx.eval(y, *cache.arrays())
        if not self.is_last:
            self.transport.send_array(y, self.rank + 1)
        else:
            self._send_head(y[None])

