"""The commands' persistent cache of compiled programs (`spec_decode.compile_cache`): a
second process loads what the first compiled, from a directory per jax version and CPU;
switched off, or where no directory can be made, nothing is cached and nothing fails; a
cache chosen outside (the suite's own, conftest.py) is kept with its settings."""

import json
import os
import subprocess
import sys

import jax

from spec_decode import compile_cache
from spec_decode.cli import main as cli_main
from spec_decode.kernels import cpu_matmul

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# enable(), one small program compiled and run, then what the cache says (one JSON line)
_CHILD = """
import json, sys
from spec_decode import compile_cache
directory = compile_cache.enable()
import jax, jax.numpy as jnp
y = jax.jit(lambda x: jnp.tanh(x * 3.25) + x.sum())(jnp.arange(6.0))
print(json.dumps({"enabled": directory, "stats": compile_cache.stats(),
                  "max_size": jax.config.jax_compilation_cache_max_size,
                  "key": compile_cache.machine_key(), "y": float(y[1])}))
"""


def _child(tmp_path, **env):
  clean = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                        compile_cache.ENV_DIR)}
  clean.update(HOME=str(tmp_path / "home"), JAX_PLATFORMS="cpu", **env)
  proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=clean,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_machine_key_names_the_cpu(monkeypatch):
  """The key is the kernel build's (`cpu_matmul.build_depends`) with jaxlib's version: it
  follows the CPU's model and feature flags."""
  key = compile_cache.machine_key()
  assert key == compile_cache.machine_key() and len(key) == 16
  assert compile_cache.default_dir().name == key
  model, flags = cpu_matmul.cpu_info()["model"], cpu_matmul._cpu_flags()
  monkeypatch.setattr(cpu_matmul, "_cpu_flags", lambda: flags + " avx512f_made_up")
  assert compile_cache.machine_key() != key
  monkeypatch.setattr(cpu_matmul, "_cpu_flags", lambda: flags)
  monkeypatch.setattr(cpu_matmul, "cpu_info", lambda: {"model": model + " (model 17)"})
  assert compile_cache.machine_key() != key


def test_a_cache_chosen_outside_is_kept():
  outside = os.environ["JAX_COMPILATION_CACHE_DIR"]  # conftest.py's, for the whole run
  assert compile_cache.enable() == outside
  assert jax.config.jax_compilation_cache_dir == outside
  assert compile_cache.stats()["dir"] == outside


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
  first = _child(tmp_path)
  want = tmp_path / "home" / ".cache" / "spec_decode" / "xla" / first["key"]
  assert first["enabled"] == str(want) and first["stats"]["dir"] == str(want)
  assert first["stats"]["requests"] >= 1 and first["stats"]["hits"] == 0
  assert first["max_size"] == compile_cache.MAX_BYTES  # bounded: least recently used out
  assert any(want.iterdir())
  second = _child(tmp_path)
  assert second["stats"]["requests"] == first["stats"]["requests"]
  assert second["stats"]["hits"] == second["stats"]["requests"]  # every program loaded
  assert second["y"] == first["y"]
  # a directory named outright
  named = _child(tmp_path, **{compile_cache.ENV_DIR: str(tmp_path / "mine")})
  assert named["enabled"] == str(tmp_path / "mine") and any((tmp_path / "mine").iterdir())


def test_switched_off_or_without_a_directory_nothing_is_cached_and_nothing_fails(tmp_path):
  off = _child(tmp_path, **{compile_cache.ENV_DIR: "off"})
  assert off["enabled"] is None and off["stats"] == {"dir": None, "requests": 0, "hits": 0}
  assert not (tmp_path / "home" / ".cache").exists()
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  blocked = _child(tmp_path, **{compile_cache.ENV_DIR: str(blocker / "cache")})
  assert blocked["enabled"] is None and blocked["stats"]["requests"] == 0
  assert blocked["y"] == off["y"]


def test_the_summary_says_how_many_programs_the_cache_answered():
  def summary(cache):
    return cli_main.format_summary({"experiment": {}, "table_row": "",
                                    "machine": {"backend": "cpu", "devices": "1 x cpu",
                                                "compile_cache": cache}})
  text = summary({"dir": "/c/xla/k", "requests": 87, "hits": 73})
  assert "compiled programs: 73 of 87 loaded from the cache in /c/xla/k" in text
  assert "compiled programs" not in summary({"dir": "/c/xla/k", "requests": 0, "hits": 0})
  assert "compiled programs" not in summary({"dir": None, "requests": 0, "hits": 0})
