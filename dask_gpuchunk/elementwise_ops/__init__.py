"""Elementwise operations over Dask arrays, NumPy's rules on every device: the operator
(:mod:`~dask_gpuchunk.elementwise_ops.operations`: ``dg.elementwise``, ``dg.multiply``), its
operands (:mod:`~dask_gpuchunk.elementwise_ops.operands`), plans and graphs
(:mod:`~dask_gpuchunk.elementwise_ops.graphs`) and what its tasks run on a block
(:mod:`~dask_gpuchunk.elementwise_ops.blocks`). The scalar functions' translation is
:mod:`dask_gpuchunk.ufunc`'s; the chunks' execution, :mod:`dask_gpuchunk.runtime.backend`'s.
"""

from .operations import ElementwiseOp, elementwise, multiply

__all__ = ["ElementwiseOp", "elementwise", "multiply"]
