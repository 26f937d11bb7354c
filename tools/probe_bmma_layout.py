"""Which A-fragment register layout makes the bmma kernel exact on this GPU (run on a GPU).

Prints, for each candidate, whether ``bmma_cuda`` matches NumPy on random odd-sized matrices.
"""

from __future__ import annotations

import cupy
import numpy as np

from dask_gpuchunk._kernels.bitpack import reference_bitpack
from dask_gpuchunk._kernels.bmma import bmma_cuda
from dask_gpuchunk._kernels.gram import reference_gram

rng = np.random.default_rng(0)
a = (rng.random((333, 1043)) < 0.5).astype(np.uint8)
words = cupy.asarray(reference_bitpack(a))
expected = reference_gram(a)
for layout in ((1, 2), (2, 1)):
    c = cupy.empty((333, 333), dtype=np.int32)
    try:
        bmma_cuda(words, None, c, layout=layout)
        got = cupy.asnumpy(c)
        print(f"layout {layout}: exact={np.array_equal(got, expected)}, "
              f"max error {int(np.abs(got.astype(np.int64) - expected).max())}")
    except Exception as exc:  # noqa: BLE001 - report whatever the compiler or driver said
        print(f"layout {layout}: {type(exc).__name__}: {str(exc)[:2000]}")
