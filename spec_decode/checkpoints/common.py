"""Shared pieces of the checkpoint readers and writers.

Parameter paths are T5X's, '/'-joined (e.g. 'encoder/layers_0/attention/query/kernel').
Readers describe each stored array as an `ArraySource` (shape, stored dtype and
a function reading any rectangular slice), so `materialize` can read each array
whole or, given shardings, one device shard at a time.

Non-finite values: `materialize` counts the NaN/Inf values of each array as it
is read (`count_nonfinite`: one reduction on the devices holding the array) and
refuses a parameter holding any, unless allow_nonfinite; writers refuse them the
same way (`check_finite`). A diverged fine-tune or a broken conversion otherwise
decodes silently into PAD tokens.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from spec_decode.models import t5
from spec_decode.tree_util import flatten

Index = tuple[slice, ...]
_MAX_LISTED = 8
_HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")
_log = logging.getLogger(__name__)


class CheckpointError(ValueError):
  """A checkpoint is missing, unreadable, corrupt, or does not fit the model."""


def expected_shapes(config: t5.T5Config) -> dict[str, tuple[int, ...]]:
  """{path: shape} of every parameter `T5(config)` has."""
  return {k: tuple(v.shape) for k, v in flatten(t5.T5(config).param_shapes()).items()}


def _listing(names) -> str:
  names = sorted(names)
  more = f" (and {len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
  return ", ".join(names[:_MAX_LISTED]) + more


def check_shapes(config: t5.T5Config, shapes: Mapping[str, tuple[int, ...]],
                 what: str = "checkpoint") -> None:
  """Raises CheckpointError naming every missing, unexpected or mis-shaped parameter."""
  want = expected_shapes(config)
  problems = []
  missing = want.keys() - shapes.keys()
  extra = shapes.keys() - want.keys()
  if missing:
    problems.append(f"missing parameters: {_listing(missing)}")
  if extra:
    problems.append(f"unexpected parameters: {_listing(extra)}")
  for name in sorted(want.keys() & shapes.keys()):
    if tuple(shapes[name]) != want[name]:
      problems.append(f"parameter {name} has shape {tuple(shapes[name])} but the config "
                      f"expects {want[name]}")
  if problems:
    raise CheckpointError(f"{what} does not match the T5 config: " + "; ".join(problems))


def resolve_dtype(dtype) -> np.dtype:
  """None -> bfloat16 on accelerators, float32 on CPU; else the dtype given."""
  if dtype is None:
    return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise CheckpointError(f"parameters must be loaded as a floating dtype, got {dtype}")
  return dtype


@dataclasses.dataclass(frozen=True)
class ArraySource:
  """One stored parameter in T5X orientation.

  read(index): the slice `index` (a tuple of slices, one per dimension) of the
  array, as a numpy array in the stored dtype.
  """
  name: str
  shape: tuple[int, ...]
  dtype: np.dtype
  read: Callable[[Index], np.ndarray]


def full_index(shape) -> Index:
  return tuple(slice(0, n) for n in shape)


def normalize_index(index, shape) -> Index:
  """jax's shard index (slices, possibly open-ended) -> explicit (start, stop) slices."""
  out = []
  for s, n in zip(index, shape):
    start, stop, step = s.indices(n)
    if step != 1:
      raise CheckpointError(f"strided shard index {index} is not supported")
    out.append(slice(start, stop))
  return tuple(out)


def _read_cast(src: ArraySource, index, dtype) -> np.ndarray:
  index = normalize_index(index, src.shape)
  data = np.asarray(src.read(index))
  want = tuple(s.stop - s.start for s in index)
  if data.shape != want:
    raise CheckpointError(f"parameter {src.name}: read a block of shape {data.shape} for "
                          f"index {index}, expected {want}")
  with np.errstate(over="ignore"):  # beyond the dtype's range: Inf, counted by the caller
    return data.astype(dtype, copy=False)


@jax.jit
def _device_nonfinite(x: jax.Array) -> jax.Array:
  # int32 counts every T5 parameter exactly (< 2**31 elements); a larger array is
  # counted in float32, where zero still means zero.
  return jnp.sum(~jnp.isfinite(x), dtype=jnp.int32 if x.size < 2**31 else jnp.float32)


