"""Shared pieces of the checkpoint readers and writers.

Parameter paths are T5X's, '/'-joined (e.g. 'encoder/layers_0/attention/query/kernel').
Readers describe each stored array as an `ArraySource` (shape, stored dtype and
a function reading any rectangular slice), so `materialize` can read each array
whole or, given shardings, one device shard at a time.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from spec_decode.models import t5
from spec_decode.tree_util import flatten

Index = tuple[slice, ...]
_MAX_LISTED = 8


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
  return data.astype(dtype, copy=False)


def materialize(sources: Mapping[str, ArraySource], dtype, shardings=None) -> dict[str, jax.Array]:
  """Reads every source into a jax.Array of `dtype`.

  shardings: None (each array read whole onto the default device) or
  {path: jax.sharding.Sharding}; then each addressable device's block is read
  on its own (`jax.make_array_from_callback`): a process reads only the blocks
  its devices hold, and at most one parameter's blocks are on the host at once.
  """
  out = {}
  for name, src in sources.items():
    if shardings is None:
      out[name] = jnp.asarray(_read_cast(src, full_index(src.shape), dtype))
      continue
    blocks: dict[tuple, np.ndarray] = {}  # replicas of a block are read once

    def read_block(index, src=src, blocks=blocks):
      index = normalize_index(index, src.shape)
      key = tuple((s.start, s.stop) for s in index)  # slices are unhashable before 3.12
      if key not in blocks:
        blocks[key] = _read_cast(src, index, dtype)
      return blocks[key]

    out[name] = jax.make_array_from_callback(src.shape, shardings[name], read_block)
  return out


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
