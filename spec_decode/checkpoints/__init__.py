"""Reading and writing T5 checkpoints: T5X legacy, T5X Orbax, Hugging Face.

  config, params = checkpoints.load(path)               # format detected
  config, params = checkpoints.load(path, mesh=mesh)    # each device reads its shard
  checkpoints.save(path, config, params, format="t5x")  # or "orbax", "hf"
  result = checkpoints.load(path, allow_nonfinite=True)  # result.nonfinite: what was kept

`path` is, for T5X legacy, a checkpoint_<step> directory or the msgpack
`checkpoint` file in it (local or gs://); for Orbax, a checkpoint_<step>
directory holding state/ or the state directory; for Hugging Face, the model
directory. `save` writes into `path` itself (which must be new or empty).
The params are the tree `T5(config).init` returns; every loaded tree is
checked against `T5(config).param_shapes()`.

Before anything is allocated, `load` checks the config's sizes against sane
bounds (`limits.MAX_SIZES`) and the parameters' bytes against the memory they
go to; as each array is read, its NaN/Inf values are counted on the devices
holding it, and a parameter holding any is refused (`allow_nonfinite=True`
keeps it; the counts are on the result). `save` refuses such parameters too.
Paths inside a checkpoint (T5X array directories, Hugging Face weight files,
Orbax files) that lead outside it, through '..', an absolute path or a
symbolic link, are refused unless `allow_outside_paths=True`.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from spec_decode.checkpoints import hf, infer, limits, orbax_ckpt, storage, t5x_legacy
from spec_decode.checkpoints.common import (CheckpointError, check_finite, check_shapes,
                                            materialize, resolve_dtype)
from spec_decode.checkpoints.t5x_optimizer import OPTIMIZER_STATES, check_optimizer_state
from spec_decode.models import t5
from spec_decode.tree_util import flatten, unflatten

FORMATS = ("t5x", "orbax", "hf")
_MSGPACK_MAP_PREFIXES = (*range(0x80, 0x90), 0xDE, 0xDF)

__all__ = ["CheckpointError", "FORMATS", "Loaded", "OPTIMIZER_STATES", "detect_format", "load",
           "save"]


class Loaded(tuple):
  """What `load` returns: the pair (config, params), plus what the load found.

  It unpacks and indexes as the pair `load` has always returned
  (`config, params = checkpoints.load(path)`) and carries more as attributes,
  as os.stat_result does:
    config, params   the loaded T5Config and parameter tree;
    format           't5x', 'orbax' or 'hf';
    nonfinite        {parameter path: count of NaN/Inf values} kept because
                     allow_nonfinite=True (empty when every value is finite);
    allow_nonfinite  the flag the load ran with (for callers to record).
  """

  def __new__(cls, config: t5.T5Config, params: dict, *, format: str,
              nonfinite: Mapping[str, int], allow_nonfinite: bool) -> "Loaded":
    loaded = super().__new__(cls, (config, params))
    loaded.format = format
    loaded.nonfinite = dict(nonfinite)
    loaded.allow_nonfinite = allow_nonfinite
    return loaded

  def __getnewargs_ex__(self) -> tuple[tuple, dict]:  # pickle and copy keep the attributes
    return tuple(self), {"format": self.format, "nonfinite": self.nonfinite,
                         "allow_nonfinite": self.allow_nonfinite}

  @property
  def config(self) -> t5.T5Config:
    return self[0]

  @property
  def params(self) -> dict:
    return self[1]


# A pytree node like the tuple `load` used to return (jax.tree.map, device_get, ...).
jax.tree_util.register_pytree_node(
    Loaded, lambda x: (tuple(x), (x.format, x.nonfinite, x.allow_nonfinite)),
    lambda aux, children: Loaded(*children, format=aux[0], nonfinite=aux[1],
                                 allow_nonfinite=aux[2]))


def detect_format(path) -> str:
  """'orbax' (an Orbax _METADATA in path or path/state), 'hf' (config.json) or
  't5x' (a msgpack `checkpoint` file, or the file itself)."""
  path = storage.normalize(path)
  if storage.is_file(path):
    head = storage.read_head(path, 32) or b""
    if head.startswith(b"model_checkpoint_path"):
      raise CheckpointError(f"{path} is a TensorFlow checkpoint index, not a T5X checkpoint")
    if head and head[0] in _MSGPACK_MAP_PREFIXES:
      return "t5x"
    raise CheckpointError(f"unknown checkpoint format: {path} is not a T5X msgpack file")
  if not storage.is_dir(path):
    raise CheckpointError(f"no checkpoint at {path}: it does not exist")
  for candidate in (path, storage.join(path, orbax_ckpt.STATE_DIR)):
    if storage.is_file(storage.join(candidate, orbax_ckpt.METADATA_FILE)):
      return "orbax"
  if storage.is_file(storage.join(path, hf.CONFIG_FILE)):
    return "hf"
  if storage.is_file(storage.join(path, t5x_legacy.CHECKPOINT_FILE)):
    return "t5x"
  raise CheckpointError(
      f"unknown checkpoint format at {path}: expected a T5X '{t5x_legacy.CHECKPOINT_FILE}' "
      f"file, an Orbax '{orbax_ckpt.STATE_DIR}/{orbax_ckpt.METADATA_FILE}', or a Hugging "
      f"Face '{hf.CONFIG_FILE}'")


def load(path, *, config: t5.T5Config | None = None, dtype=None, mesh=None,
         rules=None, allow_missing_chunks: bool = False,
         allow_outside_paths: bool = False,
         host_memory: bool = False, allow_nonfinite: bool = False) -> Loaded:
  """(T5Config, params) from a checkpoint, parameters cast to `dtype`, as a `Loaded`.

  config: expected configuration (checked against the stored shapes); default
    inferred from the shapes (T5X) or read from config.json (HF).
  dtype: parameter dtype; None = bfloat16 on accelerators, float32 on CPU.
    The returned config carries it.
  mesh, rules: when a mesh is given, each parameter is read straight into its
    `partitioning.param_shardings(T5(config), mesh, rules)` sharding, each
    device reading only its block.
  allow_missing_chunks: T5X legacy: read absent zarr chunk files as zeros
    (default: an error, since a partly copied checkpoint looks the same).
  allow_outside_paths: accept T5X TensorStore paths / HF index shard names
    that lead outside the checkpoint directory, and symbolic links inside it
    that do (default: refused).
  host_memory: read the parameters straight into host memory (pinned_host, in
    the mesh's layout when given), for `T5(stream_params=True)`: a model larger
    than device memory never passes through the device.
  allow_nonfinite: keep parameters holding NaN/Inf (default: a CheckpointError
    names the first one and its count); the result's `nonfinite` lists them.
  """
  if config is not None and not isinstance(config, t5.T5Config):
    raise CheckpointError(f"config must be a T5Config, got {type(config).__name__}")
  fmt = detect_format(path)
  dtype = resolve_dtype(dtype)
  where = f"{fmt} checkpoint {storage.normalize(path)}"
  sources, file_config = None, None
  if fmt == "orbax":
    shapes = {name: shape for name, (shape, _) in
              orbax_ckpt.target_shapes(path, allow_outside_paths=allow_outside_paths).items()}
  else:
    if fmt == "hf":
      file_config, sources = hf.open_arrays(path, allow_outside_paths=allow_outside_paths)
    else:
      sources = t5x_legacy.open_arrays(path, allow_missing_chunks=allow_missing_chunks,
                                       allow_outside_paths=allow_outside_paths)
    shapes = {name: src.shape for name, src in sources.items()}
  config = config or file_config or infer.config_from_shapes(shapes)
  config = config.replace(dtype=dtype)
  limits.check_config_sizes(config, where)
  check_shapes(config, shapes, what=f"{fmt} checkpoint {path}")
  limits.check_fits_memory(shapes, dtype, where=where, host_memory=host_memory,
                           devices=list(mesh.devices.flat) if mesh is not None
                           else jax.devices()[:1])
  shardings = None
  if mesh is not None:
    from spec_decode import partitioning
    shardings = flatten(partitioning.param_shardings(t5.T5(config, stream_params=host_memory),
                                                     mesh, rules=rules))
  elif host_memory:
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    shardings = {name: host for name in shapes}
  nonfinite: dict[str, int] = {}
  if fmt == "orbax":
    flat = orbax_ckpt.restore(path, list(shapes), dtype, shardings)
    nonfinite = check_finite(flat, allow=allow_nonfinite, where=where)
  else:
    flat = materialize(sources, dtype, shardings, allow_nonfinite=allow_nonfinite,
                       nonfinite=nonfinite, where=where)
  return Loaded(config, unflatten(flat), format=fmt, nonfinite=nonfinite,
                allow_nonfinite=allow_nonfinite)


def save(path, config: t5.T5Config, params: Mapping[str, Any], *, format: str = "t5x",
         step: int = 0, optimizer_state: str | None = None,
         allow_nonfinite: bool = False) -> None:
  """Writes `params` (the T5(config) tree, any dtype) as a `format` checkpoint at `path`.

  optimizer_state: format 't5x' only: None (the state holds the step alone) or
    'adafactor' (also the zero state of T5X's default Adafactor, so that T5X's
    strict `Checkpointer.restore` resumes training from it); see
    `t5x_legacy.write` for how T5X reads either.
  allow_nonfinite: write parameters holding NaN/Inf (default: refused before
    anything is written, naming the first one).
  """
  if format not in FORMATS:
    raise CheckpointError(f"unknown checkpoint format {format!r}; expected one of {FORMATS}")
  if not isinstance(config, t5.T5Config):
    raise CheckpointError(f"config must be a T5Config, got {type(config).__name__}")
  if not isinstance(params, Mapping):
    raise CheckpointError(f"params must be a nested dict, got {type(params).__name__}")
  check_optimizer_state(optimizer_state)
  if optimizer_state is not None and format != "t5x":
    raise CheckpointError(f"optimizer_state={optimizer_state!r} is written in T5X's legacy "
                          f"layout only (format='t5x'), not format={format!r}")
  flat = flatten(params)
  check_shapes(config, {k: tuple(np.shape(v)) for k, v in flat.items()}, what="params")
  path = storage.normalize(path)
  storage.check_empty_target(path)
  if format == "t5x":
    t5x_legacy.write(path, flat, step=step, optimizer_state=optimizer_state,
                     allow_nonfinite=allow_nonfinite)
  elif format == "orbax":
    check_finite(flat, allow=allow_nonfinite, where=f"the Orbax checkpoint to write at {path}",
                 action="write", override="checkpoints.save")
    orbax_ckpt.write(path, unflatten(flat), step=step)
  else:
    hf.write(path, config, flat, allow_nonfinite=allow_nonfinite)
