r"""The decode step against this CPU's limits: bandwidth and multiply-add peaks, T_p, T_q and
t(N) = T_verify(N) / T_p at several batch sizes and weight types.

  python -m experiments.roofline                         # big EnDe demo pair, batch 1 / 8 / 32
  python -m experiments.roofline --batch_sizes 1 --tokens 1,5 --repeats 3 --name quick

A decode step reads every decoder weight once (bytes / read bandwidth) and multiplies
batch x N rows by it (2 x decoder weights x rows FLOPs / multiply-add peak); it can go no
faster than the larger of the two. This measures the machine (read bandwidth over a
buffer the size of the packed decoder weights, with as many threads as the process may
use; the peak of independent multiply-add chains at each vector width the kernel has, and
of bfloat16 dot-product chains where it has them: the bound of 'bfloat16_dot' weights),
then the target's single-token step T_p, the draft's T_q and the target's t(N) with
marginal step costs (`timing.step_time`, the weights packed as decoding packs them), for
each batch size and each --kernel_weights setting (`T5.kernel_weights`: 'auto' packs a
checkpoint stored in bfloat16 as bfloat16), and reports achieved GB/s and GFLOP/s as
fractions of the peaks and the measured time over the bound. Names the CPU, its
features and the kernel's vector width per shape. Writes
<results_dir>/roofline_<cpu family>[_<name>].{md,csv,json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, Sequence

from experiments import harness
from experiments.harness import Column, Output, fmt

DEFAULT_TOKENS = "1,2,3,4,5,6,8,12,16"


def cpu_family(model: str, features: Sequence[str] = ()) -> str:
  """'amd_epyc_avx512', 'intel_xeon_avx512', 'amd_epyc_avx2', ... from a CPU model name and
  its features (the result file's suffix): the maker's line, then the widest vectors the
  kernel can use, which set its variants (one name covers CPUs of several kinds)."""
  m = model.lower()
  name = re.sub(r"[^a-z0-9]+", "_", m.split("(")[0]).strip("_") or "cpu"
  for key, family in (("epyc", "amd_epyc"), ("xeon", "intel_xeon"), ("ryzen", "amd_ryzen"),
                      ("core", "intel_core")):
    if key in m:
      name = family
      break
  width = next((w for f, w in (("avx512f", "avx512"), ("avx2", "avx2")) if f in features), "")
  return f"{name}_{width}" if width else name


def result_stem(prefix: str, info: dict[str, Any], name: str = "") -> str:
  """'<prefix>_<cpu family>[_<name>]': a result file's stem for the CPU `info` describes
  (`cpu_matmul.describe()`), so each CPU family's figures keep a file of their own."""
  return f"{prefix}_{cpu_family(info['model'], info['features'])}" + (f"_{name}" if name else "")


def kernel_weights_list(parser: argparse.ArgumentParser, text: str) -> list[str]:
  """A --kernel_weights comma list, each a `T5.kernel_weights` setting (a parser error
  naming the bad ones, or an empty list)."""
  from spec_decode.kernels import cpu_matmul
  weights = [w for w in text.split(",") if w]
  bad = [w for w in weights if w not in cpu_matmul.WEIGHTS]
  if bad or not weights:
    parser.error(f"--kernel_weights: each must be one of {cpu_matmul.WEIGHTS}, got "
                 f"{bad or 'none'}")
  return weights


def _decoder_cost(params) -> tuple[int, int]:
  """(bytes of the decoder's weights as stored, multiply-adds per row) of a decode step:
  every array under decoder/ (packed panels at their dtype) is read once; each 2-D kernel
  costs its K x N multiply-adds per row (the relative-position table is a gather)."""
  import jax
  import numpy as np
  from spec_decode.kernels import cpu_matmul
  nbytes = macs = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(
      params["decoder"], is_leaf=lambda x: isinstance(x, cpu_matmul.PackedKernel)):
    if isinstance(leaf, cpu_matmul.PackedKernel):
      nbytes += leaf.panels.nbytes + (0 if leaf.scales is None else leaf.scales.nbytes)
      macs += int(np.prod(leaf.shape))
    else:
      nbytes += leaf.nbytes
      if leaf.ndim == 2 and "rel_embedding" not in jax.tree_util.keystr(path):
        macs += leaf.size
  return nbytes, macs


def measure(args) -> tuple[dict[str, Any], list[dict[str, Any]]]:
  import jax.numpy as jnp
  import numpy as np

  from spec_decode.decoding import timing
  from spec_decode.kernels import cpu_matmul

  info = cpu_matmul.describe()
  if info["kernel"] != "on":
    raise SystemExit(f"the CPU kernel is {info['kernel']}: nothing to measure against the roofline")
  models = harness.load_models(args.target, {"draft": args.draft})
  target, tparams = models.target, models.target_params
  draft, dparams = models.draft("draft")
  peaks = {w: cpu_matmul.fma_peak(w) for w in cpu_matmul.widths()}
  # bfloat16 dot products (VDPBF16PS) do two multiply-adds per lane and instruction: the
  # 'bfloat16_dot' weights' products are judged against their own peak.
  dots = ({w: cpu_matmul.dot_peak(w) for w in cpu_matmul.widths()}
          if cpu_matmul.has_bfloat16_dot() else {})
  dots = {w: g for w, g in dots.items() if g}
  print(f"CPU {info['model']} ({', '.join(info['features'])}); multiply-add peak "
        + ", ".join(f"{w}-wide {g:.0f} GFLOP/s" for w, g in peaks.items())
        + "".join(f"; bfloat16 dot-product peak {w}-wide {g:.0f} GFLOP/s"
                  for w, g in dots.items()), flush=True)
  machine = {"cpu": info, "fma_peak_gflops": {str(w): g for w, g in peaks.items()},
             "dot_peak_gflops": {str(w): g for w, g in dots.items()}, "read_gbps": {}}
  length = args.position + max(args.tokens) + 1
  rows = []
  for weights in args.kernel_weights:
    dot = weights == "bfloat16_dot" or (weights == "bfloat16_dot_if_supported"
                                        and cpu_matmul.has_bfloat16_dot())
    model = dataclasses.replace(target, kernel_weights=weights)
    dmodel = dataclasses.replace(draft, kernel_weights=weights)
    packed = model.decode_params(tparams)
    nbytes, macs = _decoder_cost(packed)
    bw = cpu_matmul.read_bandwidth(nbytes)
    machine["read_gbps"][weights] = bw
    print(f"kernel_weights={weights}: decoder {nbytes / 2 ** 20:.1f} MiB, read bandwidth at that "
          f"size {bw:.1f} GB/s -> {nbytes / bw / 1e6:.3f} ms per step", flush=True)
    for batch in args.batch_sizes:
      enc = jnp.asarray(np.random.RandomState(batch).randint(
          2, model.vocab_size, (batch, args.input_length)).astype(np.int32))
      step = lambda m, p, n: timing.step_time(m, p, enc, num_tokens=n, cache_length=length,
                                              position=args.position, repeats=args.repeats)
      t_q = step(dmodel, dparams, 1)
      times = {n: step(model, tparams, n) for n in args.tokens}
      for n in args.tokens:
        rows_n = batch * n
        variant = _variant_used(rows_n)
        width = cpu_matmul.variant_width(variant)
        peak = dots[width] if dot and width in dots else peaks[width]
        flops = 2.0 * macs * rows_n
        bound = max(nbytes / (bw * 1e9), flops / (peak * 1e9))
        rows.append({"weights": weights, "decoder_mib": nbytes / 2 ** 20, "batch": batch,
                     "n": n, "rows": rows_n, "variant": variant, "t_ms": times[n] * 1e3,
                     "t_p_ms": times[1] * 1e3, "t_q_ms": t_q * 1e3, "c": t_q / times[1],
                     "t_ratio": times[n] / times[1],
                     "gbps": nbytes / times[n] / 1e9, "gbps_frac": nbytes / times[n] / 1e9 / bw,
                     "gflops": flops / times[n] / 1e9,
                     "gflops_frac": flops / times[n] / 1e9 / peak,
                     "peak": "dot" if dot and width in dots else "fma",
                     "bound_ms": bound * 1e3, "over_bound": times[n] / bound})
        r = rows[-1]
        print(f"  {weights} B={batch} N={n}: {r['t_ms']:.3f} ms (t(N) {r['t_ratio']:.2f}), "
              f"{r['gbps']:.1f} GB/s ({r['gbps_frac']:.2f}), {r['gflops']:.0f} GFLOP/s "
              f"({r['gflops_frac']:.2f}), {r['over_bound']:.2f}x the bound; T_q "
              f"{r['t_q_ms']:.3f} ms", flush=True)
  machine["chosen_variants"] = cpu_matmul.describe().get("chosen_variants", {})
  return machine, rows


def cpu_matmul_variants() -> tuple[str, ...]:
  from spec_decode.kernels import cpu_matmul
  return cpu_matmul.variants()


def _variant_used(rows: int) -> str:
  """The kernel variant used for most weight shapes at `rows` rows (the override, or the
  tuner's choices so far)."""
  import collections
  import os
  from spec_decode.kernels import cpu_matmul
  if os.environ.get(cpu_matmul.ENV_VARIANT):
    return os.environ[cpu_matmul.ENV_VARIANT]
  tuned = cpu_matmul.tuning_rows(rows)
  chosen = [v for key, v in cpu_matmul.describe().get("chosen_variants", {}).items()
            if key.startswith(f"{tuned}x")]
  return collections.Counter(chosen).most_common(1)[0][0] if chosen else "8"


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.roofline", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", default="demo:ende_target_big",
                 help="demo:<name>, a T5 preset (random weights) or a checkpoint")
  p.add_argument("--draft", default="demo:ende_small")
  p.add_argument("--batch_sizes", default="1,8,32")
  p.add_argument("--tokens", default=DEFAULT_TOKENS, help="N values (1 is added)")
  p.add_argument("--kernel_weights", default="auto,float32",
                 help="comma list of T5.kernel_weights settings to measure")
  p.add_argument("--input_length", type=int, default=32)
  p.add_argument("--position", type=int, default=24, help="cache entries already filled")
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--name", default="", help="suffix of the result files")
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  args = p.parse_args(list(argv))
  args.tokens = tuple(sorted({1} | set(harness.parse_ints(args.tokens, "tokens"))))
  args.batch_sizes = harness.parse_ints(args.batch_sizes, "batch_sizes")
  args.kernel_weights = kernel_weights_list(p, args.kernel_weights)
  if min(args.tokens) < 1 or min(args.batch_sizes) < 1 or args.repeats < 1:
    p.error("--tokens, --batch_sizes and --repeats must be >= 1")
  return args


