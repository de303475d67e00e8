"""An in-process check of the session repository, without the server.

`python -m tests.support.models.self_check DIR` builds the repository in DIR,
loads every model file in-process and checks what the catalogues' docstrings
claim, as far as that is possible without the server. The config checks use a
minimal protobuf-text reader (syntax only), not the server's parser.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from .load_failures import expected_load_errors
from .repository import EXPECTED_READY, build_test_repository
from .slow import slow_iterations


def _parse_pbtxt(text: str) -> dict:
    """Parse protobuf text format into nested dicts; repeated fields become lists."""
    import re
    token_re = re.compile(r'\s+|#[^\n]*|"(?:[^"\\]|\\.)*"|[{}\[\]:,;]|[^\s{}\[\]:,;#"]+')
    tokens = [t for t in token_re.findall(text) if t.strip() and not t.startswith("#")]
    pos = 0

    def scalar(tok: str):
        if tok.startswith('"'):
            return json.loads(tok)
        for cast in (int, float):
            try:
                return cast(tok)
            except ValueError:
                pass
        return tok

    def value():
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok == "{":
            return message("}")
        if tok == "[":
            items = []
            while tokens[pos] != "]":
                items.append(value())
                if tokens[pos] == ",":
                    pos += 1
            pos += 1
            return items
        if tok in "}],:;":
            raise ValueError(f"unexpected {tok!r} at token {pos}")
        return scalar(tok)

    def message(end: Optional[str]) -> dict:
        nonlocal pos
        fields: dict = {}
        while pos < len(tokens) and tokens[pos] != end:
            key = tokens[pos]
            if not key[0].isalpha():
                raise ValueError(f"expected a field name, got {key!r} at token {pos}")
            pos += 1
            if tokens[pos] == ":":
                pos += 1
            val = value()
            if key in fields:
                old = fields[key]
                fields[key] = (old if isinstance(old, list) else [old]) + (
                    val if isinstance(val, list) else [val])
            else:
                fields[key] = val
            if pos < len(tokens) and tokens[pos] in ",;":
                pos += 1
        if end is not None:
            if pos >= len(tokens):
                raise ValueError(f"missing {end!r}")
            pos += 1
        return fields

    try:
        result = message(None)
    except IndexError:
        raise ValueError("unexpected end of input") from None
    return result


def _triton_input_check(model: torch.jit.ScriptModule, name: str, n_inputs: int) -> Optional[str]:
    """Triton's ValidateInputs argument rules, for the self-check."""
    args = model.forward.schema.arguments[1:]  # without self
    kinds = [a.type.kind() for a in args]
    if kinds == ["DictType"]:
        return None
    if "DictType" in kinds[1:]:
        return ("Multiple inputs of kind DictType were detected. Only a single input of "
                "type Dict(str, Tensor) is supported.")
    for arg, kind in zip(args, kinds):
        if kind not in ("TensorType", "ListType"):
            return (f"An input of type '{arg.type.str()}' was detected in the model. Only a "
                    "single input of type Dict(str, Tensor) or input(s) of type Tensor are "
                    "supported.")
    if len(args) != n_inputs:
        return (f"unable to load model '{name}', configuration expects {n_inputs} inputs, "
                f"model provides {len(args)}")
    return None


