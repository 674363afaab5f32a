"""XLA's memory maps: a process that holds many compiled executables must drop them.

XLA:CPU maps each executable's code and data into memory regions of its own and a Linux
process may hold at most vm.max_map_count of them (see `release_executables_if_crowded`).
"""

from __future__ import annotations

from absl import logging
import jax


def memory_map_use() -> tuple[int, int] | None:
  """(memory regions this process maps, the kernel's limit), or None off Linux."""
  try:
    with open("/proc/self/maps", "rb") as f:
      used = sum(1 for _ in f)
    with open("/proc/sys/vm/max_map_count") as f:
      limit = int(f.read().strip())
  except (OSError, ValueError):
    return None
  return used, limit


def release_executables_if_crowded(fraction: float = 0.5) -> bool:
  """Drops every compiled executable (`jax.clear_caches`) once the process maps more
  than `fraction` of the kernel's vm.max_map_count memory regions; True if it did.

  XLA:CPU maps each executable's code and data into regions of its own (measured
  here: ~6 for a small function, ~770 for a speculative decoding loop of the demo
  pair, a few hundred for an autoregressive one) and keeps them while the executable
  is cached. A process that holds about 80 decoding loops (a gamma x draft sweep)
  reaches the limit (65530 by default), and the next compilation fails inside XLA
  ("LLVM ERROR: Unable to allocate section memory", or a segmentation fault).
  Dropping the caches only costs recompiling what is used again.
  """
  use = memory_map_use()
  if use is None or use[0] <= fraction * use[1]:
    return False
  logging.info("releasing compiled executables: %d of %d memory maps in use", *use)
  jax.clear_caches()
  return True
