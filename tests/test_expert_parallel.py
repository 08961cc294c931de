"""Expert-parallel runs (``--distributed experts``, ``model/expert_parallel.py``): the ownership
function, one rank's share of an expert tensor, and two loopback ranks against one process.

The launched runs reuse ``test_distributed``'s helpers (``_run``, ``LAUNCH``, ``CLI``); its failure
tests (a killed rank, a rank that never joins) are parametrized over both modes there.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.errors import DistributedError
from ds4_mlx.model.device_experts import DeviceExpertWeights
from ds4_mlx.model.expert_parallel import OwnedExperts, owners
from ds4_mlx.model.experts import ExpertWeights

from test_distributed import CLI, LAUNCH, PROMPT, _generate_args, _run

# -- the ownership function (pure) ---------------------------------------------------------------


@pytest.mark.parametrize("n_expert,n_ranks", [(16, 1), (16, 2), (16, 3), (16, 16), (256, 2), (256, 3), (256, 7),
                                              (5, 4), (1, 1)])
def test_every_expert_is_owned_exactly_once_balanced_and_contiguous(n_expert, n_ranks):
    ranges = owners(n_expert, n_ranks)
    assert len(ranges) == n_ranks
    ids = [e for r in ranges for e in r]
    assert ids == list(range(n_expert))  # each exactly once, in rank order
    sizes = [len(r) for r in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert all(r.step == 1 for r in ranges)
    assert owners(n_expert, n_ranks) == ranges  # deterministic: every rank computes the same table


@pytest.mark.parametrize("n_expert,n_ranks,why", [
    (16, 17, "17 ranks but the model has only 16 routed experts per layer"),
    (16, 0, "number of ranks must be an integer >= 1, got 0"),
    (16, -2, "got -2"), (16, 2.0, "got 2.0"), (16, True, "got True"), (16, "2", "got '2'"),
    (0, 2, "number of experts must be an integer >= 1, got 0"),
])
def test_impossible_ownership_is_one_line(n_expert, n_ranks, why):
    with pytest.raises(DistributedError) as exc:
        owners(n_expert, n_ranks)
    assert why in str(exc.value) and "\n" not in str(exc.value)


# -- one rank's share of an expert tensor ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_file(tiny_model_path):
    from ds4_mlx.formats.layout import load_model_file

    f, cfg, _ = load_model_file(tiny_model_path)
    yield f, cfg
    f.close()


@pytest.mark.parametrize("cls", [ExpertWeights, DeviceExpertWeights], ids=["host", "device"])
@pytest.mark.parametrize("name", ["blk.0.ffn_up_exps.weight", "blk.3.ffn_down_exps.weight"])  # a hash layer, a top-k one
@pytest.mark.parametrize("T", [1, 5])
def test_the_ranks_shares_add_up_to_the_whole_tensor_bit_for_bit(tiny_file, cls, name, T):
    """Each pair is computed by its owner as one process computes it and is an exact zero elsewhere,
    so the sum over ranks (the all_sum) is the one-process result, in both arithmetics."""
    f, cfg = tiny_file
    full = cls.from_gguf(f, name)
    n_expert, _, n_in = full.shape
    rng = np.random.default_rng(T)
    ids = np.stack([rng.choice(n_expert, cfg.n_expert_used, replace=False) for _ in range(T)]).astype(np.int32)
    x = mx.array(rng.standard_normal((T, cfg.n_expert_used, n_in)).astype(np.float32))
    for method in ("__call__", "ds4_cpu"):
        # device ids stay MLX arrays on the device strategy's own path (the masked decode path)
        call_ids = mx.array(ids) if cls is DeviceExpertWeights and method == "__call__" else ids
        want = np.array(getattr(full, method)(x, call_ids))
        for n_ranks in (2, 3):
            parts = [np.array(getattr(OwnedExperts.from_gguf(cls, f, name, r), method)(x, call_ids))
                     for r in owners(n_expert, n_ranks)]
            for r, part in zip(owners(n_expert, n_ranks), parts):
                foreign = ~np.isin(ids, list(r))
                assert not part[foreign].any()  # exact zeros for the other ranks' pairs
            assert np.array_equal(sum(parts[1:], parts[0]), want), (method, n_ranks)


def test_a_rank_maps_and_reads_only_its_experts(tiny_file):
    f, _ = tiny_file
    name = "blk.2.ffn_gate_exps.weight"
    full = ExpertWeights.from_gguf(f, name)
    n_expert = full.shape[0]
    mine = owners(n_expert, 2)[1]
    host = OwnedExperts.from_gguf(ExpertWeights, f, name, mine)
    assert host.inner.raw.shape[0] == len(mine) and np.shares_memory(host.inner.raw, full.raw)
    ids = np.array([[0, 1, mine.start, mine.stop - 1]], dtype=np.int32)
    host(mx.zeros((1, 1, full.shape[2])), ids)
    assert host.bytes_read == 2 * full.expert_nbytes  # the two owned experts' slabs, nothing else
    device = OwnedExperts.from_gguf(DeviceExpertWeights, f, name, mine)
    assert device.resident_nbytes == len(mine) * full.expert_nbytes == full.raw.nbytes // 2
    assert host.resident_nbytes == 0


def test_hostile_ids_are_one_line(tiny_file):
    from ds4_mlx.errors import LayoutError

    f, _ = tiny_file
    e = OwnedExperts.from_gguf(ExpertWeights, f, "blk.2.ffn_gate_exps.weight", range(0, 8))
    x = mx.zeros((1, 1, e.shape[2]))
    for bad, why in [(np.array([[16, 0, 1, 2]]), "expert id outside 0..15"), (np.array([[-1, 0, 1, 2]]), "outside"),
                     (np.array([1, 2]), "must be [T, k]")]:
        with pytest.raises(LayoutError, match=why.replace("[", r"\[").replace("]", r"\]")):
            e(x, bad)


def test_experts_without_a_launcher_is_one_line(tiny_model_path):
    env = {k: None for k in ("MLX_HOSTFILE", "MLX_RANK")}
    r = _run(CLI + ["generate", "-m", str(tiny_model_path), "-p", "hi", "--distributed", "experts"], timeout=120,
             **env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "ds4-mlx generate: error: --distributed experts needs two or more ranks: start every rank with "
        "mlx.launch (e.g. mlx.launch -n 2 --backend ring -- ds4-mlx generate ...)"]


# -- two ranks on loopback ----------------------------------------------------------------------------


@pytest.mark.parametrize("numerics,experts", [("ds4-cpu", None), ("default", None), ("default", "device"),
                                              ("ds4-cpu", "device")])
def test_experts_mode_matches_one_process(tiny_model_path, tmp_path, numerics, experts):
    """The issue's acceptance line with ``--distributed experts`` (``experts`` None: literally; auto is
    the host strategy on this CPU): the same greedy tokens, and every dumped logprob within 0.02. The
    observed bound is 0 (the files are byte-identical; ``expert_parallel``'s docstring says why), which
    is asserted too, so a change that loses the exactness is noticed. Default numerics decode through
    the compiled step, so all_sum inside ``mx.compile`` is covered."""
    prompt = tmp_path / "P"
    prompt.write_text(PROMPT)
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    extra = [] if experts is None else ["--experts", experts]
    r1 = _run(CLI + _generate_args(tiny_model_path, prompt, one, numerics) + extra)
    assert r1.returncode == 0, r1.stderr
    r2 = _run(LAUNCH + ["-n", "2", "--backend", "ring", "--"] + CLI
              + _generate_args(tiny_model_path, prompt, two, numerics) + extra + ["--distributed", "experts"])
    assert two.exists(), r2.stdout + r2.stderr
    assert r2.stderr.count("wrote 6 steps") == 1, r2.stderr  # rank 0 alone writes and reports
    assert "Traceback" not in r2.stderr, r2.stderr
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert [s["selected"]["id"] for s in a["steps"]] == [s["selected"]["id"] for s in b["steps"]]
    for sa, sb in zip(a["steps"], b["steps"]):
        la = {t["token"]["id"]: t["logprob"] for t in sa["top_logprobs"]}
        lb = {t["token"]["id"]: t["logprob"] for t in sb["top_logprobs"]}
        assert la.keys() == lb.keys()
        assert max(abs(la[k] - lb[k]) for k in la) <= 0.02
    assert one.read_bytes() == two.read_bytes()


_RANK_SCRIPT = """
import sys
import numpy as np
from ds4_mlx.model.loader import load
from ds4_mlx.engine.session import Session

m = load(sys.argv[1], distributed="experts", experts=sys.argv[2])
tensors = [e for b in m.blocks for e in (b.ffn.gate_exps, b.ffn.up_exps, b.ffn.down_exps)]
owned = m.owned_experts
resident = sum(e.resident_nbytes for e in tensors)


def bound():
    # each call reads at most the rank's own slabs, once each (the MLX path's cache may read fewer;
    # the native path reads the selected ones in place on every call)
    return sum(e.inner.calls * len(owned) * e.expert_nbytes for e in tensors)
print(f"rank {m.rank}: owns {owned.start}..{owned.stop - 1} of {tensors[0].shape[0]}, "
      f"expert bytes {sum(e.expert_nbytes * tensors[0].shape[0] for e in tensors)}, resident {resident}, "
      f"head {m.output is not None}", flush=True)
if m.rank:
    m.follow()
    read = sum(e.bytes_read for e in tensors)
    print(f"rank {m.rank}: stopped, read {read}, foreign {read > bound()}", flush=True)
    sys.exit(0)
s = Session(m, ctx=64)
s.sync([0, 5, 9, 11, 40, 41, 42, 43])
for _ in range(3):
    s.eval(int(np.argmax(s.logits())))
read = sum(e.bytes_read for e in tensors)
print(f"rank 0: done, read {read}, foreign {read > bound()}", flush=True)
"""


@pytest.mark.parametrize("strategy", ["device", "host"])
def test_each_rank_holds_only_its_share_of_the_experts(tiny_model_path, tmp_path, strategy):
    """Device strategy: the resident expert bytes per rank are half the model's; host strategy: the
    slabs read out of the mapping never exceed the rank's own experts' bytes. Only rank 0 holds the
    output head (the followers never compute logits)."""
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    r = _run(LAUNCH + ["-n", "2", "--backend", "ring", "--", sys.executable, str(script), str(tiny_model_path),
                       strategy])
    lines = sorted(r.stdout.splitlines())
    assert len(lines) == 4, r.stdout + r.stderr
    done0, head0, head1, done1 = lines  # sorted: "done" < "owns" < "stopped"
    assert head0.startswith("rank 0: owns 0..7 of 16") and head1.startswith("rank 1: owns 8..15 of 16"), lines
    total = int(head0.split("expert bytes ")[1].split(",")[0])
    for head in (head0, head1):
        resident = int(head.split("resident ")[1].split(",")[0])
        assert resident == (total // 2 if strategy == "device" else 0), head
    # only rank 0 computes logits, so only rank 0 holds the output head
    assert head0.endswith("head True") and head1.endswith("head False"), lines
    assert done0.startswith("rank 0: done") and done1.startswith("rank 1: stopped"), lines
    for done in (done0, done1):
        assert done.endswith("foreign False"), done
        if strategy == "host":
            assert int(done.split("read ")[1].split(",")[0]) > 0, done  # it did compute its experts
