"""The JSON form of a configuration checked against the schema, field by field.

`conform_message` returns a copy with every value of the type its field
declares (protobuf's JSON rules: int64 may be a string, an enum a name or a
number, null means "not set"). A field or enum value Triton's model_config
does not have is an error naming the path, as `json_format.ParseDict` refuses
it in Triton; the text-format parser has already refused it with line and
column for a `config.pbtxt`, so here it concerns `config.json` and the
configuration a client sends with a load request.
"""
from __future__ import annotations

from typing import Union

from .errors import fail, join_path, unknown_field
from .jsonvalue import JSONObject, JSONValue
from .schema import (
    SCHEMA, FieldSpec, check_integer, enum_from_name, enum_from_number, map_entry_name, map_key,
)

__all__ = ["conform_message"]

# A field's scalar as conformed: an enum by its name.
Scalar = Union[bool, int, float, str]


def conform_message(d: object, message: str, path: str) -> JSONObject:
    """A checked copy of `d`, a JSON object of the schema message `message`."""
    if not isinstance(d, dict):
        fail(path, f"expected an object, got {d!r}")
    fields = SCHEMA[message]
    out: JSONObject = {}
    for name, value in d.items():
        spec = fields.get(name)
        if spec is None:
            fail(path, unknown_field(str(name), message, fields))
        if value is None:       # JSON null: protobuf reads it as "not set"
            continue
        out[name] = _conform_field(value, spec, join_path(path, name), name, message)
    return out


def _conform_field(value: object, spec: FieldSpec, path: str, name: str, message: str) -> JSONValue:
    if spec.kind == "map":
        return _conform_map(value, spec, path, name, message)
    if spec.repeated:
        items = value if isinstance(value, list) else [value]
        return [_conform_single(v, spec, f"{path}[{i}]", name, message) for i, v in enumerate(items)]
    if isinstance(value, list):
        fail(path, "is not a repeated field; a list is not allowed here")
    return _conform_single(value, spec, path, name, message)


def _conform_single(value: object, spec: FieldSpec, path: str, name: str, message: str) -> JSONValue:
    if spec.kind == "message":
        assert spec.message is not None     # the schema names the type of every message field
        return conform_message(value, spec.message, path)
    try:
        return json_scalar(spec, value, name, message)
    except ValueError as err:
        fail(path, str(err))


def _conform_map(value: object, spec: FieldSpec, path: str, name: str, message: str) -> JSONObject:
    """JSON form `{"K": V}`; a list of `{key, value}` entries is accepted too."""
    if isinstance(value, dict):
        entries = list(value.items())
    elif isinstance(value, list) and all(isinstance(e, dict) for e in value):
        for entry in value:
            extra = sorted(set(entry) - {"key", "value"})
            if extra:
                fail(path, unknown_field(extra[0], map_entry_name(message, name), ("key", "value")))
        entries = [(e.get("key", "" if spec.key == "string" else 0), e.get("value")) for e in value]
    else:
        fail(path, f"expected an object mapping keys to values, got {value!r}")
    value_spec = FieldSpec(spec.value, message=spec.message)
    out: JSONObject = {}
    for key, item in entries:
        try:
            key = map_key(spec.key, key)
        except ValueError as err:
            fail(path, str(err))
        if item is None:
            item = {} if spec.value == "message" else ("" if spec.value == "string" else 0)
        out[key] = _conform_single(item, value_spec, f"{path}[{key!r}]", name, message)
    return out


def json_scalar(spec: FieldSpec, value: object, name: str, message: str) -> Scalar:
    """One JSON scalar as the field's type (raises ValueError saying what was expected)."""
    kind = spec.kind
    if kind in ("int", "uint"):
        return check_integer(kind, _json_int(value))
    if kind == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"expected a number, got {value!r}")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise ValueError(f"expected true or false, got {value!r}")
    if kind == "string":
        if isinstance(value, str):
            return value
        raise ValueError(f"expected a string, got {value!r}")
    if isinstance(value, str):
        return enum_from_name(spec, value, name, message)
    if isinstance(value, int) and not isinstance(value, bool):
        return enum_from_number(spec, value, name, message)
    raise ValueError(f"expected an enum name, got {value!r}")


def _json_int(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip(), 10)
        except ValueError:
            pass
    raise ValueError(f"expected an integer, got {value!r}")
