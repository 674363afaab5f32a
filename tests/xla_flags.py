"""The XLA flags every test process compiles with: conftest.py sets them for the suite's own
processes, and a test that starts processes with a device count of its own passes
`flags(devices)`, so every program a test compares compiles alike (see conftest.py).

XLA aborts a process whose XLA_FLAGS names a flag it does not know, and setup.py accepts
older jaxlibs than the one these flags were chosen on, so only the flags this jaxlib knows
are used: probed once per session in a child process, and handed to the workers and
subprocesses through the environment.
"""

import os
import subprocess
import sys

CANDIDATES = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
              "--xla_cpu_parallel_codegen_split_count=1")
_ENV = "SPEC_DECODE_TESTS_CHEAP_COMPILE"


def _starts(flags) -> bool:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))
  code = "import jax; jax.numpy.zeros(1).block_until_ready()"
  try:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          timeout=300).returncode == 0
  except subprocess.TimeoutExpired:
    return False


def cheap_compile() -> tuple[str, ...]:
  """Those of CANDIDATES this jaxlib knows (all of them, unless a probe fails)."""
  known = os.environ.get(_ENV)
  if known is None:
    known = " ".join(CANDIDATES if _starts(CANDIDATES) else
                     [f for f in CANDIDATES if _starts([f])])
    os.environ[_ENV] = known
  return tuple(known.split())


def flags(devices: int) -> str:
  """XLA_FLAGS for a process simulating `devices` CPU devices."""
  return " ".join((f"--xla_force_host_platform_device_count={devices}",) + cheap_compile())
