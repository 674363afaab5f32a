r"""Where one iteration of the decoding loop goes: the loop bodies the decoders run.

  python -m experiments.loop_split                      # big CNN/DM pair, one 320-token article
  python -m experiments.loop_split --target demo:ende_target_big --draft demo:ende_small \
      --task synthetic_ende --input_length 64 --gammas 3,5

Times, in the same interleaved rounds (`timing.interleaved`; each value the marginal cost of
one more iteration, (t(2k) - t(k)) / k, free of the set-up both calls pay once), on
--batch rows (consecutive test examples of the task from --example; default one):
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
  bookkeeping       = fixed(g) - verify(g + 1) at the FixedProposal body's position:
                      acceptance, commit and statistics;
  AR loop work      = autoregressive - step(1).
A row's body keeps running after its sequence ends (inactive rows still cost a full
iteration). The decode calls alone run at the cache position the bodies reach (--position
auto): at batch 8 on the big EnDe target a one-token step costs 1.42 ms with 24 slots
filled and 1.95 ms with 96 (self-attention reads the filled slots of every row), so timing
them at a fixed early position books attention the bodies read as loop work. The bodies'
marginal iterations should decode live rows: a row done before the longer loop ends still
runs (a frozen cache, nothing committed), and on the big CNN/DM target such an iteration
cost 0.15 ms less than a live one; each row of the results records the fraction of rows
done by then, and the default 4 / 8 iterations (16 / 32 autoregressive) keep the default
article's ~34-token summary live. Longer loops give steadier marginal costs (on a 2-core
AMD EPYC of family 26, 16 and 32 iterations left the differences' 25th-75th percentiles
about +-0.15 ms apart over 41 rounds, 6 and 12 about +-0.4 ms over 81), so the default
takes more rounds.
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
        rng=jax.random.PRNGKey(0), row_ids=jnp.arange(tokens.shape[0], dtype=jnp.int32),
        max_decode_len=max_decode_len, sampling=Sampling())
    parts = algorithm.loop_parts(ctx)
    body = parts.make_body(parts.ctx)
    state = jax.lax.fori_loop(0, iterations, lambda i, s: body(s), parts.init)
    # The target cache's filled slots per row: where the bodies' attention reads (both
    # loops rewind a finished row's cache, so its slots stop at its length).
    cache = getattr(state, "target_cache", None)
    cache = state.cache if cache is None else cache
    return parts.result_of(state), cache.lengths, parts.done_of(state)

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
  inputs = harness.task_inputs(args.task, split="test", num_examples=args.example + args.batch,
                               input_length=args.input_length, decode_len=args.cache_length)
  tokens = runner.trim_padding(np.asarray(inputs[args.example:args.example + args.batch]))
  if tokens.shape[0] != args.batch:
    raise ValueError(f"--batch {args.batch} from example {args.example}: the task's test "
                     f"split has only {len(inputs)} examples")
  tp = base.decoding_params(models.target, models.target_params)
  dp = base.decoding_params(draft, draft_params)
  k = args.iterations
  L = 2 * k * (max(args.gammas) + 1) + 8  # room for every token the longer loops commit

  def pair(algorithm, with_draft: bool, steps: int):
    make = lambda n: _body_loop(algorithm, models, draft if with_draft else None, tp,
                                dp if with_draft else None, tokens, iterations=n,
                                max_decode_len=L)
    return make(steps), make(2 * steps)

  finished = {}  # pair name -> fraction of rows done by the longer loop's end

  def reached(name, loops) -> int:
    """The mean target-cache position over a pair's marginal iterations (between the
    shorter and the longer loop's end), over the rows: where its bodies' attention reads.
    Also notes the rows that finished by the longer loop's end (`finished`): a finished
    row's iterations still run, but read a frozen cache and commit nothing."""
    outs = [loop() for loop in loops]
    finished[name] = float(np.mean(np.asarray(outs[1][2])))
    return int(round(sum(float(np.mean(np.asarray(o[1]))) for o in outs) / 2))

  def workload(position: int, cache_length: int):
    return timing.Workload(target=models.target, target_params=models.target_params,
                           encoder_tokens=tokens, cache_length=cache_length,
                           position=position, draft=draft, draft_params=draft_params)

  auto = args.position == "auto"
  ar = pair(decoding.Autoregressive(), False, 4 * k)
  bodies = {g: pair(decoding.Speculative(gamma=g), True, k) for g in args.gammas}
  # The decode calls alone at the positions the bodies reach (--position auto), in a
  # cache as long as theirs, or at the given position of a --cache_length cache.
  cache_length = L + max(args.gammas) + 2 if auto else args.cache_length
  at = lambda name, loops: reached(name, loops) if auto else int(args.position)
  step_position = at("autoregressive", ar)
  loops = {"autoregressive": ar,
           "step:1": timing.marginal_pair(
               lambda n: workload(step_position, cache_length).decode_loop(
                   "target", num_tokens=1, steps=n), args.steps)}
  positions, fixed_positions = {}, {}
  for g in args.gammas:
    fixed = pair(decoding.Speculative(gamma=g, drafter=FixedProposal()), False, k)
    positions[g] = at(f"speculative:{g}", bodies[g])
    fixed_positions[g] = at(f"fixed:{g}", fixed)
    w = workload(positions[g], cache_length)
    loops[f"speculative:{g}"] = bodies[g]
    loops[f"fixed:{g}"] = fixed
    drafter = decoding.Speculative(gamma=g).drafter
    loops[f"proposal:{g}"] = timing.marginal_pair(
        lambda n, g=g, w=w, drafter=drafter: drafter.proposal_loop(w, gamma=g, steps=n),
        args.steps)
    loops[f"verify:{g + 1}"] = timing.marginal_pair(
        lambda n, g=g, w=w: w.decode_loop("target", num_tokens=g + 1, steps=n), args.steps)
    if fixed_positions[g] != positions[g]:  # the FixedProposal body reads a shorter cache
      wf = workload(fixed_positions[g], cache_length)
      loops[f"verify_fixed:{g + 1}"] = timing.marginal_pair(
          lambda n, g=g, wf=wf: wf.decode_loop("target", num_tokens=g + 1, steps=n),
          args.steps)
  print(f"timing {len(loops)} loops in {args.repeats} interleaved rounds (batch "
        f"{tokens.shape[0]}, encoder input {tokens.shape[1]} positions; decode calls alone "
        f"in a {cache_length}-slot cache at position {step_position} (one token), "
        + ", ".join(f"{positions[g]} / {fixed_positions[g]} ({g + 1} tokens, speculative / "
                    "FixedProposal)" for g in args.gammas) + ")", flush=True)
  r = {name: 1e3 * np.asarray(v)
       for name, v in timing.interleaved(loops, repeats=args.repeats).items()}
  q = lambda x: {"median": float(np.median(x)), "p25": float(np.percentile(x, 25)),
                 "p75": float(np.percentile(x, 75))}
  ar_work = q(r["autoregressive"] - r["step:1"])
  rows = []
  for g in args.gammas:
    spec, fixed, verify = r[f"speculative:{g}"], r[f"fixed:{g}"], r[f"verify:{g + 1}"]
    verify_fixed = r.get(f"verify_fixed:{g + 1}", verify)
    row = {"gamma": g, "batch": int(tokens.shape[0]), "input_positions": int(tokens.shape[1]),
           "cache_length": cache_length, "step_position": step_position,
           "verify_position": positions[g], "fixed_position": fixed_positions[g],
           "speculative_ms": float(np.median(spec)), "fixed_ms": float(np.median(fixed)),
           "verify_ms": float(np.median(verify)),
           "verify_fixed_ms": float(np.median(verify_fixed)),
           "proposal_ms": float(np.median(r[f"proposal:{g}"])),
           "step_ms": float(np.median(r["step:1"])),
           "autoregressive_ms": float(np.median(r["autoregressive"])),
           "draft_in_loop": q(spec - fixed), "bookkeeping": q(fixed - verify_fixed),
           "ar_loop_work": ar_work,
           # fractions of rows done by the longer loop's end (--position auto only)
           "finished": {k: finished[k] for k in ("autoregressive", f"speculative:{g}",
                                                 f"fixed:{g}") if k in finished}}
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
  p.add_argument("--example", type=int, default=3,
                 help="index of the (first) test example decoded")
  p.add_argument("--batch", type=int, default=1,
                 help="rows: test examples --example, --example + 1, ... decoded together")
  p.add_argument("--gammas", default="1,3,5,8", help="comma-separated proposal lengths")
  p.add_argument("--iterations", type=int, default=4,
                 help="iterations of the shorter speculative loop (4x for the autoregressive)")
  p.add_argument("--cache_length", type=int, default=64,
                 help="the decode-call loops' cache (verify, step) with a numeric --position")
  p.add_argument("--position", default="auto",
                 help="their cache slots filled: 'auto' (default), the mean position the "
                      "loop bodies' marginal iterations reach (the autoregressive body's for "
                      "the one-token step, each gamma's speculative body's for its verify "
                      "call and proposal), in a cache as long as the bodies'; or a number")
  p.add_argument("--steps", type=int, default=16, help="iterations of their shorter loop")
  p.add_argument("--repeats", type=int, default=81, help="interleaved rounds")
  p.add_argument("--stem", default="loop_split")
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  args = p.parse_args(list(argv))
  if args.position == "auto":  # checked against the bodies' own caches
    harness.parse_gammas(p, args)
  else:
    try:
      args.position = int(args.position)
    except ValueError:
      p.error(f"--position must be 'auto' or an int, got {args.position!r}")
    harness.parse_gammas_in_cache(p, args)
  if (min(args.iterations, args.steps, args.repeats, args.input_length, args.batch) < 1
      or args.example < 0):
    p.error("--iterations, --steps, --repeats, --input_length and --batch must be >= 1, "
            "--example >= 0")
  return args


