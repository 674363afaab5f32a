"""The memory planner: exact params/caches per device, compiled program numbers consistent.

The XXL/small command runs with --depth=1 (one layer per stack compiled, a
few seconds); its params and caches are still the full models' and are
checked against closed-form sizes.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_decode import decoding, partitioning
from spec_decode.experiment import memory
from spec_decode.models import t5


def _params_bytes(config, mesh, rules):
  model = t5.T5(config)
  return partitioning.shard_bytes(model.param_shapes(),
                                  partitioning.param_shardings(model, mesh, rules))


@pytest.mark.slow
def test_xxl_small_command(tmp_path):
  out = tmp_path / "plan.json"
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
  env.pop("XLA_FLAGS", None)  # the command re-executes itself with 8 CPU devices
  proc = subprocess.run(
      [sys.executable, "-m", "spec_decode.cli.memory", "--target=t5_1_1_xxl",
       "--draft=t5_1_1_small", "--mesh=data=1,model=8", "--batch=1", "--input_len=512",
       "--output_len=256", "--gamma=7", "--dtype=bfloat16", "--depth=1",
       f"--json_out={out}"],
      env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "| mesh | batch | target params |" in proc.stdout
  assert "TPU v4 (32 GiB)" in proc.stdout
  (p,) = json.loads(out.read_text())
  xxl, small = t5.T5Config.preset("t5_1_1_xxl"), t5.T5Config.preset("t5_1_1_small")
  assert p["target_params_total"] == t5.T5(xxl).num_params() * 2  # bfloat16
  assert p["draft_params_total"] == t5.T5(small).num_params() * 2
  # Model-parallel target: 1/8 per device (only the norm scales are replicated).
  np.testing.assert_allclose(p["target_params"], p["target_params_total"] / 8, rtol=0.05)
  assert p["target_params"] >= p["target_params_total"] / 8
  assert p["draft_params"] == p["draft_params_total"]  # the draft is replicated
  # Caches: per layer K and V of [B, L, N/8, H] (self, L = 256 + gamma + 1) and
  # [B, S, N/8, H] (cross) in bfloat16, plus the [B, S] mask and [B] lengths.
  room, S = 256 + 7 + 1, 512
  kv = lambda n_layers, heads, length: n_layers * 2 * length * heads * 64 * 2
  assert p["target_cache"] == kv(24, 64 // 8, room) + kv(24, 64 // 8, S) + S + 4
  assert p["draft_cache"] == kv(8, 6, room) + kv(8, 6, S) + S + 4  # 6 heads: replicated
  # The compiled depth-1 float32 program's arguments are its params and inputs.
  mesh = partitioning.make_mesh("data=1,model=8")
  shallow = dict(num_encoder_layers=1, num_decoder_layers=1, dtype=jnp.float32)
  expected = (_params_bytes(xxl.replace(**shallow), mesh, partitioning.DEFAULT_RULES)
              + _params_bytes(small.replace(**shallow), mesh,
                              partitioning.data_parallel_rules()) + p["inputs"])
  np.testing.assert_allclose(p["program"]["argument"], expected, rtol=0.01)
  assert p["compiled_depth"] == 1 and p["compile_dtype"] == "float32"
  assert 0 < p["working"] < p["program"]["temp"] + p["program"]["output"]
  assert p["peak_low"] < p["peak"]  # float32 working memory halved for bfloat16
  # The full-depth persistent bytes dwarf the depth-1 program's own peak.
  program_peak = p["program"]["argument"] + p["program"]["temp"] + p["program"]["output"] \
      - p["program"]["alias"]
  assert p["peak"] > program_peak


def test_plan_autoregressive_tiny_exact():
  """Full-depth compile in the model's own dtype: arguments equal the analytic bytes."""
  cfg = t5.T5Config.preset("t5_1_1_tiny")
  mesh = partitioning.make_mesh("data=2,model=4")
  p = memory.plan(cfg, None, mesh, batch=4, input_len=6, output_len=5,
                  compile_dtype=jnp.float32)
  assert p.draft is None and p.draft_params == 0 and p.draft_cache == 0
  assert p.program.argument == p.target_params + p.inputs
  # batch 4 on data=2: 2 rows per device; 4 heads on model=4: 1 head per device.
  layers, H = cfg.num_decoder_layers, cfg.head_dim
  assert p.target_cache == layers * 2 * 2 * (5 + 6) * 1 * H * 4 + 2 * 6 + 2 * 4
  assert p.working > 0
  # Compiled in its own dtype at full depth, the plan's peak is the program's own peak,
  # read here from an independent compile of the sharded decode on real arrays.
  model = t5.T5(cfg)
  params = model.init(jax.random.PRNGKey(0))
  enc = np.ones((4, 6), np.int32)
  fn, shardings = decoding.runner.sharded(decoding.Autoregressive(), model, None, mesh,
                                          batch_shape=enc.shape, max_decode_len=5,
                                          sampling=decoding.Sampling())
  args = partitioning.put((params, None, enc, None, jax.random.PRNGKey(0),
                           np.arange(4, dtype=np.int32)), shardings)
  m = fn.lower(*args).compile().memory_analysis()
  compiled_peak = (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
                   - m.alias_size_in_bytes)
  assert p.peak == compiled_peak
  assert p.program.argument == m.argument_size_in_bytes
  assert p.peak_low == p.peak  # compiled in the plan's own dtype
  assert p.fits(p.peak) == "yes" and p.fits(p.peak - 1) == "no"
  assert "| data=2,model=4 | 4 |" in memory.format_table([p])
  assert memory.format_fits([p], {"small": p.peak - 1}).splitlines()[-1].endswith("| no |")
  with pytest.raises(ValueError, match="batch"):
    memory.plan(cfg, None, mesh, batch=0, input_len=6, output_len=5)
