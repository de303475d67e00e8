"""The worker's test for outputs that are views of an input block the client
handed over for reuse (docs/protocol.md, "reuse"): only contiguous CPU views
that lie entirely inside such a block qualify."""
from __future__ import annotations

import torch

from torchpool.worker.capture import reuse_input


def test_only_contiguous_views_inside_a_reusable_input_are_reused() -> None:
    block = torch.arange(1024, dtype=torch.float32)
    other = torch.zeros(16)
    reusable = [(block.data_ptr(), block.numel() * 4, "seg", 4096)]
    assert reuse_input(block, reusable) == ("seg", 4096, 4096)
    assert reuse_input(block[8:], reusable) == ("seg", 4096 + 32, 4096 - 32)
    assert reuse_input(block.view(torch.int32)[:4], reusable) == ("seg", 4096, 16)
    assert reuse_input(block.view(32, 32)[2], reusable) == ("seg", 4096 + 256, 128)
    assert reuse_input(block[::2], reusable) is None               # strided: written out
    assert reuse_input(block.view(32, 32).t(), reusable) is None   # not contiguous
    assert reuse_input(block.clone(), reusable) is None            # a new tensor
    assert reuse_input(other, reusable) is None
    assert reuse_input(block[:0], reusable) is None                # nothing to point at
    assert reuse_input(["a string"], reusable) is None
