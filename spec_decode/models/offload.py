"""Parameters kept in host memory and streamed to the device inside each jitted call.

SpecExec's setting: a target larger than device memory runs by holding its
parameters in host memory (a JAX memory kind) and moving each layer's weights
to the device right before that layer runs, inside the jitted decode.

  params = offload.to_host(params)            # every leaf in pinned_host memory
  model = t5.T5(config, stream_params=True)  # fetches layer by layer (`fetch`)

`fetch(tree, after=activation)` ties a transfer to an activation with an
optimization barrier, so the compiler can neither hoist it out of the decode
loop (loop-invariant code motion would otherwise move all weights to the
device once, before the loop) nor start it before that activation exists. A
layer loop ties layer i's parameters to the input of layer i - 1: one layer of
prefetch, whose transfer overlaps the previous layer's compute.

On XLA:CPU host and device memory are the same RAM, and the transfers inside
jit lower to nothing; results are unchanged. On GPU and TPU they lower to
`annotate_device_placement` custom calls (host-to-device copies).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import SingleDeviceSharding

HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")


def _memory_kinds(device) -> list[str]:
  return [m.kind for m in device.addressable_memories()]


def _host_sharding(leaf, memory_kind: str):
  if isinstance(leaf, jax.Array):
    return leaf.sharding.with_memory_kind(memory_kind)
  return SingleDeviceSharding(jax.devices()[0], memory_kind=memory_kind)


def to_host(params: Any, memory_kind: str = "pinned_host") -> Any:
  """`params` with every leaf placed in `memory_kind`, each keeping its sharding.

  Leaves that are not jax arrays (numpy arrays, scalars) go to the default
  device's host memory. Raises ValueError when a device the leaves live on
  offers no such memory.
  """
  if memory_kind not in HOST_MEMORY_KINDS:
    raise ValueError(f"memory_kind must be one of {HOST_MEMORY_KINDS}, got {memory_kind!r}")
  devices = {d for x in jax.tree.leaves(params)
             for d in (x.sharding.device_set if isinstance(x, jax.Array) else [jax.devices()[0]])}
  for d in sorted(devices, key=lambda d: d.id):
    if memory_kind not in _memory_kinds(d):
      raise ValueError(f"device {d} ({d.platform}) offers no {memory_kind!r} memory, so "
                       f"parameters cannot be offloaded there; it offers {_memory_kinds(d)}")
  return jax.device_put(params, jax.tree.map(lambda x: _host_sharding(x, memory_kind), params))


def host_shardings(shardings: Any, like: Any = None) -> Any:
  """A tree of shardings moved to host memory: each to the host memory kind its leaf
  of `like` (arrays, or None) already has, else pinned_host, so placing arrays that
  are already offloaded copies nothing."""
  def one(sharding, leaf=None):
    kind = _memory_kind(leaf)
    return sharding.with_memory_kind(kind if kind in HOST_MEMORY_KINDS else "pinned_host")
  if like is None:
    return jax.tree.map(one, shardings)
  return jax.tree.map(one, shardings, like)


def fetch(tree: Any, after: Any = None) -> Any:
  """Inside jit: every leaf of `tree` moved to device memory, sharding kept.

  after: an activation (any array or tree) the transfer must wait for. Tying
  the transfer to it with `jax.lax.optimization_barrier` keeps the transfer
  inside the loop that computes `after` and orders it after `after` exists.
  Leaves already in device memory are left as they are.
  """
  if after is not None:
    tree, _ = jax.lax.optimization_barrier((tree, after))
  return jax.device_put(tree, jax.memory.Space.Device)


def _memory_kind(leaf) -> str | None:
  sharding = getattr(leaf, "sharding", None)
  return None if sharding is None else sharding.memory_kind


def off_host_paths(params: Any) -> list[str]:
  """Paths of the leaves of `params` that are not arrays in a host memory kind."""
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  return [jax.tree_util.keystr(path) for path, leaf in flat
          if _memory_kind(leaf) not in HOST_MEMORY_KINDS]


def is_on_host(params: Any) -> bool:
  """Whether every leaf of `params` is an array (or shape) in a host memory kind."""
  return not off_host_paths(params)
