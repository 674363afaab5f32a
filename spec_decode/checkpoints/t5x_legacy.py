"""T5X's legacy checkpoint: a msgpack `checkpoint` file plus TensorStore zarr arrays.

Layout of checkpoint_<step>/ (reference/t5x.md):
  checkpoint                  msgpack {'version': 3, 'optimizer': {'target': ...,
                              'state': {'step': ..., 'param_states': {...}}}};
                              version 0 holds that state dict directly.
  target.encoder.layers_0.attention.query.kernel/   zarr array (.zarray + chunks)
  ...
A leaf of the msgpack tree is either an inline array (possibly in the chunked
dict form) or a TensorStore spec whose kvstore path is *relative* to the
checkpoint directory. T5X writes, per array, `ts.Spec(...).to_json()` of
  {'driver': 'zarr', 'dtype': 'float32',
   'kvstore': {'driver': 'file', 'path': 'target.a.b/'},      # or gcs + dummy bucket
   'metadata': {'chunks': [...], 'compressor': {'id': 'gzip', 'level': 1},
                'shape': [...]}}
(older specs keep 'path' at the top level, without the trailing '/'). The
spec's driver records where it was written, not where it is now: a local
checkpoint directory is read with the file driver and a gs:// one with the gcs
driver, whatever the spec says. Only `target/...` is read; optimizer state is
never opened. A spec path that leads outside the checkpoint directory
(absolute, a URL, '..', or a symbolic link, the array directory's own entries
included) is refused unless allow_outside_paths. Chunk files absent from an
array's directory would be read as zeros, so they are an error unless
allow_missing_chunks (then a warning names each array and count); this
module's writer stores every chunk, zeros included, so its own checkpoints are
always complete.

The writer's layout is T5X's own (`write`), so T5X reads these directories:
`t5x.checkpoints.load_t5x_checkpoint`, and `Checkpointer.restore` for
inference, or for training with T5X's default Adafactor when the zero
Adafactor state is written (optimizer_state='adafactor'); see `write`.
"""

from __future__ import annotations

import copy
import logging
import math

import jax
import numpy as np
import tensorstore as ts

from spec_decode.checkpoints import msgpack_codec, storage, t5x_optimizer
from spec_decode.checkpoints.common import ArraySource, CheckpointError, check_finite, host_blocks
from spec_decode.tree_util import flatten, unflatten

VERSION = 3
CHECKPOINT_FILE = "checkpoint"
DUMMY_BUCKET = "t5x-dummy-bucket"  # T5X writes gcs specs with this bucket, fixed up on read
CHUNK_BYTES = 64 * 1024 * 1024  # T5X's target size of one zarr chunk
GZIP_LEVEL = 1  # TensorStore's zarr gzip default, which T5X's specs record
_KV_DRIVERS = ("file", "gfile", "gcs")
_log = logging.getLogger(__name__)


def locate(path: str, *, allow_outside_paths: bool = False) -> tuple[str, str]:
  """(checkpoint dir, msgpack file) for a checkpoint_<step> dir or the file inside it.

  A `checkpoint` file inside the directory that is a symbolic link leading
  outside it is refused unless allow_outside_paths.
  """
  path = storage.normalize(path)
  if storage.is_file(path):
    return storage.dirname(path), path
  file = storage.join(path, CHECKPOINT_FILE)
  if not storage.is_file(file):
    raise CheckpointError(f"not a T5X checkpoint: {file} does not exist")
  storage.check_inside(path, CHECKPOINT_FILE, what="the T5X checkpoint directory",
                       allow_outside=allow_outside_paths)
  return path, file


def is_ts_spec(x) -> bool:
  return isinstance(x, dict) and "driver" in x and ("kvstore" in x or "path" in x)


