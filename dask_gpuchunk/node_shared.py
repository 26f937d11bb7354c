"""Device chunks handed between the GPU processes of a node through CUDA IPC, not the network.

distributed sends a CuPy chunk that a task needs from another worker as host bytes: a copy to
the host, the network (TLS in :func:`dask_gpuchunk.local_cluster`), a copy to the other GPU.
On 2 x H200 the Gram of 65,536 x 262,144 bits of device-resident words (16 chunks of 128 MiB)
took 0.68 s on one GPU and 2.00-2.93 s on two: each worker spent 1.7-2.7 s receiving chunks,
~50-150 ms each, for 0.65-1.03 s of tasks. Through this module, 0.53-0.65 s on two
(docs/perf-notes.md, stop 52).

A :class:`NodeSharedChunk` wraps such a chunk where it lies, as a task of its own
(:func:`node_shared_refs`), and the tasks that need the chunk take it through that task. Sent to
a worker of the same host, it travels as a ticket (:class:`~dask_gpuchunk.peer_chunks.CudaIpc`:
the allocation's IPC handle, the offset, shape, dtype and a checksum); the receiving worker
copies the chunk from the sender's GPU to its own while the sender still holds it (distributed's
sender keeps what it sends until the receiver has taken the message), and checks the checksum.
Sent anywhere else (another host), spilled to host memory or to disk, or where the chunk is
smaller than ``gpuchunk.share-min-bytes`` or ``gpuchunk.share-device-chunks`` is off, it
travels as distributed sends the chunk itself.

A chunk that cannot be copied through IPC on arrival (a process that cannot map the sender's
memory) leaves a task that raises, naming the setting that turns this off: never a wrong chunk.
Under dask's array query planning the Gram goes through dask's ``blockwise``, whose chunks
travel as distributed sends them.
"""

from __future__ import annotations

import os
from typing import Any

from dask.sizeof import sizeof
from dask.task_spec import Task, TaskRef
from distributed.comm.addressing import get_address_host
from distributed.protocol import dask_deserialize, dask_serialize, deserialize, serialize

from . import _compat
from .backend import is_cupy
from .devices import cluster_protocol, cluster_workers
from .peer_chunks import CudaIpc, sharing_on

__all__ = ["NodeSharedChunk", "chunk_of", "node_shared_refs", "same_host"]


class NodeSharedChunk:
    """A device chunk as the tasks on other workers of its node receive it (the module's
    docstring). ``error``: why a chunk sent through IPC could not be copied here
    (:func:`chunk_of` raises it).

    Its size is its chunk's, where it was made too: a worker's spilling can then move it off
    the GPU (to host memory as the chunk's bytes), where a small size would keep the chunk on
    the GPU as long as the wrapper lives, whatever the chunk's own key does. A worker's own
    chunks are then counted twice while their wrappers live: it spills earlier, never holds
    more than it counts."""

    def __init__(self, chunk: Any, error: str | None = None) -> None:
        self.chunk = chunk
        self.error = error

    def __repr__(self) -> str:
        return f"NodeSharedChunk({self.error or getattr(self.chunk, 'shape', None)})"


def chunk_of(shared: Any) -> Any:
    """The chunk that ``shared`` (a :class:`NodeSharedChunk`) carries, here; anything else as it
    is.

    Examples
    --------
    >>> chunk_of(NodeSharedChunk([0, 1, 2]))
    [0, 1, 2]
    >>> chunk_of(NodeSharedChunk(None, error="no IPC"))
    Traceback (most recent call last):
    ...
    RuntimeError: no IPC
    """
    if not isinstance(shared, NodeSharedChunk):
        return shared
    if shared.error is not None:
        raise RuntimeError(shared.error)
    return shared.chunk


def same_host(context: dict[str, Any] | None) -> bool:
    """Whether a message serialized with ``context`` (distributed's comms name the sender's
    and the recipient's addresses) goes between two processes of one host. No context (a
    spill to host memory or disk) or an address without a host: ``False``.

    Examples
    --------
    >>> same_host({"sender": {"address": "tls://127.0.0.1:4001"},
    ...            "recipient": {"address": "tls://127.0.0.1:4002"}})
    True
    >>> same_host({"sender": {"address": "tcp://10.0.0.1:4001"},
    ...            "recipient": {"address": "tcp://10.0.0.2:4002"}})
    False
    >>> same_host(None)
    False
    """
    try:
        sender = get_address_host(context["sender"]["address"])
        recipient = get_address_host(context["recipient"]["address"])
    except (KeyError, TypeError, ValueError):
        return False
    return bool(sender) and sender == recipient


