"""Registries of algorithms, drafters and verifiers, by name.

Each plug-in registers itself with one decorator line, which also registers it
as configurable (`spec_decode.configurable`: the command lines' gin layer makes it
gin-configurable under its class name); `get` builds one from its registered name
(e.g. in experiment configs).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from spec_decode import configurable

ALGORITHMS: dict[str, type] = {}
DRAFTERS: dict[str, type] = {}
VERIFIERS: dict[str, type] = {}
_KINDS = {"algorithm": ALGORITHMS, "drafter": DRAFTERS, "verifier": VERIFIERS}


def _register(kind: str, name: str) -> Callable[[type], type]:
  table = _KINDS[kind]

  def deco(cls: type) -> type:
    if name in table and table[name] is not cls:
      raise ValueError(f"{kind} name {name!r} is already registered to {table[name].__name__}")
    table[name] = cls
    cls.registered_name = name
    return configurable.register(cls)
  return deco


def algorithm(name: str) -> Callable[[type], type]:
  return _register("algorithm", name)


def drafter(name: str) -> Callable[[type], type]:
  return _register("drafter", name)


def verifier(name: str) -> Callable[[type], type]:
  return _register("verifier", name)


def get(kind: str, name: str, **kwargs) -> Any:
  """An instance of the `kind` ('algorithm', 'drafter', 'verifier') registered as `name`."""
  if kind not in _KINDS:
    raise ValueError(f"kind must be one of {sorted(_KINDS)}, got {kind!r}")
  table = _KINDS[kind]
  if name not in table:
    raise ValueError(f"unknown {kind} {name!r}; registered: {sorted(table)}")
  return table[name](**kwargs)


def all_classes() -> list[type]:
  """Every registered algorithm, drafter and verifier class."""
  return [cls for table in _KINDS.values() for cls in table.values()]


def describe(obj: Any) -> Any:
  """A JSON-able description of a registered plug-in (recursively): its name and fields."""
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    d = {"name": getattr(type(obj), "registered_name", type(obj).__name__)}
    d.update({f.name: describe(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
    return d
  if isinstance(obj, (list, tuple)):
    return [describe(x) for x in obj]
  return obj
