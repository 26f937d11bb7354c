"""NumPy's rules for scalar Python functions, compiled by numba: the translator behind
``dg.elementwise``.

A user's function, called on NumPy scalars, computes by NumPy's rules (``int8 * int8`` wraps,
``float32 * 0.1`` stays ``float32``); numba compiles it by its own. :mod:`.translate` walks the
function's source (:mod:`.source_capture` finds and carries it to workers;
:mod:`.translate_walk` its statements, :mod:`.translate_expressions` its expressions) and asks
:mod:`.numpy_rules`' ``Emitter`` (over :mod:`.numpy_values` and :mod:`.numpy_calls`) for code
whose every type is explicit; :mod:`.numpy_ops` binds the scalar helpers of
:mod:`.numpy_helpers` per target (CPU, CUDA, the simulator); :mod:`.user_functions` types a
user's numba functions and picks loops. Imports NumPy and numba only: nothing of dask, nothing
of the rest of the package.
"""
