"""T5X's Orbax checkpoint: checkpoint_<step>/state/ holding a PyTree checkpoint.

The state tree is {'target': params, 'state': {'step': ...}} (plus optimizer
slots in T5X's own checkpoints); `_METADATA` inside `state/` marks the format.
Only `target` is restored (orbax partial restore), each array straight into its
sharding when a mesh is given, cast by orbax to the requested dtype.

Before orbax opens anything, `check_layout` reads the files orbax needs and
names what is wrong and where: a corrupt `_METADATA` (or `_sharding`), an
OCDBT store without its manifest or data directory (`manifest.ocdbt`, `d/`,
`ocdbt.process_<i>/`), a parameter whose array directory is missing (checkpoints
written without OCDBT), or a symbolic link leading outside the checkpoint.
Errors orbax or TensorStore still raise are cut to their first line, naming the
parameter.
"""

from __future__ import annotations

import json
import os
import re

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from spec_decode.checkpoints import storage
from spec_decode.checkpoints.common import CheckpointError
from spec_decode.tree_util import flatten, unflatten

STATE_DIR = "state"
METADATA_FILE = "_METADATA"
SHARDING_FILE = "_sharding"
OCDBT_MANIFEST = "manifest.ocdbt"
OCDBT_DATA_DIR = "d"
MAX_METADATA_BYTES = 1 << 30
_STATUS = re.compile(r"\b(NOT_FOUND|FAILED_PRECONDITION|DATA_LOSS|INVALID_ARGUMENT|"
                     r"OUT_OF_RANGE|PERMISSION_DENIED|UNKNOWN|INTERNAL|UNAVAILABLE):")
_TS_KEY = re.compile(r'"((?:target|state)\.[^"/]+)(?:/[^"]*)?"')


def state_dir(path: str) -> str:
  """The orbax directory of a checkpoint_<step> dir (containing state/) or of state/ itself."""
  path = storage.normalize(path)
  for candidate in (path, storage.join(path, STATE_DIR)):
    if storage.is_file(storage.join(candidate, METADATA_FILE)):
      return candidate
  raise CheckpointError(f"not an Orbax checkpoint: no {METADATA_FILE} in {path} or "
                        f"{storage.join(path, STATE_DIR)}")


