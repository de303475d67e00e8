"""An infer request as it arrived: read once from its header.

The client makes one `InferCall` for each request and `infer_header`
writes its wire map; each edge a request comes in at (the broker's intake,
a worker's direct path) reads the map back into one with `read_infer`.
Everything after the edge takes this object, never the header: validation
(validate_infer), the direct-path rule (rules/direct.py, which the client
applies to choose its path), the deadline (start_deadline), the schedulers
(priority, sequence flags). So each field of the wire's infer map is
written and read in one place, here, and what a field means is said once.

Fields that a rule checks against the model's config (inputs, outputs,
priority, sequence, model, version) are kept as sent: the rule that reads
one names the model and what was expected. Fields with one meaning
whatever the model (the timeout, when it was sent, output_shm) are read to
their meaning here.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Optional

from ..protocol.messages import OP_INFER, PROTOCOL_VERSION

# A request's header, as msgpack decoded it.
Header = Mapping[str, object]


class InferCall(NamedTuple):
    """One infer request (docs/protocol.md, "infer"), read from its header."""

    request_id: object        # the client's id, echoed as it came
    model: object             # the model's name as sent (the registry resolves it)
    version: object           # "" / None / a number or numeric string
    inputs: object            # the tensor maps as sent: validate_infer checks them
    outputs: object           # requested outputs as sent (None: all of them)
    timeout_us: int           # the request's own timeout; 0: none
    sent_ns: Optional[int]    # when the client sent it (the host's monotonic clock), if it said
    priority: object          # the priority level as sent (the scheduler checks it); 0/None: default
    sequence: object          # the sequence map as sent (the sequence scheduler checks it)
    output_shm: bool          # the client would take outputs lent in shared memory


def read_infer(header: Header) -> InferCall:
    """The infer request a decoded header holds. Never fails: a field's
    value is checked by the rule that reads it; a timeout that is not a
    non-negative integer counts as none, on every path."""
    get = header.get
    timeout = get("timeout_us")
    sent = get("sent_ns")
    # `__class__ is int`: exactly an int (msgpack's; a bool is no timeout), and cheaper than isinstance
    timeout_us = timeout if timeout.__class__ is int and timeout >= 0 else 0
    return InferCall(get("id"), get("model"), get("version"), get("inputs"), get("outputs"), timeout_us,
                     sent if sent.__class__ is int else None,
                     get("priority"), get("sequence"), bool(get("output_shm")))


def infer_header(call: InferCall) -> dict[str, object]:
    """The wire map of an infer request (docs/protocol.md, "infer"):
    what read_infer reads back. Fields at their defaults are left out."""
    header: dict[str, object] = {
        "v": PROTOCOL_VERSION, "op": OP_INFER, "id": call.request_id, "model": call.model,
        "version": call.version, "inputs": call.inputs, "outputs": call.outputs, "timeout_us": call.timeout_us}
    if call.sent_ns is not None:
        header["sent_ns"] = call.sent_ns
    if call.priority:
        header["priority"] = call.priority
    if call.sequence:
        header["sequence"] = call.sequence
    if call.output_shm:
        header["output_shm"] = True
    return header