def resolve_spec(spec: dict, ckpt_dir: str, *, allow_outside_paths: bool = False) -> dict:
  """An openable TensorStore spec for a relative spec from a checkpoint in `ckpt_dir`.

  The kvstore is rebuilt from the checkpoint's location (file driver for a local
  directory, gcs with the real bucket for gs://); chunking and compressor
  metadata are dropped so the array opens with whatever it was written with.
  """
  spec = copy.deepcopy(spec)
  kv = spec.get("kvstore") or {}
  if not isinstance(kv, dict):
    raise CheckpointError(f"unsupported TensorStore kvstore {kv!r} (expected a dict)")
  if kv.get("driver") not in _KV_DRIVERS:
    raise CheckpointError(f"unsupported TensorStore kvstore driver {kv.get('driver')!r}; "
                          f"T5X checkpoints use one of {_KV_DRIVERS}")
  rel = kv.get("path", spec.get("path"))
  if not rel or not isinstance(rel, str):
    raise CheckpointError(f"TensorStore spec has no path: {spec}")
  storage.check_inside(ckpt_dir, rel, what="a TensorStore spec in the T5X msgpack",
                       allow_outside=allow_outside_paths)
  spec.pop("path", None)
  spec["kvstore"] = storage.kvstore_spec(storage.join(ckpt_dir, rel))
  spec.pop("metadata", None)
  spec.pop("dtype", None)
  return spec


def read_tree(path: str, *, allow_outside_paths: bool = False) -> tuple[str, dict]:
  """(checkpoint dir, decoded msgpack state dict) of a legacy checkpoint."""
  ckpt_dir, file = locate(path, allow_outside_paths=allow_outside_paths)
  raw = storage.read_bytes(file)
  if raw is None:
    raise CheckpointError(f"not a T5X checkpoint: cannot read {file}")
  if raw.startswith(b"model_checkpoint_path"):
    raise CheckpointError(f"{file} is a TensorFlow checkpoint index, not a T5X checkpoint; "
                          "convert it with T5X first")
  try:
    contents = msgpack_codec.decode(raw)
  except Exception as e:  # msgpack raises several unrelated types for bad data
    raise CheckpointError(f"{file} is not a readable msgpack checkpoint "
                          f"({type(e).__name__}: {e})") from e
  if not isinstance(contents, dict):
    raise CheckpointError(f"{file}: expected a msgpack map, got {type(contents).__name__}")
  version = contents.get("version", 0)
  state = contents if version == 0 else contents.get("optimizer")
  if not isinstance(state, dict) or not isinstance(state.get("target"), dict):
    keys = sorted(state) if isinstance(state, dict) else type(state).__name__
    raise CheckpointError(f"{file} (version {version}) has no 'target' parameter tree "
                          f"(found {keys})")
  return ckpt_dir, state


def _inline_source(name: str, arr) -> ArraySource:
  arr = np.asarray(arr)
  return ArraySource(name, tuple(arr.shape), arr.dtype, lambda index: arr[index])


def _ts_source(name: str, spec: dict, ckpt_dir: str, context: ts.Context, *,
               allow_missing_chunks: bool, allow_outside_paths: bool) -> ArraySource:
  full = f"target/{name}"
  resolved = resolve_spec(spec, ckpt_dir, allow_outside_paths=allow_outside_paths)
  where = resolved["kvstore"].get("path")
  if not storage.is_gcs(ckpt_dir):  # (a gcs kvstore path is a key in the bucket)
    storage.check_links_inside(ckpt_dir, where, what=f"parameter {full}'s array directory",
                               allow_outside=allow_outside_paths)
  try:
    store = storage.wait(ts.open(resolved, open=True, read=True, context=context), ckpt_dir,
                         f"opening {full} of")
  except CheckpointError:
    raise
  except Exception as e:
    raise CheckpointError(f"parameter {full}: cannot open its array at {where} "
                          f"(missing or corrupt zarr metadata): {e}") from e
  shape = tuple(int(d) for d in store.shape)
  meta_shape = (spec.get("metadata") or {}).get("shape")
  if meta_shape is not None and tuple(int(d) for d in meta_shape) != shape:
    raise CheckpointError(f"parameter {full}: the msgpack spec says shape "
                          f"{tuple(meta_shape)} but the array at {where} has shape {shape}")
  dtype = np.dtype(store.dtype.numpy_dtype)
  if not np.issubdtype(dtype, np.floating) and dtype.name != "bfloat16":
    raise CheckpointError(f"parameter {full}: stored as {dtype}, expected a float dtype "
                          "(T5X checkpoint versions < 3 stored bfloat16 as uint16)")

  _check_missing_chunks(full, store, resolved["kvstore"], allow=allow_missing_chunks)

  def read(index):
    try:
      return storage.wait(store[index].read(), ckpt_dir, f"reading {full} of")
    except CheckpointError:
      raise
    except Exception as e:
      raise CheckpointError(f"parameter {full}: reading {where} failed (truncated or "
                            f"corrupt chunk?): {e}") from e

  return ArraySource(name, shape, dtype, read)


