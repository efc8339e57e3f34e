"""Reading a backend's options from its extra config (with environment fallbacks).

The extra config is user input (JSON, TOML or YAML), so every value is
checked here and every error names the key and what to give instead. A key a
backend does not know is an error too: a typo such as ``max_byte`` would
otherwise silently leave the default in place.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Set
from typing import Any

from hicache.storage.base import StorageError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10, "ki": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20, "mi": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30, "gi": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40, "ti": 2**40,
}


class Options:
    """Typed access to one backend's extra config; ``source`` names it in errors."""

    def __init__(self, extra: Mapping[str, Any], source: str) -> None:
        self.extra = extra
        self.source = source

    def reject_unknown(self, known: Set[str]) -> None:
        unknown = sorted(set(self.extra) - set(known))
        if unknown:
            raise StorageError(
                f"{self.source}: unknown extra-config key(s) {', '.join(unknown)}; "
                f"known keys: {', '.join(sorted(known))}"
            )

    def _raw(self, key: str, env: tuple[str, ...] = ()) -> tuple[Any, str] | None:
        """The value and where it came from (the key, or an environment variable)."""
        if key in self.extra and self.extra[key] is not None:
            return self.extra[key], f"{self.source}: {key}"
        for name in env:
            value = os.environ.get(name)
            if value:
                return value, f"{self.source}: environment variable {name}"
        return None

    def where(self, key: str, env: tuple[str, ...] = ()) -> str:
        """Where ``key``'s value comes from, for an error found after reading it: the key,
        or the environment variable it fell back to."""
        found = self._raw(key, env)
        return f"{self.source}: {key}" if found is None else found[1]

    def string(self, key: str, default: str | None, env: tuple[str, ...] = ()) -> str | None:
        found = self._raw(key, env)
        if found is None:
            return default
        value, where = found
        if not isinstance(value, str):
            raise StorageError(f"{where} must be a string, got {value!r}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        found = self._raw(key)
        if found is None:
            return default
        value, where = found
        return parse_bool(value, where)

    def size_bytes(self, key: str, default: int, env: tuple[str, ...] = ()) -> int:
        """A byte count: an integer, or a string such as "16GB", "512MiB" (GB = 1e9 B)."""
        found = self._raw(key, env)
        if found is None:
            return default
        value, where = found
        return parse_size(value, where)

    def number(self, key: str, default: float, minimum: float = 0.0) -> float:
        found = self._raw(key)
        if found is None:
            return default
        value, where = found
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
            raise StorageError(f"{where} must be a number >= {minimum}, got {value!r}")
        return float(value)

    def whole_number(self, key: str, default: int, minimum: int = 0) -> int:
        """A count (connections, say): a number >= ``minimum`` with nothing after the point."""
        value = self.number(key, default, minimum)
        if value != int(value):
            raise StorageError(f"{self.source}: {key} must be a whole number, got {value}")
        return int(value)


def parse_bool(value: object, where: str) -> bool:
    """A flag from a bool or a string ("true", "false", "1", "0"; any case, spaces around)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise StorageError(f"{where} must be true or false, got {value!r}")


def parse_size(value: object, where: str) -> int:
    """Bytes from an int or a size string ("16GB" = 16e9 B, "16GiB" = 16 * 2^30 B)."""
    if isinstance(value, bool):
        raise StorageError(f"{where} must be a size in bytes, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise StorageError(f"{where} must be >= 0 bytes, got {value}")
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        unit = (match.group(2) or "").lower() if match else ""
        if match and unit in _UNITS:
            return int(float(match.group(1)) * _UNITS[unit])
    raise StorageError(
        f"{where} must be a size in bytes (an integer, or a string like '16GB' or '512MiB'), "
        f"got {value!r}"
    )
