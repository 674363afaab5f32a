"""Checkpoints of draft heads, the networks over a frozen target's states (EAGLE, MTP, Medusa).

One format for every kind, T5X-style: a directory holding the head's parameters as a
T5X checkpoint (the project's writer, `t5x_legacy`: msgpack metadata and TensorStore
arrays, local or gs://) and `<kind>_config.json`, the head's config. A kind of head
registers itself from its network's module (`register`), so this module names none:

  head_checkpoints.save(path, head, params, step=0, dtype=None)
  head, params = head_checkpoints.load(path)               # the kind its config file names
  head, params = head_checkpoints.load(path, kind="eagle", dtype="bfloat16")

A head is any object with `config.to_json()` (a JSON dict) and `check_params(params)`;
its kind is looked up by its class. Medusa heads written before this format (a
directory with `medusa.json` and `params.msgpack`) still load, read-only.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from spec_decode import tree_util
from spec_decode.checkpoints import common, msgpack_codec, storage, t5x_legacy


@dataclasses.dataclass(frozen=True)
class HeadKind:
  """A registered kind of head.

  name: the kind (`ModelSpec.kind`); cls: the head's class; from_config(config JSON) ->
  head; what: how messages name it ('an EAGLE head'); dtype: the one dtype its parameters
  are stored and loaded in, or None (then the config's 'dtype' is the loading dtype).
  """
  name: str
  cls: type
  from_config: Callable[[dict], Any]
  what: str
  dtype: Any = None

  @property
  def config_file(self) -> str:
    return f"{self.name}_config.json"


_KINDS: dict[str, HeadKind] = {}


def register(name: str, cls: type, *, from_config: Callable[[dict], Any], what: str,
             dtype=None) -> None:
  """Makes heads of class `cls` savable and loadable as kind `name` (see `HeadKind`)."""
  if name in _KINDS and _KINDS[name].cls is not cls:
    raise ValueError(f"head kind {name!r} is already registered to {_KINDS[name].cls.__name__}")
  _KINDS[name] = HeadKind(name, cls, from_config, what,
                          None if dtype is None else jnp.dtype(dtype))


def _register_package_heads() -> None:
  """Imports `spec_decode.heads`, whose networks register their kinds, so that a reader
  finds the package's own kinds without importing the networks first. At call time, not
  at import: the networks import this module."""
  import importlib
  importlib.import_module("spec_decode.heads")


def kinds() -> tuple[str, ...]:
  """The registered kinds: the package's own (`spec_decode.heads`) and any a user's module
  registered (a network's module registers its kind when it is imported)."""
  _register_package_heads()
  return tuple(sorted(_KINDS))


def kind_of(head) -> HeadKind:
  for kind in _KINDS.values():
    if type(head) is kind.cls:
      return kind
  raise ValueError(f"{type(head).__name__} is no registered kind of head; registered: "
                   f"{kinds()}")


# What a head was trained on, beside its config: {"target_checkpoint": the path as given,
# "target_fingerprint": `storage.fingerprint` of it}; read by `trained_for`.
TRAINED_FOR = "trained_for.json"


def trained_for(path) -> dict | None:
  """The target a head checkpoint records it was trained on (`save(trained_for=)`), or None
  when it records none (a head saved without it, a legacy Medusa directory)."""
  raw = storage.read_bytes(storage.join(storage.normalize(path), TRAINED_FOR))
  if raw is None:
    return None
  try:
    out = json.loads(raw)
  except ValueError as e:
    raise ValueError(f"corrupt {TRAINED_FOR} in {path}: {e}") from e
  if not isinstance(out, dict):
    raise ValueError(f"corrupt {TRAINED_FOR} in {path}: expected a JSON object")
  return out


def save(path, head, params, *, step: int = 0, dtype=None,
         trained_for: dict | None = None) -> None:
  """Writes the head into the new or empty directory `path`; dtype (e.g. 'bfloat16') casts
  the stored arrays (a kind with one dtype keeps its own). trained_for: what the head was
  trained on (see TRAINED_FOR), so that a run pairing it with another target can say so."""
  kind = kind_of(head)
  head.check_params(params)
  path = storage.normalize(path)
  storage.check_empty_target(path)
  stored = kind.dtype or jnp.dtype(dtype or head.config.dtype)
  flat = {k: np.asarray(v).astype(stored)
          for k, v in tree_util.flatten(jax.device_get(params)).items()}
  t5x_legacy.write(path, flat, step=step)
  config = head.config.to_json()
  if kind.dtype is None and dtype is not None:
    config["dtype"] = jnp.dtype(dtype).name
  storage.write_bytes(storage.join(path, kind.config_file),
                      json.dumps(config, indent=1).encode())
  if trained_for is not None:
    storage.write_bytes(storage.join(path, TRAINED_FOR),
                        json.dumps(dict(trained_for), indent=1).encode())


def load(path, *, kind: str | None = None, dtype=None) -> tuple[Any, dict]:
  """(head, params) from a directory `save` wrote (or a legacy Medusa directory).

  kind: the expected kind (None: the one whose config file the directory holds). dtype:
  the parameters' dtype (None: float32 on CPU, bfloat16 on accelerators), for kinds
  without a dtype of their own.
  """
  _register_package_heads()
  if kind is not None and kind not in _KINDS:
    raise ValueError(f"unknown kind of head {kind!r}; registered: {kinds()}")
  path = storage.normalize(path)
  candidates = [_KINDS[kind]] if kind is not None else list(_KINDS.values())
  for k in candidates:
    raw = storage.read_bytes(storage.join(path, k.config_file))
    if raw is not None:
      break
  else:
    if kind in (None, "medusa") and storage.read_bytes(
        storage.join(path, LEGACY_MEDUSA_CONFIG)) is not None:
      return _load_legacy_medusa(path)
    if kind is not None:
      raise ValueError(f"{path} is not {_KINDS[kind].what} checkpoint: no "
                       f"{_KINDS[kind].config_file}")
    raise ValueError(f"{path} is not a head checkpoint: none of "
                     f"{[c.config_file for c in candidates]}")
  try:
    config = json.loads(raw)
  except ValueError as e:
    raise ValueError(f"corrupt {k.config_file} in {path}: {e}") from e
  load_dtype = k.dtype or common.resolve_dtype(dtype)
  if k.dtype is None:
    config = dict(config, dtype=jnp.dtype(load_dtype).name)
  head = k.from_config(config)
  params = tree_util.unflatten(common.materialize(t5x_legacy.open_arrays(path), load_dtype))
  head.check_params(params)
  return head, params


# ---------------------------------------------------------------------- legacy Medusa files
LEGACY_MEDUSA_CONFIG = "medusa.json"
LEGACY_MEDUSA_PARAMS = "params.msgpack"


def _load_legacy_medusa(path: str) -> tuple[Any, dict]:
  """(heads, float32 params) of a Medusa directory written before the one format:
  `medusa.json` ({"format": "spec_decode.medusa", "config": ...}) and `params.msgpack`
  (the project's msgpack codec). A missing, partial or corrupt directory is a clear error."""
  kind = _KINDS["medusa"]
  cfg_path = os.path.join(path, LEGACY_MEDUSA_CONFIG)
  params_path = os.path.join(path, LEGACY_MEDUSA_PARAMS)
  if not os.path.isfile(params_path):
    raise ValueError(f"partial Medusa heads at {path}: {LEGACY_MEDUSA_PARAMS} is missing")
  try:
    with open(cfg_path, encoding="utf-8") as f:
      heads = kind.from_config(json.load(f)["config"])
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"corrupt {cfg_path}: {e}") from e
  try:
    with open(params_path, "rb") as f:
      arrays = msgpack_codec.decode(f.read())
  except Exception as e:  # msgpack raises several types on truncated data
    raise ValueError(f"corrupt {params_path}: {type(e).__name__}: {e}") from e
  if not isinstance(arrays, dict):
    raise ValueError(f"corrupt {params_path}: expected a dict of arrays, got "
                     f"{type(arrays).__name__}")
  params = {k: jnp.asarray(v, kind.dtype or jnp.float32) for k, v in arrays.items()}
  try:
    heads.check_params(params)
  except ValueError as e:
    raise ValueError(f"corrupt {params_path}: array names or shapes do not fit "
                     f"{heads.config} ({e})") from e
  return heads, params
