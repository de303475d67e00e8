"""A parser for the protobuf text format, as Triton users write `config.pbtxt`.

    max_batch_size: 8
    input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
    parameters { key: "INFERENCE_MODE" value { string_value: "true" } }

`parse_pbtxt` returns the JSON form of the message (Triton's field names,
lists for repeated fields, `{key: value}` for maps, enum names as strings).
The text format itself cannot tell a repeated field written once from a
singular one, nor a map from a repeated message, so the parser follows the
model_config schema (`schema.SCHEMA`): `input { ... }` written once is
still a list, and `parameters { key: "K" value { ... } }` becomes
`{"K": {...}}`.

The parser is strict, as Triton's is: a field the message does not have, at
any depth, or an enum value its enum does not have, is an error at that
token, with the closest valid name when there is one:

    config.pbtxt:3:1: unknown field 'max_batch_sz' in ModelConfig (did you mean 'max_batch_size'?)

Why our own parser and not protobuf's `text_format.Parse` into the shipped
`model_config_pb2`: protobuf stops with 'Message type "inference.ModelConfig"
has no field named "max_batch_sz"' and no hint, so its messages would have
to be taken apart again to add one; its result is a message that has to be
turned back into this JSON form (int64 as strings, defaults dropped) for the
rest of torchpool; and the broker and the workers, which read
configurations, would import the gRPC gateway's generated modules. This
parser already had line:column for every token and the schema, so
strictness was a few lines here.

Errors raise `ConfigError("file:line:column: message")`, line and column
counted from 1 and pointing at the offending token.

Grammar accepted (protobuf's, plus nothing surprising):
    message := { field [ "," | ";" ] }
    field   := NAME ( ":" scalar | [":"] "{" message "}" | [":"] "<" message ">"
                    | [":"] "[" [ value { "," value } ] "]" )
    scalar  := STRING { STRING } | [ "-" ] NUMBER | [ "-" ] IDENT
"""
from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass
from typing import Mapping, NoReturn, Optional, Union, cast

from .errors import ConfigError, unknown_field
from .jsonvalue import JSONObject, JSONValue
from .schema import (
    ROOT_MESSAGE, SCHEMA, FieldSpec, check_integer, enum_from_name, enum_from_number,
    map_entry_fields, map_entry_name, map_key,
)

__all__ = ["parse_pbtxt"]


# --------------------------------------------------------------------------
# Tokens
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Token:
    kind: str           # "ident" | "string" | "int" | "float" | "symbol" | "eof"
    text: str           # the source text (for messages)
    value: Union[str, int, float, None]     # str for ident / string / symbol (an ident's or a
                                            # symbol's is its text), int, float; None at eof
    line: int
    column: int

    def describe(self) -> str:
        return "end of input" if self.kind == "eof" else f"'{self.text}'"


_SPACE = re.compile(r"(?:[ \t\r\n\f\v]+|#[^\n]*)+")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBER = re.compile(
    r"0[xX][0-9A-Fa-f]+"
    r"|(?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)(?:[eE][+-]?[0-9]+)?[fF]?"
)
_NUMBER_TAIL = re.compile(r"[A-Za-z0-9_.]")
_SYMBOLS = "{}[]<>:,;-"
_OCTAL_ESCAPE = re.compile(r"[0-7]{1,3}")
_HEX_ESCAPE = re.compile(r"[0-9A-Fa-f]{1,2}")
_UNICODE_ESCAPE = {"u": re.compile(r"[0-9A-Fa-f]{4}"), "U": re.compile(r"[0-9A-Fa-f]{8}")}
_SIMPLE_ESCAPES = {
    "a": 7, "b": 8, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11,
    "\\": 92, "'": 39, '"': 34, "?": 63,
}


