import sys

from .process import main

# guarded: the helper process (offload.py, multiprocessing "spawn") imports
# this module again as __mp_main__, and must not start a gateway
if __name__ == "__main__":
    sys.exit(main())
