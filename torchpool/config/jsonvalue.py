"""The JSON form of a configuration: what pbtxt.py and json.load give,
conform.py checks field by field against the schema, and normalize.py fills.

One recursive alias, not an unchecked type: a value's shape is the schema's, checked at
run time by `conform_message`, so readers narrow (or cast, where the schema
has already decided the type) before they use one.
"""
from __future__ import annotations

from typing import Union

JSONValue = Union[None, bool, int, float, str, list["JSONValue"], dict[str, "JSONValue"]]
JSONObject = dict[str, JSONValue]

__all__ = ["JSONObject", "JSONValue"]