def run(args, meta) -> harness.Output:
  rows = measure(args)
  ms = lambda v: f"{v:.3f} ms"
  spread = lambda s: f"{s['median']:.3f} [{s['p25']:.3f}, {s['p75']:.3f}] ms"
  cols = [Column("gamma", "gamma"), Column("speculative_ms", "speculative iteration", ms),
          Column("fixed_ms", "without the draft", ms),
          Column("verify_ms", "verify call alone", ms),
          Column("verify_fixed_ms", "verify call at the FixedProposal body's position", ms),
          Column("proposal_ms", "proposal alone", ms),
          Column("draft_in_loop", "draft in the loop", spread),
          Column("bookkeeping", "bookkeeping", spread),
          Column("autoregressive_ms", "autoregressive iteration", ms),
          Column("step_ms", "target step alone", ms),
          Column("ar_loop_work", "autoregressive loop work", spread)]
  first = rows[0]
  notes = [
      f"Target {args.target}, draft {args.draft}; batch {args.batch}, {args.task} test "
      f"example{'s' if args.batch > 1 else ''} {args.example}"
      f"{'' if args.batch == 1 else f'-{args.example + args.batch - 1}'} "
      f"({first['input_positions']} encoder positions after trimming); the "
      f"loop bodies run {args.iterations} and {2 * args.iterations} iterations "
      f"({4 * args.iterations} and {8 * args.iterations} autoregressive) from the start of "
      f"its decode; the decode calls alone in a cache of {first['cache_length']} slots "
      f"filled to {first['step_position']} (the one-token step) and to "
      + ", ".join(f"{r['verify_position']} (gamma {r['gamma']}; {r['fixed_position']} for "
                  "its FixedProposal body)" for r in rows)
      + (" (--position auto: the mean position of the bodies' marginal iterations, over the "
         "rows, so the calls alone read the cache the bodies read)" if args.position == "auto"
         else "") + f"; {args.steps} and {2 * args.steps} calls; {args.repeats} interleaved "
      "rounds.",
      "draft in the loop = speculative iteration - the same body without the draft "
      "(FixedProposal), per round (that body advances ~1 token per iteration, so it reads a "
      "shorter cache: part of the difference is attention); bookkeeping = that body - the "
      "verify call alone at the position that body reaches; "
      "autoregressive loop work = its iteration - the target step alone. Cells: median "
      "[25th, 75th percentile] over rounds; the spread is the machine's noise.",
      "The cost model charges the draft gamma c T_p per iteration (c per drafted token): a "
      "'draft in the loop' that does not grow with gamma is a cost paid once per proposal."]
  done = {k: v for r in rows for k, v in r.get("finished", {}).items() if v > 0}
  if done:
    notes.append("Rows done by the longer loop's end (their later iterations decode a "
                 "finished row: a frozen cache, nothing committed; fewer --iterations keep "
                 "them live): " + ", ".join(f"{k} {v:.0%}" for k, v in sorted(done.items()))
                 + ".")
  return harness.Output(args.stem, "Where a decoding iteration goes", cols, rows, notes)


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.loop_split", argv, parse_args, run)


if __name__ == "__main__":
  main()
