"""Packing workloads: independent GEMM-like ops ready at the same time, and how to launch them.

A ``PackingWorkload`` is a multiset of ``Member`` GEMMs ``out[b] = x[b] @ w[b]`` (``x``: ``[m, k]``;
``w``: ``[k, n]`` for layout ``nn``, or ``[n, k]`` read transposed for ``nt``, a linear layer's
weight). A convolution enters as its im2col GEMM (``m`` = output pixels, ``k`` = in-channels x
kernel area, ``n`` = out-channels). Members with the same non-empty ``weight`` tag share one
weight. Its identity (``hash``) is canonical: the order of members, their labels and the names of
weight tags do not enter it.

A ``Candidate`` partitions the members into clusters and gives each cluster a backend:

* ``serial``: one cuBLAS call per member, one after another (all candidates replay as one graph);
* ``streams``: the members spread over ``k`` streams forked and joined inside the graph;
* ``padded``: every problem zero-padded to the cluster's largest ``m``, ``n``, ``k`` and stacked,
  one strided-batched GEMM; ``padded_t`` the same with the weight stack kept in the other layout
  (``[n, k]`` for ``nn`` members, ``[k, n]`` for ``nt``): weights are constants, stacked once,
  and cuBLAS picks another kernel for the other operand order;
* ``pointer``: one pointer-array batched GEMM, each problem in its own buffer padded to the
  cluster's largest shape;
* ``grouped``: one ``cublasGemmGroupedBatchedEx`` call, problems of equal shape in one group,
  no padding;
* ``concat``: members of one ``k`` as ONE GEMM: their rows stacked (as a segmented batch of
  tokens lies in memory), their weights side by side; each member's output is its diagonal block
  (the off-diagonal blocks are the waste; pays for thin outputs, e.g. LoRA shrink GEMMs);
* ``splitk`` (``splitk_candidates``; ``all_candidates`` holds every kind): the padded
  problems each cut into ``split`` slices of their depth, ONE pointer-array batched GEMM of all
  slices into float32 partial sums, then one kernel summing the slices (few output tiles, deep k);
* ``chunks`` (``chunk_candidates``): every problem cut into chunks of ``rows``
  rows (its last chunk zero-padded), ONE pointer-array batched GEMM of all chunks, each chunk
  pointing at its member's weight: members of one ``n, k`` but different ``m`` (tenants'
  sequence lengths, MoE experts' token counts) in one launch, padding under ``rows`` rows each.

Padding waste (the share of a cluster's multiply-adds spent on zeros) is part of every candidate.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tunedb.records import canonical_json, sha256_hex

SCHEME = "tunedb.packing/1"
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
LAYOUTS = ("nn", "nt")
KINDS = ("gemm", "bgemm", "conv")
BACKENDS = ("serial", "streams", "padded", "pointer", "grouped", "concat", "padded_t")
EXTRA_BACKENDS = ("splitk", "chunks")  # with parameters (slices, rows); since feature schema packing/6
SPLITK_DTYPES = ("float32", "bfloat16")
SPLITK_ALIGN = 8  # slice depth in elements: every slice's first element stays 16-byte aligned
SPLITK_MIN_DEPTH = 128
CONCAT_MAX_N = 2048  # concat only thin outputs: its waste grows with every member's columns
SMS_H200 = 132


@dataclass(frozen=True)
class Member:
    """One GEMM-like op: ``batch`` problems of ``[m, k] @ [k, n]`` in ``dtype``."""

    m: int
    n: int
    k: int
    batch: int = 1
    dtype: str = "float32"
    layout: str = "nn"
    kind: str = "gemm"
    weight: str = ""  # same non-empty tag: one shared weight
    label: str = field(default="", compare=False)  # where it comes from; not part of the identity

    def __post_init__(self) -> None:
        if min(self.m, self.n, self.k, self.batch) < 1:
            raise ValueError(f"packing member {self.label or ''} has a non-positive size: "
                             f"m={self.m} n={self.n} k={self.k} batch={self.batch}")
        if self.dtype not in DTYPES:
            raise ValueError(f"packing member dtype {self.dtype!r}: expected one of {sorted(DTYPES)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"packing member layout {self.layout!r}: expected one of {LAYOUTS}")
        if self.kind not in KINDS:
            raise ValueError(f"packing member kind {self.kind!r}: expected one of {KINDS}")

    @property
    def key(self) -> tuple:
        """Everything that shapes the computation (not the label, not the weight tag's name)."""
        return (self.kind, self.dtype, self.layout, self.m, self.n, self.k, self.batch)

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k

    def bytes(self, weight_read: bool = True) -> int:
        isz = DTYPES[self.dtype]
        weight = self.k * self.n if weight_read else 0
        return isz * self.batch * (self.m * self.k + self.m * self.n + weight)

    def to_json(self) -> dict[str, Any]:
        return {"m": self.m, "n": self.n, "k": self.k, "batch": self.batch, "dtype": self.dtype,
                "layout": self.layout, "kind": self.kind, "weight": self.weight, "label": self.label}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Member:
        return Member(**{k: d[k] for k in ("m", "n", "k", "batch", "dtype", "layout", "kind", "weight",
                                           "label") if k in d})


@dataclass(frozen=True)
class PackingWorkload:
    """A named multiset of independent members; ``family`` says which suite family it is from."""

    name: str
    family: str
    members: tuple[Member, ...]

    def __post_init__(self) -> None:
        if not self.members:
            raise ValueError(f"packing workload {self.name!r} has no members")
        shared: dict[str, tuple] = {}
        for mb in self.members:
            if mb.weight:
                sig = (mb.dtype, mb.layout, mb.n, mb.k, mb.batch)
                if shared.setdefault(mb.weight, sig) != sig:
                    raise ValueError(f"packing workload {self.name!r}: members sharing weight "
                                     f"{mb.weight!r} differ in dtype/layout/n/k/batch")

    def canonical(self) -> list:
        """Weight groups as sorted lists of member keys (a member of its own is a group of one),
        sorted: independent of member order, labels and tag names."""
        groups: dict[str, list] = defaultdict(list)
        alone = []
        for mb in self.members:
            if mb.weight:
                groups[mb.weight].append(list(mb.key))
            else:
                alone.append([False, [list(mb.key)]])
        shared = [[True, sorted(g)] for g in groups.values()]
        return sorted(alone + shared)

    @property
    def hash(self) -> str:
        return sha256_hex(canonical_json([SCHEME, self.canonical()]))

    @property
    def problems(self) -> int:
        return sum(mb.batch for mb in self.members)

    @property
    def flops(self) -> int:
        return sum(mb.flops for mb in self.members)

    def bytes(self) -> int:
        """Bytes read and written once: each shared weight counted once."""
        seen: set[str] = set()
        total = 0
        for mb in self.members:
            total += mb.bytes(weight_read=not (mb.weight and mb.weight in seen))
            if mb.weight:
                seen.add(mb.weight)
        return total

    def to_json(self) -> dict[str, Any]:
        return {"scheme": SCHEME, "name": self.name, "family": self.family, "hash": self.hash,
                "members": [mb.to_json() for mb in self.members]}

    @staticmethod
    def from_json(d: dict[str, Any]) -> PackingWorkload:
        w = PackingWorkload(d["name"], d["family"], tuple(Member.from_json(m) for m in d["members"]))
        if "hash" in d and d["hash"] != w.hash:
            raise ValueError(f"packing workload {w.name!r}: stored hash does not match its members")
        return w


# -- candidates ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cluster:
    """Members (indices into the workload) launched together by one backend."""

    members: tuple[int, ...]
    backend: str
    streams: int = 1
    split: int = 1  # splitk: slices of the depth
    rows: int = 0  # chunks: rows per chunk

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS + EXTRA_BACKENDS:
            raise ValueError(f"packing backend {self.backend!r}: expected one of "
                             f"{BACKENDS + EXTRA_BACKENDS}")
        if not self.members:
            raise ValueError("an empty packing cluster")
        if self.split < 1 or (self.split > 1 and self.backend not in EXTRA_BACKENDS) or (
                self.backend == "splitk" and self.split < 2):
            raise ValueError(f"packing cluster split {self.split} with backend {self.backend!r}: "
                             "only splitk (2 or more slices) and chunks split the depth")
        if (self.rows > 0) != (self.backend == "chunks") or self.rows < 0:
            raise ValueError(f"packing cluster rows {self.rows} with backend {self.backend!r}: "
                             "only chunks has rows per chunk, 1 or more")

    @property
    def label(self) -> str:
        if self.backend == "splitk":
            return f"splitk{self.split}"
        if self.backend == "chunks":
            return f"chunks{self.rows}" + (f"k{self.split}" if self.split > 1 else "")
        return f"streams{self.streams}" if self.backend == "streams" else self.backend

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"members": list(self.members), "backend": self.backend,
                             "streams": self.streams}
        if self.split > 1:  # absent otherwise: the stored candidates' hashes stay as they were
            d["split"] = self.split
        if self.rows > 0:
            d["rows"] = self.rows
        return d


