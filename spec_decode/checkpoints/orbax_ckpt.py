"""T5X's Orbax checkpoint: checkpoint_<step>/state/ holding a PyTree checkpoint.

The state tree is {'target': params, 'state': {'step': ...}} (plus optimizer
slots in T5X's own checkpoints); `_METADATA` inside `state/` marks the format.
Only `target` is restored (orbax partial restore), each array straight into its
sharding when a mesh is given, cast by orbax to the requested dtype.
"""

from __future__ import annotations

import jax
import numpy as np
import orbax.checkpoint as ocp

from spec_decode.checkpoints import storage
from spec_decode.checkpoints.common import CheckpointError
from spec_decode.tree_util import flatten, unflatten

STATE_DIR = "state"
METADATA_FILE = "_METADATA"


def state_dir(path: str) -> str:
  """The orbax directory of a checkpoint_<step> dir (containing state/) or of state/ itself."""
  path = storage.normalize(path)
  for candidate in (path, storage.join(path, STATE_DIR)):
    if storage.is_file(storage.join(candidate, METADATA_FILE)):
      return candidate
  raise CheckpointError(f"not an Orbax checkpoint: no {METADATA_FILE} in {path} or "
                        f"{storage.join(path, STATE_DIR)}")


def _is_metadata_leaf(x) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def target_shapes(path: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """{T5X parameter path: (shape, stored dtype)} from the checkpoint's metadata alone."""
  directory = state_dir(path)
  try:
    meta = ocp.PyTreeCheckpointer().metadata(directory)
  except Exception as e:
    raise CheckpointError(f"cannot read the Orbax metadata of {directory}: {e}") from e
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
    raise CheckpointError(f"restoring the Orbax checkpoint {directory} failed: {e}") from e
  return flatten(restored["target"])


def write(path: str, params: dict, *, step: int) -> None:
  """Saves {'target': params, 'state': {'step': step}} to <path>/state/."""
  directory = storage.join(storage.normalize(path), STATE_DIR)
  state = {"target": params, "state": {"step": np.asarray(step, np.int32)}}
  ocp.PyTreeCheckpointer().save(directory, state)
