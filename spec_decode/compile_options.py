"""XLA compile options per backend for the decoding loops and the step timers.

On XLA:CPU the defaults route every multi-row matmul to YNNPACK fusions, which
on small-M products (the 2..16 rows of a verify call or a batch) run several
times slower than Eigen's dot, and split each small op over the thread pool.
Measured on the demo pairs (2-core CPU, `experiments/benchmark.py`): with
YNNPACK dot fusions off and single-threaded Eigen, autoregressive and
speculative decoding both get faster with token-identical outputs, so the
project compiles its loops that way on CPU unless told otherwise. Options a
jaxlib does not know are dropped (probed once per process), so older or newer
jaxlibs keep working with XLA's own defaults.

`resolve(options)`: None -> this module's defaults for the current backend;
a mapping (e.g. {} for XLA's defaults) is used as given.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp

CPU_DEFAULTS: Mapping[str, Any] = {
    "xla_cpu_experimental_ynn_fusion_type": "",  # no YNNPACK fusions: Eigen/oneDNN dots
    "xla_cpu_multi_thread_eigen": False,  # small ops: no thread-pool split per kernel
}


def _supported(name: str, value: Any) -> bool:
  try:
    jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(
        jnp.zeros((), jnp.float32)).compile()
    return True
  except Exception:  # an unknown option: INVALID_ARGUMENT at compile time
    return False


@functools.lru_cache(maxsize=None)
def defaults(backend: str | None = None) -> tuple[tuple[str, Any], ...]:
  """The default options for `backend` (default: jax's default backend) as sorted pairs."""
  backend = jax.default_backend() if backend is None else backend
  if backend != "cpu":
    return ()
  return tuple(sorted((k, v) for k, v in CPU_DEFAULTS.items() if _supported(k, v)))


def resolve(options: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
  """Hashable (name, value) pairs: `options`, or the backend's defaults when None."""
  if options is None:
    return defaults()
  if not isinstance(options, Mapping):
    raise ValueError(f"compiler options must be a mapping of XLA option names to values, got "
                     f"{type(options).__name__}")
  return tuple(sorted(dict(options).items()))
