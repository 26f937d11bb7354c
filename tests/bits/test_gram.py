"""Dask operators ``dg.bitpack`` and ``dg.gram``: exact against NumPy, chunking, graph, errors."""

from __future__ import annotations

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