def missing_chunks(store, kvstore: dict) -> tuple[int, int] | None:
  """(absent, expected) chunk files of an opened zarr array; None if it cannot be listed."""
  chunks = store.chunk_layout.write_chunk.shape
  expected = math.prod(-(-int(n) // int(c)) for n, c in zip(store.shape, chunks))
  try:
    directory = dict(kvstore, path=kvstore["path"].rstrip("/") + "/")
    keys = ts.KvStore.open(directory).result().list().result()
  except Exception:  # listing is advisory; the reads report real failures
    return None
  found = sum(1 for k in keys if not k.rsplit(b"/", 1)[-1].startswith(b"."))
  return max(expected - found, 0), expected


def _check_missing_chunks(name: str, store, kvstore: dict, *, allow: bool) -> None:
  """Absent chunk files read as zeros: an error (a partly copied checkpoint), unless allowed.

  TensorStore skips chunks equal to the fill value unless told otherwise, so a
  checkpoint written elsewhere may legitimately lack all-zero chunks: allow=True
  then reads them as zeros and logs a warning.
  """
  counts = missing_chunks(store, kvstore)
  if counts is None or counts[0] == 0:
    return
  absent, expected = counts
  if not allow:
    raise CheckpointError(
        f"parameter {name}: {absent} of {expected} chunk files are absent from "
        f"{kvstore.get('path')} and would be read as zeros (an incompletely copied "
        "checkpoint?); copy the checkpoint again, or pass allow_missing_chunks=True "
        "(ModelSpec.allow_missing_chunks) if those chunks are all zeros")
  _log.warning("parameter %s: %d of %d chunks are absent and read as zeros "
               "(allow_missing_chunks=True)", name, absent, expected)


def open_arrays(path: str, *, allow_missing_chunks: bool = False,
                allow_outside_paths: bool = False) -> dict[str, ArraySource]:
  """{T5X parameter path: ArraySource} for everything under `target`."""
  ckpt_dir, state = read_tree(path, allow_outside_paths=allow_outside_paths)
  context = ts.Context({"file_io_concurrency": {"limit": 64}})
  sources = {}
  for name, leaf in flatten(state["target"], is_leaf=is_ts_spec).items():
    if is_ts_spec(leaf):
      sources[name] = _ts_source(name, leaf, ckpt_dir, context,
                                 allow_missing_chunks=allow_missing_chunks,
                                 allow_outside_paths=allow_outside_paths)
    elif isinstance(leaf, (np.ndarray, np.generic)):
      sources[name] = _inline_source(name, leaf)
    else:
      raise CheckpointError(f"parameter target/{name}: unsupported msgpack leaf of type "
                            f"{type(leaf).__name__}")
  return sources


# ---------------------------------------------------------------- writing
def chunk_shape(shape, max_elements: int) -> list[int]:
  """A chunk shape dividing `shape` with at most `max_elements` elements.

  Repeatedly shrinks the currently largest dimension to its next smaller
  divisor (as T5X does), so chunks tile the array exactly.
  """
  current = [int(d) for d in shape]
  while math.prod(current) > max(1, max_elements):
    i = max(range(len(current)), key=lambda j: current[j])
    n = current[i]
    current[i] = max(d for d in range(1, n) if shape[i] % d == 0) if n > 1 else 1
  return current


def array_spec(name: str, shape, dtype, *, gcs: bool, chunk_bytes: int = CHUNK_BYTES) -> dict:
  """The relative spec T5X writes for array `name` (e.g. 'target/encoder/...').

  It is the normal form `ts.Spec(spec).to_json()` gives T5X's spec, which is
  what T5X's msgpack files hold: kvstore path with a trailing '/', the gzip
  level TensorStore writes with.
  """
  key = name.replace("/", ".") + "/"
  kv = {"driver": "gcs", "bucket": DUMMY_BUCKET, "path": key} if gcs else \
      {"driver": "file", "path": key}
  dtype = np.dtype(dtype)
  return {"driver": "zarr", "dtype": dtype.name, "kvstore": kv,
          "metadata": {"chunks": chunk_shape(shape, chunk_bytes // dtype.itemsize),
                       "compressor": {"id": "gzip", "level": GZIP_LEVEL},
                       "shape": [int(d) for d in shape]}}


def _write_array(path: str, name: str, value, context: ts.Context, *, gcs: bool,
                 chunk_bytes: int) -> dict:
  """Writes array `name` into checkpoint directory `path`; returns its relative spec."""
  spec = array_spec(name, value.shape, value.dtype, gcs=gcs, chunk_bytes=chunk_bytes)
  # Every chunk is stored, all-zero ones included, so a reader can tell a
  # complete checkpoint from a partly copied one.
  target = dict(spec, kvstore=storage.kvstore_spec(storage.join(path, spec["kvstore"]["path"])),
                store_data_equal_to_fill_value=True)
  store = ts.open(target, create=True, delete_existing=True, context=context).result()
  for index, block in host_blocks(value):
    store[index].write(block).result()
  return spec


def _param_states(path: str, flat_params: dict, optimizer_state: str | None,
                  context: ts.Context, *, gcs: bool, chunk_bytes: int) -> dict:
  """The msgpack `param_states` of `optimizer_state`, writing its TensorStore slots."""
  shapes = {name: tuple(np.shape(v)) for name, v in flat_params.items()}
  states = {}
  for name, slots in t5x_optimizer.zero_state(optimizer_state, shapes).items():
    as_arrays = t5x_optimizer.tensorstore_slots({k: v.shape for k, v in slots.items()})
    states[name] = {
        slot: _write_array(path, f"state/param_states/{name}/{slot}", zeros, context, gcs=gcs,
                           chunk_bytes=chunk_bytes) if slot in as_arrays else zeros
        for slot, zeros in slots.items()}
  return states


def write(path: str, flat_params: dict, *, step: int, chunk_bytes: int = CHUNK_BYTES,
          optimizer_state: str | None = None, allow_nonfinite: bool = False) -> None:
  """Writes {T5X path: array} as a version-3 legacy checkpoint in directory `path`.

  The layout is T5X's `Checkpointer.save`: msgpack {'version': 3,
  'optimizer': {'target': <specs>, 'state': {'step': int32, ...}}}, arrays in
  gzip zarr directories; arrays keep their dtype. optimizer_state:
    None         'state' holds only the step, as T5X writes an InferenceState;
    'adafactor'  also 'param_states': the zero state of T5X's default Adafactor
                 (checkpoints.t5x_optimizer), as T5X writes a fresh train state.
  A parameter holding NaN/Inf is refused (nothing is written) unless allow_nonfinite.

  Reading these files in T5X (checked against T5X's source; see
  tests/test_checkpoints_t5x_compat.py):
    params = t5x.checkpoints.load_t5x_checkpoint(path)['target']      # either layout
    # eval / infer (InferenceState), and training with T5X's Adafactor from
    # optimizer_state='adafactor': the default strict restore
    utils.RestoreCheckpointConfig(path=path, mode='specific')
    # training from optimizer_state=None: the optimizer slots start from scratch
    utils.RestoreCheckpointConfig(path=path, mode='specific', fallback_to_scratch=True,
                                  assignment_map=((r'state/param_states.*', None),))
  (fallback_to_scratch needs a state transformation, which the assignment map is.)
  """
  path = storage.normalize(path)
  t5x_optimizer.check_optimizer_state(optimizer_state)
  check_finite(flat_params, allow=allow_nonfinite, where=f"the T5X checkpoint to write at {path}",
               action="write", override="checkpoints.save")
  gcs = storage.is_gcs(path)
  context = ts.Context({"file_io_concurrency": {"limit": 64}})
  specs = {name: _write_array(path, f"target/{name}", value, context, gcs=gcs,
                              chunk_bytes=chunk_bytes)
           for name, value in flat_params.items()}
  state = {"step": np.asarray(step, np.int32)}
  if optimizer_state is not None and jax.process_index() == 0:  # zeros: one process writes them
    state["param_states"] = unflatten(_param_states(path, flat_params, optimizer_state, context,
                                                    gcs=gcs, chunk_bytes=chunk_bytes))
  if jax.process_index() == 0:
    tree = {"version": VERSION, "optimizer": {"target": unflatten(specs), "state": state}}
    storage.write_bytes(storage.join(path, CHECKPOINT_FILE), msgpack_codec.encode(tree))
