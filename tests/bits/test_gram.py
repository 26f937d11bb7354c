"""Dask operators ``dg.bitpack`` and ``dg.gram``: exact against NumPy, chunking, graph, errors."""

from __future__ import annotations

from collections import Counter

import importlib

import dask
import dask.array as da
import numpy as np
import pytest
from dask.array.utils import assert_eq
from helpers import bit_products, random_bits

import dask_gpuchunk as dg
from dask_gpuchunk import jobs
from dask_gpuchunk._kernels.bitpack import BitValueError, reference_bitpack
from dask_gpuchunk._kernels.gram import reference_gram
from dask_gpuchunk import config
from dask_gpuchunk.bits import gram_blocks, gram_graphs

SIZES = [1, 7, 63, 64, 65, 1041, 1043]
# the module, which the package's function of the same name hides as an attribute
gram_module = importlib.import_module("dask_gpuchunk.bits.gram")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("k", SIZES)
def test_gram_matches_numpy(rng, n, k):
    density = rng.uniform(0.01, 0.99)
    a = random_bits(rng, (n, k), density, rng.choice(["bool", "int8", "uint8", "int64"]))
    x = da.from_array(a, chunks=(max(1, n // 3 + 1), max(1, k // 2 + 3)))
    g = dg.gram(x, device="cpu")
    assert g.dtype == np.int32 and g.chunks == (x.chunks[0], x.chunks[0])
    result = g.compute()
    np.testing.assert_array_equal(result, reference_gram(a))
    np.testing.assert_array_equal(result, result.T)


@pytest.mark.parametrize("density", [0.01, 0.2, 0.5, 0.8, 0.99])
def test_gram_densities_uneven_chunks(rng, density):
    a = random_bits(rng, (301, 999), density)
    x = da.from_array(a, chunks=((100, 1, 77, 123), (500, 13, 486)))
    assert_eq(dg.gram(x), reference_gram(a))


@pytest.mark.parametrize("bitorder", ["big", "little"])
@pytest.mark.parametrize("k", [1, 7, 8, 9, 1043])
def test_gram_of_packbits_output(rng, bitorder, k):
    a = random_bits(rng, (57, k), 0.5)
    packed = np.packbits(a, axis=1, bitorder=bitorder)
    x = da.from_array(packed, chunks=(20, 5))
    assert_eq(dg.gram(x, packed=True), reference_gram(a))


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64", ">u4"])
def test_gram_of_packed_words_any_unsigned_dtype(rng, dtype):
    a = random_bits(rng, (40, 300), 0.5)
    words = reference_bitpack(a).view(np.uint8).view(np.dtype(dtype).newbyteorder("="))
    words = words.astype(dtype)
    assert_eq(dg.gram(words, packed=True), reference_gram(a))


def test_gram_of_bitpack_output_and_numpy_input(rng):
    a = random_bits(rng, (70, 200), 0.4)
    words = dg.bitpack(da.from_array(a, chunks=(30, 100)))
    assert_eq(words, reference_bitpack(a))
    assert_eq(dg.gram(words, packed=True), reference_gram(a))
    assert_eq(dg.gram(a), reference_gram(a))


@pytest.fixture(params=[True, False], ids=["listed", "blockwise"])
def graph_kind(request):
    """Both of gram's graphs: listed by hand, and dask's blockwise (never listed under array
    query planning)."""
    if request.param and da.array_expr_enabled():
        pytest.skip("array query planning: no listed graphs")
    with config.internal_values({"listed-graphs": request.param}):
        yield request.param


def test_many_word_chunks_are_tree_summed(rng, monkeypatch, graph_kind):
    sums = []
    summed = gram_graphs.sum_blocks if graph_kind else gram_graphs.sum_partials

    def counting(*args, **kwargs):
        parts = args if graph_kind else args[0]
        sums.append(len(parts))
        return summed(*args, **kwargs)

    monkeypatch.setattr(gram_graphs, "sum_blocks" if graph_kind else "sum_partials", counting)
    a = random_bits(rng, (33, 64 * 11), 0.5)
    x = da.from_array(a, chunks=(10, 64))  # 11 word chunks: 4 + 4 + 3, then one more sum
    assert_eq(dg.gram(x), reference_gram(a))
    assert max(sums) <= gram_module.SPLIT_EVERY
    # 4 x 4 blocks (listed: the 10 on or above the diagonal), each a tree of three sums and one
    assert len(sums) == 10 * 4 if graph_kind else len(sums) >= 16 * 4


@pytest.mark.parametrize("chunks, word_chunks", [((10, 100), 1), ((10, 40), 2)])
def test_only_upper_blocks_are_computed(rng, monkeypatch, chunks, word_chunks, graph_kind):
    computed = []
    block_of = gram_graphs.block_task
    a = random_bits(rng, (50, 100), 0.5)
    packed = reference_bitpack(a)

    def row_of(words):  # the row whose words, somewhere, are these (all rows differ)
        m = words.shape[0]
        return next(r for r in range(len(packed)) for o in range(packed.shape[1] - m + 1)
                    if np.array_equal(packed[r, o:o + m], words))

    def recording(x, y, *args, **kwargs):
        computed.append((row_of(x[0]) // 10, row_of(y[0]) // 10))
        return block_of(x, y, *args, **kwargs)

    # The listed graph's tasks call it from gram_graphs, blockwise's partials from gram_blocks.
    monkeypatch.setattr(gram_graphs, "block_task", recording)
    monkeypatch.setattr(gram_blocks, "block_task", recording)
    assert len({tuple(r) for r in packed}) == 50
    g = dg.gram(da.from_array(a, chunks=chunks))  # 5 row chunks
    assert_eq(g, reference_gram(a))
    # bits chunked by 40 are packed in chunks of 64 and 36 bits: two word chunks
    assert sorted(computed) == sorted([(i, j) for i in range(5) for j in range(i, 5)] * word_chunks)


@pytest.mark.parametrize("block_rows", [1, 15, 20, 33, 1000])
@pytest.mark.parametrize("word_chunks", [None, 64])
def test_block_rows_groups_row_chunks_into_fewer_exact_blocks(rng, block_rows, word_chunks,
                                                               graph_kind):
    a = random_bits(rng, (46, 150), rng.uniform(0.1, 0.9))
    chunks = (7, 13, 5, 20, 1)
    x = da.from_array(a, chunks=(chunks, word_chunks or 150))
    g = dg.gram(x, block_rows=block_rows)
    grouped = gram_module.grouped_row_chunks(chunks, block_rows)
    assert g.chunks == (grouped, grouped)
    assert_eq(g, reference_gram(a))


def test_grouped_rows_make_a_gram_of_device_sized_tasks_with_few_tasks(rng):
    a = random_bits(rng, (16 * 64, 256), 0.5)
    x = da.from_array(a, chunks=(64, 256))  # 16 row chunks: 136 blocks + 120 mirrors
    each = len(dict(dg.gram(x).__dask_graph__()))
    grouped = dg.gram(x, block_rows=256)  # 4 groups: 10 blocks + 6 mirrors, and the regroup
    assert grouped.chunks[0] == (256,) * 4
    assert len(dict(grouped.__dask_graph__())) < each // 4
    assert_eq(grouped, reference_gram(a))


@pytest.mark.parametrize("block_rows", [0, -3, 2.5, "8", True])
def test_block_rows_must_be_a_whole_positive_number(block_rows):
    with pytest.raises(ValueError, match="block_rows"):
        dg.gram(np.ones((4, 4), np.uint8), block_rows=block_rows)


def test_task_block_rows_follows_work_memory_and_workers():
    rows = gram_module.task_block_rows
    # memory: a smaller budget, smaller blocks
    assert rows(65536, 262144, "popcount", budget=2 << 30, workers=1) < rows(
        65536, 262144, "popcount", budget=8 << 30, workers=1)
    # workers: more of them, more groups
    assert rows(65536, 262144, "popcount", budget=8 << 30, workers=8) <= 65536 // 8
    # work: long rows need fewer of them for a block's worth of GPU work
    assert rows(10**7, 10**7, "popcount", budget=1 << 40, workers=1) < rows(
        10**7, 64, "popcount", budget=1 << 40, workers=1)
    # C's blocks: never over BLOCK_MAX_BYTES
    assert rows(10**7, 64, "popcount", budget=1 << 40, workers=1) ** 2 * 4 <= (
        gram_module.BLOCK_MAX_BYTES)
    assert rows(10, 64, "popcount", budget=1, workers=1) >= 1


def test_gram_of_sliced_chunks_computes_each_pair_once(rng):
    a = random_bits(rng, (61, 90), 0.5)
    g = dg.gram(da.from_array(a, chunks=(13, 90)))
    expected = reference_gram(a)
    for rows, cols in [(slice(2, 7), slice(3, 40)), (slice(20, 61), slice(0, 15)),
                       (slice(5, 6), slice(5, 6)), (slice(None), slice(11, 29))]:
        assert_eq(g[rows, cols], expected[rows, cols])


@pytest.mark.parametrize("n, k, rows", [(1, 1, (1,)), (65, 63, (20, 20, 20, 5)),
                                        (301, 999, (100, 1, 77, 123))])
def test_gram_slab_is_a_whole_row_block(rng, n, k, rows):
    a = random_bits(rng, (n, k), rng.uniform(0.05, 0.95))
    words = reference_bitpack(a)
    chunks = np.split(words, np.cumsum(rows)[:-1])
    expected = reference_gram(a)
    start = 0
    for chunk in chunks:
        slab = gram_module.gram_slab(chunk, chunks, device="cpu")
        assert slab.dtype == np.int32 and slab.shape == (len(chunk), n)
        np.testing.assert_array_equal(slab, expected[start:start + len(chunk)])
        start += len(chunk)
    np.testing.assert_array_equal(jobs.gram._slab_after(None, chunks[0], chunks, "auto", "auto"),
                                  expected[:rows[0]])
    with pytest.raises(ValueError, match="GPU only"):
        gram_module.gram_slab(chunks[0], chunks, method="bmma", device="cpu")


@pytest.mark.skipif(da.array_expr_enabled(), reason="dask.array.store: not under query planning")
def test_row_slices_stream_to_store(rng, tmp_path):
    a = random_bits(rng, (90, 130), 0.5)
    out = np.lib.format.open_memmap(tmp_path / "c.npy", mode="w+", dtype=np.int32, shape=(90, 90))
    da.store(dg.gram(da.from_array(a, chunks=(25, 130))), out)
    out.flush()
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), reference_gram(a))


def test_empty_inputs(rng):
    assert dg.gram(np.zeros((0, 5), np.uint8)).compute().shape == (0, 0)
    np.testing.assert_array_equal(dg.gram(np.zeros((3, 0), np.uint8)).compute(), np.zeros((3, 3)))
    assert dg.bitpack(np.zeros((2, 0), np.uint8)).compute().shape == (2, 0)


def test_bitpack_aligns_column_chunks(rng):
    a = random_bits(rng, (5, 300), 0.5)
    words = dg.bitpack(da.from_array(a, chunks=(5, 100)))
    assert words.chunks == ((5,), (2, 2, 1))
    assert_eq(words, reference_bitpack(a))


def test_bad_value_is_named_at_compute_time(rng):
    a = random_bits(rng, (40, 70), 0.5)
    a[37, 65] = 2
    x = da.from_array(a, chunks=(16, 64))
    g = dg.gram(x)  # lazy: no error yet
    with pytest.raises(BitValueError, match=r"found 2 at row 37, column 65\b"):
        g.compute()
    with pytest.raises(ValueError, match="bits must be 0 or 1"):
        dg.bitpack(x).compute()


def test_the_hint_for_packed_bytes_names_packed_first_and_following_it_is_exact(rng):
    bits = random_bits(rng, (37, 203), 0.3)
    packed = np.packbits(bits, axis=1)  # what np.packbits users have: bytes, 8 bits each
    x = da.from_array(packed, chunks=(16, -1))
    with pytest.raises(BitValueError, match=r"look like packed bits .*pass packed=True") as err:
        dg.gram(x).compute()
    assert err.value.looks_packed and "--packed" in err.value.hint("--packed")
    expected = bit_products(bits, bits)
    assert_eq(dg.gram(x, packed=True), expected.astype(np.int32))  # the hint, followed
    # Its other branch (each byte one bit) gives another matrix: named second, never first.
    assert not np.array_equal(dg.gram((x != 0).astype("uint8")).compute(), expected)


def test_the_hint_for_values_of_signed_integers_converts_and_following_it_is_exact(rng):
    bits = random_bits(rng, (29, 130), 0.4)
    coded = bits.astype(np.int16) * 3  # nonzero meaning 1, in a dtype words never come in
    x = da.from_array(coded, chunks=(10, 64))
    with pytest.raises(BitValueError, match=r"found 3 .*convert first") as err:
        dg.gram(x).compute()
    assert not err.value.looks_packed and "packed" not in str(err.value)
    assert_eq(dg.gram((x != 0).astype("uint8")),
              (bit_products(bits, bits)).astype(np.int32))  # the hint, followed


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: dg.gram(np.zeros(5, np.uint8)), ValueError, "2-D array"),
        (lambda: dg.gram(np.zeros((2, 2, 2), np.uint8)), ValueError, "2-D array"),
        (lambda: dg.gram(np.zeros((2, 2))), TypeError, "bool or integer"),
        (lambda: dg.gram(np.zeros((2, 2), np.int64), packed=True), TypeError, "unsigned"),
        (lambda: dg.gram(np.zeros((2, 2), bool), packed=True), TypeError, "unsigned"),
        (lambda: dg.gram(np.zeros((2, 2), np.uint8), method="bmmx"), ValueError, "method must"),
        (lambda: dg.gram(np.zeros((2, 2), np.uint8), device="tpu"), ValueError, "device must"),
        (lambda: dg.gram(np.zeros((2, 2), np.uint8), method="int8", device="cpu"),
         ValueError, "GPU only"),
        (lambda: dg.gram(np.zeros((2, 2), np.uint8), method="bmma", device="cpu"),
         ValueError, "GPU only"),
        (lambda: dg.bitpack(np.zeros((2, 2), np.float32)), TypeError, "bool or integer"),
    ],
)
def test_bad_input_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_gpu_only_requests_fail_clearly_without_gpu():
    if dg.gpu_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(dg.GPUNotAvailableError, match="int8"):
        dg.gram(np.zeros((2, 2), np.uint8), method="int8")
    with pytest.raises(dg.GPUNotAvailableError, match="bmma"):
        dg.gram(np.zeros((2, 2), np.uint8), method="bmma")
    with pytest.raises(dg.GPUNotAvailableError, match="wgmma"):
        dg.gram(np.zeros((2, 2), np.uint8), method="wgmma")
    with pytest.raises(dg.GPUNotAvailableError):
        dg.gram(np.zeros((2, 2), np.uint8), device="gpu")


