"""The classes a gin file may configure, registered where they are defined.

The library stays free of gin (its classes are plain frozen dataclasses): a class a
config file may build is marked where it is defined,

  @configurable.register
  @dataclasses.dataclass(frozen=True)
  class ExperimentConfig: ...

and the command lines' gin layer (`spec_decode.cli.gin`) makes every registered class
gin-configurable under its name (decoding plug-ins register through
`decoding.registry`). A config that a command line runs on its own (a training run)
has a `run` method and is registered with `runnable=True`.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import numpy as np

T = TypeVar("T", bound=type)

_CLASSES: dict[str, type] = {}
_RUNNABLE: set[str] = set()


def register(cls: T | None = None, *, name: str | None = None,
             runnable: bool = False) -> T | Callable[[T], T]:
  """Registers `cls` under `name` (default its class name); usable as a decorator."""

  def deco(c: T) -> T:
    key = name or c.__name__
    if key in _CLASSES and _CLASSES[key] is not c:
      raise ValueError(f"configurable name {key!r} is already registered to "
                       f"{_CLASSES[key].__module__}.{_CLASSES[key].__qualname__}")
    _CLASSES[key] = c
    if runnable:
      _RUNNABLE.add(key)
    return c
  return deco if cls is None else deco(cls)


def is_int(x) -> bool:
  """Whether a config value is a whole number: an int or a numpy integer, not a bool (and
  not a string: gin passes a quoted '5' through as one)."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def classes() -> dict[str, type]:
  """{name: class} of everything registered so far (in registration order)."""
  return dict(_CLASSES)


def runnable() -> dict[str, type]:
  """{name: class} of the registered configs a command line runs (`run` method)."""
  return {k: c for k, c in _CLASSES.items() if k in _RUNNABLE}