@dataclass(frozen=True)
class Candidate:
    """A partition of the members into clusters, each with a backend; clusters run in order."""

    partition: str  # how the clusters were formed (whole / shape / nk / bins)
    clusters: tuple[Cluster, ...]
    concurrent: int = 1  # > 1: the clusters spread over this many forked streams

    @property
    def name(self) -> str:
        labels = sorted({c.label for c in self.clusters})
        tail = f"@{self.concurrent}" if self.concurrent > 1 else ""
        return f"{self.partition}:{'+'.join(labels)}{tail}"

    def to_json(self) -> dict[str, Any]:
        return {"partition": self.partition, "concurrent": self.concurrent,
                "clusters": [c.to_json() for c in self.clusters]}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Candidate:
        return Candidate(d["partition"], tuple(Cluster(tuple(c["members"]), c["backend"],
                                                       c.get("streams", 1), c.get("split", 1),
                                                       c.get("rows", 0))
                                               for c in d["clusters"]), d.get("concurrent", 1))


def padded_shape(members: Sequence[Member]) -> tuple[int, int, int]:
    return max(m.m for m in members), max(m.n for m in members), max(m.k for m in members)


def done_macs(members: Sequence[Member], backend: str, split: int = 1, rows: int = 0) -> int:
    """Multiply-adds a backend performs for ``members``, padding and cross terms included
    (``splitk``: the depth padded to ``split`` aligned slices; ``chunks``: every problem's rows
    padded to a multiple of ``rows``, its ``n`` and ``k`` to the cluster's largest)."""
    if backend == "chunks":
        _, N, K = padded_shape(members)
        K = split * splitk_depth(K, split) if split > 1 else K
        return sum(m.batch * -(-m.m // rows) * rows for m in members) * N * K
    if backend in ("padded", "padded_t", "pointer", "splitk"):
        M, N, K = padded_shape(members)
        if backend == "splitk":
            K = split * splitk_depth(K, split)
        return sum(m.batch for m in members) * M * N * K
    if backend == "concat":
        return sum(m.batch * m.m for m in members) * sum(m.n for m in members) * members[0].k
    return sum(m.flops // 2 for m in members)


def padding_waste(members: Sequence[Member], backend: str) -> float:
    """Share of the multiply-adds a backend spends on zero padding or on the off-diagonal blocks
    of ``concat`` (0 for per-problem backends)."""
    return 1.0 - sum(m.flops // 2 for m in members) / done_macs(members, backend)


def concat_ok(members: Sequence[Member]) -> bool:
    return (len(members) > 1 and uniform(members) and len({m.k for m in members}) == 1
            and all(m.batch == 1 for m in members) and sum(m.n for m in members) <= CONCAT_MAX_N)


def candidate_waste(w: PackingWorkload, cand: Candidate) -> float:
    """Padding waste of a whole candidate: padded multiply-adds over all multiply-adds done."""
    done = sum(done_macs([w.members[i] for i in c.members], c.backend, c.split, c.rows)
               for c in cand.clusters)
    return 1.0 - (w.flops // 2) / done


def uniform(members: Sequence[Member]) -> bool:
    """One dtype and one layout: what a single batched call needs."""
    return len({(m.dtype, m.layout) for m in members}) == 1


def _groups(w: PackingWorkload, key: Any) -> list[tuple[int, ...]]:
    out: dict[Any, list[int]] = defaultdict(list)
    for i, mb in enumerate(w.members):
        out[key(mb)].append(i)
    return [tuple(v) for _, v in sorted(out.items(), key=lambda kv: str(kv[0]))]


def _bins(w: PackingWorkload, max_waste: float) -> list[tuple[int, ...]]:
    """Members of one (dtype, layout, n, k) sorted by m and cut wherever padding a run to its
    largest m would waste more than ``max_waste``."""
    out = []
    for grp in _groups(w, lambda m: (m.dtype, m.layout, m.kind, m.n, m.k)):
        run: list[int] = []
        for i in sorted(grp, key=lambda i: w.members[i].m):
            trial = run + [i]
            if run and padding_waste([w.members[j] for j in trial], "padded") > max_waste:
                out.append(tuple(run))
                trial = [i]
            run = trial
        out.append(tuple(run))
    return out


def partitions(w: PackingWorkload) -> dict[str, list[tuple[int, ...]]]:
    """The clusterings tried: everything together, equal shapes, equal (n, k), m-bins."""
    everything = [tuple(range(len(w.members)))]
    parts = {"whole": everything,
             "shape": _groups(w, lambda m: m.key),
             "nk": _groups(w, lambda m: (m.dtype, m.layout, m.kind, m.n, m.k)),
             "bins": _bins(w, 0.25)}
    seen, out = set(), {}
    for name, p in parts.items():
        sig = tuple(sorted(p))
        if name == "whole" or sig not in seen:
            out[name] = p
        seen.add(sig)
    return out


def candidates(w: PackingWorkload, stream_counts: Iterable[int] = (2, 4, 8, 16),
               max_waste: float = 0.92) -> list[Candidate]:
    """Every candidate tried for ``w`` (a cluster whose padding would waste more than
    ``max_waste`` of its work is not padded)."""
    n = len(w.members)
    allm = tuple(range(n))
    out = [Candidate("whole", (Cluster(allm, "serial"),))]
    for k in stream_counts:
        if 2 <= k <= max(2, n):
            out.append(Candidate("whole", (Cluster(allm, "streams", min(k, n)),)))
    if len({m.dtype for m in w.members}) == 1:
        out.append(Candidate("whole", (Cluster(allm, "grouped"),)))
    for pname, parts in partitions(w).items():
        for backend in ("padded", "pointer", "padded_t"):
            clusters = []
            for p in parts:
                ms = [w.members[i] for i in p]
                ok = uniform(ms) and padding_waste(ms, backend) <= max_waste
                clusters.append(Cluster(p, backend if ok and (len(ms) > 1 or ms[0].batch > 1)
                                        else "serial"))
            if any(c.backend == backend for c in clusters):
                out.append(Candidate(pname, tuple(clusters)))
                # the batched calls of the clusters side by side (padded_t: not, fewer candidates)
                if len(clusters) >= 2 and backend != "padded_t":
                    for k in sorted({min(len(clusters), 4), min(len(clusters), 8)}):
                        out.append(Candidate(pname, tuple(clusters), k))
    by_k = _groups(w, lambda m: (m.dtype, m.layout, m.k))
    clusters = [Cluster(p, "concat" if concat_ok([w.members[i] for i in p]) else "serial") for p in by_k]
    if any(c.backend == "concat" for c in clusters):
        out.append(Candidate("k", tuple(clusters)))
        if len(clusters) >= 2:
            out.append(Candidate("k", tuple(clusters), min(len(clusters), 8)))
    uniq: dict[str, Candidate] = {}
    for c in out:
        uniq.setdefault(canonical_json(c.to_json()), c)
    return list(uniq.values())


def splitk_depth(k: int, split: int) -> int:
    """Depth of one of ``split`` slices of ``k``: rounded up to ``SPLITK_ALIGN`` elements (the
    last slice reads zero padding)."""
    return -(-k // (split * SPLITK_ALIGN)) * SPLITK_ALIGN


def splitk_ok(members: Sequence[Member], split: int, max_waste: float = 0.92) -> bool:
    """Whether ``members`` can run as one split-K cluster of ``split`` slices: one dtype and
    layout (float32 or bfloat16), more than one problem, slices at least ``SPLITK_MIN_DEPTH``
    deep, padding waste within ``max_waste``."""
    if not members or not uniform(members) or members[0].dtype not in SPLITK_DTYPES:
        return False
    if len(members) == 1 and members[0].batch == 1:
        return False
    K = padded_shape(members)[2]
    if splitk_depth(K, split) < SPLITK_MIN_DEPTH:
        return False
    return 1.0 - sum(m.flops // 2 for m in members) / done_macs(members, "splitk", split) <= max_waste


def splitk_candidates(w: PackingWorkload, splits: Iterable[int] = (2, 3, 4, 8),
                      max_waste: float = 0.92) -> list[Candidate]:
    """Split-K candidates (not in ``candidates``, which keeps the set of feature schema <= 5):
    per partition and slice count, every cluster that can split does (the others run serial),
    alone and with the clusters on up to 8 forked streams."""
    out: dict[str, Candidate] = {}
    for pname, parts in partitions(w).items():
        for s in splits:
            clusters = tuple(Cluster(p, "splitk", split=s) if splitk_ok([w.members[i] for i in p], s,
                                                                        max_waste)
                             else Cluster(p, "serial") for p in parts)
            if not any(c.backend == "splitk" for c in clusters):
                continue
            for k in sorted({1, min(len(clusters), 8)}):
                c = Candidate(pname, clusters, k)
                out.setdefault(canonical_json(c.to_json()), c)
    return list(out.values())


CHUNK_SPLIT_MIN_DEPTH = 256
CHUNK_SPLIT_MAX_TILES = 4 * SMS_H200


def chunks_ok(members: Sequence[Member], rows: int, split: int = 1, max_waste: float = 0.92) -> bool:
    """Whether ``members`` can run as one chunks cluster: one dtype and layout, more than one
    chunk, padding waste within ``max_waste``; with ``split`` slices of the depth also float32 or
    bfloat16, slices at least ``CHUNK_SPLIT_MIN_DEPTH`` deep and at most
    ``CHUNK_SPLIT_MAX_TILES`` output tiles (128 wide) times slices: splitting pays where few
    tiles meet a deep ``k`` (LoRA shrink GEMMs), not where the tiles fill the GPU already."""
    if not members or not uniform(members):
        return False
    chunks = sum(m.batch * -(-m.m // rows) for m in members)
    if chunks < 2:
        return False
    if split > 1:
        _, N, K = padded_shape(members)
        if members[0].dtype not in SPLITK_DTYPES or splitk_depth(K, split) < CHUNK_SPLIT_MIN_DEPTH:
            return False
        if chunks * -(-N // 128) * split > CHUNK_SPLIT_MAX_TILES:
            return False
    done = done_macs(members, "chunks", split=split, rows=rows)
    return 1.0 - sum(m.flops // 2 for m in members) / done <= max_waste


def chunk_candidates(w: PackingWorkload, rows: Iterable[int] = (64, 128, 256),
                     splits: Iterable[int] = (1, 2, 4, 8), max_waste: float = 0.92) -> list[Candidate]:
    """Chunked candidates (not in ``candidates``, likewise): per
    partition, chunk height and slices of the depth, every cluster that can be chunked is (the
    others run serial), alone and with the clusters on up to 8 forked streams."""
    out: dict[str, Candidate] = {}
    for pname, parts in partitions(w).items():
        if pname == "shape":  # members of one shape: chunks are padded's problems cut shorter
            continue
        for r, s in ((r, s) for r in rows for s in splits):
            clusters = tuple(Cluster(p, "chunks", rows=r, split=s)
                             if chunks_ok([w.members[i] for i in p], r, s, max_waste)
                             else Cluster(p, "serial") for p in parts)
            if not any(c.backend == "chunks" for c in clusters):
                continue
            for k in sorted({1, min(len(clusters), 8)}):
                c = Candidate(pname, clusters, k)
                out.setdefault(canonical_json(c.to_json()), c)
    return list(out.values())


def all_candidates(w: PackingWorkload) -> list[Candidate]:
    """``candidates``, then the split-K and the chunked ones: what the collector measures and the
    cost model (feature schema ``packing/6``) ranks."""
    return candidates(w) + splitk_candidates(w) + chunk_candidates(w)


def with_dtype(w: PackingWorkload, dtype: str, suffix: str = "") -> PackingWorkload:
    return PackingWorkload(w.name + suffix, w.family, tuple(replace(m, dtype=dtype) for m in w.members))
