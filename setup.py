"""Build of the C extensions; everything else is in setup.cfg.

Every extension is optional: without a C compiler torchpool installs and
works. Large shared-memory copies then take the ordinary path, BYTES
tensors are walked in Python (much slower for many elements), and workers
refuse client-owned regions, which are safe only under the SIGBUS guard,
and copy every output instead of answering large ones where the model made
them (_outcapture).

None needs torch or numpy headers: a client-only install (no extras) builds
them too, and the client uses two of them (_streamcopy for large inputs into
its arena, _bytescan for BYTES tensors).
"""
from setuptools import Extension, setup

setup(ext_modules=[
    Extension("torchpool.shm._streamcopy", ["torchpool/shm/_streamcopy.c"], optional=True),
    Extension("torchpool.shm._sigbus", ["torchpool/shm/_sigbus.c"], optional=True),
    Extension("torchpool.protocol._bytescan", ["torchpool/protocol/_bytescan.c"], optional=True),
    Extension("torchpool.worker._outcapture",
              ["torchpool/worker/_outcapture.c", "torchpool/worker/outcapture_heap.c"],
              depends=["torchpool/worker/outcapture_heap.h"], optional=True),
])
