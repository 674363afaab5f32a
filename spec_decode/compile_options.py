"""XLA compile options per backend for the decoding loops and the step timers.

On XLA:CPU the defaults route every multi-row matmul to YNNPACK fusions, which
on small-M products (the 2..16 rows of a verify call or a batch) run several
times slower than Eigen's dot, and split each small op over the thread pool.
Measured on the demo pairs on a small CPU host (`experiments/benchmark.py`): with
YNNPACK dot fusions off and single-threaded Eigen, autoregressive and
speculative decoding both get faster with token-identical outputs, so the
project compiles its loops that way on CPU unless told otherwise. Options a
jaxlib does not know are dropped (probed once per process), so older or newer
jaxlibs keep working with XLA's own defaults.

`resolve(options)`: None -> this module's defaults for the current backend;
a mapping (e.g. {} for XLA's defaults) is used as given.

`unroll_threefry_on_cpu()` (called when `spec_decode.decoding` is imported): JAX lowers
its Threefry hash on CPU as a rolled 5-step while loop (cheap to compile), so every
random draw inside a decoding loop runs a nested loop of ~16 kernels per step. A sampled
speculative iteration of the demo pair draws 7-10 times (row keys, splits, the draft's
samples, the acceptance uniforms, the residual draw) and ran ~1,600 kernels against ~680
greedy; with the unrolled lowering JAX uses on other backends it runs ~840 (a sampled
decode's time moves towards its greedy one). The hash is the same, so every random bit
is unchanged (tests/test_compile_options.py); a call costs some more compile time.
SPEC_DECODE_UNROLLED_THREEFRY=0 keeps JAX's lowering.
"""

from __future__ import annotations

import functools
import logging
import os
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


ENV_THREEFRY = "SPEC_DECODE_UNROLLED_THREEFRY"


def switched_off(env_var: str) -> bool:
  """Whether the environment turns a default-on speed path off: `env_var` set to 0, false,
  no or off (any case; unset or anything else leaves it on)."""
  return os.environ.get(env_var, "1").strip().lower() in ("0", "false", "no", "off")


@functools.lru_cache(maxsize=None)
def unroll_threefry_on_cpu() -> bool:
  """Lowers JAX's Threefry hash unrolled on CPU too (see the module doc), once per process;
  whether it now is. Lowerings made before the call keep the rolled loop. Needs JAX's
  internal lowering rule; where a JAX version has none under the known names, JAX's own
  lowering stays (logged) and nothing else changes."""
  if switched_off(ENV_THREEFRY):
    return False
  try:
    from jax._src.interpreters import mlir
    from jax._src.random import threefry2x32 as threefry
    primitive, rule = threefry.threefry2x32_p, threefry._threefry2x32_lowering_rule
  except (ImportError, AttributeError) as e:
    logging.info("spec_decode: JAX's Threefry lowering stays rolled on CPU (%s)", e)
    return False
  mlir.register_lowering(primitive, rule, platform="cpu", inline=False)
  return True
