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

# Whether remote callers may register system shared memory (Triton's
# --allow-client-shm, off by default since 26.04): the daemon opens the
# segment with the gateway's rights, not the caller's.
ALLOW_CLIENT_SHM = False
