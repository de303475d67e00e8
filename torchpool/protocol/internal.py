"""Broker <-> worker messages (internal; over a SOCK_SEQPACKET socket pair).

Each message is one msgpack array; the first element says what it is.
A tensor descriptor is `[name, datatype, shape, segment, offset, nbytes]`:
the bytes live in shared memory, only the descriptor crosses the socket.

broker -> worker
    [RUN, batch_id, [descriptor, ...], [requested output names], [released block, ...]]
    [RELEASE, [released block, ...]]
    [STOP]
A released block is `[segment, offset, size]` of an output block the broker
no longer reads: the worker may reuse it.
worker -> broker
    [READY, pid, device]
    [LOAD_FAILED, code, message]
    [DONE, batch_id, [descriptor, ...], [input_ns, infer_ns, output_ns]]
    [FAILED, batch_id, code, message]
"""
from __future__ import annotations

RUN = 1
STOP = 2
RELEASE = 3
READY = 10
LOAD_FAILED = 11
DONE = 12
FAILED = 13

# A message is far smaller than this; sized for descriptors of many outputs.
MAX_MESSAGE = 1 << 20
