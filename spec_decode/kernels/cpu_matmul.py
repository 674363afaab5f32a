"""Weight-streaming matrix products for decoding on XLA:CPU (an XLA FFI custom call).

A decode step multiplies a handful of rows (1 token, or the gamma + 1 tokens of
a verify call, times the batch) by every weight matrix. XLA:CPU runs a 1-row
product as a GEMV that reads the weights once, but hands 2 or more rows to a
GEMM library call that packs the weight panel first, so on the project's CPU
verifying 5 tokens cost about 1.8-2.4 single-token steps (experiments/results/
verify_scaling.md): not the "about one step while memory bound" the paper's
argument rests on.

This module keeps each decoding weight W [K, N] in a panel layout made once
(`pack`: panels[j, k, :] = W[k, 16 j : 16 j + 16]) and multiplies by it with a
small C++ kernel (cpu_matmul.cc) that streams the panels in memory order, so
the weights are read once per call for any number of rows, and splits the
panels over XLA's intra-op threads. Every output accumulates over k in order,
so a row's result does not depend on the other rows of the call: a verify
call's logits equal single-token steps' bit for bit.

The kernel is compiled on first use with the system C++ compiler against
jaxlib's FFI headers (cached under $SPEC_DECODE_KERNEL_CACHE, default
~/.cache/spec_decode/kernels) and registered with jax. Where that is not
possible (no compiler, another backend, SPEC_DECODE_CPU_KERNELS=0) `available()`
is False and models keep XLA's dots; outputs are the same up to float rounding.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import weakref
from pathlib import Path
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_decode import compile_options

PANEL = 16
_SOURCE = Path(__file__).with_name("cpu_matmul.cc")
_TARGET = "spec_decode_small_m_matmul"
_SYMBOL = "SpecDecodeSmallMMatmul"
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
# Weight matrices with fewer elements than this keep XLA's dot (per matrix, in
# `T5.decode_params`). Measured per product on the 2-core CPU (1..11 rows, /tmp
# microbenchmark in a jitted loop, issue 13): the kernel is faster for every matrix of
# 192 x 192 and up (36,864 elements: equal at 1 row, 0.6-0.9x at 2-11 rows; 192 x 512:
# 0.86x at 1 row, 0.32-0.67x at 2-11), while on 64 x 64 and 64 x 192 matrices XLA's
# single-row product, a loop it fuses, is 0.1-0.4 us faster than a custom call. The 3.7M
# demo target (all of its matrices >= 192 x 192) then verifies 5 tokens in 1.35-1.4
# single steps against 2.3 with XLA's dots. (An earlier version of the kernel, without
# multi-panel blocks for few rows, lost to XLA's dots on that model; a model-level
# threshold of 32 MB of decoder weights kept it off then.)
MIN_PACKED_ELEMENTS = 2 ** 15
ENV_DISABLE = "SPEC_DECODE_CPU_KERNELS"
ENV_CACHE = "SPEC_DECODE_KERNEL_CACHE"
ENV_THREADS = "SPEC_DECODE_CPU_MATMUL_THREADS"


@flax.struct.dataclass
class PackedKernel:
  """A weight matrix W [K, N] as column panels [ceil(N / 16), K, 16] (zero-padded)."""
  panels: jax.Array
  n: int = flax.struct.field(pytree_node=False)

  @property
  def shape(self) -> tuple[int, int]:
    return (self.panels.shape[1], self.n)

  @property
  def dtype(self):
    return self.panels.dtype


def pack(kernel) -> PackedKernel:
  """W [K, N] float32 -> PackedKernel (one copy of the weights, made once)."""
  kernel = jnp.asarray(kernel)
  if kernel.ndim != 2 or kernel.dtype != jnp.float32:
    raise ValueError(f"pack wants a float32 [K, N] kernel, got {kernel.dtype} {kernel.shape}")
  K, N = kernel.shape
  P = -(-N // PANEL)
  padded = jnp.pad(kernel, ((0, 0), (0, P * PANEL - N)))
  return PackedKernel(panels=jnp.transpose(padded.reshape(K, P, PANEL), (1, 0, 2)), n=N)


def unpack(packed: PackedKernel) -> jax.Array:
  P, K, _ = packed.panels.shape
  return jnp.transpose(packed.panels, (1, 0, 2)).reshape(K, P * PANEL)[:, :packed.n]


def _threads() -> int:
  raw = os.environ.get(ENV_THREADS, "")
  if not raw:
    return 1 << 20  # all of XLA's intra-op threads
  try:
    n = int(raw)
  except ValueError:
    n = 0
  if n < 1:
    raise ValueError(f"{ENV_THREADS} must be a positive int, got {raw!r}")
  return n


def matmul(x, kernel: PackedKernel) -> jax.Array:
  """x [..., K] @ W -> [..., N] through the kernel (on CPU, when `available()`)."""
  reason = _register()
  if reason is not None:
    raise RuntimeError(f"the CPU decoding kernel is unavailable ({reason}); multiply by "
                       f"cpu_matmul.unpack(kernel) instead")
  K, N = kernel.shape
  if x.shape[-1] != K:
    raise ValueError(f"matmul: x has {x.shape[-1]} features, the kernel wants {K}")
  lead = x.shape[:-1]
  x2 = x.astype(jnp.float32).reshape(-1, K)
  call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x2.shape[0], N), jnp.float32),
                          vmap_method="sequential")
  return call(x2, kernel.panels, threads=np.int64(_threads())).reshape(*lead, N)


def _cpu_flags() -> str:
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith(("flags", "Features")):
        return line
  except OSError:
    pass
  return platform.processor()


def _build() -> Path:
  """Compiles cpu_matmul.cc (once per source, compiler, jaxlib and CPU) -> the .so path."""
  compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if compiler is None:
    raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
  include = jax.ffi.include_dir()
  source = _SOURCE.read_bytes()
  key = hashlib.sha256(b"\0".join([
      source, " ".join(_FLAGS).encode(), compiler.encode(), include.encode(),
      jax.__version__.encode(), _cpu_flags().encode()])).hexdigest()[:16]
  cache = Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "spec_decode" / "kernels")
  out = cache / f"cpu_matmul_{key}.so"
  if out.exists():
    return out
  cache.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
  os.close(fd)
  try:
    proc = subprocess.run([compiler, *_FLAGS, f"-I{include}", str(_SOURCE), "-o", tmp],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
      raise RuntimeError(f"{compiler} failed on {_SOURCE.name}: {proc.stderr.strip()[-2000:]}")
    os.replace(tmp, out)  # atomic: concurrent builders (test workers) each write whole files
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return out


@functools.lru_cache(maxsize=None)
def _register() -> str | None:
  """Builds and registers the kernel once per process; None on success, else why not."""
  if compile_options.switched_off(ENV_DISABLE):
    return f"disabled by {ENV_DISABLE}"
  try:
    lib = ctypes.cdll.LoadLibrary(str(_build()))
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(getattr(lib, _SYMBOL)),
                                platform="cpu")
  except Exception as e:  # no compiler, no headers, an FFI mismatch: keep XLA's dots
    logging.warning("spec_decode: CPU decoding kernel unavailable, using XLA dots (%s)", e)
    return str(e)
  return None


def available(backend: str | None = None) -> bool:
  """Whether decoding on `backend` (default: jax's default) can use the kernel."""
  backend = jax.default_backend() if backend is None else backend
  return backend == "cpu" and _register() is None


def unavailable_reason() -> str | None:
  """Why the kernel cannot be used (None when it can, on CPU)."""
  return _register()


class PackCache:
  """Packed copies of a few parameter trees, keyed by the identity of their leaves.

  Decoders are called again and again with the same parameter objects; packing
  them once per tree (not once per call, inside jit) is what makes the panel
  layout free. Entries hold weak references to the original leaves and are
  dropped when those die or when more than `size` trees have been packed.
  """

  def __init__(self, size: int = 4):
    self._size = size
    self._entries: list[tuple[tuple[int, ...], list[Any], Any]] = []

  def made(self, tree) -> bool:
    """Whether `tree` is one of the packed trees this cache holds (so needs no packing)."""
    return any(packed is tree for _, _, packed in self._entries)

  def get(self, tree, make):
    leaves = jax.tree_util.tree_leaves(tree)
    key = tuple(id(leaf) for leaf in leaves)
    for i, (k, refs, packed) in enumerate(self._entries):
      if k == key and all(r() is leaf for r, leaf in zip(refs, leaves)):
        self._entries.append(self._entries.pop(i))
        return packed
    packed = make(tree)
    try:
      refs = [weakref.ref(leaf) for leaf in leaves]
    except TypeError:  # leaves that cannot be weakly referenced (numpy arrays): no caching
      return packed
    self._entries = [e for e in self._entries if all(r() is not None for r in e[1])]
    self._entries.append((key, refs, packed))
    del self._entries[:-self._size]
    return packed
