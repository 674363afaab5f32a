r"""Every CPU-kernel variant at every row count of a decode step, on this CPU.

  python -m experiments.kernel_variants                  # big EnDe demo target, 1-12 rows
  python -m experiments.kernel_variants --rows 1,5,8 --kernel_weights float32 --name quick

For each weight format and row count, times each variant of the decode kernel
(`cpu_matmul.variants()`: vector width, 'f' = full row blocks first, 'r' = weights held
in registers, 'p' = software prefetch) over the target decoder's matrices, each shape
weighted by how often a step multiplies by it, in one thread with the weights streamed from memory
(`cpu_matmul.time_variants`: the variants take turns within each round, so load from
elsewhere falls on all of them alike). Reports the time of a step's products per variant,
the fastest, how much slower the others are, and t(M) = the fastest at M rows over the
fastest at 1 row. The tuner (`cpu_matmul.chosen_variant`) makes the same measurement per
shape at first use; this table shows what its choice is worth, and where the per-row cost
of the blocks is not monotonic. Writes <results_dir>/kernel_variants_<cpu family>[_<name>].
{md,csv,json}.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
from typing import Any, Sequence

from experiments import harness, roofline
from experiments.harness import Column, Output, fmt


def decoder_shapes(packed) -> dict[tuple[int, int, str, bool], int]:
  """{(K, N, dtype name, pairs): how many of the decoder's packed matrices have it}."""
  import jax
  import numpy as np
  from spec_decode.kernels import cpu_matmul
  counts: dict[tuple[int, int, str, bool], int] = collections.Counter()
  for leaf in jax.tree_util.tree_leaves(
      packed["decoder"], is_leaf=lambda x: isinstance(x, cpu_matmul.PackedKernel)):
    if isinstance(leaf, cpu_matmul.PackedKernel):
      K, N = leaf.shape
      counts[(K, N, np.dtype(leaf.dtype).name, leaf.pairs)] += 1
  return dict(counts)


def measure(args) -> tuple[dict[str, Any], list[dict[str, Any]]]:
  from spec_decode.kernels import cpu_matmul
  info = cpu_matmul.describe()
  if info["kernel"] != "on":
    raise SystemExit(f"the CPU kernel is {info['kernel']}: no variants to time")
  variants = cpu_matmul.variants()
  models = harness.load_models(args.target)
  rows = []
  for weights in args.kernel_weights:
    model = dataclasses.replace(models.target, kernel_weights=weights)
    shapes = decoder_shapes(model.decode_params(models.target_params))
    if not shapes:
      raise SystemExit(f"{args.target}: no decoder matrix is packed for the kernel")
    base = None
    for m in args.rows:
      total = dict.fromkeys(variants, 0.0)
      for (K, N, dtype, pairs), count in shapes.items():
        times = cpu_matmul.time_variants(m, K, N, dtype, variants, repeats=args.repeats,
                                         pairs=pairs)
        for v in variants:
          total[v] += count * times[v]
      best = min(variants, key=total.__getitem__)
      base = total[best] if base is None else base
      row = {"weights": weights, "rows": m, "best": best, "best_ms": total[best] * 1e3,
             "t_ratio": total[best] / base}
      row.update({f"ms_{v}": total[v] * 1e3 for v in variants})
      row.update({f"over_{v}": total[v] / total[best] for v in variants})
      rows.append(row)
      print(f"  {weights} rows {m}: " + ", ".join(f"{v} {total[v] * 1e3:.3f} ms"
                                                  for v in variants)
            + f"; fastest {best}, t({m}) {row['t_ratio']:.2f}", flush=True)
  return {"cpu": info, "variants": list(variants)}, rows


def add_shape_args(p: argparse.ArgumentParser, rows: str) -> None:
  """The flags of drivers that time the kernel over a target decoder's matrices: --target,
  --rows (default `rows`), --kernel_weights, --repeats, --name, --results_dir."""
  p.add_argument("--target", default="demo:ende_target_big",
                 help="demo:<name>, a T5 preset (random weights) or a checkpoint")
  p.add_argument("--rows", default=rows, help="row counts (batch x N)")
  p.add_argument("--kernel_weights", default="auto,float32",
                 help="comma list of T5.kernel_weights settings to time")
  p.add_argument("--repeats", type=int, default=5, help="rounds (least kept)")
  p.add_argument("--name", default="", help="suffix of the result files")
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)


def check_shape_args(p: argparse.ArgumentParser, args) -> None:
  """Parses and checks `add_shape_args`' flags in place (a parser error on bad ones)."""
  args.rows = harness.parse_ints(args.rows, "rows")
  args.kernel_weights = roofline.kernel_weights_list(p, args.kernel_weights)
  if min(args.rows) < 1 or args.repeats < 1:
    p.error("--rows and --repeats must be >= 1")


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.kernel_variants", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  add_shape_args(p, "1,2,3,4,5,6,7,8,9,10,12")
  args = p.parse_args(list(argv))
  check_shape_args(p, args)
  return args


def run(args, meta: dict) -> Output:
  from spec_decode.kernels import cpu_matmul
  machine, rows = measure(args)
  meta["kernel_variants"] = machine
  variants = machine["variants"]
  cols = ([Column("weights", "kernel weights"), Column("rows", "rows")]
          + [Column(f"ms_{v}", f"{v} (ms)", lambda x: f"{x:.3f}") for v in variants]
          + [Column("best", "fastest"), Column("t_ratio", "t(rows)", lambda x: fmt(x, 2))]
          + [Column(f"over_{v}", f"{v} / fastest", lambda x: fmt(x, 2)) for v in variants])
  info = machine["cpu"]
  notes = [f"CPU: {info['model']}, features {', '.join(info['features']) or 'none listed'}; "
           f"target {args.target}.",
           "Time of one decode step's products with the decoder's matrices (each shape times "
           "how many the decoder has), one thread, weights streamed from memory; the least "
           f"of {args.repeats} rounds, the variants taking turns within each round.",
           f"Variants: vector width; {cpu_matmul.VARIANT_LEGEND}. Full blocks first: 8 rows "
           "of 8-wide as 6 + 2, not 4 + 4 (where both splits agree, an 'f' column times the "
           "same code again); weights held in registers: not folded into each row's "
           "multiply-add. All give the same bits.",
           "t(rows) = the fastest at that row count over the fastest at 1 row (one thread: "
           "the decode step splits the products over two, so its t(N) differs)."]
  return Output(roofline.result_stem("kernel_variants", info, args.name),
                f"CPU kernel variants by row count ({info['model']})", cols, rows, notes=notes)


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.kernel_variants", argv, parse_args, run)


if __name__ == "__main__":
  main()
