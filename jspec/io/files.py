"""Checked reading of the JSON files jspec loads (config.json, safetensors indexes, run configs).

A damaged file is one error that names it and what is wrong (the line and column of invalid JSON, a
list where an object of settings belongs), never a bare `json.JSONDecodeError` or `AttributeError`.
"""

from __future__ import annotations

import json
import os

from jspec.errors import CheckpointError


def read_json_object(path: str, error: type[Exception] = CheckpointError) -> dict:
    """The JSON object (a dict) stored in `path`; `error` naming the file when it is not one."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except IsADirectoryError:
        raise error(f"{path} is a directory, expected a JSON file") from None
    if not raw.strip():
        raise error(f"{path} is empty (0 bytes of JSON): the file is damaged or was not fully written; "
                    "download or write it again")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{path} is not JSON text (invalid UTF-8 at byte {err.start}): the file is damaged or is "
                    "not a JSON file") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{path} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}") from None
    if not isinstance(value, dict):
        kind = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}.get(
            type(value), "null")
        raise error(f"{path} holds {kind} ({os.path.basename(path)} must hold a JSON object of settings, "
                    "{\"name\": value, ...})")
    return value
