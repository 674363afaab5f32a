"""Test setup: 8 simulated CPU devices (before jax is imported), float32, CPU only.

Compiled executables are dropped after each test module. XLA:CPU maps every
executable's code and data into its own memory regions (about 6 per small
function, hundreds for a decoding loop), and a Linux process may hold at most
vm.max_map_count (65530 by default) of them: the whole suite in one process
kept every executable alive and crossed that limit, after which the next
compilation's mmap failed and XLA crashed with a segmentation fault.
"""

import gc
import os
import shutil
import tempfile

import pytest

import xla_flags

_OWN_CACHE = None  # the compilation cache directory this process made, if any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# 8 simulated devices. The suite is bound by XLA:CPU compile time (hundreds of decoding
# loops, most run a few times), so the flags after the first make compiling cheaper:
# LLVM's backend optimisation off (about a quarter less); XLA's elemental emitters for
# fused loops instead of its MLIR fusion emitters, and each program's code generated as one
# LLVM module rather than split for parallel code generation (together about 45% less
# again, measured on a tiny pair's decoding loops on 2 AMD EPYC cores); a jaxlib that does
# not know one of them goes without it (`xla_flags.cheap_compile`). They change how XLA
# generates code, not what a program computes; results may differ from a default build in
# the last bits (e.g. where LLVM would fuse a multiply-add), so every program a test
# compares compiles alike: subprocesses inherit the setting.
for _flag in ("--xla_force_host_platform_device_count=8",) + xla_flags.cheap_compile():
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
# One persistent compilation cache for the whole run: both xdist workers and every
# subprocess a test starts (they inherit the environment of the process that loads this file
# first, pytest's controller) compile the same programs many times over (the tiny pairs'
# decoding loops in every test file, the main job in-process and as a command), and the
# compiled programs of each file are dropped after it (below). A new directory per run,
# removed at its end (`pytest_unconfigure`), so no run reads another's programs; a cache
# directory set outside (JAX_COMPILATION_CACHE_DIR) is used and kept. Every program is
# written (no minimum compile time), so small ones are shared too. Unbounded size: a
# bounded cache locks and rescans the whole directory at every write; without the lock, a
# read that meets another process's write in progress finds a truncated entry, which JAX
# reports as a warning and compiles instead (the bits do not depend on which happened).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE = tempfile.mkdtemp(
      prefix="spec_decode_test_jax_cache_")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The CPU kernel's variant fixed (all give the same bits, tested in test_cpu_matmul.py):
# no variant tuning, which would time every small shape the tests use.
os.environ.setdefault("SPEC_DECODE_CPU_KERNEL_VARIANT", "8p")


def pytest_collection_finish(session):
  """Python's cycle collector less often. Tracing a decoding loop allocates millions of
  small objects, and at the default thresholds (700, 10, 10) the collector ran ~2,400
  times in test_adaptive.py alone, 3.3 s of its 75 s on 2 AMD EPYC cores; every object the
  test modules imported is frozen out of its scans, and it runs a generation-0 pass per
  50,000 allocations: 0.7 s. The fixture below still collects after every module."""
  del session
  gc.collect()
  gc.freeze()
  gc.set_threshold(50_000, 20, 20)


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_executables():
  yield
  import jax  # imported by every test module already; here only to clear its caches
  jax.clear_caches()
  gc.collect()


def pytest_unconfigure(config):
  del config
  if _OWN_CACHE:
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)
