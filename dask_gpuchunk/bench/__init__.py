"""``dask-gpuchunk bench``: this package, its peers and the measured limits, side by side in one run.

Benchmarks are not tests: they measure, on whatever machine runs them, and report seconds and
ratios (to the physical floor the run measures itself, and to the best peer), as a printed table,
JSON and a PNG chart.
"""

__all__: list[str] = []
