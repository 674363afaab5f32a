r"""Where one iteration of the decoding loop goes: the loop bodies the decoders run.

  python -m experiments.loop_split                      # big CNN/DM pair, one 320-token article
  python -m experiments.loop_split --target demo:ende_target_big --draft demo:ende_small \
      --task synthetic_ende --input_length 64 --gammas 3,5

Times, in the same interleaved rounds (`timing.interleaved`; each value the marginal cost of
one more iteration, (t(2k) - t(k)) / k, free of the set-up both calls pay once), batch 1,
one example of the task:
  speculative(g)  the speculative decoder's own loop body (`Algorithm.loop_parts(...)
                  .make_body`: proposal, verify call, acceptance, commit, statistics), run k
                  and 2k times in one jit from the start of a decode, with its draft model;
  fixed(g)        the same body with `FixedProposal` as the drafter (no draft model runs;
                  its tokens are mostly rejected, so the sequence advances ~1 token per
                  iteration instead of ~alpha-dependent several; the self-attention it reads
                  is correspondingly shorter);
  verify(g + 1)   the target's decode call on g + 1 tokens alone in a loop (`decode_loop`);
  proposal(g)     the draft's proposal alone, in a loop of its own (`Drafter.proposal_loop`:
                  what the cost model's c = T_q / T_p measures);
  autoregressive  the autoregressive decoder's loop body, and step(1), the target's
                  single-token call alone.
The differences are taken within each round (neighbours see the same moment of the
machine) and reported as medians with 25th-75th percentiles:
  draft in the loop = speculative(g) - fixed(g): what the draft's proposal costs where the
                      loop runs it, right after the target's verify call went through the
                      caches; the cost model charges g c for it (c per drafted token);
  bookkeeping       = fixed(g) - verify(g + 1): acceptance, commit and statistics;
  AR loop work      = autoregressive - step(1).
A row's body keeps running after its sequence ends (inactive rows still cost a full
iteration). Longer loops give steadier marginal costs: on a 2-core AMD EPYC of family 26,
6 and 12 iterations left the differences' 25th-75th percentiles +-0.4 ms apart over 81
rounds, 16 and 32 about +-0.15 ms over 41 (the defaults).
Writes <results_dir>/<stem>.{md,csv,json}.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from experiments import harness
from experiments.harness import Column


def _body_loop(algorithm, models, draft, params, draft_params, tokens, *, iterations: int,
               max_decode_len: int):
  """A zero-argument function running `iterations` iterations of `algorithm`'s own loop body
  from the start of a decode of `tokens` (set-up included, paid once), in one jit."""
  import jax
  import jax.numpy as jnp

  from spec_decode.decoding import runner
  from spec_decode.decoding.sampling import Sampling

  @jax.jit
  def run(target_params, draft_params, tokens):
    ctx = runner.LoopContext(
        target=models.target, target_params=target_params, draft=draft,
        draft_params=draft_params, encoder_tokens=tokens,
        draft_encoder_tokens=None if draft is None else tokens,
        rng=jax.random.PRNGKey(0), row_ids=jnp.zeros((tokens.shape[0],), jnp.int32),
        max_decode_len=max_decode_len, sampling=Sampling())
    parts = algorithm.loop_parts(ctx)
    body = parts.make_body(parts.ctx)
    state = jax.lax.fori_loop(0, iterations, lambda i, s: body(s), parts.init)
    return parts.result_of(state)

  def loop():
    return jax.block_until_ready(run(params, draft_params, tokens))
  loop.steps = iterations
  return loop


def measure(args) -> list[dict[str, Any]]:
  import numpy as np

  from spec_decode import decoding
  from spec_decode.decoding import runner, timing
  from spec_decode.decoding.drafters.base import FixedProposal
  from spec_decode.models import base

  models = harness.load_models(args.target, {args.draft: args.draft})
  draft, draft_params = models.draft(args.draft)
  inputs = harness.task_inputs(args.task, split="test", num_examples=args.example + 1,
                               input_length=args.input_length, decode_len=args.cache_length)
  tokens = runner.trim_padding(np.asarray(inputs[args.example:args.example + 1]))
  tp = base.decoding_params(models.target, models.target_params)
  dp = base.decoding_params(draft, draft_params)
  k = args.iterations
  L = 2 * k * (max(args.gammas) + 1) + 8  # room for every token the longer loops commit

  def pair(algorithm, with_draft: bool, steps: int):
    make = lambda n: _body_loop(algorithm, models, draft if with_draft else None, tp,
                                dp if with_draft else None, tokens, iterations=n,
                                max_decode_len=L)
    return make(steps), make(2 * steps)

  w = timing.Workload(target=models.target, target_params=models.target_params,
                      encoder_tokens=tokens, cache_length=args.cache_length,
                      position=args.position, draft=draft, draft_params=draft_params)
  loops = {"autoregressive": pair(decoding.Autoregressive(), False, 4 * k),
           "step:1": timing.marginal_pair(
               lambda n: w.decode_loop("target", num_tokens=1, steps=n), args.steps)}
  for g in args.gammas:
    loops[f"speculative:{g}"] = pair(decoding.Speculative(gamma=g), True, k)
    loops[f"fixed:{g}"] = pair(decoding.Speculative(gamma=g, drafter=FixedProposal()), False,
                               k)
    drafter = decoding.Speculative(gamma=g).drafter
    loops[f"proposal:{g}"] = timing.marginal_pair(
        lambda n, g=g, drafter=drafter: drafter.proposal_loop(w, gamma=g, steps=n), args.steps)
    loops[f"verify:{g + 1}"] = timing.marginal_pair(
        lambda n, g=g: w.decode_loop("target", num_tokens=g + 1, steps=n), args.steps)
  print(f"timing {len(loops)} loops in {args.repeats} interleaved rounds (encoder input "
        f"{tokens.shape[1]} positions)", flush=True)
  r = {name: 1e3 * np.asarray(v)
       for name, v in timing.interleaved(loops, repeats=args.repeats).items()}
  q = lambda x: {"median": float(np.median(x)), "p25": float(np.percentile(x, 25)),
                 "p75": float(np.percentile(x, 75))}
  ar_work = q(r["autoregressive"] - r["step:1"])
  rows = []
  for g in args.gammas:
    spec, fixed, verify = r[f"speculative:{g}"], r[f"fixed:{g}"], r[f"verify:{g + 1}"]
    row = {"gamma": g, "input_positions": int(tokens.shape[1]),
           "speculative_ms": float(np.median(spec)), "fixed_ms": float(np.median(fixed)),
           "verify_ms": float(np.median(verify)),
           "proposal_ms": float(np.median(r[f"proposal:{g}"])),
           "step_ms": float(np.median(r["step:1"])),
           "autoregressive_ms": float(np.median(r["autoregressive"])),
           "draft_in_loop": q(spec - fixed), "bookkeeping": q(fixed - verify),
           "ar_loop_work": ar_work}
    rows.append(row)
    print({key: v for key, v in row.items()}, flush=True)
  return rows


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.loop_split", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", default="demo:cnndm_target_big")
  p.add_argument("--draft", default="demo:cnndm_small")
  p.add_argument("--task", default="synthetic_cnndm")
  p.add_argument("--input_length", type=int, default=320)
  p.add_argument("--example", type=int, default=3, help="index of the test example decoded")
  p.add_argument("--gammas", default="1,3,5,8", help="comma-separated proposal lengths")
  p.add_argument("--iterations", type=int, default=16,
                 help="iterations of the shorter speculative loop (4x for the autoregressive)")
  p.add_argument("--cache_length", type=int, default=64,
                 help="the decode-call loops' cache (verify, step)")
  p.add_argument("--position", type=int, default=24, help="their cache slots filled")
  p.add_argument("--steps", type=int, default=16, help="iterations of their shorter loop")
  p.add_argument("--repeats", type=int, default=41, help="interleaved rounds")
  p.add_argument("--stem", default="loop_split")
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  args = p.parse_args(list(argv))
  harness.parse_gammas_in_cache(p, args)
  if min(args.iterations, args.steps, args.repeats, args.input_length) < 1 or args.example < 0:
    p.error("--iterations, --steps, --repeats and --input_length must be >= 1, --example >= 0")
  return args


def run(args, meta) -> harness.Output:
  rows = measure(args)
  ms = lambda v: f"{v:.3f} ms"
  spread = lambda s: f"{s['median']:.3f} [{s['p25']:.3f}, {s['p75']:.3f}] ms"
  cols = [Column("gamma", "gamma"), Column("speculative_ms", "speculative iteration", ms),
          Column("fixed_ms", "without the draft", ms),
          Column("verify_ms", "verify call alone", ms),
          Column("proposal_ms", "proposal alone", ms),
          Column("draft_in_loop", "draft in the loop", spread),
          Column("bookkeeping", "bookkeeping", spread),
          Column("autoregressive_ms", "autoregressive iteration", ms),
          Column("step_ms", "target step alone", ms),
          Column("ar_loop_work", "autoregressive loop work", spread)]
  first = rows[0]
  notes = [
      f"Target {args.target}, draft {args.draft}; batch 1, {args.task} test example "
      f"{args.example} ({first['input_positions']} encoder positions after trimming); the "
      f"loop bodies run {args.iterations} and {2 * args.iterations} iterations "
      f"({4 * args.iterations} and {8 * args.iterations} autoregressive) from the start of "
      f"its decode; the decode calls alone at a cache of {args.cache_length} slots filled to "
      f"{args.position}, {args.steps} and {2 * args.steps} calls; {args.repeats} interleaved "
      "rounds.",
      "draft in the loop = speculative iteration - the same body without the draft "
      "(FixedProposal), per round; bookkeeping = that body - the verify call alone; "
      "autoregressive loop work = its iteration - the target step alone. Cells: median "
      "[25th, 75th percentile] over rounds; the spread is the machine's noise.",
      "The cost model charges the draft gamma c T_p per iteration (c per drafted token): a "
      "'draft in the loop' that does not grow with gamma is a cost paid once per proposal."]
  return harness.Output(args.stem, "Where a decoding iteration goes", cols, rows, notes)


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.loop_split", argv, parse_args, run)


if __name__ == "__main__":
  main()