class _Lexer:
    """Turns text into tokens, keeping line and column for every one."""

    def __init__(self, text: str, filename: str) -> None:
        self.text = text
        self.filename = filename
        self.pos = 0
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", text)]

    def error(self, pos: int, message: str) -> NoReturn:
        line, column = self.where(pos)
        raise ConfigError(f"{self.filename}:{line}:{column}: {message}")

    def where(self, pos: int) -> tuple[int, int]:
        """1-based (line, column) of a character offset."""
        line = bisect.bisect_right(self.line_starts, pos) - 1
        return line + 1, pos - self.line_starts[line] + 1

    def tokens(self) -> list[Token]:
        out = []
        while True:
            space = _SPACE.match(self.text, self.pos)
            if space:
                self.pos = space.end()
            token = self._next()
            out.append(token)
            if token.kind == "eof":
                return out

    def _token(self, kind: str, start: int, value: Union[str, int, float, None]) -> Token:
        line, column = self.where(start)
        return Token(kind, self.text[start:self.pos], value, line, column)

    def _next(self) -> Token:
        start, text = self.pos, self.text
        if start >= len(text):
            return self._token("eof", start, None)
        char = text[start]
        if char in "\"'":
            return self._token("string", start, self._string(char))
        if char in _SYMBOLS:
            self.pos += 1
            return self._token("symbol", start, char)
        match = _IDENT.match(text, start)
        if match:
            self.pos = match.end()
            return self._token("ident", start, match.group())
        match = _NUMBER.match(text, start)
        if match:
            self.pos = match.end()
            if _NUMBER_TAIL.match(text, self.pos):
                end = self.pos
                while end < len(text) and _NUMBER_TAIL.match(text, end):
                    end += 1
                self.error(start, f"invalid number '{text[start:end]}'")
            kind, value = _number_value(match.group())
            return self._token(kind, start, value)
        self.error(start, f"unexpected character {char!r}")

    def _string(self, quote: str) -> str:
        """A quoted string with C escapes; escapes may produce raw bytes, so the
        result is assembled as bytes and must decode as UTF-8."""
        start, text = self.pos, self.text
        pos = start + 1
        out = bytearray()
        while True:
            if pos >= len(text) or text[pos] == "\n":
                self.error(start, "unterminated string")
            char = text[pos]
            if char == quote:
                self.pos = pos + 1
                break
            if char == "\\":
                pos = self._escape(pos, out)
            else:
                out += char.encode("utf-8", "surrogatepass")
                pos += 1
        try:
            return out.decode("utf-8")
        except UnicodeDecodeError:
            self.error(start, "string is not valid UTF-8")

    def _escape(self, pos: int, out: bytearray) -> int:
        """Decode the escape at `pos` (the backslash) into `out`; return the next position."""
        text = self.text
        char = text[pos + 1] if pos + 1 < len(text) else ""
        if char in _SIMPLE_ESCAPES:
            out.append(_SIMPLE_ESCAPES[char])
            return pos + 2
        octal = _OCTAL_ESCAPE.match(text, pos + 1)
        if octal:
            value = int(octal.group(), 8)
            if value > 255:
                self.error(pos, f"octal escape '\\{octal.group()}' is out of range")
            out.append(value)
            return octal.end()
        if char in ("x", "X"):
            digits = _HEX_ESCAPE.match(text, pos + 2)
            if not digits:
                self.error(pos, "'\\x' must be followed by hex digits")
            out.append(int(digits.group(), 16))
            return digits.end()
        if char in ("u", "U"):
            width = 4 if char == "u" else 8
            digits = _UNICODE_ESCAPE[char].match(text, pos + 2)
            if not digits or int(digits.group(), 16) > 0x10FFFF:
                self.error(pos, f"'\\{char}' must be followed by {width} hex digits of a code point")
            out += chr(int(digits.group(), 16)).encode("utf-8", "surrogatepass")
            return digits.end()
        self.error(pos, f"invalid escape sequence '\\{char}'")


def _number_value(text: str) -> tuple[str, Union[int, float]]:
    if text[:2] in ("0x", "0X"):
        return "int", int(text, 16)
    if re.fullmatch(r"[0-9]+", text):
        return "int", int(text)
    return "float", float(text.rstrip("fF"))


# --------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------

_TRUE = frozenset({"true", "True", "t"})
_FALSE = frozenset({"false", "False", "f"})
_FLOAT_WORDS = {"inf": math.inf, "infinity": math.inf, "nan": math.nan}
_CLOSERS = {"{": "}", "<": ">"}
_MAP_VALUE_DEFAULTS: dict[str, JSONValue] = {"string": "", "bool": False, "float": 0.0}   # else 0


# What the parser makes of a field's value: a JSON value, or a map entry's (key, value).
_Value = Union[JSONValue, tuple[str, JSONValue]]


@dataclass
class _Scalar:
    """A scalar as written: its token kind decides what a typed field accepts."""

    kind: str           # "ident" | "string" | "int" | "float"
    value: Union[str, int, float]
    token: Token        # where it starts, for errors
    text: str           # as written, for errors

    def describe(self) -> str:
        return f"'{self.text}'"


