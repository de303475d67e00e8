"""The test model catalogues: every model the tests serve, grouped by what it exercises.

The session-wide repository (`repository.build_test_repository(root)`, which
tests/conftest.py builds once; end-to-end tests start the real server on it)
is the union of these catalogues, each with a `write_<area>(root)` and a
`READY` dict (model -> versions that must be READY):

  basic               add/sub in Triton's QA style, the JSON config, the model
                      file name, instance groups, identity_bf16; plus_one
  versions            version directories and version policies
  naming              binding config inputs to forward arguments, Dict input,
                      every datatype
  strings             TYPE_STRING <-> List[str], with and without batching
  shapes_and_batching zero-size, reshape, views of the input, the executed
                      batch size, ragged batching
  sequences           sequence batching with an implicit state
  backend_parameters  the backend's parameters (inference mode, threads, ...)
  execution_errors    models that load but fail (or raise) at execution
  slow                busy-loop models and `slow_iterations(seconds)`
  load_failures       models that must fail to load, `expected_load_errors(root)`

`core` holds what they share: config text and TorchScript writing.
`self_check` builds the repository in a directory and checks it in-process
(`python -m tests.support.models.self_check DIR`).

Two more repositories are built on their own, by the tests that need them:
  batching_repository  probes that reveal how requests were batched
                       (tests/e2e/test_e2e_batching.py)
  pt2_repository       PyTorch 2 formats: torch.export programs and
                       AOTInductor packages (tests/e2e/test_e2e_pt2.py)

Conventions used in the catalogues' docstrings
----------------------------------------------
* `mbs` is `max_batch_size`. With mbs > 0 every input and output has an
  implicit leading batch dimension: a request of n items sends `[n] + dims`
  and gets `[n] + dims` back. With mbs 0 the shape is exactly `dims`.
* `-1` in dims means any size. Every model has exactly version 1 unless said.
* Every config uses `platform: "pytorch_libtorch"` except those marked
  [backend], which say `backend: "pytorch"` (and no platform); both must load.
* No model has `dynamic_batching` unless said: such a model executes every
  request on its own (Triton's default scheduler), so an error in one request
  never touches another.
* Expected error texts are Triton's wording; the server's message must
  *contain* the quoted text (it may add a prefix such as the model name).
  `<root>` is the directory passed to `build_test_repository` (absolute).
"""
