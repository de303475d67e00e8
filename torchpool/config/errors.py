"""The errors of reading a model configuration, and the "did you mean" hint.

`ConfigError` is what callers see: its text names the file and the place
(`file:line:column` for the text format, a field path such as
`input[1].dims` for the JSON form and for Triton's rules). `FieldError` is
internal to validation: it carries the path, and `ModelConfig.from_json`
turns it into a `ConfigError` that also names the source and the model.
"""
from __future__ import annotations

import difflib
from typing import Iterable, NoReturn


class ConfigError(Exception):
    """A configuration that cannot be used; the message names file and place."""


class FieldError(Exception):
    """A problem at one field path; `from_json` adds the source and model."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message


def fail(path: str, message: str) -> NoReturn:
    raise FieldError(path, message)


def join_path(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest choice, or '' when none is close.

    Compared without case, so `Max_Batch_Size` still finds `max_batch_size`
    and `kind_cpu` finds `KIND_CPU`.
    """
    by_folded = {c.casefold(): c for c in choices}
    close = difflib.get_close_matches(word.casefold(), list(by_folded), n=1)
    return f" (did you mean '{by_folded[close[0]]}'?)" if close else ""


def unknown_field(name: str, message: str, known: Iterable[str]) -> str:
    """The one wording of an unknown field, for the text format and JSON alike."""
    return f"unknown field '{name}' in {message}{did_you_mean(name, known)}"


def unknown_enum_value(value: str, field: str, message: str, names: Iterable[str]) -> str:
    """The one wording of an unknown enum name; without a close match, the
    valid names (Triton's enums are short) so the user need not look them up."""
    names = [n for n in names]
    hint = did_you_mean(value, names) or f" (expected one of {', '.join(names)})"
    return f"unknown value '{value}' for field '{field}' in {message}{hint}"
