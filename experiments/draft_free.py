r"""Speculation without a draft model, on the big demo targets: source lookup and
self-speculation from the target's own first decoder layers, next to the bigram table and
the small draft model.

  python -m experiments.draft_free                                  # EnDe and CNN/DM, t=0, 1
  python -m experiments.draft_free --tasks cnndm --temperatures 0 --num_examples 10
  python -m experiments.draft_free --scale tiny --num_examples 2 --repeats 1   # smoke run

For each task (the big demo target, demo_models/<task>_target_big, 45.6M parameters; the
task's first --num_examples test inputs, batch 1) and temperature, on the same keys:

  autoregressive                  the baseline;
  lookup                          `LookupDrafter` (n-grams 3..1, the source then the output
                                  so far; nothing proposed where nothing matches);
  lookup, <= 2 after a 1-gram     the same, proposing at most 2 tokens after a single-token
                                  match (`tokens_per_ngram=(2, gamma)`);
  lookup tree, 2 matches          `LookupTreeDrafter(width=2)` with `TreeVerifier`: the
                                  continuations of the two best different matches, a tree
                                  of up to 2 gamma nodes (verify calls trimmed to the rows'
                                  nodes);
  layer skip k                    `LayerSkipDrafter(layers=k)` for k in --layers: the target's
                                  own first k decoder layers, final norm and LM head;
  layer skip k + exit adapter     `LayerSkipDrafter(layers=k, adapter=True)`: the same after
                                  the trained exit adapter (Kangaroo) shipped for the task
                                  (demo_models/<task>_exit_adapter, k from its config; run
                                  when that directory exists; tiny scale: a random one);
  lookup, else layer skip k       the lookup where it matches, the first --layers depth
                                  elsewhere (`LookupDrafter(fallback=...)`);
  bigram table                    the paper's Table 3 bigram draft, fit on the task's train
                                  targets (--bigram_examples);
  small draft                     the demo small draft model (0.44M; demo_models/<task>_small).

all at gamma --gamma with token-level verification. Reported per decoder: tokens per target
call, drafted tokens per call, alpha (the mean beta over decided positions), c (one
proposal's marginal cost in its decoding loop / (gamma T_p), measured in interleaved rounds
with the target step: `experiment.measure.step_costs`), c in the loop (the same, each
proposal followed by the verify call, minus that call: `step_costs(in_loop=True)`), the cost
model's speedup from those (E[tokens] / (gamma c_in_loop + T_verify(gamma + 1) / T_p); the
lookup's E at its mean proposed length), and the measured speedup: the median over --repeats rounds (decoders
interleaved within a round, all after compilation) of the baseline's seconds over the
decoder's, and the same ratio of each example's fastest call summed over the examples
(`fastest calls`: what a round's drift or a stall cannot move); at t=0 the fraction of rows
identical to the baseline. The EAGLE heads shipped for the demo tasks read the 3.7M
targets' features (width 192), not the big targets': they do not run here. The tiny scale
runs random T5 models on the offline toy task: seconds, for CI; the numbers mean nothing.
The notes name the layer skip depth the cost model picks (`best_depths`) and what an oracle
lookup could reach on the greedy outputs (`lookup_ceiling`).
Writes <results_dir>/<name>.{md,csv,json}.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any, Sequence

import jax
import numpy as np

from experiments import harness, setups
from experiments.harness import Column, fmt

# The tiny scale's task: (name, input length, decode length, split of the inputs).
TINY_TASK = ("toy_reverse", 64, 32, "validation")


def _models(args, task: str):
  """(target, params, {draft name: (model, params)}, inputs [N, S], decode_len)."""
  from spec_decode import data
  from spec_decode.models import ngram
  if args.scale == "tiny":
    name, input_len, decode_len, split = TINY_TASK
    target_spec = harness.model_spec("t5_1_1_mini", vocab_size=259, seed=0)
    small_spec = harness.model_spec("t5_1_1_tiny", vocab_size=259, seed=1,
                                    config='{"num_decoder_layers": 1}', role="draft")
  else:
    (name, input_len, decode_len), split = setups.DEMO_TASKS[task], "test"
    demo = args.demo_models or harness.DEMO_DIR
    target_spec = harness.model_spec(os.path.join(demo, f"{task}_target_big"))
    small_spec = harness.model_spec(os.path.join(demo, f"{task}_small"), role="draft")
  adapter_spec = {}
  if args.scale == "demo" and os.path.isdir(os.path.join(demo, f"{task}_exit_adapter")):
    from spec_decode.experiment.model_specs import ModelSpec
    adapter_spec["adapter"] = ModelSpec(kind="exit_adapter", dtype="float32",
                                        checkpoint=os.path.join(demo, f"{task}_exit_adapter"))
  models = harness.load_models(target_spec, {"small": small_spec, **adapter_spec})
  target, tparams = models.target, models.target_params
  train = data.load_examples(data.get_task(name), split="train",
                             num_examples=args.bigram_examples,
                             feature_lengths={"inputs": input_len, "targets": decode_len})
  bigram = ngram.NGramDecoder(vocab_size=target.vocab_size, order=2)
  drafts = {"small": models.draft("small"),
            "bigram": (bigram, ngram.fit([ex.target_tokens for ex in train], order=2,
                                         vocab_size=target.vocab_size))}
  if adapter_spec:
    drafts["adapter"] = models.draft("adapter")
  elif args.scale == "tiny":  # a random adapter: the target's layer 1 copied after layer 0
    from spec_decode.heads.exit_adapter import ExitAdapter, ExitAdapterConfig
    adapter = ExitAdapter(ExitAdapterConfig.for_target(target.config, 1))
    drafts["adapter"] = (adapter, adapter.from_target_layer(tparams, 1))
  inputs = harness.task_inputs(name, split=split, num_examples=args.num_examples,
                               input_length=input_len, decode_len=decode_len)
  return target, tparams, drafts, inputs, decode_len


def lookup_ceiling(inputs: np.ndarray, outputs, *, gamma: int, max_ngram: int = 3,
                   width: int = 8) -> float:
  """Tokens per target call of an oracle source lookup on the greedy `outputs` (token lists,
  EOS included) of `inputs` [N, S]: at each step, of the continuations (up to gamma tokens)
  of the first `width` distinct places where the longest matching n-gram (n <= max_ngram) of
  the output occurs in the source or the output so far, the one the target accepts
  furthest. What a lookup tree of that width could reach at t=0; the chain lookup proposes
  the first place only."""
  from spec_decode.models.base import PAD_ID
  calls = tokens = 0
  for src_row, out in zip(np.asarray(inputs).tolist(), outputs):
    src = [t for t in src_row if t != PAD_ID]
    out = list(out)
    m = 0
    while m < len(out):
      hay = src + out[:m]
      ends = [len(src)] * len(src) + [len(hay)] * m  # a continuation stays in its segment
      found = []
      for n in range(min(max_ngram, m), 0, -1):
        suffix = out[m - n:m]
        for i in range(len(hay) - n):
          if hay[i:i + n] == suffix and i + n < ends[i]:
            cont = hay[i + n:min(i + n + gamma, ends[i])]
            if cont not in found:
              found.append(cont)
        if found:
          break
      best = 0
      for cont in found[:width]:
        a = 0
        while a < len(cont) and m + a < len(out) and cont[a] == out[m + a]:
          a += 1
        best = max(best, a)
      m += best + 1
      calls += 1
    tokens += len(out)
  return tokens / max(calls, 1)


def decoders(args, adapter=None) -> dict[str, tuple[Any, str | None]]:
  """{label: (Speculative, the draft it needs or None)} of the comparison (module doc);
  `adapter`: the exit adapter, if the task has one."""
  from spec_decode import decoding
  from spec_decode.decoding.drafters.layer_skip import LayerSkipDrafter
  from spec_decode.decoding.drafters.lookup import LookupDrafter, LookupTreeDrafter
  g = args.gamma
  spec = lambda drafter: decoding.Speculative(gamma=g, drafter=drafter)
  out = {"lookup": (spec(LookupDrafter()), None),
         "lookup, <= 2 after a 1-gram": (spec(LookupDrafter(tokens_per_ngram=(2, g))), None),
         "lookup tree, 2 matches": (decoding.Speculative(
             gamma=g, drafter=LookupTreeDrafter(width=2), verifier=decoding.TreeVerifier()),
             None)}
  for k in args.layers:
    out[f"layer skip {k}"] = (spec(LayerSkipDrafter(layers=k)), None)
  if adapter is not None:
    out[f"layer skip {adapter.layers} + exit adapter"] = (
        spec(LayerSkipDrafter(layers=adapter.layers, adapter=True)), "adapter")
  k = args.layers[0]
  out[f"lookup, else layer skip {k}"] = (
      spec(LookupDrafter(fallback=LayerSkipDrafter(layers=k))), None)
  out["bigram table"] = (decoding.Speculative(gamma=g), "bigram")
  out["small draft"] = (decoding.Speculative(gamma=g), "small")
  return out


def run_task(args, task: str, ceilings: dict) -> list[dict[str, Any]]:
  from spec_decode import decoding
  from spec_decode.decoding import timing
  from spec_decode.experiment import measure
  target, tparams, drafts, inputs, decode_len = _models(args, task)
  for k in args.layers:
    if k >= target.config.num_decoder_layers:
      raise ValueError(f"--layers {k}: the {task} target has "
                       f"{target.config.num_decoder_layers} decoder layers")
  batches = [(inputs[i:i + 1], np.asarray([i], np.int32)) for i in range(len(inputs))]
  specs = decoders(args, drafts["adapter"][0] if "adapter" in drafts else None)
  name = task if args.scale == "demo" else TINY_TASK[0]  # the rows' task label
  rows = []
  for temperature in args.temperatures:
    sampling = decoding.Sampling(temperature=temperature)
    common = dict(max_decode_len=decode_len, sampling=sampling,
                  rng=jax.random.PRNGKey(args.seed))
    fns = {"autoregressive": harness.decode_fn(decoding.Autoregressive(), target, tparams,
                                               **common)}
    for label, (algo, draft) in specs.items():
      d = drafts[draft] if draft else (None, None)
      fns[label] = harness.decode_fn(algo, target, tparams, *d, **common)
    print(f"[{task} T={temperature:g}] compiling {len(fns)} decoders", flush=True)
    times = harness.time_decodes(
        fns, batches, repeats=args.repeats, target=target,
        on_round=lambda r: print(f"[{task} T={temperature:g}] round {r + 1}/{args.repeats}",
                                 flush=True))
    workload = timing.Workload(target=target, target_params=tparams,
                               encoder_tokens=inputs[:1], cache_length=decode_len + args.gamma + 1,
                               position=decode_len // 2, sampling=sampling)
    costs = measure.step_costs(
        workload, {label: algo for label, (algo, _) in specs.items()},
        drafts={label: drafts[d] for label, (_, d) in specs.items() if d},
        repeats=args.cost_repeats, in_loop=True)
    base = times["autoregressive"]
    if temperature == 0:
      greedy = [r["tokens"] for r in harness.rows_of(base.outputs, len(inputs))]
      ceilings[name] = {w: lookup_ceiling(inputs, greedy, gamma=args.gamma, width=w)
                        for w in (1, 8)}
    for label, (algo, draft) in specs.items():
      st = harness.decode_stats(times[label].outputs, len(inputs), baseline=base.outputs)
      speedups = [a / b for a, b in zip(base.seconds, times[label].seconds)]
      verify_ratio = costs["verify_ratio"][algo.max_proposal + 1]
      model = algo.cost_model(alpha=st["alpha"],
                              draft_cost=costs["c_in_loop"][label] * algo.gamma,
                              verify_ratio=verify_ratio,
                              counters={"draft_tokens": st["drafted_per_target_call"],
                                        "target_calls": 1.0})
      rows.append({
          "task": name,
          "temperature": temperature, "decoder": label,
          "draft_model": {None: "none", "bigram": "bigram table", "small": "small T5 (0.44M)",
                          "adapter": f"exit adapter ({_millions(drafts, 'adapter')})"}[draft]
          if args.scale == "demo"
          else draft or "none",
          "tokens_per_call": st["tokens_per_target_call"],
          "drafted_per_call": st["drafted_per_target_call"], "alpha": st["alpha"],
          "c": costs["c"][label], "c_in_loop": costs["c_in_loop"][label],
          "verify_ratio": verify_ratio,
          "predicted": model["cost_model"] if model else None,
          "speedup": float(statistics.median(speedups)),
          "speedup_fastest": sum(base.call_seconds) / sum(times[label].call_seconds),
          "speedup_spread": harness.spread(speedups),
          "seconds": float(statistics.median(times[label].seconds)),
          "autoregressive_seconds": float(statistics.median(base.seconds)),
          "identical_fraction": st["identical"] if temperature == 0 else None,
          "examples": len(inputs)})
    jax.clear_caches()
  return rows


def _millions(drafts, name: str) -> str:
  return f"{drafts[name][0].num_params() / 1e6:.1f}M"


def best_depths(rows) -> dict[tuple[str, float], dict[str, Any]]:
  """{(task, temperature): {k, predicted, speedup}}: the layer skip depth whose cost model
  (the measured alpha, c and verify cost) predicts the largest speedup."""
  out = {}
  for r in rows:
    if (not r["decoder"].startswith("layer skip ") or r["predicted"] is None
        or r["draft_model"] != "none"):
      continue
    key = (r["task"], r["temperature"])
    if key not in out or r["predicted"] > out[key]["predicted"]:
      out[key] = {"k": int(r["decoder"].rsplit(" ", 1)[1]), "predicted": r["predicted"],
                  "speedup": r["speedup"]}
  return out


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.draft_free", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--scale", default="demo", choices=("tiny", "demo"))
  p.add_argument("--tasks", default="ende,cnndm")
  p.add_argument("--temperatures", default="0,1")
  p.add_argument("--gamma", type=int, default=4)
  p.add_argument("--layers", default=None, help="layer skip depths, the first also the "
                 "lookup's fallback (default: demo 2,4 of 8 decoder layers; tiny 1,2 of 3)")
  p.add_argument("--num_examples", type=int, default=20)
  p.add_argument("--bigram_examples", type=int, default=2000,
                 help="train targets the bigram table is fit on")
  p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median)")
  p.add_argument("--cost_repeats", type=int, default=10, help="rounds of the step costs")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--demo_models", default=None, help="the demo models' directory (default "
                 "demo_models/)")
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  p.add_argument("--name", default=None, help="the result files' stem (default draft_free, "
                 "draft_free_tiny at the tiny scale)")
  args = p.parse_args(list(argv))
  args.tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
  bad = [t for t in args.tasks if t not in setups.TASKS]
  if bad or not args.tasks:
    p.error(f"unknown tasks {bad}; known: {setups.TASKS}")
  if args.scale == "tiny":
    args.tasks = args.tasks[:1]  # both map to the toy task
  try:
    args.temperatures = harness.parse_floats(args.temperatures, "temperatures")
    args.layers = harness.parse_ints(args.layers or ("2,4" if args.scale == "demo" else "1,2"),
                                     "layers")
  except ValueError as e:
    p.error(str(e))
  if any(t < 0 for t in args.temperatures):
    p.error("--temperatures must be >= 0")
  for name in ("gamma", "num_examples", "bigram_examples", "repeats", "cost_repeats"):
    if getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1")
  args.name = args.name or ("draft_free" if args.scale == "demo" else "draft_free_tiny")
  return args


def run(args, meta) -> harness.Output:
  rows, ceilings = [], {}
  for task in args.tasks:
    rows += run_task(args, task, ceilings)
  f2, f3 = (lambda v: fmt(v, 2)), (lambda v: fmt(v, 3))
  cols = [Column("task", "task"), Column("temperature", "T", lambda v: fmt(v, 0)),
          Column("decoder", "decoder"), Column("draft_model", "draft model"),
          Column("tokens_per_call", "tokens/call", f2),
          Column("drafted_per_call", "drafted/call", f2), Column("alpha", "alpha", f3),
          Column("c", "c", f3), Column("c_in_loop", "c in loop", f3),
          Column("predicted", "cost model", lambda v: fmt(v, 2, "X")),
          Column("speedup", "measured speedup", lambda v: fmt(v, 2, "X")),
          Column("speedup_fastest", "fastest calls", lambda v: fmt(v, 2, "X")),
          Column("identical_fraction", "identical (t=0)", f2)]
  notes = [f"Big demo targets (45.6M, T5.1.1-small-shaped), batch 1, gamma {args.gamma}, "
           f"{args.num_examples} test examples per task; speedup: median over {args.repeats} "
           "interleaved rounds of autoregressive / decoder seconds (compilation excluded, "
           "encoding included); fastest calls: the sums of each example's fastest call, "
           "autoregressive / decoder.",
           "c: one proposal's marginal cost in its loop / (gamma x the target's step); the "
           "lookup's is its search, the layer skip's the truncated target's steps. c in loop: "
           "the same for proposals each followed by the verify call, minus the verify call "
           "(`step_costs(in_loop=True)`): what a proposal costs where the decoding loop runs "
           "it, after the target's weights went through the caches; the cost model charges "
           "it."]
  for (task, temperature), best in best_depths(rows).items():
    notes.append(f"{task}, t={temperature:g}: of the layer skip depths, the cost model picks "
                 f"k = {best['k']} from the measured alpha and c ({best['predicted']:.2f}X "
                 f"predicted, {best['speedup']:.2f}X measured).")
  for task, c in ceilings.items():
    notes.append(f"{task}: an oracle lookup on the greedy outputs (`lookup_ceiling`) would "
                 f"reach {c[1]:.2f} tokens per call with the first match (the chain lookup's "
                 f"rule) and {c[8]:.2f} with the best of 8 distinct matches (a lookup tree's "
                 "most): the task's own copy rate bounds any source lookup.")
  if args.scale == "tiny":
    notes = ["Tiny scale: random T5 models on the offline toy task; the numbers mean nothing."]
  return harness.Output(args.name, "Speculation without a draft model", cols, rows, notes,
                        extra={"lookup_ceiling": ceilings,
                               "best_layer_skip_depth": {f"{t}_t{temp:g}": v for (t, temp), v
                                                         in best_depths(rows).items()}})


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.draft_free", argv, parse_args, run)


if __name__ == "__main__":
  main()
