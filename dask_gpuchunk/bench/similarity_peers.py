"""``bench similarity``'s peers: the same fingerprints scored by the tools chemists and
search engineers use, each timed on a subset (``peer_rows`` database rows against a few
queries), reported as unique pairs a second and checked against the exact Tanimotos (or Hamming
distances) of the host's ``bitwise_count``. A peer that is not installed, does not fit the
device or cannot run on this GPU has a row that says why.

* CuPy as a user would write it (float32 GEMM of the unpacked rows, the formula,
  ``argpartition``), on a GPU;
* NumPy on the host, one thread (``bitwise_count``, the formula, ``argpartition``);
* RDKit's ``BulkTanimotoSimilarity``, one thread;
* FPSim2's CPU engine (``top_k``, one thread) and, on a GPU, its CUDA engine (threshold only),
  over an FPSim2 database of the same fingerprints;
* nvMolKit's dense cross Tanimoto on a GPU, through its extension's raw-buffer call (its Python
  wrappers import PyTorch; the extension takes CUDA array interfaces);
* FAISS's exact binary index (Hamming top-k): ``GpuIndexBinaryFlat`` where its wheel runs on
  this GPU, else ``IndexBinaryFlat`` on every host core.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .timing import Bench, Entry

__all__ = ["tanimoto_rows", "time_peers"]

#: Queries a batch of the CuPy peer scores at once: its scores, the formula's temporaries and
#: ``argpartition``'s int64 indices of 256 queries x 131,072 rows take about 1 GB, so the peer
#: fits an 8 GiB card beside the bench's fingerprints (all 2,048 queries at once did not).
CUPY_QUERY_BATCH = 256


def tanimoto_rows(words: np.ndarray, rows: np.ndarray, of: np.ndarray | None = None
                  ) -> np.ndarray:
    """Exact float32 Tanimoto of ``rows`` (packed words) against every row of ``of`` (default
    ``words``), on the host: ``np.float32(c) / np.float32(a + b - c)``, 0 where both are empty."""
    of = words if of is None else of
    w64 = np.ascontiguousarray(of).view(np.uint64) if of.shape[1] % 8 == 0 else None
    pop_of = np.bitwise_count(of).sum(axis=1, dtype=np.int64)
    out = np.empty((len(rows), of.shape[0]), dtype=np.float32)
    for i, row in enumerate(rows):
        if w64 is not None:
            q = np.ascontiguousarray(row).view(np.uint64)
            c = np.bitwise_count(w64 & q).sum(axis=1, dtype=np.int64)
        else:
            c = np.bitwise_count(of & row).sum(axis=1, dtype=np.int64)
        d = np.bitwise_count(row).sum(dtype=np.int64) + pop_of - c
        out[i] = np.float32(c) / np.float32(np.where(d == 0, 1, d))
    return out



def time_peers(bench: Bench, table: str, words: np.ndarray, query_words: np.ndarray,
           peer_rows: int, k: int, gpu: bool, threshold: float) -> None:
    db = words[:min(peer_rows, len(words))]
    q = query_words[:64] if len(query_words) else words[:64]
    truth = tanimoto_rows(db, q[:4])
    if gpu:
        import cupy

        _cupy_peer(bench, table, db, query_words[:2048] if len(query_words) else words[:2048],
                   k, truth)
        cupy.get_default_memory_pool().free_all_blocks()  # the peer's unpacked copies
    qn = q[:16]
    held: list[Any] = []

    def numpy_top_k() -> None:
        s = tanimoto_rows(db, qn)
        best = np.argpartition(-s, min(k, s.shape[1] - 1), axis=1)[:, :k]
        held[:] = [s, best]

    e = bench.timed(table, "peer NumPy bitwise_count + top-k (host, one thread)", numpy_top_k,
                    repeat=1, check=lambda: _same(held[0][:4], truth, "NumPy"))
    if e is not None:
        e.extra["pairs"] = float(len(qn)) * len(db)
    _rdkit_peer(bench, table, db, q, truth)
    _fpsim2_peer(bench, table, db, q, k, truth, threshold, gpu)
    # nvMolKit before FAISS: both load the CUDA 12 runtime, and a FAISS launch on a GPU its
    # wheel has no kernels for leaves an error there that nvMolKit's next check reads as its own.
    _nvmolkit_peer(bench, table, db, query_words[:2048] if len(query_words) else words[:2048],
                   truth, gpu)
    _faiss_peer(bench, table, db, query_words[:2048] if gpu and len(query_words) else q, k, gpu)


def _same(got: np.ndarray, want: np.ndarray, who: str) -> None:
    if not np.array_equal(got, want):
        raise AssertionError(f"{who}: Tanimotos differ from the exact ones")


def _cupy_peer(bench: Bench, table: str, db: np.ndarray, q: np.ndarray, k: int,
               truth: np.ndarray) -> None:
    """CuPy as a user would write it: unpack to float32, one GEMM per batch of
    ``CUPY_QUERY_BATCH`` queries (exact counts: every sum is below 2**24), the formula,
    ``argpartition`` for the top k of each batch."""
    import cupy

    name = "peer CuPy float32 GEMM + formula + top-k (full scores)"
    try:
        d = cupy.unpackbits(cupy.asarray(db)).reshape(len(db), -1).astype(cupy.float32)
        pop_d = d.sum(axis=1)
        qq = cupy.unpackbits(cupy.asarray(q)).reshape(len(q), -1).astype(cupy.float32)
    except cupy.cuda.memory.OutOfMemoryError as exc:  # under a capped pool: reported
        bench.add(Entry(table, name, "peer", skipped=f"does not fit the device: {exc}"[:200]))
        return
    held: list[Any] = []

    def once() -> None:
        held.clear()
        for start in range(0, len(qq), CUPY_QUERY_BATCH):
            batch = qq[start:start + CUPY_QUERY_BATCH]
            c = batch @ d.T
            s = cupy.nan_to_num(c / (batch.sum(axis=1)[:, None] + pop_d[None, :] - c), nan=0.0)
            best = cupy.argpartition(-s, k)[:, :k]
            # copies: views would keep each batch's full scores alive
            held.append((s[:4].copy() if start == 0 else None, best.copy()))
        cupy.cuda.Device().synchronize()

    e = bench.timed(table, name, once, gpu=True,
                    check=lambda: _same(held[0][0].get(), truth, "CuPy"))
    if e is not None:
        e.extra["pairs"] = float(len(q)) * len(db)
    held.clear()


def _bit_vector(words: np.ndarray) -> Any:
    """An RDKit ``ExplicitBitVect`` of one row of ``np.packbits`` words, as peers take it."""
    from rdkit import DataStructs

    v = DataStructs.ExplicitBitVect(words.shape[0] * 8)
    v.SetBitsFromList(np.flatnonzero(np.unpackbits(words)).tolist())
    return v


def _rdkit_peer(bench: Bench, table: str, db: np.ndarray, q: np.ndarray,
                truth: np.ndarray) -> None:
    name = "peer RDKit BulkTanimotoSimilarity (CPU, one thread)"
    if not bench.want(name):
        return
    try:
        from rdkit import DataStructs
    except ImportError as exc:
        bench.add(Entry(table, name, "peer", skipped=f"RDKit not importable ({exc})"))
        return
    fps = [_bit_vector(w) for w in db]
    queries = [_bit_vector(w) for w in q[:8]]
    held: list[Any] = []

    def once() -> None:
        held[:] = [[DataStructs.BulkTanimotoSimilarity(v, fps) for v in queries]]

    e = bench.timed(table, name, once, repeat=1,
                    check=lambda: _same(np.array(held[0][:4]).astype(np.float32), truth,
                                        "RDKit"))
    if e is not None:
        e.extra["pairs"] = float(len(queries)) * len(fps)


def _fpsim2_peer(bench: Bench, table: str, db: np.ndarray, q: np.ndarray, k: int,
                 truth: np.ndarray, threshold: float, gpu: bool) -> None:
    """FPSim2 as chemists run it, over an FPSim2 database of the same fingerprints (written by
    :func:`dask_gpuchunk.io.fingerprint_files.write_fpsim2`): its CPU engine's ``top_k(query, k,
    threshold=0)`` per query, one thread, top scores checked against the exact ones; on a GPU
    its CUDA engine's ``similarity(query, threshold)`` (it has no top-k), the pairs it finds
    checked against the exact ones. A peer that cannot run says why."""
    names = {"cpu": "peer FPSim2 CPU engine top-k (host, one thread)",
             "cuda": f"peer FPSim2 CUDA engine threshold {threshold} (device)"}
    wanted = [kind for kind, name in names.items()
              if bench.want(name) and (kind == "cpu" or gpu)]
    if not wanted:
        return
    import tempfile

    from ..io.fingerprint_files import Fingerprints, write_fpsim2

    try:
        import FPSim2  # noqa: F401 - its engines are imported below, each where it runs
        import rdkit  # noqa: F401 - the queries are RDKit bit vectors
    except ImportError as exc:
        for kind in wanted:
            bench.add(Entry(table, names[kind], "peer",
                            skipped=f"FPSim2 or RDKit not importable ({exc})"))
        return
    bits = db.shape[1] * 8
    fps_order = np.packbits(np.unpackbits(db, axis=1), axis=1, bitorder="little")
    queries = [_bit_vector(w) for w in q[:8]]
    held: list[Any] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/db.h5"
        try:
            write_fpsim2(path, Fingerprints(fps_order, np.arange(len(db)), bits),
                         fp_params={"radius": 2, "fpSize": bits})
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported
            for kind in wanted:
                bench.add(Entry(table, names[kind], "peer", skipped=f"database: {exc}"[:300]))
            return
        if "cpu" in wanted:
            def top_k() -> None:
                from FPSim2 import FPSim2Engine

                engine = held[1] if len(held) > 1 else FPSim2Engine(path)
                held[:] = [[engine.top_k(v, k, 0.0) for v in queries], engine]

            def check_top_k() -> None:
                want = -np.sort(-truth, axis=1)[:, :k]
                got = [found["coeff"][:k] for found in held[0][:4]]
                if not all(np.allclose(g, w[:len(g)], rtol=1e-6) for g, w in zip(got, want)):
                    raise AssertionError("FPSim2: top scores differ from the exact ones")

            e = bench.timed(table, names["cpu"], top_k, repeat=1, check=check_top_k)
            if e is not None:
                e.extra["pairs"] = float(len(queries)) * len(db)
            held.clear()
        if "cuda" in wanted:
            def above() -> None:
                from FPSim2.FPSim2Cuda import FPSim2CudaEngine

                engine = held[1] if len(held) > 1 else FPSim2CudaEngine(path)
                held[:] = [[engine.similarity(v, threshold) for v in queries], engine]

            def check_above() -> None:
                for found, exact in zip(held[0][:4], truth):
                    want = np.sort(exact[exact >= np.float32(threshold)])
                    if not np.allclose(np.sort(found["coeff"]), want, rtol=1e-6):
                        raise AssertionError("FPSim2 CUDA: the pairs found differ from the "
                                             "exact ones")

            e = bench.timed(table, names["cuda"], above, repeat=1, check=check_above)
            if e is not None:
                e.extra["pairs"] = float(len(queries)) * len(db)


def _faiss_peer(bench: Bench, table: str, db: np.ndarray, q: np.ndarray, k: int,
                gpu: bool) -> None:
    """FAISS's exact binary index: the ``k`` nearest by Hamming distance of each query, its
    distances checked against the exact ones (our ``metric="hamming"``). On a GPU,
    ``GpuIndexBinaryFlat`` first, tried on a few queries before it is timed: the
    ``faiss-gpu-cu12`` wheels hold kernels for compute capability 7.0 and 8.0 only (no PTX), so
    on a Hopper GPU its searches fail inside FAISS and return wrong distances without raising
    (faiss-wheels issue #151); its row then says so. The host's ``IndexBinaryFlat`` on every
    core is timed where the GPU index did not run."""
    try:
        import faiss
    except ImportError as exc:
        bench.add(Entry(table, "peer FAISS binary flat index, Hamming top-k", "peer",
                        skipped=f"FAISS not importable ({exc})"))
        return
    queries = np.ascontiguousarray(q)
    bits = db.shape[1] * 8
    exact = np.sort(np.bitwise_count(db[None, :, :] ^ queries[:4, None, :]).sum(axis=2),
                    axis=1)[:, :k]
    if gpu and hasattr(faiss, "GpuIndexBinaryFlat"):
        name = "peer FAISS GpuIndexBinaryFlat, Hamming top-k (device)"
        if not bench.want(name):
            return
        index = faiss.GpuIndexBinaryFlat(faiss.StandardGpuResources(), bits)
        index.add(np.ascontiguousarray(db))
        if np.array_equal(index.search(queries[:4], k)[0], exact):
            _time_faiss(bench, table, name, index, queries, db, k, exact)
            return
        from ..bits.gram_blocks import compute_capability

        major, minor = compute_capability()
        bench.add(Entry(table, name, "peer", skipped=(
            f"its distances are wrong on this GPU (compute capability {major}.{minor}): the "
            "faiss-gpu-cu12 wheels carry kernels for 7.0 and 8.0 only (faiss-wheels #151)")))
        del index
    threads = faiss.omp_get_max_threads()
    name = f"peer FAISS IndexBinaryFlat, Hamming top-k (host, {threads} threads)"
    if bench.want(name):
        index = faiss.IndexBinaryFlat(bits)
        index.add(np.ascontiguousarray(db))
        _time_faiss(bench, table, name, index, queries, db, k, exact)


def _time_faiss(bench: Bench, table: str, name: str, index: Any, queries: np.ndarray,
                db: np.ndarray, k: int, exact: np.ndarray) -> None:
    held: list[Any] = []

    def once() -> None:
        held[:] = [index.search(queries, k)]

    def check() -> None:
        if not np.array_equal(held[0][0][:4], exact):
            raise AssertionError("FAISS: Hamming distances differ from the exact ones")

    e = bench.timed(table, name, once, repeat=1, check=check)
    if e is not None:
        e.extra["pairs"] = float(len(queries)) * len(db)


def _nvmolkit_peer(bench: Bench, table: str, db: np.ndarray, q: np.ndarray,
                   truth: np.ndarray, gpu: bool) -> None:
    """nvMolKit's dense cross Tanimoto (its 1-bit tensor-core kernel, float scores of every
    pair on the device) of the queries against the database, as ``uint32`` words. Called
    through ``nvmolkit._DataStructs.CrossTanimotoSimilarityRawBuffers``, which takes CUDA
    array interfaces and a stream: ``nvmolkit.similarity.crossTanimotoSimilarity`` is the same
    call behind PyTorch tensors, and PyTorch (about 0.9 GB of wheels) is not on every GPU
    machine. Its first rows checked against the exact float32 Tanimotos (to a float32 ulp:
    it returns float64). Measured beside ours on an H200 (nvmolkit 0.7.0, rdkit 2026.3.6, no
    PyTorch; 2,048 queries x 65,536 rows of 2048 bits): 4.4 ms, 3.1e10 pairs/s, every
    checked score exact."""
    name = "peer nvMolKit cross Tanimoto, dense scores (device)"
    if not bench.want(name):
        return
    if not gpu:
        bench.add(Entry(table, name, "peer", skipped="no CUDA GPU visible"))
        return
    try:  # _arrayHelpers registers the class the raw call returns
        from nvmolkit import _arrayHelpers, _DataStructs  # noqa: F401
    except (ImportError, OSError) as exc:
        bench.add(Entry(table, name, "peer", skipped=f"nvMolKit not importable ({exc})"[:200]))
        return
    import cupy

    if db.shape[1] % 4:
        bench.add(Entry(table, name, "peer", skipped="rows not whole uint32 words"))
        return
    d32 = cupy.asarray(np.ascontiguousarray(db)).view(cupy.uint32)
    q32 = cupy.asarray(np.ascontiguousarray(q)).view(cupy.uint32)
    held: list[Any] = []

    def once() -> None:
        stream = cupy.cuda.get_current_stream()
        result = _DataStructs.CrossTanimotoSimilarityRawBuffers(
            q32.__cuda_array_interface__, d32.__cuda_array_interface__, stream.ptr)
        held[:] = [cupy.asarray(result)[:4].copy(), result]
        stream.synchronize()

    def check() -> None:
        got = held[0].get().astype(np.float64)
        if got.shape != truth.shape or np.abs(got - truth).max() > 6e-8:
            raise AssertionError("nvMolKit: Tanimotos differ from the exact ones")

    e = bench.timed(table, name, once, repeat=1, check=check)
    if e is not None:
        e.extra["pairs"] = float(len(q)) * len(db)
    held.clear()
