"""A persistent cache of compiled XLA programs for the commands (JAX's compilation cache).

The no-argument main job compiles about 90 programs (the decoding loops of both decoders,
the step timers, the warm-up's probes): 52 s of compilation in one run on 2 AVX2-only AMD
EPYC cores (family 25, model 1). The same command run again compiles the same programs.
`enable()`, called by the commands before they compile anything, points JAX's persistent
compilation cache at a directory of this user's, so a rerun, or another experiment with
the same models and shapes (every run of a table shares its target's autoregressive
loops), loads them instead: that job run twice on that machine took 101 s, then 68 s (73
of its 87 programs loaded; those of a gamma the noisy warm-up had not chosen before
compiled), with token-identical outputs.

Where: $SPEC_DECODE_COMPILE_CACHE if set (0, off, false or no switch it off), else
~/.cache/spec_decode/xla/<key>, where key hashes jax's and jaxlib's versions and the CPU
(its model and /proc/cpuinfo flags, `machine_key`): XLA:CPU compiles for the host's
instruction set, so a home directory shared between machines never loads a program built
for another CPU. A cache directory chosen outside (JAX_COMPILATION_CACHE_DIR, or
jax.config) is kept as it is, as are its settings (the test suite's per-run cache).

JAX keys each program by its HLO, compile options, XLA_FLAGS, devices and versions; only
process 0 of a multi-process run writes. The cache is bounded (`MAX_BYTES`, least
recently used out first; JAX evicts with the `filelock` package, an install requirement:
without it the cache grows unbounded). A directory that cannot be made leaves the cache
off (a cache must never fail a run).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import jax

from spec_decode import compile_options

ENV_DIR = "SPEC_DECODE_COMPILE_CACHE"
MAX_BYTES = 2 << 30
_HIT = "/jax/compilation_cache/cache_hits"
_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"

_state: dict[str, Any] = {"dir": None, "hits": 0, "requests": 0, "listening": False}


def machine_key() -> str:
  """The name of this machine's cache directory: `cpu_matmul.build_depends()` (jax's
  version, the CPU's model and feature flags, as the kernel's own build cache is keyed)
  and jaxlib's version, hashed."""
  import jaxlib

  from spec_decode.kernels import cpu_matmul
  text = "\0".join([*cpu_matmul.build_depends(), getattr(jaxlib, "__version__", "?")])
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def default_dir() -> Path:
  """~/.cache/spec_decode/xla/<hash of jax, jaxlib and the CPU>."""
  return Path.home() / ".cache" / "spec_decode" / "xla" / machine_key()


def _count(event: str, **kwargs) -> None:
  del kwargs
  if _state["dir"] is None:  # JAX counts requests with no directory too
    return
  if event == _HIT:
    _state["hits"] += 1
  elif event == _REQUEST:
    _state["requests"] += 1


def enable() -> str | None:
  """Turns JAX's persistent compilation cache on for this process (see the module doc),
  before its first compilation; the directory in use, or None where it is off. Idempotent."""
  if not _state["listening"]:
    jax.monitoring.register_event_listener(_count)
    _state["listening"] = True
  outside = jax.config.jax_compilation_cache_dir
  if outside:
    _state["dir"] = outside
    return outside
  raw = os.environ.get(ENV_DIR, "").strip()
  if raw and compile_options.switched_off(ENV_DIR):
    _state["dir"] = None
    return None
  directory = Path(raw).expanduser() if raw else default_dir()
  try:
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
  except OSError as e:
    logging.info("spec_decode: no compilation cache (%s: %s)", directory, e)
    _state["dir"] = None
    return None
  try:
    import filelock  # noqa: F401  (JAX evicts least recently used entries with it)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
  except ImportError:
    pass
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_compilation_cache_dir", str(directory))
  _state["dir"] = str(directory)
  return str(directory)


def stats() -> dict[str, Any]:
  """{'dir': the cache directory or None, 'requests': compilations that consulted it since
  `enable`, 'hits': those it answered}."""
  return {"dir": _state["dir"], "requests": _state["requests"], "hits": _state["hits"]}
