r"""Dataset throughput with in-loop refill against plain batches, both decoders.

  python -m experiments.refill                     # big EnDe pair, 64 examples, B = 1,4,8
  python -m experiments.refill --batch_sizes 8 --num_examples 200 --name ende_b8_200
  python -m experiments.refill --batch_sizes 8 --gamma 6 --adaptive tuned --name ende_adaptive

A plain batched decode runs each batch until its slowest row is done, computing the rows
that finished (`compact_batch` shrinks such a batch, never refills it). With refill
(`decoding.run(..., refill_batch=B)`) the whole dataset goes to one call of B slots and a
finished row's slot takes the next example inside the jitted loop. For each batch size
this times, interleaved in rounds (`harness.time_decodes`), the autoregressive and the
speculative decoder (gamma --gamma, temperature --temperature) three ways: plain batches,
plain batches that compact, and refill; and reports dataset tokens/s, each decoder's gain
from refill over its plain batches, the speculative / autoregressive ratio in each mode,
and the fraction of rows identical to the plain autoregressive decode (greedy: must be 1).
Writes <results_dir>/refill_<name>.{md,csv,json}.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Sequence

from experiments import harness, setups
from experiments.harness import Column, fmt

MODES = ("plain", "compact", "refill")


def _drafter(args):
  """The speculative decoder's drafter: the draft model proposing gamma tokens, or with
  --adaptive a per-row number of them up to gamma (`AdaptiveDrafter`, its rule)."""
  from spec_decode import decoding
  if args.adaptive == "none":
    return decoding.ModelDrafter()
  return decoding.AdaptiveDrafter(rule=args.adaptive)


def measure(args) -> list[dict[str, Any]]:
  import jax

  from spec_decode import decoding
  models = harness.load_models(harness.model_spec(args.target),
                               {"draft": harness.model_spec(args.draft, role="draft")})
  draft, dparams = models.draft("draft")
  inputs = harness.task_inputs(args.task, split="test", num_examples=args.num_examples,
                               input_length=args.input_length, decode_len=args.decode_len)
  sampling = decoding.Sampling(temperature=args.temperature)
  rows = []
  for B in args.batch_sizes:
    fns, batch_sets = {}, {}
    for mode in MODES:
      compact = mode == "compact"
      algos = {"autoregressive": decoding.Autoregressive(compact_batch=compact),
               "speculative": decoding.Speculative(gamma=args.gamma, compact_batch=compact,
                                                   drafter=_drafter(args))}
      extra = {"refill_batch": B} if mode == "refill" else {}
      for name, algo in algos.items():
        fns[(mode, name)] = harness.decode_fn(
            algo, models.target, models.target_params, draft, dparams,
            max_decode_len=args.decode_len, sampling=sampling,
            rng=jax.random.PRNGKey(args.seed), **extra)
      batch_sets[mode] = (harness.batches(inputs, len(inputs) if mode == "refill" else B)[0])
    times = {}
    for mode in MODES:  # each mode's two decoders interleaved; modes one after the other
      pair = {name: fns[(mode, name)] for name in ("autoregressive", "speculative")}
      for name, t in harness.time_decodes(pair, batch_sets[mode], repeats=args.repeats,
                                          target=models.target).items():
        times[(mode, name)] = t
    base = times[("plain", "autoregressive")].outputs
    row = {"batch": B}
    for (mode, name), t in times.items():
      st = harness.decode_stats(t.outputs, len(inputs), baseline=base)
      seconds = statistics.median(t.seconds)
      key = f"{mode}_{name[:4]}"
      row[f"{key}_tps"] = st["tokens"] / seconds
      row[f"{key}_identical"] = st.get("identical")
      if name == "speculative":
        row[f"{mode}_tokens_per_call"] = st["tokens_per_target_call"]
    for mode in MODES:
      row[f"{mode}_speedup"] = row[f"{mode}_spec_tps"] / row[f"{mode}_auto_tps"]
    row["refill_gain_auto"] = row["refill_auto_tps"] / row["plain_auto_tps"]
    row["refill_gain_spec"] = row["refill_spec_tps"] / row["plain_spec_tps"]
    row["identical"] = min(v for k, v in row.items() if k.endswith("_identical") and v is not None)
    rows.append(row)
    print(f"[refill] batch {B}: AR tokens/s plain {row['plain_auto_tps']:.0f} compact "
          f"{row['compact_auto_tps']:.0f} refill {row['refill_auto_tps']:.0f}; speculative "
          f"plain {row['plain_spec_tps']:.0f} compact {row['compact_spec_tps']:.0f} refill "
          f"{row['refill_spec_tps']:.0f}; spec/AR plain {row['plain_speedup']:.2f}X refill "
          f"{row['refill_speedup']:.2f}X; identical {row['identical']:.3f}", flush=True)
  return rows


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.refill", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  task, inputs, targets = setups.DEMO_TASKS["ende"]
  p.add_argument("--target", default="demo:ende_target_big")
  p.add_argument("--draft", default="demo:ende_small")
  p.add_argument("--task", default=task)
  p.add_argument("--input_length", type=int, default=inputs)
  p.add_argument("--decode_len", type=int, default=targets)
  p.add_argument("--num_examples", type=int, default=64)
  p.add_argument("--batch_sizes", default="1,4,8")
  p.add_argument("--gamma", type=int, default=4)
  p.add_argument("--adaptive", default="none", choices=("none", "schedule", "threshold",
                                                         "tuned"),
                 help="per-row draft lengths up to --gamma (AdaptiveDrafter's rule), decided "
                      "by each row from its own blocks, so rows at different depths (and "
                      "refilled rows) draft differently")
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--name", default="ende_big")
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  args = p.parse_args(list(argv))
  args.batch_sizes = harness.parse_ints(args.batch_sizes, "batch_sizes")
  if args.num_examples < 1 or args.repeats < 1 or min(args.batch_sizes) < 1:
    p.error("--num_examples, --repeats and every batch size must be >= 1")
  return args


def run(args, meta) -> harness.Output:
  rows = measure(args)
  tps = lambda v: f"{v:.0f}"
  x = lambda v: fmt(v, 2, "X")
  cols = [Column("batch", "batch")]
  for mode in MODES:
    cols += [Column(f"{mode}_auto_tps", f"AR {mode} tok/s", tps),
             Column(f"{mode}_spec_tps", f"spec {mode} tok/s", tps),
             Column(f"{mode}_speedup", f"spec/AR {mode}", x)]
  cols += [Column("refill_gain_auto", "AR refill / plain", x),
           Column("refill_gain_spec", "spec refill / plain", x),
           Column("refill_tokens_per_call", "spec tokens per call (refill)", lambda v: fmt(v, 2)),
           Column("identical", "rows identical to plain AR", lambda v: fmt(v, 3))]
  notes = [f"{args.target} with {args.draft} on {args.task} (test), the first "
           f"{args.num_examples} examples, inputs {args.input_length} / outputs up to "
           f"{args.decode_len} tokens, " + (
               f"gamma {args.gamma}" if args.adaptive == "none" else
               f"per-row draft lengths up to {args.gamma} (AdaptiveDrafter rule "
               f"{args.adaptive!r})") + f", temperature {args.temperature}; "
           f"tokens/s over the whole dataset, median of {args.repeats} rounds, the two "
           "decoders interleaved within a round, modes one after the other.",
           "plain: batches of B, each until its slowest row is done; compact: the same "
           "batches halved as rows finish (compact_batch); refill: one call over the dataset "
           "in B slots, a finished row's slot taking the next example inside the loop."]
  return harness.Output(f"refill_{args.name}", "In-loop refill against plain batches", cols,
                        rows, notes)


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.refill", argv, parse_args, run)


if __name__ == "__main__":
  main()
