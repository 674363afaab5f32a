"""Nested-dict parameter trees <-> flat {'a/b/c': leaf} dicts (T5X-style paths)."""

from __future__ import annotations

from typing import Any, Callable, Mapping


def flatten(tree: Mapping[str, Any], is_leaf: Callable[[Any], bool] = lambda x: False,
            prefix: str = "") -> dict[str, Any]:
  """Nested dicts -> {'a/b/c': leaf}. Non-dict values (and `is_leaf` dicts) are leaves."""
  out = {}
  for key, value in tree.items():
    path = f"{prefix}{key}"
    if isinstance(value, Mapping) and not is_leaf(value):
      out.update(flatten(value, is_leaf, path + "/"))
    else:
      out[path] = value
  return out


def unflatten(flat: Mapping[str, Any]) -> dict:
  """{'a/b/c': leaf} -> nested dicts."""
  tree: dict = {}
  for path, value in flat.items():
    node = tree
    *parents, leaf = path.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return tree
