"""Binary data: 0/1 rows packed into words (:mod:`~dask_gpuchunk.bits.bitpacking`), their exact
Gram matrix ``A·Aᵀ`` (:mod:`~dask_gpuchunk.bits.gram`, its blocks and graphs in
:mod:`~dask_gpuchunk.bits.gram_blocks` and :mod:`~dask_gpuchunk.bits.gram_graphs`), and
similarity search over it: scores, top-k and threshold (:mod:`~dask_gpuchunk.bits.similarity`,
:mod:`~dask_gpuchunk.bits.similarity_graphs`, :mod:`~dask_gpuchunk.bits.selection`). The
kernels they launch are in :mod:`dask_gpuchunk._kernels`. The public names are the package's
own: ``dg.bitpack``, ``dg.gram``, ``dg.similarity``, ``dg.Neighbours``, ``dg.Pairs``.
"""

__all__: list[str] = []
