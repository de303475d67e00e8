"""Which infer requests a direct path takes: the one rule the client (to
choose the path) and the worker (to check what arrives on it) apply.

A direct path runs a request alone, at once, as the daemon's scheduler
would have: so not one with a priority or a sequence (the daemon orders
and routes those), nor one whose inputs or outputs live in shared memory
(the worker maps none for a direct request). A per-call timeout goes
along (validation.start_deadline). Whether the model takes direct
requests at all is its scheduler's to say (Scheduler.direct_refusal).
"""
from __future__ import annotations

from typing import Optional

from ..protocol import errors, tensors
from ..protocol.errors import TorchpoolError
from .request import InferCall


def plain_refusal(call: InferCall, model: str) -> Optional[TorchpoolError]:
    """None when a direct path takes this infer request; otherwise the
    error the worker answers it with (a client sends it to the daemon)."""
    if call.priority or call.sequence:
        return TorchpoolError(errors.UNSUPPORTED, f"a request for model '{model}' with a priority or "
                                                  f"sequence goes to the daemon, not the direct path")
    outputs = call.outputs
    if outputs is not None:
        if outputs.__class__ is not list:
            return TorchpoolError(errors.UNSUPPORTED, f"the direct path of model '{model}' takes "
                                                      f"outputs by name only")
        for o in outputs:
            if o.__class__ is not str:
                return TorchpoolError(errors.UNSUPPORTED, f"the direct path of model '{model}' takes "
                                                          f"outputs by name only")
    entries = call.inputs
    if entries.__class__ is list:
        for e in entries:
            if e.__class__ is dict and tensors.location(e) != tensors.DATA:
                return TorchpoolError(errors.UNSUPPORTED, f"input '{e.get('name')}' for model '{model}': "
                                                          f"the direct path takes inline inputs only")
    return None