@pytest.mark.parametrize("cc, expected", [((6, 1), "popcount"), ((7, 0), "popcount"),
                                          ((7, 5), "int8"), ((8, 0), "bmma"), ((8, 9), "bmma"),
                                          ((9, 0), "wgmma"), ((10, 0), "bmma")])
def test_auto_method_follows_compute_capability(monkeypatch, cc, expected):
    import importlib

    gram_module = importlib.import_module("dask_gpuchunk.bits.gram")

    monkeypatch.setattr(gram_blocks, "compute_capability", lambda: cc)
    assert gram_module.resolve_method("auto", on_gpu=True) == expected
    assert gram_module.resolve_method("auto", on_gpu=False) == "popcount"
    assert gram_module.resolve_method("int8", on_gpu=True) == "int8"


def test_threads_scheduler_and_sync_agree(rng):
    a = random_bits(rng, (120, 500), 0.5)
    g = dg.gram(da.from_array(a, chunks=(31, 200)))
    with dask.config.set(scheduler="sync"):
        sync = g.compute()
    np.testing.assert_array_equal(sync, g.compute(scheduler="threads"))


# ---- on a real GPU -------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["auto", "popcount", "int8", "bmma", "wgmma"])
@pytest.mark.parametrize("n, k", [(1, 1), (63, 65), (1041, 1043), (1043, 5000)])
def test_gram_result_stays_where_its_chunks_are(xp, rng, method, n, k):
    if method in ("int8", "bmma", "wgmma") and not dg.gpu_available():
        pytest.skip("a GPU-only method")
    _skip_unless_hopper(method)
    if xp is np and k > 2000:
        pytest.skip("the CPU's large cases are test_gram_matches_numpy's")
    a = random_bits(rng, (n, k), rng.uniform(0.01, 0.99))
    x = dg.asarray(xp.asarray(a), chunks=(max(1, n // 3), max(1, k // 2)))
    g = dg.gram(x, method=method)
    assert type(g._meta) is type(x._meta)
    assert_eq(g, xp.asarray(reference_gram(a)))


def _skip_unless_hopper(method: str) -> None:
    if method == "wgmma":
        from dask_gpuchunk._kernels.wgmma import wgmma_supported

        if not wgmma_supported():
            pytest.skip("wgmma needs a Hopper GPU (compute capability 9.0)")


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["popcount", "int8", "bmma", "wgmma"])
def test_gram_host_chunks_on_gpu(rng, method):
    _skip_unless_hopper(method)
    a = random_bits(rng, (700, 3000), 0.3)
    x = da.from_array(a, chunks=(250, 1000))
    result = dg.gram(x, method=method, device="gpu").compute()
    assert isinstance(result, np.ndarray)
    np.testing.assert_array_equal(result, reference_gram(a))


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["popcount", "int8", "bmma", "wgmma"])
def test_gram_slab_on_gpu(rng, method):
    import cupy

    _skip_unless_hopper(method)
    a = random_bits(rng, (700, 3001), 0.3)
    words = reference_bitpack(a)
    chunks = np.split(words, [250, 251, 600])
    expected = reference_gram(a)
    slab = gram_module.gram_slab(chunks[2], chunks, method=method, device="gpu")
    assert isinstance(slab, np.ndarray)
    np.testing.assert_array_equal(slab, expected[251:600])
    on_device = [cupy.asarray(c) for c in chunks]
    slab = gram_module.gram_slab(on_device[0], on_device, method=method)
    np.testing.assert_array_equal(cupy.asnumpy(slab), expected[:250])


@pytest.mark.gpu
def test_packbits_on_gpu(rng):
    import cupy

    a = random_bits(rng, (333, 2001), 0.5)
    packed = cupy.asarray(np.packbits(a, axis=1))
    x = dg.asarray(packed, chunks=(100, 100))
    for method in ("popcount", "int8", "bmma", "auto"):
        got = dg.gram(x, packed=True, method=method).compute()
        np.testing.assert_array_equal(cupy.asnumpy(got), reference_gram(a))


@pytest.mark.gpu
def test_bitpack_on_gpu_names_bad_value(rng):
    import cupy

    a = random_bits(rng, (50, 100), 0.5)
    a[44, 99] = 3
    x = dg.asarray(cupy.asarray(a), chunks=(20, 64))
    with pytest.raises(BitValueError, match=r"found 3 at row 44, column 99\b"):
        dg.bitpack(x).compute()
    with pytest.raises(BitValueError, match=r"row 44, column 99\b"):
        dg.bitpack(a, device="gpu").compute()


# ---- words straight from a .npy: each chunk read once per process, never sent between workers

# Under dask's array query planning the words are read through their tasks, as before.
needs_legacy_graphs = pytest.mark.skipif(
    type(da.ones(1)).__module__.startswith("dask.array._array_expr"),
    reason="the Gram reads a .npy's chunks itself only outside array query planning")


@needs_legacy_graphs
@pytest.mark.parametrize("words_dtype", ["uint8", "uint64"])
@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_gram_of_a_npy_reads_its_chunks_where_the_blocks_run(rng, tmp_path, words_dtype, device):
    from dask_gpuchunk.io import npy_reader_of

    a = random_bits(rng, (203, 1000 if words_dtype == "uint8" else 1024), 0.3)
    words = (np.packbits(a, axis=1) if words_dtype == "uint8"
             else np.packbits(a, axis=1, bitorder="little").view(np.uint64))
    np.save(tmp_path / "w.npy", words)
    x = dg.from_npy(tmp_path / "w.npy", chunks=((50, 1, 77, 75), -1))
    assert npy_reader_of(x) is not None
    g = dg.gram(x, packed=True, device=device, block_rows=None if device == "cpu" else 1)
    assert any(str(k).startswith("resident-words") for k in dict(g.__dask_graph__()))
    assert g.chunks == (x.chunks[0], x.chunks[0])
    np.testing.assert_array_equal(g.compute(), reference_gram(a))
    # grouped: blocks over whole groups of the file's row chunks, read as groups
    g = dg.gram(x, packed=True, device=device, block_rows=80, keep_on_device=True)
    assert g.chunks == ((51, 77, 75),) * 2
    result = g.compute()
    if device != "cpu" and dg.gpu_available():  # C's blocks stayed on the GPU
        import cupy

        assert isinstance(g._meta, cupy.ndarray) and isinstance(result, cupy.ndarray)
        result = cupy.asnumpy(result)
    assert isinstance(result, np.ndarray)
    np.testing.assert_array_equal(result, reference_gram(a))
    # Anything done to the words first: read through their tasks, as before.
    for y in (x.rechunk((60, -1)), x[1:], x.rechunk((50, 64))):
        assert npy_reader_of(y) is None
        np.testing.assert_array_equal(dg.gram(y, packed=True, device=device).compute(),
                                      reference_gram(a[1:] if y.shape[0] == 202 else a))


@needs_legacy_graphs
@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_gram_of_a_npy_computes_the_blocks_below_too_when_asked(rng, tmp_path, device):
    # gram-mirror="recompute": every block its own task over the source, no
    # transposes of other blocks; the same counts.
    a = random_bits(rng, (150, 777), 0.4)
    np.save(tmp_path / "w.npy", np.packbits(a, axis=1))
    x = dg.from_npy(tmp_path / "w.npy", chunks=((40, 1, 60, 49), -1))
    with config.internal_values({"gram-mirror": "recompute"}):
        g = dg.gram(x, packed=True, device=device)
    graph = dict(g.__dask_graph__())
    assert not any(v[0] is gram_graphs.transposed_block for v in graph.values() if isinstance(v, tuple))
    assert g.name != dg.gram(x, packed=True, device=device).name
    np.testing.assert_array_equal(g.compute(), reference_gram(a))
    with config.internal_values({"gram-mirror": "sideways"}), \
            pytest.raises(ValueError, match="gram-mirror"):
        dg.gram(x, packed=True, device=device)


def test_gram_of_a_npy_refuses_a_file_changed_since_and_names_it_to_to_npy(rng, tmp_path):
    from dask_gpuchunk.io.files import InputChangedError
    from dask_gpuchunk.io import inputs_of

    words = np.packbits(random_bits(rng, (40, 64), 0.5), axis=1)
    np.save(tmp_path / "w.npy", words)
    g = dg.gram(dg.from_npy(tmp_path / "w.npy", chunks=(15, -1)), packed=True)
    assert [reader.path for reader in inputs_of(g)] == [str(tmp_path / "w.npy")]
    np.save(tmp_path / "w.npy", words[::-1])
    with pytest.raises(InputChangedError):
        g.compute()


@needs_legacy_graphs
def test_gram_of_a_npy_sends_no_words_between_workers(rng, tmp_path):
    # Two workers: before, each block read its chunks through the tasks that read them, and a
    # block on the other worker was sent them (1.0 x the words' bytes between the two; on
    # two GPUs, 2.3 GB over TLS for 2.1 GB of words). Now each worker reads what it needs.
    from distributed import Client, LocalCluster

    words = np.packbits(random_bits(rng, (600, 32768), 0.3), axis=1)  # 2.4 MB
    np.save(tmp_path / "w.npy", words)
    g = dg.gram(dg.from_npy(tmp_path / "w.npy", chunks=(100, -1)), packed=True, device="cpu")
    want = reference_gram(np.unpackbits(words, axis=1))
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        before = jobs.sent_by_workers(client)
        total = client.compute(g.sum(dtype=np.int64), sync=True)
        sent = jobs.sent_by_workers(client, before)
        assert total == want.sum(dtype=np.int64)
        assert len(sent) == 2 and sum(sent.values()) < words.nbytes // 20
        np.testing.assert_array_equal(client.compute(g[::97], sync=True), want[::97])


@needs_legacy_graphs
@pytest.mark.parametrize("read_ahead", [True, False])
def test_gram_of_a_npy_reads_ahead_on_each_worker_once_per_chunk(rng, tmp_path, read_ahead):
    # Each worker reads every row chunk its blocks need once; with read-ahead (the
    # default) all but the first on a thread of its own, before its blocks ask. On
    # dg.local_cluster, whose active memory manager keeps every worker's copy of the source
    # (dask_gpuchunk.distributed.replicas): on a plain LocalCluster a worker read them twice in one CI run.
    from dask_gpuchunk.runtime.resident import resident_stats

    words = np.packbits(random_bits(rng, (900, 4096), 0.3), axis=1)
    np.save(tmp_path / "w.npy", words)
    with config.internal_values({"read-ahead": read_ahead}):
        g = dg.gram(dg.from_npy(tmp_path / "w.npy", chunks=(100, -1)), packed=True,
                    device="cpu")
    want = reference_gram(np.unpackbits(words, axis=1)).sum(dtype=np.int64)
    with dg.local_cluster(n_workers=2, threads_per_gpu=1, dashboard_address=None,
                          secure=False) as client:
        assert client.compute(g.sum(dtype=np.int64), sync=True) == want
        stats = [s["host"] for s in client.run(resident_stats).values()]
    assert all(s["reads"] <= 9 for s in stats), stats  # 9 row chunks: each once at most
    ahead = sum(s["read_ahead"] for s in stats)
    assert (ahead > 0) if read_ahead else (ahead == 0), stats


@needs_legacy_graphs
def test_gram_of_a_npy_shares_its_blocks_between_workers_and_sends_none(rng, tmp_path):
    # distributed hands out a task group whose dependencies are few tasks as root tasks, to
    # whichever worker has a free thread. Named as the Gram's own blocks, the computed blocks
    # depended on their own group (the transposes below the diagonal): each then went where
    # the source was made, and on two GPUs one worker ran 3/4 of them and sent the other
    # 1.3 GB of blocks for its transposes. Small blocks on the CPU do not show it (work
    # stealing evens them out), so the graph's shape is checked, then the cluster's outcome.
    from dask.utils import key_split
    from distributed import Client, LocalCluster, get_task_stream

    words = np.packbits(random_bits(rng, (2400, 4096), 0.3), axis=1)
    np.save(tmp_path / "w.npy", words)
    g = dg.gram(dg.from_npy(tmp_path / "w.npy", chunks=(200, -1)), packed=True, device="cpu")
    computed = _computed_blocks(g)
    assert len(computed) == 78  # 12 row chunks: the blocks on and above the diagonal
    groups = {key_split(key) for key in computed}
    assert len(groups) == 1 and groups != {key_split(g.name)}, groups
    sources = set().union(*(task.dependencies for task in computed.values()))
    assert len(sources) == 1, sources  # the source only: not the group itself

    block_bytes = 200 * 200 * 4
    want = reference_gram(np.unpackbits(words, axis=1)).sum(dtype=np.int64)
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        assert client.compute(g.sum(dtype=np.int64), sync=True) == want  # compiles, warms
        before = jobs.sent_by_workers(client)
        with get_task_stream(client) as stream:
            assert client.compute(g.sum(dtype=np.int64), sync=True) == want
        sent = jobs.sent_by_workers(client, before)
    blocks = Counter(t["worker"] for t in stream.data if key_split(t["key"]) in groups)
    assert len(blocks) == 2 and min(blocks.values()) >= sum(blocks.values()) // 5, blocks
    assert sum(sent.values()) < block_bytes, sent  # not one block of C between the workers


def _computed_blocks(g: da.Array) -> dict:
    """The tasks of a Gram over a ``.npy`` that compute a block, by key."""
    from dask._task_spec import Task

    from dask_gpuchunk.bits.gram_graphs import _resident_block

    layer = dict(g.__dask_graph__().layers[g.name])
    return {key: task for key, task in layer.items()
            if isinstance(task, Task) and task.func is _resident_block}


@needs_legacy_graphs
def test_gram_of_a_npy_spreads_its_diagonal_blocks_over_the_workers(rng, tmp_path):
    # Each diagonal block has one dependent (its block of C), so dask fuses the two and the
    # 16 diagonal blocks form a task group of their own. Without the data-producer mark,
    # distributed takes a group as root tasks only when it has more than twice the cluster's
    # threads: on four workers of two threads (four GPUs), one worker ran all 16.
    from dask.utils import key_split
    from distributed import Client, LocalCluster, get_task_stream

    words = np.packbits(random_bits(rng, (16 * 48, 512), 0.3), axis=1)
    np.save(tmp_path / "w.npy", words)
    g = dg.gram(dg.from_npy(tmp_path / "w.npy", chunks=(48, -1)), packed=True, device="cpu")
    computed = _computed_blocks(g)
    assert len(computed) == 136 and all(task.data_producer for task in computed.values())
    want = reference_gram(np.unpackbits(words, axis=1)).sum(dtype=np.int64)
    # Without work stealing, which moved some of them at times: where the scheduler put them.
    with dask.config.set({"distributed.scheduler.work-stealing": False}), \
            LocalCluster(n_workers=4, threads_per_worker=2, processes=False,
                         dashboard_address=None) as cluster, Client(cluster) as client:
        with get_task_stream(client) as stream:
            assert client.compute(g.sum(dtype=np.int64), sync=True) == want
    fused = {t["key"] for t in stream.data if "upper" in key_split(t["key"])
             and key_split(t["key"]) != key_split(next(iter(computed))[0])}
    assert len(fused) == 16, fused  # the diagonal blocks, fused with their blocks of C
    workers = Counter(t["worker"] for t in stream.data if t["key"] in fused)
    assert len(workers) >= 2, workers


@needs_legacy_graphs
@pytest.mark.gpu
@pytest.mark.parametrize("method", ["auto", "int8", "popcount"])
def test_gram_of_a_npy_stages_each_chunk_to_the_gpu_once(rng, tmp_path, device_cap, method):
    from dask_gpuchunk.jobs import staged_by_workers
    from dask_gpuchunk.runtime.resident import resident_stats

    device_cap(1 << 30)
    a = random_bits(rng, (1000, 3000), 0.3)
    words = np.packbits(a, axis=1)
    np.save(tmp_path / "w.npy", words)
    x = dg.from_npy(tmp_path / "w.npy", chunks=(300, -1))  # 300, 300, 300, 100 rows
    before = staged_by_workers(None)
    reads = resident_stats().get("device 0", {}).get("reads", 0)
    c = dg.gram(x, packed=True, device="gpu", method=method).compute()
    np.testing.assert_array_equal(c, reference_gram(a))
    staged = staged_by_workers(None, before)["this process"]
    assert staged["h2d_bytes"] == words.nbytes  # each chunk once (10 blocks read them)
    sizes = x.chunks[0]
    upper = sum(sizes[i] * sizes[j] for i in range(4) for j in range(i, 4))
    assert staged["d2h_bytes"] == upper * 4
    stats = resident_stats()["device 0"]
    assert stats["reads"] - reads == 4 and stats["nbytes"] == 0  # nothing kept after


@needs_legacy_graphs
@pytest.mark.gpu
def test_a_gram_kept_on_the_device_sums_without_moving_c_to_the_host(rng, tmp_path, device_cap):
    from dask_gpuchunk.jobs import staged_by_workers

    device_cap(1 << 30)
    a = random_bits(rng, (1000, 3000), 0.3)
    np.save(tmp_path / "w.npy", np.packbits(a, axis=1))
    x = dg.from_npy(tmp_path / "w.npy", chunks=(300, -1))
    before = staged_by_workers(None)
    total = dg.gram(x, packed=True, keep_on_device=True).sum(dtype=np.int64).compute()
    assert int(total) == int(reference_gram(a).sum(dtype=np.int64))
    assert staged_by_workers(None, before)["this process"]["d2h_bytes"] == 0


@pytest.mark.gpu
def test_device_resident_words_make_grouped_blocks_by_default(rng, device_cap):
    import cupy

    device_cap(1 << 30)
    a = random_bits(rng, (2000, 4096), 0.4)
    x = dg.asarray(cupy.asarray(np.packbits(a, axis=1)), chunks=(125, -1))  # 16 chunks
    g = dg.gram(x, packed=True)
    assert len(g.chunks[0]) < len(x.chunks[0])  # grouped by the GPU's work
    assert len(g.chunks[0]) >= gram_module.MIN_ROW_GROUPS
    np.testing.assert_array_equal(cupy.asnumpy(g.compute()), reference_gram(a))
