"""Sizes checked before anything is allocated: sane bounds and the memory the load needs.

A config.json (or a T5X msgpack's layer names) with absurd sizes would
otherwise build millions of parameter names, or read until the machine runs
out of memory. `check_config_sizes` bounds every T5Config size far above any
published T5 (T5 11B: 24 layers, emb_dim 1024, mlp_dim 65536, 128 heads; mT5:
vocab_size 250112) and far below sizes whose bookkeeping alone is a problem;
`check_fits_memory` compares the parameters' bytes with the memory they are
loaded into (device memory of the devices used, or the host's available
memory) and refuses a load that cannot fit.
"""

from __future__ import annotations

import math
import os
from typing import Mapping, Sequence

import jax
import numpy as np

from spec_decode.checkpoints.common import CheckpointError
from spec_decode.models import t5

MAX_SIZES = {
    "vocab_size": 1 << 22,
    "emb_dim": 1 << 16,
    "num_heads": 1 << 12,
    "head_dim": 1 << 12,
    "mlp_dim": 1 << 20,
    "num_encoder_layers": 1 << 10,
    "num_decoder_layers": 1 << 10,
    "relative_attention_num_buckets": 1 << 12,
    "relative_attention_max_distance": 1 << 20,
}
_GiB = 1024 ** 3


def check_config_sizes(config: t5.T5Config, where: str) -> None:
  """Refuses a config whose sizes exceed MAX_SIZES, or whose epsilon is not small and positive."""
  too_big = [f"{name} = {getattr(config, name)} (at most {limit})"
             for name, limit in MAX_SIZES.items() if getattr(config, name) > limit]
  if too_big:
    raise CheckpointError(f"{where}: absurd model sizes {', '.join(too_big)}; refusing to build "
                          "a model that large (the bounds, checkpoints.limits.MAX_SIZES, lie "
                          "far above any published T5)")
  eps = config.layer_norm_epsilon
  if not isinstance(eps, (float, int)) or not math.isfinite(eps) or not 0 < eps < 1:
    raise CheckpointError(f"{where}: layer_norm_epsilon = {eps!r}, expected a small positive "
                          "number (T5 uses 1e-6)")


def _cgroup_available() -> int | None:
  """Bytes the process's cgroup (v2) may still allocate, when it has a limit."""
  try:
    with open("/sys/fs/cgroup/memory.max") as f:
      limit = f.read().strip()
    with open("/sys/fs/cgroup/memory.current") as f:
      current = int(f.read().strip())
  except (OSError, ValueError):
    return None
  return None if limit == "max" else max(int(limit) - current, 0)


def host_available_bytes() -> int | None:
  """The host memory this process can still use (MemAvailable, within its cgroup's limit)."""
  available = None
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          available = int(line.split()[1]) * 1024
          break
  except (OSError, ValueError, IndexError):
    pass
  if available is None:
    try:
      available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
      return None
  cgroup = _cgroup_available()
  return available if cgroup is None else min(available, cgroup)


def memory_capacity(devices: Sequence[jax.Device], host_memory: bool) -> tuple[int, str] | None:
  """(bytes, what) the parameters can occupy at most; None when unknown.

  Host memory (host_memory=True, or CPU devices): what the host still has
  available. Accelerators: the sum of the devices' memory (`bytes_limit`), an
  upper bound however the parameters are sharded.
  """
  if host_memory or all(d.platform == "cpu" for d in devices):
    available = host_available_bytes()
    return None if available is None else (available, "available host memory")
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
  if not all(limits):
    return None
  return int(sum(limits)), f"memory of the {len(devices)} {devices[0].platform} device(s) used"


def check_fits_memory(shapes: Mapping[str, tuple[int, ...]], dtype, *, where: str,
                      devices: Sequence[jax.Device], host_memory: bool = False) -> None:
  """Refuses to load parameters of these shapes in `dtype` when they cannot fit.

  On the host each process holds at least its share (1 / process_count) of the
  parameters; on accelerators, all devices together at least one copy: a load
  refused here could not have succeeded.
  """
  capacity = memory_capacity(devices, host_memory)
  if capacity is None:
    return
  count = sum(math.prod(shape) for shape in shapes.values())
  need = count * np.dtype(dtype).itemsize
  if capacity[1] == "available host memory":
    need //= jax.process_count()
  if need > capacity[0]:
    raise CheckpointError(
        f"{where}: its {count:,} parameters need {need / _GiB:.1f} GiB as "
        f"{np.dtype(dtype).name}, more than the {capacity[0] / _GiB:.1f} GiB of "
        f"{capacity[1]}; refusing to load it (load it in a narrower dtype, over a mesh of "
        "more devices, or with host_memory=True)")
