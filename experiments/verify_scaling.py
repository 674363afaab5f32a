r"""Verify cost against target size: t(N) = T_verify(N) / T_p for N = 1 .. 16 new tokens.

  python -m experiments.verify_scaling                  # big demo target, 3.7M target, T5.1.1 shapes
  python -m experiments.verify_scaling --models t5_1_1_tiny --tokens 1,2,5 --repeats 2

Speculative decoding pays off when scoring gamma + 1 tokens in one target call
costs about one step (the paper's premise: a memory-bound target reads its
weights once either way). On a CPU a small target's weights sit in cache and
its steps are compute-bound, so t(N) grows with N. This experiment measures,
for targets from the demo target to the T5.1.1-base shape (random weights,
float32 unless --dtype says otherwise, the demo vocabulary unless --vocab_size does), T_p (one
token) and t(N) with marginal step costs (`timing.step_time`: the cost of one
more decode inside a jitted loop, cache filled to --position), under the
project's XLA options for decoding loops (`spec_decode.compile_options`) with
the weights in the layout the decoders use (on CPU: packed for the
weight-streaming kernel, `spec_decode.kernels.cpu_matmul`); with
--compare_xla_dots also with XLA's dots on the unpacked weights, and with
--xla_defaults under XLA's own defaults (XLA's dots). Everything runs back to
back in one process. Writes <results_dir>/verify_scaling.{md,csv,json}.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from experiments import harness
from experiments.harness import Column, fmt

DEFAULT_MODELS = "demo:ende_target_big,demo:ende_target,t5_1_1_small,t5_1_1_base"
DEMO_VOCAB = 1536


def measure(args) -> list[dict[str, Any]]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from spec_decode.decoding import timing
  option_sets = [("project", None, True)]
  if args.compare_xla_dots:
    option_sets.append(("project, XLA dots", None, False))
  if args.xla_defaults:
    option_sets.append(("xla defaults, XLA dots", {}, False))
  rows = []
  for text in args.models:
    spec = harness.model_spec(text, vocab_size=args.vocab_size, dtype=args.dtype)
    models = harness.load_models(spec)
    model, params = models.target, models.target_params
    leaves = jax.tree_util.tree_leaves_with_path(params)
    n_params = int(sum(x.size for _, x in leaves))
    n_decoder = int(sum(x.size for path, x in leaves
                        if "decoder" in jax.tree_util.keystr(path)))
    enc = jnp.asarray(np.random.RandomState(0).randint(
        2, model.vocab_size, (1, args.input_length)).astype(np.int32))
    length = args.position + max(args.tokens) + 1
    for label, options, layout in option_sets:
      times = {n: timing.step_time(model, params, enc, num_tokens=n, cache_length=length,
                                   position=args.position, repeats=args.repeats,
                                   compiler_options=options, decode_layout=layout)
               for n in args.tokens}
      row = {"model": spec.label, "params": n_params, "decoder_params": n_decoder,
             "weight_mb": n_decoder * jnp.dtype(model.config.dtype).itemsize / 2 ** 20,
             "compiler": label, "t_p_ms": times[1] * 1e3,
             "ratios": {str(n): times[n] / times[1] for n in args.tokens}}
      rows.append(row)
      print(f"{row['model']} ({n_params / 1e6:.1f}M, {label}): T_p {row['t_p_ms']:.3f} ms, "
            + ", ".join(f"t({n}) {v:.2f}" for n, v in row["ratios"].items()), flush=True)
    del params
  return rows


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.verify_scaling", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", default=DEFAULT_MODELS,
                 help="comma list: demo:<name> or a T5 preset (random weights)")
  p.add_argument("--vocab_size", type=int, default=DEMO_VOCAB,
                 help="vocabulary of preset models (default: the demo models')")
  p.add_argument("--dtype", default=None,
                 help="parameter dtype, e.g. bfloat16 (default: float32 for presets)")
  p.add_argument("--tokens", default="1,2,3,4,5,6,8,12,16", help="N values (1 is added)")
  p.add_argument("--input_length", type=int, default=32)
  p.add_argument("--position", type=int, default=24, help="cache entries already filled")
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--compare_xla_dots", action="store_true",
                 help="also measure with XLA's dots (weights not packed for the CPU kernel)")
  p.add_argument("--xla_defaults", action="store_true",
                 help="also measure under XLA's default options (XLA's dots)")
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  args = p.parse_args(list(argv))
  args.models = [m for m in args.models.split(",") if m]
  args.tokens = tuple(sorted({1} | set(harness.parse_ints(args.tokens, "tokens"))))
  if not args.models:
    p.error("--models is empty")
  if min(args.tokens) < 1 or args.repeats < 1 or args.input_length < 1 or args.position < 0:
    p.error("--tokens, --repeats and --input_length must be >= 1, --position >= 0")
  return args


def run(args, meta) -> harness.Output:
  rows = measure(args)
  cols = [Column("model", "target"),
          Column("params", "params", lambda v: f"{v / 1e6:.1f}M"),
          Column("weight_mb", "decoder weights", lambda v: f"{v:.1f} MB"),
          Column("compiler", "XLA options, products"),
          Column("t_p_ms", "T_p", lambda v: f"{v:.3f} ms")]
  cols += [Column(f"t{n}", f"t({n})", lambda v: fmt(v, 2)) for n in args.tokens if n > 1]
  table = [dict(r, **{f"t{n}": r["ratios"][str(n)] for n in args.tokens}) for r in rows]
  notes = [f"random-weight T5 targets ({args.dtype or 'float32'}; presets with vocabulary "
           f"{args.vocab_size}), batch 1, encoder input {args.input_length} tokens, cache "
           f"filled to {args.position}; marginal step costs, median of {args.repeats} rounds.",
           "t(N) = T_verify(N) / T_p: the cost of scoring N new tokens in one call, in "
           "single-token steps. Speculative decoding with gamma = N - 1 needs "
           "E[tokens per call] > gamma c + t(N) to pay off."]
  return harness.Output("verify_scaling", "Verify cost against target size", cols, table, notes)


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.verify_scaling", argv, parse_args, run)


if __name__ == "__main__":
  main()
