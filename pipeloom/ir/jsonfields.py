"""Strict reading of pipeloom's format-tagged JSON files (schedules, cost tables, plans): the format
tag, known keys, typed values.

Every check raises the caller's error class with a message naming the key and what was expected.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Literal, overload

from pipeloom.errors import PipeloomError, ScheduleFormatError, shown

__all__ = [
    "MISSING", "DuplicateKeyError", "check_format", "check_keys", "check_path", "check_text", "integer",
    "json_failure", "json_object", "number", "parse_object", "read_json_file", "read_text", "string", "strings",
    "unique_keys",
]

MISSING = object()
"""Default of the getters: the key is required."""


def check_text(text: object, *, what: str, error: type[PipeloomError] = ScheduleFormatError) -> str:
    """``text`` when it is a str; else ``error`` saying what was given (bytes: decode them first)."""
    if isinstance(text, str):
        return text
    if isinstance(text, (bytes, bytearray)):
        raise error(f"the {what} must be text (str), got {type(text).__name__}; decode it first "
                    "(data.decode('utf-8')), or give the file's path to the loader")
    raise error(f"the {what} must be text (str), got {shown(text)} ({type(text).__name__})")


def check_path(path: object, *, error: type[PipeloomError] = ScheduleFormatError) -> Path:
    """``path`` as a Path when it is a str or an os.PathLike; else ``error`` saying what was given."""
    if isinstance(path, str) or hasattr(path, "__fspath__"):
        return Path(path)
    raise error(f"expected a file path (a str or pathlib.Path), got {shown(path)} ({type(path).__name__})")


def read_text(path: str | Path) -> str:
    """The UTF-8 text of ``path`` (a leading byte-order mark is allowed); ScheduleFormatError
    naming the file when it cannot be read or is not UTF-8 (or when ``path`` is no path)."""
    path = check_path(path)
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise ScheduleFormatError(f"cannot read {path}: not UTF-8 text (byte {error.start})") from None
    except OSError as error:
        raise ScheduleFormatError(f"cannot read {path}: {error.strerror or error}") from None


def read_json_file(path: str | Path, error: type[PipeloomError]) -> str:
    """The UTF-8 text of ``path``; ``error`` naming the file when it cannot be read."""
    try:
        return read_text(path)
    except ScheduleFormatError as failure:
        raise error(str(failure)) from None


def json_object(text: str, *, fmt: str, keys: set[str], error: type[PipeloomError], what: str) -> dict:
    """The top-level object of ``text``: valid JSON, an object, ``"format": fmt``, only ``keys``."""
    document = parse_object(text, error=error, what=what)
    check_format(document, fmt=fmt, keys=keys, error=error, what=what)
    return document


class DuplicateKeyError(ValueError):
    """A JSON object naming one key twice (``json`` keeps the last without a word); ``args[0]`` is the key."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook`` that refuses a key given twice (:class:`DuplicateKeyError`)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key)
        out[key] = value
    return out


def json_failure(failure: BaseException) -> str:
    """Why ``json.loads`` failed, as a reader of the file can act on it: Python's limit on an integer's digits said as
    the number it is (its own text points at ``sys.set_int_max_str_digits``)."""
    if isinstance(failure, ValueError) and "int_max_str_digits" in str(failure):
        return f"a number of more than {sys.get_int_max_str_digits():,} digits, surely a typo"
    return str(failure)


def parse_object(text: str, *, error: type[PipeloomError], what: str, hint: str = "") -> dict:
    """``text`` parsed: valid JSON holding an object (``hint`` says what it should hold); UTF-8 bytes are
    read as json.loads reads them, anything else but a str is ``error``."""
    if not isinstance(text, (bytes, bytearray)):
        check_text(text, what=what, error=error)
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as failure:
        raise error(f"malformed JSON in the {what}: {json_failure(failure)}") from None
    if not isinstance(document, dict):
        raise error(f"a {what} must hold a JSON object{hint}, got {shown(document)}")
    return document


def check_format(document: dict, *, fmt: str, keys: set[str], error: type[PipeloomError], what: str) -> None:
    """``error`` unless ``document`` holds ``"format": fmt`` and only ``keys``."""
    if "format" not in document:
        other = ("; a file of num_ranks and tasks alone is a search problem: `pipeloom search --problem FILE`"
                 if fmt.startswith("pipeloom.schedule/") and {"num_ranks", "tasks"} <= set(document)
                 and "ranks" not in document else "")
        raise error(f"the {what} is missing key 'format'; expected \"format\": \"{fmt}\"{other}")
    if document["format"] != fmt:
        raise error(f"format {shown(document['format'])} is not supported; expected {fmt!r}")
    check_keys(document, keys, where=what, error=error)


def check_keys(entry: dict, keys: set[str], *, where: str, error: type[PipeloomError]) -> None:
    """``error`` listing the allowed keys when ``entry`` has others."""
    unknown = set(entry) - keys
    if unknown:
        raise error(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(keys)}")


def _get(entry: dict, key: str, default: Any, where: str, error: type[PipeloomError]) -> Any:
    if key in entry:
        return entry[key]
    if default is MISSING:
        raise error(f"{where}: missing key {key!r}")
    return default


@overload
def number(entry: dict, key: str, *, where: str, error: type[PipeloomError], default: Any = ...,
           minimum: float | None = ..., null: Literal[False] = ...) -> float: ...
@overload
def number(entry: dict, key: str, *, where: str, error: type[PipeloomError], default: Any = ...,
           minimum: float | None = ..., null: bool) -> float | None: ...
def number(entry: dict, key: str, *, where: str, error: type[PipeloomError], default: Any = MISSING,
           minimum: float | None = 0.0, null: bool = False) -> float | None:
    """A finite number >= ``minimum`` (None allowed when ``null``)."""
    value = _get(entry, key, default, where, error)
    if value is None and null:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        extra = " or null" if null else ""
        raise error(f"{where}.{key}: expected a finite number{extra}, got {shown(value)}")
    if minimum is not None and value < minimum:
        raise error(f"{where}.{key}: must be >= {minimum:g}, got {shown(value)}")
    return float(value)


def _finite(value: float) -> bool:
    """``math.isfinite`` that answers False for an integer too large for a float (``10**400`` in a
    file) instead of raising OverflowError."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def integer(entry: dict, key: str, *, where: str, error: type[PipeloomError], default: Any = MISSING,
            minimum: int = 1) -> int:
    """An integer >= ``minimum``."""
    value = _get(entry, key, default, where, error)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise error(f"{where}.{key}: expected an integer >= {minimum}, got {shown(value)}")
    return value


def string(entry: dict, key: str, *, where: str, error: type[PipeloomError], default: Any = MISSING) -> str:
    """A string."""
    value = _get(entry, key, default, where, error)
    if not isinstance(value, str):
        raise error(f"{where}.{key}: expected a string, got {shown(value)}")
    return value


def strings(entry: dict, key: str, *, where: str, error: type[PipeloomError], default: Any = MISSING
            ) -> tuple[str, ...]:
    """A list of strings, as a tuple."""
    value = _get(entry, key, default, where, error)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise error(f"{where}.{key}: expected a list of strings, got {shown(value)}")
    return tuple(value)
