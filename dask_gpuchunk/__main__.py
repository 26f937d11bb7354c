"""``python -m dask_gpuchunk``: the ``dask-gpuchunk`` command line."""

from .cli import main

if __name__ == "__main__":
    main()
