""".npy files larger than memory, in and out, chunk by chunk: ``from_npy`` and ``to_npy``.

``from_npy`` reads the header once, on the client, and checks the file (magic string, header,
dtype, size); each task then reads only its own region, on whichever worker runs it (workers
must see the same path), with large sequential ``preadv`` calls straight into a new array. Where
the worker sees a GPU, that array is page-locked (CuPy's pinned pool): the file is read straight
into the buffer that goes to the device, and the GPU path sends it with no staging copy.

``to_npy`` first checks that the target's file system has room for it, then writes the header
of the whole array into a temporary file next to the target (``.<name>.dgc-<writer>.partial``,
:mod:`dask_gpuchunk.partials`), then every chunk into its region of that file from the worker
that computed it (``pwrite`` of its contiguous runs; CuPy chunks land in a pinned buffer and are
written from there), and renames the file onto the target only when every chunk is written.
Writes go through the page cache like ``np.save``'s; the file is not synced to disk. A failure
removes the temporary file; a killed job leaves at most that hidden temporary file, never a
half-written target, and the next job writing the same target removes it once its writer is
gone.

The reading side is :mod:`dask_gpuchunk.npy_reading`, the writing side
:mod:`dask_gpuchunk.npy_writing`; this module gives both their names.
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

__all__ = ["NoSpaceError", "NoWorkersError", "NpyFormatError", "NpyHeader", "NpyReader",
           "NpyTrailingDataWarning", "check_output_directory", "check_space", "check_target",
           "checked_chunks", "from_npy", "in_flight", "inputs_of", "no_workers_timeout",
           "npy_bytes",
           "npy_in_place", "npy_reader_of", "read_header", "run_writes", "temporary_output",
           "with_row_chunks",
           "to_npy", "write_region"]
