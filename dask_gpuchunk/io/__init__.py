""".npy files larger than memory, in and out, chunk by chunk: ``from_npy`` and ``to_npy``;
``.npz`` files out: ``to_npz``.

Each task reads only its own region of a ``.npy``, where it runs
(:mod:`dask_gpuchunk.io.npy_reading`, whose docstring says how); a write goes to a temporary
file beside the target, each chunk into its region from the worker that computed it, renamed
onto the target once whole (:mod:`dask_gpuchunk.io.npy_writing`); a ``.npz``'s members the same
way (:mod:`dask_gpuchunk.io.npz_writing`). This module gives them their names.
"""

from .npy_reading import (
    NpyFormatError,
    NpyHeader,
    NpyReader,
    NpyTrailingDataWarning,
    checked_chunks,
    from_npy,
    in_flight,
    inputs_of,
    npy_reader_of,
    read_header,
    with_row_chunks,
)
from .npy_writing import (
    NoSpaceError,
    NoWorkersError,
    SchedulerLostError,
    check_output_directory,
    check_space,
    check_target,
    no_workers_timeout,
    npy_bytes,
    npy_in_place,
    run_writes,
    temporary_output,
    to_npy,
    write_region,
)
from .npz_writing import to_npz

__all__ = ["NoSpaceError", "NoWorkersError", "NpyFormatError", "NpyHeader", "NpyReader",
           "NpyTrailingDataWarning", "SchedulerLostError", "check_output_directory", "check_space", "check_target",
           "checked_chunks", "from_npy", "in_flight", "inputs_of", "no_workers_timeout",
           "npy_bytes",
           "npy_in_place", "npy_reader_of", "read_header", "run_writes", "temporary_output",
           "with_row_chunks",
           "to_npy", "to_npz", "write_region"]