def self_check(root: Path) -> None:
    """Check the repository built under `root` (AssertionError on the first claim that fails)."""
    root = Path(root)
    errors = expected_load_errors(root)

    def load(name: str, version: int = 1, filename: str = "model.pt") -> torch.jit.ScriptModule:
        return torch.jit.load(str(root / name / str(version) / filename))

    t = torch.tensor

    # Every config (but the broken one) is valid protobuf text; the JSON one is JSON.
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        pbtxt = model_dir / "config.pbtxt"
        if model_dir.name == "broken_pbtxt_syntax":
            try:
                _parse_pbtxt(pbtxt.read_text())
            except ValueError:
                continue
            raise AssertionError("broken_pbtxt_syntax parsed")
        if pbtxt.exists():
            parsed = _parse_pbtxt(pbtxt.read_text())
            assert parsed["name"] == model_dir.name, model_dir
        elif model_dir.name == "libtorch_json_config":
            assert json.loads((model_dir / "config.json").read_text())["name"] == model_dir.name
        else:
            assert model_dir.name == "broken_no_config", model_dir

    a = t([3, -2] * 8, dtype=torch.int8).reshape(1, 16)
    b = t([1, 5] * 8, dtype=torch.int8).reshape(1, 16)
    for name, dtype in [("libtorch_int8_int8_int8", torch.int8),
                        ("libtorch_int16_int16_int16", torch.int16),
                        ("libtorch_int32_int32_int32", torch.int32),
                        ("libtorch_float32_float32_float32", torch.float32),
                        ("libtorch_json_config", torch.int32)]:
        s, d = load(name)(a.to(dtype), b.to(dtype))
        assert torch.equal(s, (a + b).to(dtype)) and torch.equal(d, (a - b).to(dtype)), name
    total, _ = load("custom_filename", filename="weights.pt")(a.float(), b.float())
    assert torch.equal(total, (a + b).float())
    assert not (root / "custom_filename" / "1" / "model.pt").exists()

    x4 = t([[1.0, 2.0, 3.0, 4.0]])
    for name, versions in EXPECTED_READY.items():
        if name.startswith("versioned"):
            on_disk = sorted(int(p.name) for p in (root / name).iterdir() if p.name.isdigit())
            for v in on_disk:
                assert torch.equal(load(name, v)(x4), x4 * v), (name, v)
            assert max(on_disk) in versions
    assert (root / "versioned_numeric_order" / "notes").is_dir()

    p, q = t([[5.0, 1.0, 2.0, 0.0]]), t([[2.0, 4.0, 2.0, 3.0]])
    assert torch.equal(load("naming_forward_argument")(q, p), p - q)  # forward(b, a)
    for name in ("naming_named_index", "naming_strict", "naming_bad_suffix", "bad_output_index"):
        out = load(name)(p, q)
        assert len(out) == 2 and torch.equal(out[0], p - q) and torch.equal(out[1], p * q)
    assert torch.equal(load("dict_input")({"x": p, "y": q}), p * 2 + q)
    samples = [t([True, False]), t([0, 255], dtype=torch.uint8), t([-128, 127], dtype=torch.int8),
               t([-1, 2], dtype=torch.int16), t([-1, 2], dtype=torch.int32),
               t([-(2 ** 62), 2 ** 62], dtype=torch.int64), t([0.5, -1.0], dtype=torch.float16),
               t([0.5, -1.0]), t([0.5, -1.0], dtype=torch.float64)]
    for sent, got in zip(samples, load("all_dtypes")(*samples)):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    bf16 = t([1.5, -2.0], dtype=torch.bfloat16)
    assert torch.equal(load("identity_bf16")(bf16), bf16)

    for name in ("string_io", "string_batched"):
        texts, lengths = load(name)(["abc", "", "hello"])
        assert texts == ["cba", "", "olleh"] and lengths.tolist() == [3, 0, 5], name
        texts, lengths = load(name)([])
        assert texts == [] and lengths.dtype == torch.int64 and lengths.shape == (0,)

    empty = torch.zeros(0)
    assert load("identity_fp32")(empty).shape == (0,)
    shape, flat = load("reshape_model")(torch.arange(12.0).reshape(3, 4))
    assert shape.tolist() == [3, 4] and torch.equal(flat, torch.arange(12.0))
    assert load("reshape_batched")(torch.zeros(2, 3, 4)).tolist() == [[2, 3, 4]] * 2
    sizes, echo = load("batch_probe")(t([[1.0], [2.0], [3.0]]))
    assert sizes.tolist() == [[3]] * 3 and echo.tolist() == [[1.0], [2.0], [3.0]]

    params = load("params")
    one = t([1.0])
    with torch.inference_mode():
        assert [o.tolist() for o in params(one)] == [[True], [False]]
        inference_input = torch.ones(1)
    with torch.no_grad():
        assert [o.tolist() for o in params(one)] == [[False], [False]]
        assert [o.tolist() for o in params(inference_input)] == [[False], [False]]

    raiser = load("raise_on_negative")
    assert torch.equal(raiser(x4), x4)
    try:
        raiser(-x4)
        raise AssertionError("raise_on_negative did not raise")
    except torch.jit.Error as exc:
        assert "boom: input sum is negative" in str(exc)
    assert load("bad_output_dtype")(x4).dtype == torch.float32
    assert load("bad_scalar_output")(x4[0]).dim() == 0
    listed = load("bad_list_tensor_output")(x4[0])
    assert isinstance(listed, list) and len(listed) == 2
    # Triton's message is "received List[" + element type + "]".
    returned = load("bad_list_tensor_output").forward.schema.returns[0].type
    assert returned.kind() == "ListType" and returned.getElementType().str() == "Tensor"
    assert load("slow")(t([1000])).tolist() == [1000]

    accumulate = load("sequence_accumulate")
    state = torch.zeros(1, dtype=torch.int32)
    totals = []
    for value, start in [(1, 1), (2, 0), (3, 0), (7, 1)]:
        total, state = accumulate(t([value], dtype=torch.int32), t([start], dtype=torch.int32),
                                  state)
        totals.append(int(total))
    assert totals == [1, 3, 6, 7], totals
    sums = load("ragged_sum")(t([1.0, 2.0, 3.0, 10.0, 20.0]), t([2, 2, 5], dtype=torch.int32))
    assert sums.tolist() == [[3.0], [0.0], [33.0]], sums

    # Broken models: what can be seen without the server.
    assert not any((root / "broken_missing_file" / "1").iterdir())
    assert str(Path("broken_missing_file") / "1" / "model.pt") in errors["broken_missing_file"]
    for name, n_inputs in [("broken_arg_count", 2), ("broken_arg_type", 2),
                           ("broken_two_dicts", 1)]:
        assert _triton_input_check(load(name), name, n_inputs) == errors[name], name
    for name, n_inputs in [("naming_forward_argument", 2), ("dict_input", 2),
                           ("all_dtypes", 9), ("string_io", 1), ("ragged_sum", 2),
                           ("sequence_accumulate", 3)]:
        assert _triton_input_check(load(name), name, n_inputs) is None, name
    try:
        load("broken_corrupt_model")
        raise AssertionError("broken_corrupt_model loaded")
    except RuntimeError as exc:
        prefix = "failed to load model 'broken_corrupt_model': "
        assert errors["broken_corrupt_model"].startswith(prefix)
        assert str(exc).startswith(errors["broken_corrupt_model"][len(prefix):]), exc
    assert not any((root / "broken_no_config" / f).exists()
                   for f in ("config.pbtxt", "config.json"))
    assert _parse_pbtxt((root / "broken_bool_param" / "config.pbtxt").read_text())[
        "parameters"]["value"]["string_value"] == "maybe"
    string_2d = _parse_pbtxt((root / "broken_string_2d" / "config.pbtxt").read_text())
    assert string_2d["max_batch_size"] > 0 and len(string_2d["input"][0]["dims"]) == 1
    assert set(EXPECTED_READY) | set(errors) | {"gpu_instance"} == {
        p.name for p in root.iterdir() if p.is_dir()}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} DIR   (builds the test repository in DIR and checks it)",
              file=sys.stderr)
        return 2
    root = Path(argv[1]).resolve()
    start = time.perf_counter()
    build_test_repository(root)
    built = time.perf_counter() - start
    self_check(root)
    count = sum(1 for p in root.iterdir() if p.is_dir())
    print(f"built {count} models in {root} in {built:.2f} s; self-check passed "
          f"(slow: {slow_iterations(0.3)} iterations ~ 0.3 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
