"""Broker <-> worker messages (internal; over a SOCK_SEQPACKET socket pair).

Each message is one msgpack array; the first element says what it is.
A tensor descriptor is `[name, datatype, shape, segment, offset, nbytes, generation]`:
the bytes live in shared memory, only the descriptor crosses the socket.
`segment` names a daemon segment, or is `[key, inode]` for a client's
registered region; a non-zero `generation` is checked against the client
block header in front of `offset`. An input descriptor may carry an eighth
element, `true`, when the answer may point into its block: a client's copy
of the input (`reuse`, see docs/protocol.md), or the broker's own copy of an
inline input, which the broker keeps until the answer is sent. A requested output is
a name, or `[name, [key, inode], offset, capacity]` to be written into a region.

broker -> worker
    [RUN, batch_id, [descriptor, ...], [requested output names], [released block, ...]]
    [RELEASE, [released block, ...]]
    [FORGET, [segment name | [key, inode], ...]]   unmap: a client session or region is gone
    [STOP]
A released block is `[segment, offset, size]` of an output block the broker
no longer reads: the worker may reuse it.
worker -> broker
    [READY, pid, device]
    [LOAD_FAILED, code, message]
    [DONE, batch_id, [descriptor, ...], [input_ns, infer_ns, output_ns], [reused output, ...]]
    [FAILED, batch_id, code, message]
An output descriptor is `[name, datatype, shape, segment, offset, nbytes]`;
a reused output's descriptor points into the input block it is a view of
(nothing to release), every other one into the worker's arena or a region.
"""
from __future__ import annotations

RUN = 1
STOP = 2
RELEASE = 3
FORGET = 4
READY = 10
LOAD_FAILED = 11
DONE = 12
FAILED = 13

# A message is far smaller than this; sized for descriptors of many outputs.
MAX_MESSAGE = 1 << 20
