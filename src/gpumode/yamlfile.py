"""Operator YAML files read with errors that say where: the file, the key path, the problem.

:class:`Node` wraps each value with where it came from; its accessors check the type and raise
:class:`ConfigError` naming the exact key. The catalog (``modes/catalog.py``) and the whitelist
(``modes/policy.py``) are read with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from gpumode.errors import GpumodeError


class ConfigError(GpumodeError, ValueError):
    """A config file is unreadable or invalid; the message names the file, the key path and the problem."""

    def __init__(self, source: str, path: str, problem: str) -> None:
        self.source = source
        self.path = path
        self.problem = problem
        where = f"{source}: {path}" if path else source
        super().__init__(f"{where}: {problem}", code="bad_config")


class Node:
    """A value read from YAML together with where it came from, so every error can say exactly where."""

    def __init__(self, source: str, path: str, value: Any) -> None:
        self.source = source
        self.path = path
        self.value = value

    def error(self, problem: str) -> ConfigError:
        return ConfigError(self.source, self.path or "(top level)", problem)

    def _child_path(self, key: str | int) -> str:
        if isinstance(key, int):
            return f"{self.path}[{key}]"
        return f"{self.path}.{key}" if self.path else key

    def mapping(self, required: tuple[str, ...] = (), optional: tuple[str, ...] = ()) -> dict[str, Node]:
        """The value as a mapping with exactly these keys (unknown keys are an error, as are missing ones)."""
        if not isinstance(self.value, dict):
            raise self.error(f"expected a mapping, got {_kind(self.value)}")
        known = set(required) | set(optional)
        for key in self.value:
            if not isinstance(key, str):
                raise self.error(f"key {key!r} must be a string (quote it)")
            if key not in known:
                raise self.error(f"unknown key {key!r} (known: {', '.join(sorted(known))})")
        missing = [k for k in required if k not in self.value]
        if missing:
            raise self.error(f"missing key {missing[0]!r}")
        return {k: Node(self.source, self._child_path(k), v) for k, v in self.value.items()}

    def entries(self) -> Iterator[tuple[str, Node]]:
        """A mapping with free-form string keys (names chosen by the author), in file order."""
        if not isinstance(self.value, dict):
            raise self.error(f"expected a mapping, got {_kind(self.value)}")
        for key, value in self.value.items():
            if not isinstance(key, str):
                raise self.error(
                    f"key {key!r} must be a quoted string (YAML reads unquoted digits as a number)"
                )
            yield key, Node(self.source, self._child_path(key), value)

    def items(self) -> list[Node]:
        if not isinstance(self.value, list):
            raise self.error(f"expected a list, got {_kind(self.value)}")
        return [Node(self.source, self._child_path(i), v) for i, v in enumerate(self.value)]

    def text(self) -> str:
        if not isinstance(self.value, str) or not self.value.strip():
            raise self.error(f"expected a non-empty string, got {_kind(self.value)}")
        return self.value

    def integer(self, *, minimum: int = 0) -> int:
        if isinstance(self.value, bool) or not isinstance(self.value, int):
            raise self.error(f"expected an integer, got {_kind(self.value)}")
        if self.value < minimum:
            raise self.error(f"must be at least {minimum}, got {self.value}")
        return self.value

    def number(self) -> float:
        if isinstance(self.value, bool) or not isinstance(self.value, int | float) or self.value < 0:
            raise self.error(f"expected a non-negative number, got {self.value!r}")
        return float(self.value)

    def flag(self) -> bool:
        if not isinstance(self.value, bool):
            raise self.error(f"expected true or false, got {self.value!r}")
        return self.value

    def choice(self, choices: tuple[str, ...]) -> str:
        if self.value not in choices:
            raise self.error(f"expected one of {', '.join(choices)}, got {self.value!r}")
        return str(self.value)

    def str_list(self) -> tuple[str, ...]:
        return tuple(n.text() for n in self.items())


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, dict):
        return "a mapping"
    return "a list" if isinstance(value, list) else repr(value)


def read_text(path: str | Path | None, default_resource: str) -> tuple[str, str]:
    """The text of a config file (or the packaged default when ``path`` is None); returns (source, text)."""
    if path is None:
        source = f"gpumode/data/{default_resource}"
        return source, resources.files("gpumode").joinpath("data", default_resource).read_text()
    try:
        return str(path), Path(path).read_text()
    except OSError as exc:
        raise ConfigError(str(path), "", f"cannot read: {exc.strerror or exc}") from exc


def parse_yaml(source: str, text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, "", f"not valid YAML: {exc}") from exc


def read_yaml(path: str | Path | None, default_resource: str) -> tuple[str, Any]:
    """Parse a YAML file (or the packaged default when ``path`` is None); returns (source name, data)."""
    source, text = read_text(path, default_resource)
    return source, parse_yaml(source, text)
