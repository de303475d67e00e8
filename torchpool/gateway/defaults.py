"""The gateway's defaults, in a module that imports nothing: the daemon's
options (broker/options.py) read them here too, without the gateway's
dependencies."""

# The largest HTTP request body (decompressed too) and gRPC request message:
# Triton's default --http-max-input-size. Raised by --http-max-input-size and
# --grpc-max-input-size.
MAX_INPUT_BYTES = 64 << 20

# Requests of one caller (an HTTP connection, a gRPC peer) sent to the daemon
# at once; more wait in the gateway (--gateway-max-in-flight-per-caller).
# Enough for a client that fills a dynamic batch of 64 from one connection;
# another caller's request waits behind at most this many of one caller's.
MAX_IN_FLIGHT_PER_CALLER = 64

# ModelStreamInfer streams one gRPC peer (a user on this host, by uid; an
# address elsewhere) holds open at once, all its connections together: twice
# what one connection may open at the default share (grpc's
# max_concurrent_streams is 2 x --gateway-max-in-flight-per-caller). One more
# is refused RESOURCE_EXHAUSTED at once (--grpc-max-streams-per-peer; 0: no cap).
MAX_STREAMS_PER_PEER = 4 * MAX_IN_FLIGHT_PER_CALLER

# Whether remote callers may register system shared memory (Triton's
# --allow-client-shm, off by default since 26.04): the daemon opens the
# segment with the gateway's rights, not the caller's.
ALLOW_CLIENT_SHM = False

# Every connection costs the gateway a file descriptor (its soft limit is
# raised to the hard one at start). A quarter of the limit, at least
# FD_RESERVE_MIN, is kept for everything else: the daemon's socket, shared
# memory, the helper process, grpc's own, and connections accepted in one go
# before they are refused.
# The protocols served share the rest evenly, each under its own cap
# (--http-max-connections, --grpc-max-connections; 0: this share).
FD_RESERVE_MIN = 256


def fd_reserve(open_files: int) -> int:
    """File descriptors kept free of connections at a soft limit of `open_files`."""
    return max(FD_RESERVE_MIN, open_files // 4)


def max_connections(open_files: int, protocols: int) -> int:
    """One protocol's connection cap when none is given, at a soft limit of
    `open_files`, with `protocols` (1 or 2) served."""
    return max(1, (open_files - fd_reserve(open_files)) // max(1, protocols))