class _Parser:
    """Recursive descent over the token list, typed by the model_config schema."""

    def __init__(self, text: str, filename: str) -> None:
        self.filename = filename
        self.tokens = _Lexer(text, filename).tokens()
        self.index = 0

    # -- token access -------------------------------------------------------

    def peek(self) -> Token:
        return self.tokens[self.index]

    def advance(self) -> Token:
        token = self.tokens[self.index]
        if token.kind != "eof":
            self.index += 1
        return token

    def accept(self, symbol: str) -> bool:
        token = self.peek()
        if token.kind == "symbol" and token.value == symbol:
            self.index += 1
            return True
        return False

    def at(self, *symbols: str) -> bool:
        token = self.peek()
        return token.kind == "symbol" and token.value in symbols

    def error(self, token: Token, message: str) -> NoReturn:
        raise ConfigError(f"{self.filename}:{token.line}:{token.column}: {message}")

    # -- messages -------------------------------------------------------------

    def parse(self) -> JSONObject:
        return self.message_body(SCHEMA[ROOT_MESSAGE], ROOT_MESSAGE, opener=None)

    def message_body(self, fields: Mapping[str, FieldSpec], message: str,
                     opener: Optional[Token]) -> JSONObject:
        """Fields of `message` up to the closer matching `opener` (or end of input at top level)."""
        closer = _CLOSERS[opener.text] if opener else None
        result: JSONObject = {}
        while True:
            token = self.peek()
            if token.kind == "eof":
                if opener:
                    self.error(token, f"unexpected end of input: '{opener.value}' opened at "
                                      f"line {opener.line}, column {opener.column} is not closed")
                return result
            if closer and self.accept(closer):
                return result
            if token.kind != "ident":
                expected = f"a field name or '{closer}'" if closer else "a field name"
                self.error(token, f"expected {expected}, found {token.describe()}")
            self.advance()
            self.field(result, fields, message, token)
            if not self.accept(","):
                self.accept(";")

    def field(self, result: JSONObject, fields: Mapping[str, FieldSpec], message: str,
              name: Token) -> None:
        spec = fields.get(name.text)           # (an ident: its text is its value)
        if spec is None:
            self.error(name, unknown_field(name.text, message, fields))
        has_colon = self.accept(":")
        if self.at("["):
            values = self.list_value(spec, name, message)
            self.store(result, spec, name, values, is_list=True)
            return
        if self.at("{", "<"):
            value = self.message_value(spec, name, message)
        elif not has_colon:
            self.error(self.peek(), f"expected ':' after field '{name.value}', found {self.peek().describe()}")
        else:
            value = self.scalar_value(spec, name, message)
        self.store(result, spec, name, [value], is_list=False)

    def list_value(self, spec: FieldSpec, name: Token, message: str) -> list[_Value]:
        """`[a, b, c]` of scalars or of messages; no trailing comma, as protobuf."""
        self.advance()                  # "["
        values: list[_Value] = []
        if self.accept("]"):
            return values
        while True:
            if self.at("{", "<"):
                values.append(self.message_value(spec, name, message))
            else:
                values.append(self.scalar_value(spec, name, message))
            if self.accept("]"):
                return values
            if not self.accept(","):
                self.error(self.peek(), f"expected ',' or ']' in the list of '{name.value}', "
                                        f"found {self.peek().describe()}")

    def message_value(self, spec: FieldSpec, name: Token, message: str) -> _Value:
        opener = self.advance()
        if spec.scalar:
            self.error(opener, f"field '{name.value}' expects {_kind_words(spec)}, not a message")
        if spec.kind == "map":
            entry = self.message_body(map_entry_fields(spec), map_entry_name(message, name.text), opener)
            return self.map_entry(spec, entry, opener)
        assert spec.message is not None     # the schema names the type of every message field
        return self.message_body(SCHEMA[spec.message], spec.message, opener)

    def map_entry(self, spec: FieldSpec, entry: JSONObject, opener: Token) -> tuple[str, JSONValue]:
        key = entry.get("key", "" if spec.key == "string" else 0)
        default: JSONValue
        if spec.value == "message":
            default = {}
        else:
            default = _MAP_VALUE_DEFAULTS.get(spec.value, 0)
        try:
            if not isinstance(key, (str, int, float)):      # (a scalar: the entry's schema says so)
                raise ValueError(f"map key {key!r} is not a scalar")
            return map_key(spec.key, key), entry.get("value", default)
        except ValueError as err:
            self.error(opener, str(err))

    # -- scalars --------------------------------------------------------------

    def scalar_value(self, spec: FieldSpec, name: Token, message: str) -> JSONValue:
        scalar = self.scalar()
        if not spec.scalar:
            what = "a map entry" if spec.kind == "map" else "a message"
            self.error(scalar.token, f"field '{name.value}' expects {what} ('{{ ... }}'), "
                                     f"found {scalar.describe()}")
        try:
            return _typed(spec, scalar, name.text, message)
        except ValueError as err:
            self.error(scalar.token, str(err))

    def scalar(self) -> _Scalar:
        token = self.advance()
        if isinstance(token.value, str) and token.kind == "string":
            parts = [token.value]
            while self.peek().kind == "string":     # "abc" "def" is "abcdef"
                parts.append(str(self.advance().value))
            return _Scalar("string", "".join(parts), token, token.text)
        if token.kind == "symbol" and token.value == "-":
            return self.negative(token)
        if token.kind in ("int", "float", "ident") and token.value is not None:
            return _Scalar(token.kind, token.value, token, token.text)
        self.error(token, f"expected a value, found {token.describe()}")

    def negative(self, minus: Token) -> _Scalar:
        token = self.advance()
        if isinstance(token.value, (int, float)):      # an "int" or a "float" token
            return _Scalar(token.kind, -token.value, minus, "-" + token.text)
        if token.kind == "ident" and token.text.lower() in _FLOAT_WORDS:
            return _Scalar("float", -_FLOAT_WORDS[token.text.lower()], minus, "-" + token.text)
        self.error(token, f"expected a number after '-', found {token.describe()}")

    # -- storing --------------------------------------------------------------

    def store(self, result: JSONObject, spec: FieldSpec, name: Token,
              values: list[_Value], is_list: bool) -> None:
        key = name.text
        if spec.kind == "map":
            entries = result.setdefault(key, {})
            assert isinstance(entries, dict)                # (set here, for this field)
            entries.update(cast("list[tuple[str, JSONValue]]", values))   # later entries win, as protobuf
        elif spec.repeated:
            items = result.setdefault(key, [])
            assert isinstance(items, list)                  # (set here, for this field)
            items.extend(cast("list[JSONValue]", values))
        elif is_list:
            self.error(name, f"field '{key}' is not repeated; a list is not allowed")
        elif key in result:
            self.error(name, f"field '{key}' is specified more than once")
        else:
            result[key] = cast(JSONValue, values[0])     # (a map field's entries went above)