def count_nonfinite(x) -> int:
  """The number of NaN and +-Inf values in array `x` (0 for non-float dtypes).

  One reduction, where the array lives: a jax.Array in device memory is reduced
  on its own devices (each one its shards; a sharded, even multi-process, array
  is never gathered, and every process gets the same count); an array in host
  memory (pinned_host) or a numpy array is counted on the host with numpy.
  """
  if not jnp.issubdtype(x.dtype, jnp.floating):  # bfloat16 and float8 included
    return 0
  if not isinstance(x, jax.Array):
    return int(np.count_nonzero(~np.isfinite(np.asarray(x))))
  if x.sharding.memory_kind not in _HOST_MEMORY_KINDS:
    return int(np.asarray(_device_nonfinite(x).addressable_data(0)))
  local = sum(int(np.count_nonzero(~np.isfinite(np.asarray(s.data))))
              for s in x.addressable_shards if s.replica_id == 0)
  if not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    local = int(np.sum(multihost_utils.process_allgather(np.int64(local))))
  return local


def nonfinite_error(name: str, count: int, size: int, where: str, action: str,
                    override: str) -> CheckpointError:
  """The one-line refusal of a parameter holding `count` non-finite values."""
  return CheckpointError(
      f"parameter {name} of {where} holds {count} non-finite values (NaN or Inf) of "
      f"{size}: a diverged training run or a broken conversion? Refusing to {action} it; "
      f"pass allow_nonfinite=True to {override} to {action} it anyway")


def check_finite(arrays: Mapping[str, Any], *, allow: bool, where: str, action: str = "load",
                 override: str = "checkpoints.load", log: bool = True) -> dict[str, int]:
  """{name: count} of the arrays holding NaN/Inf (empty when all are finite).

  Raises CheckpointError at the first such array unless `allow`; allowed ones
  are logged in one warning (unless not `log`). `where` names the checkpoint in
  messages; `action` and `override` say what is refused and where
  allow_nonfinite is passed.
  """
  found = {}
  for name, x in arrays.items():
    count = count_nonfinite(x)
    if count and not allow:
      raise nonfinite_error(name, count, int(np.size(x)), where, action, override)
    if count:
      found[name] = count
  if found and log:
    log_nonfinite(found, where)
  return found


def log_nonfinite(found: Mapping[str, int], where: str) -> None:
  _log.warning("%s: parameters holding non-finite values, kept (allow_nonfinite=True): %s",
               where, ", ".join(f"{n} ({c})" for n, c in sorted(found.items())))


def materialize(sources: Mapping[str, ArraySource], dtype, shardings=None, *,
                allow_nonfinite: bool = False, nonfinite: dict[str, int] | None = None,
                where: str = "the checkpoint") -> dict[str, jax.Array]:
  """Reads every source into a jax.Array of `dtype`.

  shardings: None (each array read whole onto the default device) or
  {path: jax.sharding.Sharding}; then each addressable device's block is read
  on its own (`jax.make_array_from_callback`): a process reads only the blocks
  its devices hold, and at most one parameter's blocks are on the host at once.
  Each array's NaN/Inf values are counted as soon as it is read (after the cast
  to `dtype`, so a value beyond the range of a narrower dtype counts too): a
  CheckpointError names the first parameter holding any, unless
  allow_nonfinite; the counts are then added to `nonfinite` (when given).
  `where` names the checkpoint in messages.
  """
  out, found = {}, {}
  for name, src in sources.items():
    out[name] = _read_array(src, dtype, None if shardings is None else shardings[name])
    found.update(check_finite({name: out[name]}, allow=allow_nonfinite, where=where, log=False))
  if found:
    log_nonfinite(found, where)
  if nonfinite is not None:
    nonfinite.update(found)
  return out


def _read_array(src: ArraySource, dtype, sharding) -> jax.Array:
  """One source as a jax.Array, whole on the default device or block by block."""
  if sharding is None:
    return jnp.asarray(_read_cast(src, full_index(src.shape), dtype))
  blocks: dict[tuple, np.ndarray] = {}  # replicas of a block are read once

  def read_block(index):
    index = normalize_index(index, src.shape)
    key = tuple((s.start, s.stop) for s in index)  # slices are unhashable before 3.12
    if key not in blocks:
      blocks[key] = _read_cast(src, index, dtype)
    return blocks[key]

  return jax.make_array_from_callback(src.shape, sharding, read_block)


def host_blocks(x) -> list[tuple[Index, np.ndarray]]:
  """(index, numpy block) pieces that together cover array `x` once.

  A sharded jax.Array gives its addressable shards with replica_id 0 (so a
  writer never gathers a whole sharded array on the host); anything else is
  one block.
  """
  if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
    return [(normalize_index(s.index, x.shape), np.asarray(s.data))
            for s in x.addressable_shards if s.replica_id == 0]
  x = np.asarray(x)
  return [(full_index(x.shape), x)]
