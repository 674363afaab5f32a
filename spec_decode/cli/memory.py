r"""The memory planner's command: per-device memory of a sharded decode, without allocating.

  python -m spec_decode.cli.memory --target=t5_1_1_xxl --draft=t5_1_1_small \
      --mesh=data=1,model=8 --batch=1 --input_len=512 --output_len=256 --gamma=7 \
      --dtype=bfloat16

What is computed how: `spec_decode.experiment.memory`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from spec_decode import partitioning
from spec_decode.cli import errors
from spec_decode.experiment import memory
from spec_decode.models import t5

_DEFAULT_MESHES = ["data=1,model=8"]


def _define_flags():
  flags.DEFINE_string("target", "t5_1_1_xxl", "Target preset.")
  flags.DEFINE_string("draft", "t5_1_1_small", "Draft preset, or 'none' (autoregressive).")
  flags.DEFINE_multi_string("mesh", _DEFAULT_MESHES, "Mesh spec(s), e.g. data=1,model=8.")
  flags.DEFINE_multi_integer("batch", [1], "Batch size(s).")
  flags.DEFINE_integer("input_len", 512, "Encoder tokens per row.")
  flags.DEFINE_integer("output_len", 256, "max_decode_len.")
  flags.DEFINE_integer("gamma", 7, "Draft tokens per target call.")
  flags.DEFINE_string("dtype", "bfloat16", "Parameter / activation / cache dtype.")
  flags.DEFINE_string("compile_dtype", "float32", "dtype of the compiled program (docstring).")
  flags.DEFINE_integer("depth", None, "Compile this many layers per stack (default: full).")
  flags.DEFINE_string("json_out", None, "Also write the plans as JSON here.")
  flags.DEFINE_string("from_json", None, "Print the tables of plans saved by --json_out "
                      "(nothing is compiled; the other flags are ignored).")


def _ensure_devices(needed: int) -> None:
  """Re-executes on `needed` simulated CPU devices when fewer devices are visible."""
  if jax.device_count() >= needed:
    return
  if os.environ.get("_SPEC_DECODE_MEMORY_REEXEC"):
    raise RuntimeError(f"need {needed} devices, have {jax.device_count()}")
  env = dict(os.environ, JAX_PLATFORMS="cpu", _SPEC_DECODE_MEMORY_REEXEC="1")
  flag = f"--xla_force_host_platform_device_count={needed}"
  env["XLA_FLAGS"] = " ".join(
      [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
      + [flag])
  sys.stdout.flush()
  os.execve(sys.executable, [sys.executable, "-m", "spec_decode.cli.memory", *sys.argv[1:]], env)


def _float_dtype(flag: str):
  text = getattr(flags.FLAGS, flag)
  try:
    dtype = jnp.dtype(text)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"--{flag} must name a floating dtype (bfloat16, float16, float32), "
                     f"got {text!r}")
  return dtype


def main(argv):
  with errors.handle_errors("spec_decode.cli.memory"):
    errors.quiet_logging()
    _main(argv)


def _main(argv):
  FLAGS = flags.FLAGS
  if FLAGS.from_json:
    with open(FLAGS.from_json) as f:
      _print_report([memory.MemoryPlan.from_dict(d) for d in json.load(f)])
    return
  if any("-1" in m for m in FLAGS.mesh):
    raise ValueError("memory planning needs explicit mesh sizes (no -1)")
  sizes = [partitioning.parse_mesh_spec(m, 1 << 30) for m in FLAGS.mesh]
  for m in FLAGS.mesh:  # the plans use T5X's standard rules
    partitioning.check_mesh_axes(m, partitioning.standard_logical_axis_rules())
  dtype, compile_dtype = _float_dtype("dtype"), _float_dtype("compile_dtype")
  del argv
  _ensure_devices(max(int(np.prod(list(s.values()))) for s in sizes))
  target = t5.T5Config.preset(FLAGS.target, dtype=dtype)
  draft = None if FLAGS.draft == "none" else t5.T5Config.preset(FLAGS.draft, dtype=dtype)
  plans = []
  for spec in FLAGS.mesh:
    mesh = partitioning.make_mesh(spec)
    for batch in FLAGS.batch:
      plans.append(memory.plan(target, draft, mesh, batch=batch, input_len=FLAGS.input_len,
                        output_len=FLAGS.output_len, gamma=FLAGS.gamma, depth=FLAGS.depth,
                        compile_dtype=compile_dtype,
                        names=(FLAGS.target, FLAGS.draft)))
      print(f"planned mesh {spec} batch {batch}", file=sys.stderr, flush=True)
  _print_report(plans)
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump([dict(dataclasses.asdict(p), peak=p.peak, peak_low=p.peak_low) for p in plans],
                f, indent=1)


def _print_report(plans: Sequence[memory.MemoryPlan]) -> None:
  print(memory.describe(plans[0]))
  print()
  print(memory.format_table(plans))
  print()
  print(memory.format_fits(plans))


if __name__ == "__main__":
  _define_flags()
  errors.define_flags()
  app.run(main, flags_parser=errors.flags_parser("spec_decode.cli.memory"))