def _shared_here(chunk: Any) -> bool:
    return is_cupy(chunk) and sharing_on(chunk.nbytes, "share-device-chunks")


@dask_serialize.register(NodeSharedChunk)
def _dumps(shared: NodeSharedChunk, context: dict[str, Any] | None = None
           ) -> tuple[dict[str, Any], list[Any]]:
    if shared.error is None and _shared_here(shared.chunk) and same_host(context):
        ticket = CudaIpc().export(shared.chunk)
        if ticket is not None:
            return {"ipc": {**ticket, "pid": os.getpid()}}, []
    header, frames = serialize(shared.chunk, serializers=("dask", "pickle"), on_error="raise")
    return {"chunk": header, "error": shared.error}, frames


def _fetched(ticket: dict[str, Any]) -> Any:
    """:meth:`CudaIpc.fetch` on a stream of its own: received on distributed's event loop, the
    copy then does not wait for the kernels this worker's tasks queue on the legacy default
    stream."""
    transport = CudaIpc()
    try:
        import cupy
    except ImportError:  # no GPU here: the transport says so
        return transport.fetch(ticket)
    with cupy.cuda.Stream(non_blocking=True):
        return transport.fetch(ticket)


@dask_deserialize.register(NodeSharedChunk)
def _loads(header: dict[str, Any], frames: list[Any]) -> NodeSharedChunk:
    if "ipc" not in header:
        chunk = deserialize(header["chunk"], frames)
        return NodeSharedChunk(chunk, error=header.get("error"))
    ticket = header["ipc"]
    try:
        chunk = _fetched(ticket)
        reason = "its checksum did not match, or CUDA refused the handle"
    except Exception as error:  # deserialized in distributed's comm: kept for the task
        chunk, reason = None, f"{type(error).__name__}: {error}"
    if chunk is None:
        return NodeSharedChunk(None, error=(
            f"a chunk of shape {tuple(ticket.get('shape', ()))} could not be copied from the GPU "
            f"of process {ticket.get('pid')} through CUDA IPC ({reason}); set "
            "gpuchunk.share-device-chunks to False to send device chunks through the network"))
    return NodeSharedChunk(chunk)


@sizeof.register(NodeSharedChunk)
def _sizeof(shared: NodeSharedChunk) -> int:
    return sizeof(shared.chunk)


def _register_device_object() -> None:
    """Tell dask-cuda's spilling that a wrapper holds device memory, as the chunk it carries
    does, where dask-cuda is already imported: a dask-cuda worker imports it before this
    package, and importing it here would import dask's dataframes (and pandas) into every
    process that imports the package."""
    _compat.register_device_object(NodeSharedChunk, lambda shared: is_cupy(shared.chunk))


_register_device_object()


def _on_devices(collection: Any) -> bool:
    """Whether ``collection``'s chunks are on GPUs, and a cluster of several workers may send
    them through the network (with one, or none, nothing is sent, and a wrapper would only
    count each chunk twice for the worker's spilling; over UCX distributed sends a CuPy chunk
    from GPU to GPU itself, where a wrapper would send its host bytes: on 2 x H200 the Gram of
    2 GiB of device-resident words took 2.2-2.8 s wrapped and 0.60-0.71 s not, against
    0.69-0.72 s wrapped over TLS, docs/perf-notes.md, stop 53)."""
    return (is_cupy(getattr(collection, "_meta", None)) and cluster_protocol() != "ucx"
            and cluster_workers() > 1)


def node_shared_refs(dsk: dict, collection: Any, keys: list[Any], name: str) -> list[Any]:
    """What a task names for each chunk key in ``keys`` of ``collection``: the key itself, or,
    where the collection's chunks are on GPUs (CuPy) and the default client's cluster has
    several workers when the graph is made, a task that takes the chunk out of a
    :class:`NodeSharedChunk` wrapping it where it lies, which ``dsk`` gains as ``(name, n)``:
    then another worker of the same host receives the chunk through CUDA IPC.

    Examples
    --------
    >>> import dask.array as da
    >>> words = da.ones((4, 2), chunks=2, dtype="uint64")
    >>> dsk = {}
    >>> refs = node_shared_refs(dsk, words, [(words.name, 0, 0)], "shared-words")
    >>> [ref.key for ref in refs] == [(words.name, 0, 0)], dsk  # host chunks: their own keys
    (True, {})
    """
    if not _on_devices(collection):
        return [TaskRef(key) for key in keys]
    refs = []
    for n, key in enumerate(keys):
        shared_key = (name, n)
        dsk[shared_key] = Task(shared_key, NodeSharedChunk, TaskRef(key))
        refs.append(Task(None, chunk_of, TaskRef(shared_key)))
    return refs
