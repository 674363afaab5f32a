r"""A draft model's proposal where the decoding loop runs it, in two parameter layouts.

  python -m experiments.draft_layout                      # the big EnDe target, its drafts
  python -m experiments.draft_layout --target demo:cnndm_target_big \
      --drafts demo:cnndm_small --task synthetic_cnndm --input_length 320

A speculative iteration runs the draft's gamma steps right after the target's verify call,
which streams the target's weights (99 MB for the 45.6M target in float32) through every
cache of the CPU. A small draft's step is then bound neither by its weights' bytes nor by
its arithmetic but by the number of XLA thunks it runs (each a cold call: its code, its
buffers, its arguments), so it costs more in the loop than in a loop of its own.

For each draft and layout this times, in the same interleaved rounds (`timing.interleaved`,
marginal cost of one more iteration of a jitted loop, batch 1):
  alone      one proposal of gamma tokens (the drafter's own `propose`), loop of its own;
  in loop    a proposal followed by the target's verify call on gamma + 1 tokens, minus
             the same loop with a proposal of fixed tokens (`drafters.base.FixedProposal`),
             timed right before it in each round: what the proposal adds where the decoding
             loop runs it; the median over rounds of the per-round difference, and the
             difference of the two loops' 10th percentiles (the fastest rounds: other
             tenants of the machine only ever add time);
  set-up     the draft's encoder and cross-attention cache per example
             (`measure.setup_seconds`, median of --repeats calls), on the task's inputs;
and counts the thunks of the draft's single-token step (`step_variants.loop_launches`: the
instructions of its compiled step loop's body that run as calls: fusions, dots, copies,
custom calls). --gammas 1,3,5,8 measures each at several proposal lengths: whether what the
loop adds grows with the drafted tokens (a cost per token, as the cost model's c charges it)
or is paid once per proposal.

Layouts (`T5.packed_min_elements`):
  kernel     the library's default: every weight matrix of `cpu_matmul.MIN_PACKED_ELEMENTS`
             elements and up packed for the CPU kernel, so such layers attend in the
             kernel and fold their norms into the products;
  xla_dots   no matrix of the draft packed (XLA's dots and attention);
  2**15      the library's threshold before this experiment (packed from 192 x 192 up).
Writes <results_dir>/draft_layout.{md,csv,json} (--stem to rename).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Sequence

from experiments import harness, step_variants
from experiments.harness import Column, fmt

LAYOUTS = {"kernel": None, "xla_dots": 2 ** 62, "2**15": 2 ** 15}


def measure(args) -> list[dict[str, Any]]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from spec_decode import decoding
  from spec_decode.decoding import timing
  from spec_decode.decoding.drafters.base import FixedProposal
  from spec_decode.experiment import measure as costs
  from spec_decode.kernels import cpu_matmul
  from spec_decode.models import t5

  if not cpu_matmul.available():
    raise SystemExit(f"the CPU kernel is unavailable: {cpu_matmul.unavailable_reason()}")
  models = harness.load_models(args.target, {d: d for d in args.drafts})
  inputs = harness.task_inputs(args.task, split="test", num_examples=args.setup_examples,
                               input_length=args.input_length, decode_len=args.cache_length)
  enc = inputs[:1]
  base = dict(target=models.target, target_params=models.target_params, encoder_tokens=enc,
              cache_length=args.cache_length, position=args.position)
  workloads, loops = {}, {}
  first, first_params = models.draft(args.drafts[0])
  fixed = timing.Workload(**base, draft=first, draft_params=first_params)
  for d in args.drafts:
    model, params = models.draft(d)
    if not isinstance(model, t5.T5):
      raise SystemExit(f"--drafts: {d} is a {type(model).__name__}, not a T5 model; the "
                       "layouts are T5's (`T5.packed_min_elements`)")
    for layout in args.layouts:
      m = dataclasses.replace(model, packed_min_elements=LAYOUTS[layout])
      # A copy per layout: the packed tree is cached by the leaves' identity.
      w = timing.Workload(**base, draft=m, draft_params=jax.tree.map(jnp.array, params))
      for G in args.gammas:
        drafter = decoding.Speculative(gamma=G).drafter
        workloads[d, layout, G] = w
        key = f"{d}:{layout}:{G}"
        loops[f"alone:{key}"] = timing.marginal_pair(
            lambda k, w=w, G=G, drafter=drafter: timing.proposal_loop(drafter, w, gamma=G,
                                                                      steps=k), args.steps)
        # The loop without a proposal right before the one with it (one compile per gamma
        # for all drafts): the machine's speed drifts within a round, so each difference
        # is of neighbours.
        loops[f"fixed:{key}"] = timing.marginal_pair(
            lambda k, G=G: timing.proposal_loop(FixedProposal(), fixed, gamma=G, steps=k,
                                                verify_tokens=G + 1), args.steps)
        loops[f"loop:{key}"] = timing.marginal_pair(
            lambda k, w=w, G=G, drafter=drafter: timing.proposal_loop(
                drafter, w, gamma=G, steps=k, verify_tokens=G + 1), args.steps)
  print(f"timing {len(loops)} loops in {args.repeats} interleaved rounds", flush=True)
  r = {k: np.asarray(v) for k, v in timing.interleaved(loops, repeats=args.repeats).items()}
  rows = []
  thunks, setups = {}, {}
  for (d, layout, G), w in workloads.items():
    key = f"{d}:{layout}:{G}"
    if (d, layout) not in thunks:
      step = w.decode_loop("draft", num_tokens=1, steps=2)
      step()
      thunks[d, layout] = step_variants.loop_launches(step.compiled_text())["total"]
      setups[d, layout] = float(np.mean([
          costs.setup_seconds(w.draft, w.draft_params, inputs[i:i + 1],
                              cache_length=args.cache_length, repeats=args.repeats)["median"]
          for i in range(len(inputs))]))
    packed = [isinstance(x, cpu_matmul.PackedKernel) for x in jax.tree.leaves(
        w.draft.decode_params(w.draft_params),
        is_leaf=lambda x: isinstance(x, cpu_matmul.PackedKernel))]
    with_it, without = r[f"loop:{key}"], r[f"fixed:{key}"]
    in_loop = with_it - without
    rows.append(dict(
        draft=d, layout=layout, gamma=G, packed=int(sum(packed)), thunks=thunks[d, layout],
        alone_ms=1e3 * float(np.median(r[f"alone:{key}"])),
        in_loop_ms=1e3 * float(np.median(in_loop)),
        in_loop_p25_ms=1e3 * float(np.percentile(in_loop, 25)),
        in_loop_p75_ms=1e3 * float(np.percentile(in_loop, 75)),
        in_loop_fastest_ms=1e3 * float(np.percentile(with_it, 10)
                                        - np.percentile(without, 10)),
        verify_loop_ms=1e3 * float(np.median(without)),
        setup_ms=1e3 * setups[d, layout]))
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()},
          flush=True)
  return rows


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.draft_layout", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", default="demo:ende_target_big")
  p.add_argument("--drafts", default="demo:ende_small,demo:ende_base,demo:ende_large")
  p.add_argument("--layouts", default="kernel,xla_dots",
                 help=f"comma-separated, of {', '.join(LAYOUTS)}")
  p.add_argument("--task", default="synthetic_ende")
  p.add_argument("--input_length", type=int, default=32)
  p.add_argument("--cache_length", type=int, default=64)
  p.add_argument("--position", type=int, default=24, help="cache slots filled")
  p.add_argument("--gammas", default="5",
                 help="comma-separated proposal lengths, each measured in the same rounds")
  p.add_argument("--steps", type=int, default=8, help="iterations of the shorter loop")
  p.add_argument("--repeats", type=int, default=31, help="interleaved rounds")
  p.add_argument("--setup_examples", type=int, default=5)
  p.add_argument("--stem", default="draft_layout")
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  args = p.parse_args(list(argv))
  args.drafts = [d for d in args.drafts.split(",") if d]
  args.layouts = [x for x in args.layouts.split(",") if x]
  unknown = [x for x in args.layouts if x not in LAYOUTS]
  if unknown or not args.layouts:
    p.error(f"--layouts must name some of {', '.join(LAYOUTS)}, got {unknown or 'none'}")
  if not args.drafts:
    p.error("--drafts must name at least one draft")
  harness.parse_gammas_in_cache(p, args)
  if min(args.steps, args.repeats, args.setup_examples, args.input_length) < 1:
    p.error("--steps, --repeats, --setup_examples and --input_length must be >= 1")
  return args


def run(args, meta) -> harness.Output:
  rows = measure(args)
  ms = lambda v: f"{v:.3f} ms"
  cols = [Column("draft", "draft"), Column("layout", "layout"), Column("gamma", "gamma"),
          Column("packed", "packed matrices"), Column("thunks", "thunks per step"),
          Column("alone_ms", "proposal alone", ms),
          Column("in_loop_ms", "proposal in the loop", ms),
          Column("in_loop_p25_ms", "in the loop, 25th pct", ms),
          Column("in_loop_p75_ms", "75th pct", ms),
          Column("in_loop_fastest_ms", "in the loop, fastest rounds", ms),
          Column("setup_ms", "set-up per example", ms)]
  gammas = ", ".join(map(str, args.gammas))
  notes = [f"Target {args.target}; batch 1, gamma {gammas}, cache of {args.cache_length} "
           f"slots filled to {args.position}; {args.repeats} interleaved rounds, each value the "
           f"marginal cost of one more iteration of a jitted loop ({args.steps} vs "
           f"{2 * args.steps} iterations).",
           "in the loop: (proposal of gamma tokens + verify call on gamma + 1) - (fixed tokens + "
           "the same verify call, timed right before it), per round; the latter's median "
           f"{fmt(min(r['verify_loop_ms'] for r in rows), 3)}-"
           f"{fmt(max(r['verify_loop_ms'] for r in rows), 3)} ms. Its 25th-75th percentiles "
           "show the machine's noise; a slower neighbour only ever adds time, so 'fastest "
           "rounds' also gives the difference of the two loops' 10th percentiles over the "
           "rounds.",
           f"set-up: the draft's encoder and cross-attention cache, mean over "
           f"{args.setup_examples} {args.task} test inputs of {args.input_length} tokens of "
           "each one's median call."]
  return harness.Output(args.stem, "A draft's proposal in the decoding loop, by layout",
                        cols, rows, notes)


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.draft_layout", argv, parse_args, run)


if __name__ == "__main__":
  main()
