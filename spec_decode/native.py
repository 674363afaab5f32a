"""Small C++ sources built at first use into a per-user cache of shared libraries.

The CPU decoding kernel (`kernels/cpu_matmul.cc`) and the lost-coordinator abort
handler (`host_abort.cc`) are compiled on the machine that runs them: the library's
name is a hash of the source, the compiler and its flags, and whatever else the caller
says the binary depends on (the CPU, jaxlib's headers), so a home directory shared
between different machines never loads a binary built for another.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

ENV_CACHE = "SPEC_DECODE_KERNEL_CACHE"


def cache_dir() -> Path:
  """$SPEC_DECODE_KERNEL_CACHE, else ~/.cache/spec_decode/kernels."""
  return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "spec_decode" / "kernels")


def compiler() -> str:
  """$CXX, else g++ or c++ on PATH; RuntimeError when there is none."""
  found = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if found is None:
    raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
  return found


def build(source: Path, flags: Sequence[str], depends_on: Sequence[str] = ()) -> Path:
  """Compiles `source` with `flags` once per (source, compiler, flags, depends_on) -> the
  shared library's path. RuntimeError naming the compiler's complaint when it fails."""
  cxx = compiler()
  text = Path(source).read_bytes()
  key = hashlib.sha256(b"\0".join([text, " ".join(flags).encode(), cxx.encode(),
                                   *(d.encode() for d in depends_on)])).hexdigest()[:16]
  out = cache_dir() / f"{Path(source).stem}_{key}.so"
  if out.exists():
    return out
  out.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
  os.close(fd)
  try:
    proc = subprocess.run([cxx, *flags, str(source), "-o", tmp], capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
      raise RuntimeError(f"{cxx} failed on {Path(source).name}: {proc.stderr.strip()[-2000:]}")
    os.replace(tmp, out)  # atomic: concurrent builders (test workers) each write whole files
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return out
