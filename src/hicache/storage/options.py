"""Reading a backend's settings from its extra config (with environment fallbacks).

A backend's settings are a frozen pydantic dataclass (``@dataclass(frozen=True,
config=SETTINGS)``) whose fields use the types below; ``read_settings`` fills one.

Invariants:
- The extra config is user input (JSON, TOML or YAML): every value is checked, and
  every error is a ``StorageError`` that names the key (or the environment variable
  the value came from) and what to give instead. Validators raise ``ValueError``
  with the text after the key; pydantic's own messages never reach the user.
- A key the settings do not declare is an error (a typo such as ``max_byte`` would
  otherwise silently leave the default in place); a None value is as if absent.
- A field annotated ``FromEnv`` falls back to the first of its environment variables
  that is set and non-empty; the extra config wins.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    TypeAdapter,
    ValidationError,
)
from pydantic_core import PydanticUseDefault

from hicache.storage.base import StorageError

SETTINGS = ConfigDict(extra="forbid")
_UNKNOWN_KEY = "unexpected_keyword_argument"  # what extra="forbid" reports for a dataclass
# A size: a number, then k, m, g or t (powers of 1000; with "i", of 1024), then an optional
# b. pydantic's ByteSize reads it; alone it would also take True (1 byte), "1bit" (0) and
# "PB", and refuse the "Ki" and "Mi" these keys accept.
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i)?)?b?\s*$", re.IGNORECASE)
_BYTES = TypeAdapter(ByteSize)
T = TypeVar("T")


class FromEnv:
    """Field metadata: the environment variables the field falls back to, in order.

    ``parse`` reads a variable's text (another program's units, say). An error in
    the value names the variable, or the key if not ``name_variable``.
    """

    def __init__(self, *names: str, parse: Callable[[str], object] = str,
                 name_variable: bool = True) -> None:
        self.names, self.parse, self.name_variable = names, parse, name_variable


def read_settings(cls: type[T], extra: Mapping[str, Any], source: str) -> T:
    """``cls`` from ``extra`` and the environment; ``source`` ("redis storage") starts
    every error message."""
    fields = {f.alias or name: f for name, f in cls.__pydantic_fields__.items()}  # type: ignore[attr-defined]
    data = {key: value for key, value in extra.items() if value is not None or key not in fields}
    where = {key: f"{source}: {key}" for key in fields}
    for key, field in fields.items():
        env = next((m for m in field.metadata if isinstance(m, FromEnv)), None)
        if env is None or key in data:
            continue
        name = next((name for name in env.names if os.environ.get(name)), None)
        if name is None:
            continue
        variable = f"{source}: environment variable {name}"
        where[key] = variable if env.name_variable else where[key]
        try:
            data[key] = env.parse(os.environ[name])
        except ValueError as error:
            raise StorageError(f"{variable} {error}") from None
    try:
        return cls(**data)
    except ValidationError as error:
        problems = error.errors()
    unknown = sorted(str(p["loc"][0]) for p in problems if p["type"] == _UNKNOWN_KEY)
    if unknown:
        raise StorageError(f"{source}: unknown extra-config key(s) {', '.join(unknown)}; "
                           f"known keys: {', '.join(sorted(fields))}")
    problem = problems[0]  # the first in field order
    message = str(problem.get("ctx", {}).get("error", problem["msg"]))
    if not problem["loc"]:  # a check of the settings as a whole
        raise StorageError(f"{source}: {message}")
    raise StorageError(f"{where[str(problem['loc'][0])]} {message}")


def text(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"must be a string, got {value!r}")
    return value


def text_or_default(value: object) -> str:
    """A string; "" stands for the field's default."""
    if value == "":
        raise PydanticUseDefault()
    return text(value)


def parse_bool(value: object) -> bool:
    """A flag from a bool or a string ("true", "false", "1", "0"; any case, spaces around)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise ValueError(f"must be true or false, got {value!r}")


def parse_flag_or_auto(value: object) -> bool | None:
    """``parse_bool``'s values, or "auto" (and None): None, the backend decides."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    try:
        return parse_bool(value)
    except ValueError:
        raise ValueError(f"must be true, false or auto, got {value!r}") from None


def parse_size(value: object) -> int:
    """Bytes from an int or a size string ("16GB" = 16e9 B, "16GiB" = 16 * 2^30 B)."""
    if isinstance(value, bool):
        raise ValueError(f"must be a size in bytes, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"must be >= 0 bytes, got {value}")
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError("must be a size in bytes (an integer, or a string like '16GB' or "
                         f"'512MiB'), got {value!r}")
    digits, prefix, binary = match.groups()
    return int(_BYTES.validate_python(f"{digits}{prefix or ''}{'ib' if binary else 'b'}"))


def number(minimum: float = 0.0, whole: bool = False) -> BeforeValidator:
    """A number (not a bool) >= ``minimum``, as a float; ``whole``: a count, as an int."""
    def check(value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
            raise ValueError(f"must be a number >= {minimum}, got {value!r}")
        if whole and value != int(value):
            raise ValueError(f"must be a whole number, got {float(value)}")
        return int(value) if whole else float(value)
    return BeforeValidator(check)


def must(holds: Callable[[Any], bool], message: str) -> AfterValidator:
    """A check of the parsed value; ``message`` is formatted with it ("got {!r}")."""
    def check(value: T) -> T:
        if not holds(value):
            raise ValueError(message.format(value))
        return value
    return AfterValidator(check)


def _strip(value: str) -> str:
    return value.strip()


def _directory(value: object) -> Path:
    return value if isinstance(value, Path) else Path(text_or_default(value)).expanduser()


Text = Annotated[str, BeforeValidator(text)]
TextOrDefault = Annotated[str, BeforeValidator(text_or_default)]
# A string, spaces around it dropped ("" means the default).
Stripped = Annotated[TextOrDefault, AfterValidator(_strip)]
Flag = Annotated[bool, BeforeValidator(parse_bool)]
# True, false, or None for "auto" (the backend decides, its docstring says how).
FlagOrAuto = Annotated[bool | None, BeforeValidator(parse_flag_or_auto)]
Size = Annotated[int, BeforeValidator(parse_size)]
# A directory, "~" expanded ("" means the default; a Path is settings built in code).
Directory = Annotated[Path, BeforeValidator(_directory)]