def _kind_words(spec: FieldSpec) -> str:
    return {"int": "an integer", "uint": "a non-negative integer", "float": "a number",
            "bool": "true or false", "string": "a quoted string",
            "enum": "an enum name"}[spec.kind]


def _typed(spec: FieldSpec, scalar: _Scalar, field: str, message: str) -> JSONValue:
    """The text format's rules for a typed scalar (raises ValueError with the
    whole message: a wrong type names the field, an unknown enum value the
    valid ones)."""
    kind, value = scalar.kind, scalar.value
    if spec.kind == "string" and kind == "string":
        return value
    if spec.kind == "enum":
        if kind == "ident":
            return enum_from_name(spec, scalar.token.text, field, message)
        if isinstance(value, int) and kind == "int":
            return enum_from_number(spec, value, field, message)
    if spec.kind in ("int", "uint") and isinstance(value, int) and kind == "int":
        try:
            return check_integer(spec.kind, value)
        except ValueError as err:
            raise ValueError(f"field '{field}': {err}") from None
    if spec.kind == "float":
        if kind in ("int", "float"):
            return float(value)
        if kind == "ident" and scalar.text.lower() in _FLOAT_WORDS:
            return _FLOAT_WORDS[scalar.text.lower()]
    if spec.kind == "bool":
        if kind == "ident" and scalar.text in _TRUE | _FALSE:
            return scalar.text in _TRUE
        if kind == "int" and value in (0, 1):
            return bool(value)
    raise ValueError(f"field '{field}': expected {_kind_words(spec)}, found {scalar.describe()}")


def parse_pbtxt(text: str, filename: str = "<string>") -> JSONObject:
    """Parse a `config.pbtxt` into the JSON form of Triton's ModelConfig.

    Raises `ConfigError("<filename>:<line>:<column>: <message>")`.
    """
    return _Parser(text, filename).parse()
