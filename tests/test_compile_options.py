"""The project's lowering of JAX's Threefry hash on CPU: unrolled, with unchanged bits."""

import json
import os
import subprocess
import sys

_PROBE = """
import json
import jax, numpy as np
from spec_decode import compile_options
import spec_decode.decoding  # applies compile_options.unroll_threefry_on_cpu()

def draws(key):
  a = jax.random.fold_in(key, 3)
  return (jax.random.uniform(a, (101,)), jax.random.split(key, 7), jax.random.bits(key, (33,)),
          jax.random.categorical(a, np.zeros((4, 9), np.float32)))

f = jax.jit(draws)
key = jax.random.PRNGKey(42)
hlo = f.lower(key).compile().as_text()
u, keys, bits, cat = f(key)
print(json.dumps({"unrolled": compile_options.unroll_threefry_on_cpu(),
                  "loops": hlo.count(" while("),
                  "bits": [np.asarray(u).view(np.uint32).tolist(), np.asarray(keys).tolist(),
                           np.asarray(bits).tolist(), np.asarray(cat).tolist()]}))
"""


def _probe(**env):
  out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu", **env}, timeout=300)
  assert out.returncode == 0, out.stderr
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_threefry_is_unrolled_on_cpu_with_the_same_bits():
  ours = _probe()
  jax_own = _probe(SPEC_DECODE_UNROLLED_THREEFRY="0")
  assert ours["unrolled"] and not jax_own["unrolled"]
  assert jax_own["loops"] > 0  # JAX's CPU lowering: a rolled while loop per hash
  assert ours["loops"] == 0
  assert ours["bits"] == jax_own["bits"]  # the same hash: every random bit unchanged
