"""How a request's inputs are encoded: into the client's arena (copied once,
or passed in place when built there with `empty()`), as a registered
region, or inline in the request; and what is given back when it is over.
One part of `ClientState` (flows.py), which gives it the quarantine of
requests it stopped waiting for.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..protocol import errors, tensors
from ..protocol.messages import INLINE_BUDGET
from ..protocol.errors import InferenceError
from .arena import ClientArena, block_size
from .outputs import Quarantined, EncodedInputs
from .types import Inputs, SharedMemoryRef
from .values import nbytes_of, prepare_input


class NeedRoom(Exception):
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class InputEncoder:
    """Encodes a request's inputs, and gives back what they held once it is over."""

    def __init__(self, quarantine: dict[object, Quarantined]) -> None:
        # requests we stopped waiting for: what they hold until a late answer
        # (the state's own dict: a session that ends clears it)
        self.quarantine = quarantine

    def encode(self, inputs: Inputs, arena: Optional[ClientArena], session: Optional[str]) -> EncodedInputs:
        """Entries and payload frames; inputs go to the arena when there is one.
        Raises NeedRoom (having freed what it took) when the arena is full.
        (`session`: the client's, if any: a registered region needs one)"""
        if arena is None:
            return self.encode_inline(inputs, session)
        enc = EncodedInputs()
        need = 0
        try:
            for name, value in inputs.items():
                if isinstance(value, SharedMemoryRef):
                    if session is None:
                        raise InferenceError(errors.INVALID_ARG, f"input '{name}': a region needs a "
                                                                 f"session (register the region first)")
                    enc.entries.append(value.entry(name))
                    enc.stats[1] += value.byte_size
                    continue
                datatype, shape, src = prepare_input(name, value)
                entry = tensors.tensor_entry(name, datatype, shape)
                enc.entries.append(entry)
                nbytes = nbytes_of(src)
                # built in place with empty(): never copied
                if arena.user_blocks and nbytes > 0 and isinstance(src, np.ndarray):
                    block = arena.lookup(src)
                    if block is not None and block.in_flight == 0:
                        tensors.put_shm(entry, *arena.hand_out(block, nbytes))
                        block.in_flight += 1
                        enc.lent.append(block)
                        enc.stats[1] += nbytes
                        continue
                if tensors.worth_descriptor(nbytes):
                    block = arena.alloc(nbytes) if need == 0 else None
                    if block is None:
                        need += block_size(nbytes)
                        continue
                    enc.blocks.append(block)
                    arena.write(block, src, nbytes)
                    # our own copy: an output that is a view of it (an identity,
                    # an in-place model) may come back pointing into it
                    tensors.put_shm(entry, *arena.hand_out(block, nbytes), reuse=True)
                    enc.stats[0] += nbytes
                    continue
                tensors.put_data(entry, src, enc.frames, inline=enc.stats[2] + nbytes <= INLINE_BUDGET)
                enc.stats[2] += nbytes
        except BaseException:
            self.finish(enc, arena, answered=True)
            raise
        if need:
            self.finish(enc, arena, answered=True)
            raise NeedRoom(need)
        return enc

    def encode_inline(self, inputs: Inputs, session: Optional[str]) -> EncodedInputs:
        """`encode` without an arena: every tensor's bytes travel in the
        request (inline or as frames); nothing to give back on failure."""
        enc = EncodedInputs()
        entries, frames, inline = enc.entries, enc.frames, 0
        for name, value in inputs.items():
            if isinstance(value, SharedMemoryRef):
                if session is None:
                    raise InferenceError(errors.INVALID_ARG, f"input '{name}': a region needs a "
                                                             f"session (register the region first)")
                entries.append(value.entry(name))
                enc.stats[1] += value.byte_size
                continue
            datatype, shape, src = prepare_input(name, value)
            entry = tensors.tensor_entry(name, datatype, shape)
            entries.append(entry)
            nbytes = nbytes_of(src)
            tensors.put_data(entry, src, frames, inline=inline + nbytes <= INLINE_BUDGET)
            inline += nbytes
        enc.stats[2] = inline
        return enc

    def finish(self, enc: EncodedInputs, arena: Optional[ClientArena], answered: bool,
               rid: Optional[int] = None, token: Optional[str] = None) -> None:
        """The request is over (answered) or lost (no answer: keep its blocks
        until a late answer arrives, or the session ends)."""
        if not answered:
            if rid is not None and (token is not None or enc.blocks or enc.lent):
                self.quarantine[rid] = (token, arena, enc.blocks, enc.lent)
        elif arena is not None:
            for block in enc.blocks:
                arena.free(block)
            for block in enc.lent:
                arena.flight_done(block)
        enc.blocks, enc.lent = [], []
