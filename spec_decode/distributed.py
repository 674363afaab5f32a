"""Several hosts (processes) as one JAX program: flags, start-up, per-host inputs, gathering.

JAX is the distributed engine: `jax.distributed.initialize` joins the
processes (on CPU with gloo collectives), after which `jax.devices()` lists
every process's devices, a mesh from `partitioning.make_mesh` spans them all,
and one jitted decode runs on it SPMD. Each process feeds only the input rows
that its own devices hold (`process_rows`, `global_batch`), and results come
back to every process, process 0 writing them (`gather`).

Typical use in an entry point:

  distributed.define_flags()          # before app.run; idempotent
  ...
  distributed.initialize_from_flags() # first thing in main(), before any JAX computation
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from absl import flags
from jax.experimental import multihost_utils

from spec_decode import partitioning


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Defines --coordinator_address, --num_processes, --process_id (once)."""
  if "coordinator_address" in flag_values:
    return
  flags.DEFINE_string("coordinator_address", None,
                      "host:port of process 0's coordinator for multi-host runs; "
                      "unset for a single process.", flag_values=flag_values)
  flags.DEFINE_integer("num_processes", 1, "Number of processes (hosts) in the run.",
                       flag_values=flag_values)
  flags.DEFINE_integer("process_id", 0, "This process's index in [0, num_processes).",
                       flag_values=flag_values)


def initialize(coordinator_address: str | None = None, num_processes: int = 1,
               process_id: int = 0, *, cpu_collectives: str | None = "gloo",
               initialization_timeout: int = 300) -> bool:
  """Joins the processes of a multi-host run; returns whether there are several.

  Must run before any other JAX call in the process. A single process
  (num_processes 1, no coordinator) needs nothing and returns False.
  cpu_collectives: implementation of cross-process collectives on the CPU
  backend ('gloo'); it does not affect TPU or GPU collectives.
  """
  if num_processes == 1 and coordinator_address is None:
    return False
  if not coordinator_address:
    raise ValueError("a multi-process run needs --coordinator_address host:port")
  if not isinstance(num_processes, int) or num_processes < 1:
    raise ValueError(f"num_processes must be a positive int, got {num_processes!r}")
  if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id!r}")
  if cpu_collectives is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id,
                             initialization_timeout=initialization_timeout)
  return True


def initialize_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> bool:
  """`initialize` with the values of the flags from `define_flags`."""
  return initialize(flag_values.coordinator_address, flag_values.num_processes,
                    flag_values.process_id)


def process_rows(mesh, global_batch_size: int,
                 rules: partitioning.Rules | None = None) -> slice:
  """The contiguous rows of a global batch that this process's devices hold.

  With the batch replicated (it does not divide the `data` axis, or the mesh
  has none) that is every row. Raises if this process's rows are not one
  contiguous block (a mesh whose `data` axis interleaves hosts).
  """
  sharding = partitioning.batch_sharding(mesh, (global_batch_size,), rules)
  index_map = sharding.addressable_devices_indices_map((global_batch_size,))
  rows = sorted({r for idx in index_map.values()
                 for r in range(*idx[0].indices(global_batch_size))})
  if not rows or rows != list(range(rows[0], rows[-1] + 1)):
    raise ValueError(f"process {jax.process_index()} holds non-contiguous rows {rows}")
  return slice(rows[0], rows[-1] + 1)


def global_batch(local_rows, mesh, global_batch_size: int,
                 rules: partitioning.Rules | None = None) -> jax.Array:
  """A global [B, ...] array from this process's rows (`process_rows`) of it.

  The result has the decoders' batch sharding, so they take it without moving data.
  """
  local_rows = np.asarray(local_rows)
  sharding = partitioning.batch_sharding(mesh, (global_batch_size,), rules)
  expected = process_rows(mesh, global_batch_size, rules)
  if local_rows.shape[0] != expected.stop - expected.start:
    raise ValueError(f"process {jax.process_index()} must feed rows {expected.start}:"
                     f"{expected.stop} ({expected.stop - expected.start} rows), "
                     f"got {local_rows.shape[0]}")
  return jax.make_array_from_process_local_data(
      sharding, local_rows, (global_batch_size,) + local_rows.shape[1:])


def gather(tree: Any) -> Any:
  """Every leaf of `tree` (global jax.Arrays) as a full numpy array on every process.

  A collective: all processes must call it. Process 0 then writes the results.
  """
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, tree)
  return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))
