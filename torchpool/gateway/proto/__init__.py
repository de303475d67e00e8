"""The KServe v2 / Triton gRPC protocol: the .proto files and the modules
`scripts/gen_proto` generates from them (shipped; do not edit by hand).

POOL is the descriptor pool the generated modules are built in. It is not
protobuf's default pool because tritonclient registers the same names
(`inference.ModelInferRequest`, ...) from its own copy of these files there,
and one process may import both: the tests do, and so may an application that
embeds the gateway and also calls a Triton server.
"""
from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
