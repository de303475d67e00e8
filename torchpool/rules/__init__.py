"""The rules every path applies to a request, written once.

What the broker, a worker's direct path and the client must agree on lives
here, above the wire (protocol/: the message and tensor formats) and the
model configuration (config/), and below everything that moves requests
(client/, worker/, broker/, gateway/):

    validation   an infer request checked against its model: inputs,
                 outputs, shapes, datatypes, sizes, limits; its own timeout
    direct       which requests a direct path takes
    batching     how requests form a batch (Triton's dynamic batcher)
    spin         when a waiting end polls instead of sleeping

This package imports nothing at load: a client install (no config/, no
torch) imports `rules.direct` and `rules.spin` alone.
"""