def run(args, meta: dict) -> Output:
  from spec_decode.kernels import cpu_matmul
  machine, rows = measure(args)
  meta["roofline"] = machine
  cols = [Column("weights", "kernel weights"), Column("decoder_mib", "decoder MiB",
                                                        lambda v: f"{v:.1f}"),
          Column("batch", "batch"), Column("n", "N"), Column("variant", "variant"),
          Column("t_ms", "T_verify(N)", lambda v: f"{v:.3f} ms"),
          Column("t_ratio", "t(N)", lambda v: fmt(v, 2)),
          Column("gbps", "GB/s", lambda v: f"{v:.1f}"),
          Column("gbps_frac", "of bandwidth", lambda v: fmt(v, 2)),
          Column("gflops", "GFLOP/s", lambda v: f"{v:.0f}"),
          Column("gflops_frac", "of peak", lambda v: fmt(v, 2)),
          Column("over_bound", "time / bound", lambda v: fmt(v, 2)),
          Column("t_q_ms", "T_q", lambda v: f"{v:.3f} ms"),
          Column("c", "c", lambda v: fmt(v, 3))]
  info = machine["cpu"]
  notes = [f"CPU: {info['model']}, features {', '.join(info['features']) or 'none listed'}; "
           f"kernel variants {', '.join(cpu_matmul_variants())}; multiply-add peak "
           + ", ".join(f"{w}-wide {g:.0f} GFLOP/s" for w, g in machine["fma_peak_gflops"].items())
           + "".join(f"; bfloat16 dot-product (VDPBF16PS) peak {w}-wide {g:.0f} GFLOP/s"
                     for w, g in machine.get("dot_peak_gflops", {}).items())
           + "; read bandwidth at the decoder's size "
           + ", ".join(f"{k} {v:.1f} GB/s" for k, v in machine["read_gbps"].items()) + ".",
           f"target {args.target}, draft {args.draft}; encoder input {args.input_length} tokens, "
           f"cache filled to {args.position}; marginal step costs, median of {args.repeats} "
           "rounds. N new tokens per row, rows = batch x N.",
           "bound = max(decoder bytes / read bandwidth, 2 x decoder multiply-adds x rows / peak "
           "at the width used: the bfloat16 dot-product peak for 'bfloat16_dot' weights, the "
           "multiply-add peak otherwise); attention and the loop's own work are outside it, so "
           "'time / bound' >= 1 by their share.",
           f"variant: the kernel variant (vector width; {cpu_matmul.VARIANT_LEGEND}) chosen "
           "for most weight shapes at that row count."]
  stem = result_stem("roofline", info, args.name)
  return Output(stem, f"Decode step against the roofline ({info['model']})", cols, rows,
                notes=notes)


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.roofline", argv, parse_args, run)


if __name__ == "__main__":
  main()
