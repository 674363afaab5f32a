r"""The CPU kernel of this checkout against the kernel of another revision, on this CPU.

  python -m experiments.kernel_ab --base 4083bfb                 # big EnDe demo target
  python -m experiments.kernel_ab --base HEAD~1 --rows 1,3 --placements cache --name quick
  python -m experiments.kernel_ab --base HEAD --rows 1,5 --placements decode --repeats 20
  python -m experiments.kernel_ab --base HEAD --rows 1,6 --placements decode \
      --target demo:cnndm_target_big --input_length 300 --kernel_weights auto

Builds `spec_decode/kernels/cpu_matmul.cc` as it is in this checkout and as it was at git
revision --base (or from the file --base_source), both with the flags the project uses,
and times the two builds' products over the target decoder's matrices (each shape weighted
by how often a step multiplies by it, as `experiments.kernel_variants` does), per weight
format, row count and placement of the weights:
- stream: copies of each matrix end to end through 48 MiB, so every product reads its
  weights from memory, as a decode step of the big target does;
- cache: the same matrix again and again, so it comes from the caches, as a small draft's
  weights do.
Each build takes its fastest variant per shape (what the tuner would choose), one thread,
the least time over --repeats rounds; the two builds take turns within each round (the
order reversed every other round), so load from elsewhere falls on both alike.
- decode: the target's whole decode step of `rows` tokens per row at batch --decode_batch
  (default 1), --input_length encoder positions per row (default 32: the cross-attention
  an EnDe sentence reads; ~300 for a CNN/DM article) (`timing.step_time`'s
  marginal cost inside a jitted loop: the products on the kernel's threads as decoding
  runs them, its attention, XLA's own fusions), one compiled loop per build in this
  process (the base build's handlers registered under target names of their own), the
  loops taking turns in each of --repeats rounds; both use the variants this checkout's
  tuner chose (SPEC_DECODE_CPU_KERNEL_VARIANT pins one). Reported: each build's median
  and the median over rounds of the per-round ratio. Single-thread sweeps can miss what
  two threads sharing the memory do; this measures it.
A kernel change is judged by these ratios, measured in one run, not by two runs of a
decoder at different times: on a noisy 2-core machine end-to-end figures move by more than
most kernel changes. Writes <results_dir>/kernel_ab_<cpu family>[_<name>].{md,csv,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Sequence

from experiments import harness, kernel_variants, roofline
from experiments.harness import Column, Output, fmt

PLACEMENTS = ("stream", "cache", "decode")


def base_source(args) -> tuple[str, str]:
  """(the base kernel's source text, what it is: 'git <rev>' or the file's path)."""
  if args.base_source:
    return Path(args.base_source).read_text(), args.base_source
  from spec_decode import paths
  from spec_decode.kernels import cpu_matmul
  root = Path(paths.REPO_ROOT).resolve()
  rel = Path(cpu_matmul._SOURCE).resolve().relative_to(root)
  proc = subprocess.run(["git", "-C", str(root), "show", f"{args.base}:{rel.as_posix()}"],
                        capture_output=True, text=True)
  if proc.returncode != 0:
    raise SystemExit(f"--base {args.base}: git cannot show {rel} there ({proc.stderr.strip()})")
  return proc.stdout, f"git {args.base}"


def _load(path: Path):
  lib = ctypes.CDLL(str(path))
  lib.spec_decode_sweep.restype = ctypes.c_double
  lib.spec_decode_sweep.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 7
  return lib


def builds(text: str) -> tuple[dict[str, Any], Path]:
  """({'base': library, 'this': library}, the base library's path): the base source and
  this checkout's, built as `cpu_matmul` builds its kernel (cached by source, compiler and
  flags)."""
  import jax

  from spec_decode import native
  from spec_decode.kernels import cpu_matmul
  flags = [*cpu_matmul._FLAGS, f"-I{jax.ffi.include_dir()}"]
  depends = cpu_matmul.build_depends()
  with tempfile.TemporaryDirectory() as tmp:
    src = Path(tmp) / cpu_matmul._SOURCE.name
    src.write_text(text)
    base = native.build(src, flags, depends_on=depends)
  return {"base": _load(base), "this": _load(native.build(cpu_matmul._SOURCE, flags,
                                                         depends_on=depends))}, base


BASE_PREFIX = "kernel_ab_base_"


def register_base(path: Path) -> None:
  """Registers the base library's FFI handlers with jax under BASE_PREFIX + each target's
  name (this checkout's keep theirs, registered by `cpu_matmul`)."""
  from spec_decode.kernels import cpu_matmul
  if cpu_matmul.unavailable_reason() is not None:  # registers this checkout's first
    raise SystemExit(f"the CPU kernel is unavailable: {cpu_matmul.unavailable_reason()}")
  cpu_matmul.register_handlers(ctypes.CDLL(str(path)), BASE_PREFIX)


def check_targets(hlo: str, *, base: bool) -> None:
  """Raises unless the compiled program `hlo` calls the kernel, and only the base build's
  handlers (base) or only this checkout's: an A/B whose two loops call one build measures
  nothing."""
  import re
  targets = set(re.findall(r'custom_call_target="([^"]+)"', hlo))
  ours = {t for t in targets if "spec_decode_" in t}
  based = {t for t in ours if t.startswith(BASE_PREFIX)}
  if not ours or (based != ours if base else based):
    which = "the base build's" if base else "this checkout's"
    raise RuntimeError(f"{which} decode loop calls kernel targets {sorted(ours) or 'none'}: "
                       f"not only {which}")


def base_targets():
  """Within: programs traced call the base build's handlers (`register_base`)."""
  from spec_decode.kernels import cpu_matmul
  return cpu_matmul.handlers_under(BASE_PREFIX)


def time_decode(model, params, tokens: int, *, repeats: int, steps: int = 16,
                input_length: int = 32, position: int = 24, batch: int = 1) -> dict[str, Any]:
  """Seconds per decode step of `tokens` tokens per row (`batch` rows, `input_length`
  encoder positions each) with each build's loop, compiled in turn (the base inside
  `base_targets`) and timed taking turns: {'base': median, 'this': median, 'ratio': the
  median over rounds of this / base}."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from spec_decode.decoding import timing
  enc = jnp.asarray(np.random.RandomState(0).randint(
      2, model.vocab_size, (batch, input_length)).astype(np.int32))
  cache_length = position + tokens + 1
  loops = {}
  for name in ("base", "this"):
    timing._jitted_steps.cache_clear()  # a fresh jit per build: no trace shared between them
    # compiled ahead of time inside the build's block: the model's jitted decode, traced
    # there with the build's target names, is not reused by the other build's loops
    make = lambda k: timing.decode_loop(model, params, enc, num_tokens=tokens,
                                        cache_length=cache_length, position=position, steps=k,
                                        compiled=True)
    with base_targets() if name == "base" else contextlib.nullcontext():
      pair = timing.marginal_pair(make, steps)
    for f in pair:
      check_targets(f.compiled_text(), base=name == "base")
      jax.block_until_ready(f())
    loops[name] = pair
  timing._jitted_steps.cache_clear()
  # The builds take turns, the order reversed every other round (with a fixed order, A/A
  # runs of one build read 1.00 and 1.06 at 1 token: the second loop of a round can lose).
  rounds = timing.interleaved(loops, repeats=repeats, alternate=True)
  ratios = [t / b for t, b in zip(rounds["this"], rounds["base"])]
  return {"base": statistics.median(rounds["base"]), "this": statistics.median(rounds["this"]),
          "ratio": statistics.median(ratios)}


def time_shape(libs, M: int, K: int, N: int, dtype, pairs: bool, variants, *, cached: bool,
               repeats: int) -> dict[str, float]:
  """{build: seconds of one [M, K] x [K, N] product by its fastest variant}, the builds
  and variants taking turns in each round (round 0 warms up; the least of the rest).
  cached: one copy of the weights, swept again and again (`calls` sweeps per timing)."""
  from spec_decode.kernels import cpu_matmul
  stream = cpu_matmul.TUNE_STREAM_BYTES
  args, copies = cpu_matmul.sweep_operands(M, K, N, dtype, pairs, 1 if cached else stream)
  calls = max(1, stream // (8 * cpu_matmul.panel_bytes(K, N, dtype))) if cached else 1
  best: dict[tuple[str, str], float] = {}
  order = list(libs)
  for r in range(repeats + 1):
    for v in variants:
      for name in (order if r % 2 == 0 else order[::-1]):
        t = sum(libs[name].spec_decode_sweep(*args(v)) for _ in range(calls))
        if t < 0:
          raise SystemExit(f"the {name} build refused variant {v} for {dtype} weights")
        if r:
          best[(name, v)] = min(best.get((name, v), float("inf")), t / (copies * calls))
  return {name: min(best[(name, v)] for v in variants) for name in libs}


def measure(args) -> tuple[dict[str, Any], list[dict[str, Any]]]:
  from spec_decode.kernels import cpu_matmul
  info = cpu_matmul.describe()
  if info["kernel"] != "on":
    raise SystemExit(f"the CPU kernel is {info['kernel']}: nothing to compare")
  text, what = base_source(args)
  libs, base_path = builds(text)
  if "decode" in args.placements:
    register_base(base_path)
  variants = cpu_matmul.variants()
  models = harness.load_models(args.target)
  rows = []
  for weights in args.kernel_weights:
    model = dataclasses.replace(models.target, kernel_weights=weights)
    shapes = kernel_variants.decoder_shapes(model.decode_params(models.target_params))
    if not shapes:
      raise SystemExit(f"{args.target}: no decoder matrix is packed for the kernel")
    for placement in args.placements:
      for m in args.rows:
        if placement == "decode":
          t = time_decode(model, models.target_params, m, repeats=args.repeats,
                          input_length=args.input_length, batch=args.decode_batch)
          row = {"weights": weights, "placement": placement,
                 "rows": m * args.decode_batch,
                 "base_ms": t["base"] * 1e3, "this_ms": t["this"] * 1e3, "ratio": t["ratio"]}
          rows.append(row)
          print(f"  {weights} decode step, batch {args.decode_batch} x {m} tokens: base "
                f"{row['base_ms']:.3f} ms, this {row['this_ms']:.3f} ms, this / base (median "
                f"of rounds) {row['ratio']:.3f}", flush=True)
          continue
        total = {"base": 0.0, "this": 0.0}
        for (K, N, dtype, pairs), count in shapes.items():
          t = time_shape(libs, m, K, N, dtype, pairs, variants,
                         cached=placement == "cache", repeats=args.repeats)
          for name in total:
            total[name] += count * t[name]
        row = {"weights": weights, "placement": placement, "rows": m,
               "base_ms": total["base"] * 1e3, "this_ms": total["this"] * 1e3,
               "ratio": total["this"] / total["base"]}
        rows.append(row)
        print(f"  {weights} {placement} rows {m}: base {row['base_ms']:.3f} ms, this "
              f"{row['this_ms']:.3f} ms, this / base {row['ratio']:.3f}", flush=True)
  return {"cpu": info, "base": what, "variants": list(variants)}, rows


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.kernel_ab", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--base", default="HEAD", help="git revision of the kernel to compare with")
  p.add_argument("--base_source", default=None,
                 help="a cpu_matmul.cc file to compare with instead of --base")
  kernel_variants.add_shape_args(p, "1,2,3,4,5,6,7,8")
  p.add_argument("--placements", default="stream,cache",
                 help=f"comma list of {PLACEMENTS}")
  p.add_argument("--decode_batch", type=int, default=1,
                 help="decode placement: rows of the batch (each decodes --rows tokens)")
  p.add_argument("--input_length", type=int, default=32,
                 help="decode placement: encoder positions per row (cross-attention reads)")
  args = p.parse_args(list(argv))
  kernel_variants.check_shape_args(p, args)
  args.placements = [x for x in args.placements.split(",") if x]
  bad = [x for x in args.placements if x not in PLACEMENTS]
  if bad or not args.placements:
    p.error(f"--placements: each must be one of {PLACEMENTS}, got {bad or 'none'}")
  if args.decode_batch < 1 or args.input_length < 1:
    p.error("--decode_batch and --input_length must be >= 1")
  if args.base_source and not Path(args.base_source).is_file():
    p.error(f"--base_source {args.base_source}: no such file")
  return args


def run(args, meta: dict) -> Output:
  machine, rows = measure(args)
  meta["kernel_ab"] = machine
  cols = [Column("weights", "kernel weights"), Column("placement", "weights from"),
          Column("rows", "rows"), Column("base_ms", "base (ms)", lambda x: f"{x:.3f}"),
          Column("this_ms", "this checkout (ms)", lambda x: f"{x:.3f}"),
          Column("ratio", "this / base", lambda x: fmt(x, 3))]
  info = machine["cpu"]
  notes = [f"CPU: {info['model']}, features {', '.join(info['features']) or 'none listed'}; "
           f"target {args.target}; base kernel: {machine['base']}."]
  if set(args.placements) & {"stream", "cache"}:
    notes.append(
        "stream / cache: time of one decode step's products with the decoder's matrices "
        "(each shape times how many the decoder has), one thread, each build's fastest "
        f"variant per shape; the least of {args.repeats} rounds, the builds taking turns "
        "within each round. stream: the weights read from memory (copies through 48 MiB); "
        "cache: one matrix again and again (as a small draft's weights stay in the caches).")
  if "decode" in args.placements:
    notes.append(
        f"decode: the target's whole decode step at batch {args.decode_batch}, "
        f"{args.input_length} encoder positions per row, `rows` = batch x tokens (marginal "
        "cost in a jitted loop; the products on two threads as decoding runs them, attention, "
        "XLA's fusions), both builds with the variants this checkout's tuner chose; each "
        f"build's median over {args.repeats} rounds, the order reversed every other round; "
        "'this / base' is the median of the rounds' ratios.")
  notes.append("this / base < 1: this checkout's kernel is faster. Both builds give the same "
               "bits (tests/test_cpu_matmul.py checks every variant against float32 and "
               "float64).")
  return Output(roofline.result_stem("kernel_ab", info, args.name),
                f"CPU kernel against {machine['base']} ({info['model']})", cols, rows,
                notes=notes)


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.kernel_ab", argv, parse_args, run)


if __name__ == "__main__":
  main()
