"""Device meshes, T5X logical axis rules, and the shardings they give to arrays.

Every array the decoders touch carries a tuple of T5X *logical* axis names
(parameters: `T5.logical_axes()`; caches, encoder outputs and decoding state:
the functions below). A rule list maps logical names to mesh axes:

  rules = (("batch", "data"), ("vocab", "model"), ("mlp", "model"), ...)

Resolution of one array dimension (as in T5X, plus a divisibility check):
the rules for its logical name are tried in order; the first one whose mesh
axis (or axes) is in the mesh, not yet used by another dimension of the same
array, and whose size divides the dimension, shards it; a rule mapping to
None, or no usable rule, replicates it. So a dimension a mesh axis does not
divide is *replicated*, never padded: padding heads, vocab or batch would
change the shapes the model and the decoders compute with (and extra rows
would cost work and need masking out of results and statistics), while
replication keeps the unsharded computation, at the cost of memory on that
axis. (Sharded contractions still sum in another order, so logits may differ
from the unsharded ones in the last float bits; tokens then differ only where
two candidates tie to within that rounding.) Examples: T5.1.1-small's 6 heads on
model=4 or 8 leave `heads` and `joined_kv` replicated (joined_kv = heads * head_dim is only split whole
heads at a time, see `param_shardings`) while `mlp` (1024) and `vocab`
(32128) stay sharded; a batch of 3 on data=2 is replicated over `data`.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from spec_decode.models import offload

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

# T5X's standard 1-D model-parallel rules (t5x.partitioning.standard_logical_axis_rules
# with activation_partitioning_dims = parameter_partitioning_dims = 1).
DEFAULT_RULES: Rules = (
    ("batch", "data"),
    ("vocab", "model"),
    ("mlp", "model"),
    ("heads", "model"),
    ("joined_kv", "model"),
    ("kv", None),
    ("embed", None),
    ("length", None),
    ("relpos_buckets", None),
)


def standard_logical_axis_rules(*, parameter_partitioning_dims: int = 1,
                                additional_rules: Iterable[tuple[str, MeshAxes]] = ()) -> Rules:
  """T5X's standard rules; `additional_rules` come first, so they override.

  parameter_partitioning_dims=2 also shards parameters' `embed` dimension over
  `data` (2-D parameter sharding, as T5X); activations keep `batch` on `data`
  because a mesh axis is used at most once per array and `batch` comes first.
  """
  if parameter_partitioning_dims not in (1, 2):
    raise ValueError(f"parameter_partitioning_dims must be 1 or 2, "
                     f"got {parameter_partitioning_dims!r}")
  rules = list(DEFAULT_RULES)
  if parameter_partitioning_dims == 2:
    rules.insert(rules.index(("embed", None)), ("embed", "data"))
  return validate_rules(tuple(additional_rules) + tuple(rules))


def validate_rules(rules: Iterable[Sequence[Any]]) -> Rules:
  """Normalizes rules to a hashable tuple of (logical, mesh axes) pairs."""
  out = []
  for rule in rules:
    if len(rule) != 2 or not isinstance(rule[0], str):
      raise ValueError(f"a logical axis rule must be a (logical_name, mesh_axis) pair, "
                       f"got {rule!r}")
    name, axes = rule
    if isinstance(axes, list):
      axes = tuple(axes)
    ok = axes is None or isinstance(axes, str) or (
        isinstance(axes, tuple) and axes and all(isinstance(a, str) for a in axes))
    if not ok:
      raise ValueError(f"rule {name!r}: mesh axis must be None, a name or a tuple of "
                       f"names, got {axes!r}")
    out.append((name, axes))
  return tuple(out)


def data_parallel_rules(rules: Rules | None = None) -> Rules:
  """Only the `batch` rules of `rules`: parameters replicated, batch still sharded.

  The default layout of a small draft model (its weights fit on every device,
  and model-parallel collectives would dominate its tiny matmuls).
  """
  rules = DEFAULT_RULES if rules is None else validate_rules(rules)
  return tuple(r for r in rules if r[0] == "batch")


# ------------------------------------------------------------------ meshes
def _mesh_items(spec: str | Mapping[str, int]) -> list[tuple[str, Any]]:
  """'data=2,model=4' -> [('data', 2), ('model', 4)], the syntax checked."""
  if isinstance(spec, Mapping):
    return [(str(k), v) for k, v in spec.items()]
  if not isinstance(spec, str) or not spec.strip():
    raise ValueError(f"mesh spec must be a string like 'data=2,model=4', got {spec!r}")
  items = []
  for part in spec.split(","):
    m = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*=\s*(-?\d+)\s*", part)
    if not m:
      raise ValueError(f"bad mesh spec entry {part!r} in {spec!r}; expected name=size")
    items.append((m.group(1), int(m.group(2))))
  return items


def rule_mesh_axes(rules: Rules) -> set[str]:
  """The mesh axis names that some rule shards over."""
  return {a for _, axes in rules if axes is not None
          for a in ((axes,) if isinstance(axes, str) else axes)}


def check_mesh_axes(spec: str | Mapping[str, int], rules: Rules) -> None:
  """Refuses a mesh axis that no rule names (a typo such as 'modle=8'): every array would
  be replicated along it, its devices all doing the same work, and nothing would say so."""
  known = rule_mesh_axes(rules)
  unknown = [n for n, _ in _mesh_items(spec) if n not in known]
  if unknown:
    raise ValueError(f"mesh spec {spec!r}: no logical axis rule shards over "
                     f"{', '.join(map(repr, unknown))} (the rules use {sorted(known)}): every "
                     f"array would be replicated along it; rename the axis, or add a rule "
                     f"that names it (ExperimentConfig.logical_axis_rules in an experiment)")


def parse_mesh_spec(spec: str | Mapping[str, int], num_devices: int) -> dict[str, int]:
  """'data=2,model=4' -> {'data': 2, 'model': 4}. One size may be -1 (the rest)."""
  items = _mesh_items(spec)
  names = [n for n, _ in items]
  if len(set(names)) != len(names):
    raise ValueError(f"mesh spec {spec!r} repeats an axis name")
  sizes = dict(items)
  wild = [n for n, s in items if s == -1]
  if len(wild) > 1 or any(s == 0 or s < -1 for s in sizes.values()):
    raise ValueError(f"mesh spec {spec!r}: sizes must be positive, with at most one -1")
  known = math.prod(s for s in sizes.values() if s != -1)
  if wild:
    if num_devices % known:
      raise ValueError(f"mesh spec {spec!r}: {num_devices} devices are not divisible by {known}")
    sizes[wild[0]] = num_devices // known
  if math.prod(sizes.values()) > num_devices:
    raise ValueError(f"mesh spec {spec!r} needs {math.prod(sizes.values())} devices, "
                     f"only {num_devices} available")
  return sizes


def make_mesh(spec: str | Mapping[str, int] | None = None, *, num_partitions: int | None = None,
              devices: Sequence[Any] | None = None) -> Mesh:
  """A mesh over `devices` (default all of `jax.devices()`, every process's).

  spec: 'data=2,model=4' (axis order as written; put `model` last so a
  model-parallel group is contiguous devices, within one host). Or, T5X-style,
  num_partitions=P: mesh 'data=N/P,model=P' over all N devices. Axes are
  `AxisType.Auto` (GSPMD propagation with the constraints the decoders add).
  """
  devices = list(jax.devices() if devices is None else devices)
  if (spec is None) == (num_partitions is None):
    raise ValueError("give exactly one of a mesh spec or num_partitions")
  if num_partitions is not None:
    if not isinstance(num_partitions, int) or num_partitions < 1 \
        or len(devices) % num_partitions:
      raise ValueError(f"num_partitions={num_partitions!r} must be a positive divisor of "
                       f"the {len(devices)} devices")
    spec = {"data": len(devices) // num_partitions, "model": num_partitions}
  sizes = parse_mesh_spec(spec, len(devices))
  n = math.prod(sizes.values())
  return jax.make_mesh(tuple(sizes.values()), tuple(sizes), devices=devices[:n],
                       axis_types=(AxisType.Auto,) * len(sizes))


def mesh_axis_size(mesh: Mesh, axes: MeshAxes) -> int:
  """Product of the sizes of `axes` in `mesh` (1 for None)."""
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape[a] for a in axes)


# ------------------------------------------------------------------ logical -> physical
def logical_to_spec(logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Rules | None = None,
                    units: Mapping[str, int] | None = None) -> PartitionSpec:
  """PartitionSpec of one array from its logical axes (see the module docstring).

  units: logical name -> how many indivisible pieces that dimension has
  (default its size); e.g. `joined_kv` has `num_heads` pieces, so a mesh axis
  must divide the head count, not only heads * head_dim.
  """
  rules = DEFAULT_RULES if rules is None else rules
  if len(logical) != len(shape):
    raise ValueError(f"logical axes {tuple(logical)} do not match shape {tuple(shape)}")
  used: set[str] = set()
  out = []
  for name, size in zip(logical, shape):
    chosen = None
    pieces = (units or {}).get(name, size) if name is not None else size
    for rule_name, axes in rules:
      if rule_name != name:
        continue
      if axes is None:
        break
      names = (axes,) if isinstance(axes, str) else axes
      if any(a not in mesh.shape or a in used for a in names):
        continue
      if pieces % mesh_axis_size(mesh, axes) or size % mesh_axis_size(mesh, axes):
        continue
      chosen = axes
      used.update(names)
      break
    out.append(chosen)
  return PartitionSpec(*out)


def _is_axes(x) -> bool:
  return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def tree_shardings(logical_tree, shape_tree, mesh: Mesh, rules: Rules | None = None,
                   units: Mapping[str, int] | None = None):
  """NamedShardings for a tree of arrays (or ShapeDtypeStructs) from a matching
  tree of logical-axis tuples. A None logical leaf means fully replicated."""
  def one(axes, x):
    if axes is None:
      return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, logical_to_spec(axes, x.shape, mesh, rules, units))
  return jax.tree.map(one, logical_tree, shape_tree,
                      is_leaf=lambda x: x is None or _is_axes(x))


def model_units(model) -> dict[str, int]:
  """Indivisible pieces per logical axis for `model` (joined_kv splits by whole heads)."""
  config = getattr(model, "config", None)
  heads = getattr(config, "num_heads", None)
  return {} if heads is None else {"joined_kv": int(heads), "heads": int(heads)}


def param_shardings(model, mesh: Mesh, rules: Rules | None = None, params=None):
  """Tree of NamedSharding with the structure of `model.init(...)`'s params.

  Uses `model.logical_axes()` and the abstract `model.param_shapes()`; a model
  without `logical_axes` (an n-gram table, say) gets every leaf replicated,
  in which case `params` (or their shapes) must be given for the tree. A model
  that streams its parameters from host memory (`stream_params`) gets them in
  host memory (`offload.host_shardings`).
  """
  if hasattr(model, "logical_axes"):
    shapes = model.param_shapes() if params is None else params
    shardings = tree_shardings(model.logical_axes(), shapes, mesh, rules, model_units(model))
    if getattr(model, "stream_params", False):
      shardings = offload.host_shardings(shardings, params)
    return shardings
  if params is None:
    raise ValueError(f"{type(model).__name__} has no logical_axes(); pass params= to "
                     "replicate them on the mesh")
  return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), params)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, shape: Sequence[int], rules: Rules | None = None) -> NamedSharding:
  """[B, ...] arrays: `batch` sharded when it divides, rest replicated.

  The spec names only the leading axis, so one such sharding serves arrays of
  any rank >= 1 with that batch (e.g. as `out_shardings` for a whole result).
  """
  return NamedSharding(mesh, logical_to_spec(("batch",), tuple(shape)[:1], mesh, rules))


# ------------------------------------------------------------------ non-parameter arrays
def encoder_output_axes(encoded) -> Any:
  """Logical axes of an encoder output that declares them (`logical_axes()`), else None."""
  return encoded.logical_axes() if hasattr(encoded, "logical_axes") else None


def cache_axes(cache) -> Any:
  """Logical axes of a decoder cache that declares them (`logical_axes()`), else None.

  A cache without them is left to the compiler.
  """
  return cache.logical_axes() if hasattr(cache, "logical_axes") else None


def constrain(tree, logical_tree, mesh: Mesh | None, rules: Rules | None = None,
              units: Mapping[str, int] | None = None):
  """`jax.lax.with_sharding_constraint` of `tree` by its logical axes (no-op without a mesh)."""
  if mesh is None or logical_tree is None:
    return tree
  return jax.lax.with_sharding_constraint(
      tree, tree_shardings(logical_tree, tree, mesh, rules, units))


def constrain_cache(cache, model, mesh: Mesh | None, rules: Rules | None = None):
  return constrain(cache, cache_axes(cache), mesh, rules, model_units(model))


def constrain_batch(tree, mesh: Mesh | None, rules: Rules | None = None):
  """Constrains every array leaf of `tree` to be batch-sharded on its first axis."""
  if mesh is None:
    return tree
  logical = jax.tree.map(lambda x: ("batch",) + (None,) * (x.ndim - 1) if x.ndim else (), tree)
  return constrain(tree, logical, mesh, rules)


def shard_bytes(shape_tree, sharding_tree) -> int:
  """Bytes one device holds of a tree of arrays under a tree of shardings (max over devices)."""
  total = 0
  for x, s in zip(jax.tree.leaves(shape_tree), jax.tree.leaves(sharding_tree)):
    total += int(np.prod(s.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
  return total


def put(tree, shardings):
  """Places a host-identical tree (same values on every process) into `shardings`.

  Works across processes: each process builds only its addressable shards
  from its own copy, so nothing is communicated. Arrays already laid out as
  asked are returned as they are.
  """
  def one(x, s):
    if isinstance(x, jax.Array) and x.sharding == s:
      return x
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return jax.device_put(x, s)  # a global array in another layout: resharded by XLA
    if jax.process_count() == 1:
      return jax.device_put(x, s)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])
  return jax.tree.map(one, tree, shardings)


# ------------------------------------------------------------------ jit with explicit layouts
@functools.lru_cache(maxsize=64)
def _cached_jit(fn, in_leaves, in_treedef, out_shardings, static_items):
  return jax.jit(functools.partial(fn, **dict(static_items)),
                 in_shardings=jax.tree.unflatten(in_treedef, list(in_leaves)),
                 out_shardings=out_shardings)


def sharded_jit(fn, in_shardings: tuple, out_shardings, **static):
  """`jax.jit(partial(fn, **static), in_shardings=..., out_shardings=...)`, memoized.

  The positional arguments of the returned function are the dynamic ones, laid
  out by `in_shardings` (one sharding tree per argument); `static` values are
  hashable (models, Sampling, ints, meshes, rule tuples) and key the cache, so
  repeated calls with the same layout reuse one compiled program.
  """
  leaves, treedef = jax.tree.flatten(in_shardings)
  return _cached_jit(fn, tuple(leaves), treedef, out_shardings, tuple(sorted(static.items())))
