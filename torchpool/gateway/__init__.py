"""KServe v2 / Triton endpoints: HTTP/REST and gRPC gateways.

A gateway is a client of the broker, not a second broker: one process
(`python -m torchpool.gateway`, started by `torchpool serve --http-port/
--grpc-port` or run on its own) that speaks torchpool's ZeroMQ protocol over
the local shared-memory path. A tensor in a request body is copied once, into
the gateway's shared-memory arena; outputs are written to the socket straight
from the worker's shared memory.

    backend.py      the calls both protocols share: torchpool client calls,
                    Triton's tensor layouts, error codes -> HTTP/gRPC status
    callers.py      a remote caller (an HTTP connection, a gRPC peer) and its
                    share of the daemon; defaults.py the gateway's defaults
    offload.py      the helper process that parses large requests
    chunks.py       large outputs converted a chunk per turn of the loop
    http_server.py  Triton's HTTP routes; http_protocol.py HTTP/1.1 on asyncio +
                    httptools (http_messages.py, http_bodies.py: the body
                    budget); http_binary.py JSON and binary tensors
    grpc_server.py  inference.GRPCInferenceService on grpcio's asyncio server;
                    grpc_requests.py ModelInferRequest parsing, grpc_peers.py
                    its callers, proto/wire.py tensor bytes around protobuf
    process.py      the gateway process: the event loop, both servers, signals
"""