def _read_json(file: str, directory: str) -> object:
  what = f"Orbax checkpoint {directory}: {os.path.basename(file)}"
  data = storage.read_bytes(file)
  if data is None:
    raise CheckpointError(f"{what} is missing ({file})")
  if not data.strip():
    raise CheckpointError(f"{what} is empty ({file}): corrupt checkpoint")
  if len(data) > MAX_METADATA_BYTES:
    raise CheckpointError(f"{what} is {len(data)} bytes ({file}), far more than any checkpoint's")
  try:
    return json.loads(data.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{what} is corrupt, not valid JSON ({file}: {e})") from None
  except RecursionError:
    raise CheckpointError(f"{what} is corrupt, nested too deeply ({file})") from None


def _tree_names(metadata: dict) -> list[tuple[str, ...]]:
  """The key paths of the arrays `_METADATA` lists (tree_metadata[...]['key_metadata'])."""
  names = []
  for entry in (metadata.get("tree_metadata") or {}).values():
    keys = entry.get("key_metadata") if isinstance(entry, dict) else None
    if isinstance(keys, list) and all(isinstance(k, dict) and "key" in k for k in keys):
      names.append(tuple(str(k["key"]) for k in keys))
  return names


def check_layout(directory: str, base: str, *, allow_outside_paths: bool = False) -> None:
  """Refuses, with what is wrong and where, a state/ directory orbax could not read.

  base: the checkpoint's path as given (the state/ directory or its parent).
  """
  if directory != base:
    storage.check_inside(base, STATE_DIR, what=f"Orbax checkpoint {base}",
                         allow_outside=allow_outside_paths)
  metadata = _read_json(storage.join(directory, METADATA_FILE), directory)
  if not isinstance(metadata, dict) or not isinstance(metadata.get("tree_metadata", {}), dict):
    raise CheckpointError(f"Orbax checkpoint {directory}: {METADATA_FILE} is corrupt, not a "
                          "JSON object with a 'tree_metadata' map")
  if storage.is_file(storage.join(directory, SHARDING_FILE)):
    _read_json(storage.join(directory, SHARDING_FILE), directory)
  if storage.is_gcs(directory):
    return
  storage.check_links_inside(directory, directory, what=f"Orbax checkpoint {directory}",
                             allow_outside=allow_outside_paths)
  use_ocdbt = metadata.get("use_ocdbt")
  if use_ocdbt is None:  # not recorded by older orbax versions: look
    use_ocdbt = any(name == OCDBT_MANIFEST or name.startswith("ocdbt.process_")
                    for name in os.listdir(directory))
  if use_ocdbt:
    _check_ocdbt(directory)
    return
  for keys in _tree_names(metadata):
    if keys[0] == "target" and not os.path.isdir(os.path.join(directory, ".".join(keys))):
      raise CheckpointError(f"parameter {'/'.join(keys)} of Orbax checkpoint {directory}: its "
                            f"array directory {os.path.join(directory, '.'.join(keys))} is "
                            "missing (an incompletely copied checkpoint?)")


def _check_ocdbt(directory: str) -> None:
  """The OCDBT store's manifest and data directories, the root's and each process's."""
  def need(*parts: str, is_dir: bool) -> None:
    where = os.path.join(directory, *parts)
    if not (os.path.isdir(where) if is_dir else os.path.isfile(where)):
      raise CheckpointError(f"Orbax checkpoint {directory}: {where} is missing; the arrays' "
                            "OCDBT store is incomplete (an incompletely copied checkpoint?)")

  need(OCDBT_MANIFEST, is_dir=False)
  need(OCDBT_DATA_DIR, is_dir=True)
  processes = {m.group(1) for name in os.listdir(directory)
               if (m := re.fullmatch(r"ocdbt\.process_(\d+)", name))}
  listed = os.path.join(directory, "array_metadatas")  # one file per writing process
  if os.path.isdir(listed):
    processes |= {m.group(1) for name in os.listdir(listed)
                  if (m := re.fullmatch(r"process_(\d+)", name))}
  for i in sorted(processes, key=int):
    need(f"ocdbt.process_{i}", OCDBT_MANIFEST, is_dir=False)
    need(f"ocdbt.process_{i}", OCDBT_DATA_DIR, is_dir=True)


def _reason(error: BaseException) -> str:
  """The first line of the innermost TensorStore status in an orbax error chain."""
  chain, seen = [], set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    chain.append(error)
    error = error.__cause__ or error.__context__
  for e in reversed(chain):
    text = str(e)
    if m := _STATUS.search(text):
      return text[m.start():].split("\n")[0].split(" [tensorstore_spec=")[0][:500]
  return f"{type(chain[-1]).__name__}: " + str(chain[-1]).split("\n")[0][:500]


def _failure(directory: str, doing: str, error: BaseException) -> CheckpointError:
  reason = _reason(error)
  key = _TS_KEY.search(reason)
  subject = (f"parameter {key.group(1).replace('.', '/')} of Orbax checkpoint {directory}"
             if key else f"Orbax checkpoint {directory}")
  return CheckpointError(f"{subject}: {doing} failed (a missing, truncated or corrupt file "
                         f"in the checkpoint?): {reason}")


def _is_metadata_leaf(x) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def target_shapes(path: str, *, allow_outside_paths: bool = False
                  ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """{T5X parameter path: (shape, stored dtype)} from the checkpoint's metadata alone."""
  directory = state_dir(path)
  check_layout(directory, storage.normalize(path), allow_outside_paths=allow_outside_paths)
  handler = ocp.PyTreeCheckpointHandler()
  try:  # the handler raises what orbax's Checkpointer.metadata only logs
    meta = handler.metadata(epath.Path(directory))
  except Exception as e:
    raise _failure(directory, "reading the arrays' metadata", e) from e
  finally:
    handler.close()
  tree = getattr(meta, "item_metadata", meta)
  tree = getattr(tree, "tree", tree)
  if not isinstance(tree, dict) or not isinstance(tree.get("target"), dict):
    keys = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
    raise CheckpointError(f"Orbax checkpoint {directory} has no 'target' tree (found {keys})")
  out = {}
  for name, leaf in flatten(tree["target"], is_leaf=_is_metadata_leaf).items():
    if not _is_metadata_leaf(leaf):
      raise CheckpointError(f"parameter target/{name} in {directory} is not an array")
    out[name] = (tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype))
  return out


def restore(path: str, names, dtype, shardings=None) -> dict[str, jax.Array]:
  """Reads target/<name> for each name into `shardings[name]` (default: first device)."""
  directory = state_dir(path)
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  pick = (lambda n: default) if shardings is None else (lambda n: shardings[n])
  item = {"target": unflatten({n: 0 for n in names})}
  args = {"target": unflatten({n: ocp.ArrayRestoreArgs(sharding=pick(n), dtype=dtype)
                               for n in names})}
  try:
    restored = ocp.PyTreeCheckpointer().restore(
        directory, args=ocp.args.PyTreeRestore(item=item, restore_args=args,
                                               partial_restore=True))
  except Exception as e:
    raise _failure(directory, "restoring the parameters", e) from e
  return flatten(restored["target"])


def write(path: str, params: dict, *, step: int) -> None:
  """Saves {'target': params, 'state': {'step': step}} to <path>/state/."""
  directory = storage.join(storage.normalize(path), STATE_DIR)
  state = {"target": params, "state": {"step": np.asarray(step, np.int32)}}
  ocp.PyTreeCheckpointer().save(directory, state)
