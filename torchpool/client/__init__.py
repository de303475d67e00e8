"""The torchpool client library (synchronous and asyncio).

    from torchpool import Client
    with Client("ipc:///tmp/torchpool.sock") as c:
        out = c.infer("addsub", {"INPUT0": a, "INPUT1": b})

A `Client` may be shared by threads; `Client([url, url])` spreads requests
over several daemons. The whole API: docs/client.md.

Both clients speak the same wire format (docs/protocol.md); the encoding,
decoding, session and shared-memory logic is shared, only the transport
differs. The package, one module per job:

    api.py     the API, declared once: what each client answers (Protocols)
    sync.py    Client: calls from any thread           } thin drivers: send,
    aio.py     AsyncClient: many calls, one socket     } wait, run a flow
    channel.py one socket shared by threads: replies routed to their callers
    watch.py   the socket's monitor: why no answer came (DEADLINE_EXCEEDED,
               UNAVAILABLE), failing at once when nothing is there
    multi.py   MultiClient = Client([url, ...]): several daemons, failover
    common.py  what both share: socket + state ownership, errors, inline helpers
    flows.py   ClientState and the I/O-free flows (hello, infer, empty, regions)
    arena.py   the client's shared-memory arena and the lent-output mappings
    values.py  numpy / torch / str values <-> tensor bytes
    types.py   SharedMemoryRef, OutputRef, Classification, RegionOutput, InferResult, NoAnswer

The tensor entry itself (inline / frame / descriptor / region) is encoded and
decoded by torchpool/protocol/tensors.py, shared with the daemon. Nothing here
imports torch unless the caller passes a torch tensor or a BF16 output arrives
(then as a torch tensor if torch is installed).

Local clients (same host): at the first `infer` the client says `hello`; when
the daemon agrees it is local, inputs are copied once into the client's
shared-memory arena and only descriptors cross the socket, and outputs come
back as read-only numpy views of the worker's shared memory (no copy at all),
released to the daemon once the last view is garbage. Turn it off with
`Client(url, local=False)` or `TORCHPOOL_LOCAL=0`. A daemon that does not
speak sessions is used inline, as before.

- `c.empty(shape, datatype)` allocates an input in the arena: fill it and pass
  it (or a torch view, `torch.from_numpy(buf)`) to `infer` and nothing is
  copied. For BF16 it is a uint16 array: `torch.from_numpy(buf).view(torch.bfloat16)`.
- `c.infer(..., copy=True)` returns ordinary (writable) arrays and hands the
  daemon's memory back at once. Without it, outputs of a local session view
  the daemon's memory: they stay valid while referenced, until `close()` (or
  until the session's lease expires after `lease_s` seconds without any
  request). Copy what must outlive the client.
- The dict `infer` returns is a context manager: `with c.infer(...) as out:`.
- `c.transfer_stats()`: bytes copied into shared memory, sent zero-copy
  (descriptors of `empty()` buffers, registered regions) and sent inline.
- Triton's system shared-memory API: `register_system_shared_memory`,
  `unregister_system_shared_memory`, `get_system_shared_memory_status`;
  inputs `SharedMemoryRef(region, byte_size, offset, datatype, shape)`, and
  `outputs=[OutputRef(name, region, byte_size, offset)]` (answered as a
  `RegionOutput`: name, region, offset, nbytes, datatype, shape).
- Triton's classification extension: `outputs=[Classification(name, k)]`
  answers that output as its top k classes, a BYTES array of
  b"score:index:label" ([batch, k] for a batching model, else [k]).
"""
from __future__ import annotations

from ..protocol.errors import InferenceError
from .aio import AsyncClient
from .arena import DEFAULT_ARENA_CAP
from .common import DEFAULT_TIMEOUT, GOODBYE_WAIT, decode_infer, encode_control, encode_infer
from .multi import MultiClient
from .sync import Client
from .types import (Classification, InferResult, NoAnswer, OutputRef, RawTensor, RegionOutput,
                    SharedMemoryRef)

__all__ = ["AsyncClient", "Classification", "Client", "DEFAULT_ARENA_CAP", "DEFAULT_TIMEOUT",
           "GOODBYE_WAIT", "InferResult", "InferenceError", "MultiClient", "NoAnswer", "OutputRef",
           "RawTensor", "RegionOutput", "SharedMemoryRef", "decode_infer", "encode_control",
           "encode_infer"]
