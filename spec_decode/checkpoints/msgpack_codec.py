"""The msgpack encoding of T5X's `checkpoint` file (flax.serialization's wire format).

- numpy arrays: msgpack ExtType 1 whose payload is itself msgpack of
  (shape, dtype name, C-order bytes); numpy scalars: ExtType 3 with the same
  payload for a 0-d array; Python complex: ExtType 2 with (real, imag).
- Arrays too big for one msgpack object are stored as the dict
  {'__msgpack_chunked_array__': True, 'shape': {'0': d0, ...},
   'chunks': {'0': flat_part_0, ...}}, the flattened array cut into pieces.
- Tuples and lists are written as msgpack arrays; dict keys are strings.
"""

from __future__ import annotations

from typing import Any

import jax
import ml_dtypes
import msgpack
import numpy as np

EXT_NDARRAY = 1
EXT_COMPLEX = 2
EXT_NPSCALAR = 3
CHUNKED_KEY = "__msgpack_chunked_array__"
# msgpack caps one object at 2**31 - 1 bytes; larger inline arrays are chunked.
MAX_INLINE_BYTES = 2**30


def _dtype(name: str) -> np.dtype:
  try:
    return np.dtype(name)
  except TypeError:
    if hasattr(ml_dtypes, name):  # bfloat16, float8_*: numpy does not know their names
      return np.dtype(getattr(ml_dtypes, name))
    raise ValueError(f"unknown array dtype {name!r} in msgpack data") from None


def _array_payload(arr: np.ndarray) -> bytes:
  if arr.dtype.hasobject or arr.dtype.fields is not None:
    raise ValueError(f"cannot serialize arrays of dtype {arr.dtype}")
  return msgpack.packb((list(arr.shape), arr.dtype.name, arr.tobytes("C")), use_bin_type=True)


def _array_from_payload(data: bytes) -> np.ndarray:
  shape, name, buf = msgpack.unpackb(data, raw=True)
  name = name.decode() if isinstance(name, bytes) else name
  return np.frombuffer(buf, dtype=_dtype(name)).reshape(shape)


def _default(obj):
  if isinstance(obj, np.ndarray):
    return msgpack.ExtType(EXT_NDARRAY, _array_payload(obj))
  if isinstance(obj, np.generic):
    return msgpack.ExtType(EXT_NPSCALAR, _array_payload(np.asarray(obj)))
  if isinstance(obj, complex):
    return msgpack.ExtType(EXT_COMPLEX, msgpack.packb((obj.real, obj.imag)))
  if isinstance(obj, jax.Array):
    return _default(np.asarray(obj))
  raise TypeError(f"cannot msgpack-serialize {type(obj).__name__}")


def _ext_hook(code: int, data: bytes):
  if code == EXT_NDARRAY:
    return _array_from_payload(data)
  if code == EXT_NPSCALAR:
    return _array_from_payload(data)[()]
  if code == EXT_COMPLEX:
    real, imag = msgpack.unpackb(data)
    return complex(real, imag)
  return msgpack.ExtType(code, data)


def _chunk_large(tree, max_bytes: int):
  if isinstance(tree, dict):
    return {k: _chunk_large(v, max_bytes) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return [_chunk_large(v, max_bytes) for v in tree]
  if isinstance(tree, np.ndarray) and tree.nbytes > max_bytes:
    flat = tree.reshape(-1)
    step = max(1, max_bytes // tree.dtype.itemsize)
    parts = [flat[i:i + step] for i in range(0, flat.size, step)]
    return {CHUNKED_KEY: True,
            "shape": {str(i): int(d) for i, d in enumerate(tree.shape)},
            "chunks": {str(i): p for i, p in enumerate(parts)}}
  return tree


def _unchunk(tree):
  if isinstance(tree, dict):
    if tree.get(CHUNKED_KEY):
      shape = tuple(int(tree["shape"][str(i)]) for i in range(len(tree["shape"])))
      parts = [tree["chunks"][str(i)] for i in range(len(tree["chunks"]))]
      flat = np.concatenate(parts) if parts else np.zeros((0,))
      if flat.size != int(np.prod(shape)):
        raise ValueError(f"chunked array has {flat.size} elements, its shape {shape} needs "
                         f"{int(np.prod(shape))}")
      return flat.reshape(shape)
    return {k: _unchunk(v) for k, v in tree.items()}
  if isinstance(tree, list):
    return [_unchunk(v) for v in tree]
  return tree


def encode(tree: Any, max_inline_bytes: int = MAX_INLINE_BYTES) -> bytes:
  """Nested dicts/lists of Python scalars, strings and arrays -> msgpack bytes."""
  return msgpack.packb(_chunk_large(tree, max_inline_bytes), default=_default,
                       use_bin_type=True)


def decode(data: bytes) -> Any:
  """Inverse of `encode` (also reads files written by flax.serialization)."""
  tree = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
  return _unchunk(tree)
