"""Build of the one C extension; everything else is in setup.cfg.

The extension is optional: without a C compiler torchpool installs and
works, its large shared-memory copies just take the ordinary path.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("torchpool.shm._streamcopy", ["torchpool/shm/_streamcopy.c"],
                             optional=True)])
