r"""How the CPU kernel's calls split their work between two threads, in decode steps and
the set-up.

  python -m experiments.kernel_threads                  # the big demo EnDe target
  python -m experiments.kernel_threads --target demo:cnndm_target_big --task synthetic_cnndm \
      --input_length 320

A kernel call on a large enough weight matrix hands panels to a helper from XLA's intra-op
pool while the calling thread starts on its own share (`cpu_matmul.cc`, `Run`); a helper
that starts late leaves its share to the caller. For single-token decode steps, verify
calls of N tokens (`decoding.timing.step_time`, batch 1) and each example's set-up (encoder
and cross-attention cache), this reports the time and the kernel's counters over the timed
calls (`cpu_matmul.thread_stats`): the helpers' share of the panels, their mean start
delay, the fraction that found no work left, the caller's wait for its helper, and a split
call's mean duration; start delay / call is roughly what the split's start costs a call.
Writes <results_dir>/kernel_threads.{md,csv,json}.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Sequence

from experiments import harness
from experiments.harness import Column, fmt


def measure(args) -> list[dict[str, Any]]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from spec_decode.decoding import runner, timing
  from spec_decode.kernels import cpu_matmul
  if not cpu_matmul.available():
    raise SystemExit(f"the CPU kernel is unavailable: {cpu_matmul.unavailable_reason()}")
  models = harness.load_models(args.target)
  model, params = models.target, models.target_params
  inputs = harness.task_inputs(args.task, split="test", num_examples=args.num_examples,
                               input_length=args.input_length, decode_len=args.decode_len)
  rows = []

  def row(what, seconds):
    time.sleep(0.05)  # a helper still running is counted once it ends
    stats = cpu_matmul.thread_stats(reset=True)
    out = dict(stats, what=what, ms=1e3 * seconds,
               start_fraction=stats["helper_start_us"] / stats["call_us"]
               if stats["call_us"] else 0.0)
    rows.append(out)
    print(f"{what}: {out['ms']:.3f} ms; {stats['split_calls']} split calls, helper share "
          f"{stats['helper_share']:.2f}, start {stats['helper_start_us']:.1f} us of "
          f"{stats['call_us']:.1f} us calls, idle {stats['helper_idle']:.2f}", flush=True)

  enc = jnp.asarray(inputs[:1])
  for n in args.tokens:
    timing.step_time(model, params, enc, num_tokens=n, cache_length=args.decode_len,
                     position=args.decode_len // 2, repeats=1)  # compile
    cpu_matmul.thread_stats(reset=True)
    seconds = timing.step_time(model, params, enc, num_tokens=n, cache_length=args.decode_len,
                               position=args.decode_len // 2, repeats=args.repeats)
    row("decode step" if n == 1 else f"verify call, {n} tokens", seconds)

  packed = model.decode_params(params)
  set_up = jax.jit(lambda p, t: model.init_cache(p, model.encode(p, t), args.decode_len))
  tokens = [jnp.asarray(runner.trim_padding(inputs[i:i + 1])) for i in range(len(inputs))]
  for t in tokens:
    jax.block_until_ready(set_up(packed, t))
  cpu_matmul.thread_stats(reset=True)
  start = time.perf_counter()
  for t in tokens:
    jax.block_until_ready(set_up(packed, t))
  row(f"set-up (mean of {len(tokens)} examples)", (time.perf_counter() - start) / len(tokens))
  return rows


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.kernel_threads", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", default="demo:ende_target_big")
  p.add_argument("--task", default="synthetic_ende")
  p.add_argument("--input_length", type=int, default=32)
  p.add_argument("--decode_len", type=int, default=48)
  p.add_argument("--tokens", default="1,5", help="tokens per decode call (1: a decode step)")
  p.add_argument("--num_examples", type=int, default=20, help="examples of the set-up")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  args = p.parse_args(list(argv))
  args.tokens = harness.parse_ints(args.tokens, "tokens")
  if min(args.tokens) < 1 or min(args.input_length, args.decode_len, args.num_examples,
                                 args.repeats) < 1:
    p.error("--tokens, --input_length, --decode_len, --num_examples and --repeats must be >= 1")
  return args


def run(args, meta) -> harness.Output:
  rows = measure(args)
  cols = [Column("what", "call"), Column("ms", "time", lambda v: f"{v:.3f} ms"),
          Column("split_calls", "split calls"),
          Column("helper_share", "helper share", lambda v: fmt(v, 2)),
          Column("helper_start_us", "helper start", lambda v: f"{v:.1f} us"),
          Column("call_us", "split call", lambda v: f"{v:.1f} us"),
          Column("start_fraction", "start / call", lambda v: fmt(v, 2)),
          Column("helper_idle", "helpers idle", lambda v: fmt(v, 2)),
          Column("wait_us", "caller's wait", lambda v: f"{v:.1f} us"),
          Column("helper_same_cpu", "helpers on the caller's CPU", lambda v: fmt(v, 2))]
  notes = [f"Target {args.target}, inputs of {args.task} ({args.input_length} tokens, trimmed as "
           f"decoding.run trims them), batch 1; decode steps and verify calls: "
           f"`timing.step_time` ({args.repeats} repeats, cache of {args.decode_len} slots), its "
           "time per call; set-up: encoder + cross-attention cache per example.",
           "Counters over every timed call (`cpu_matmul.thread_stats`). helper share 0.5 is "
           "an even split; a helper starting d us late leaves the caller about d / 2 us more "
           "work, so start / call bounds what a helper that starts at once would save.",
           "helpers on the caller's CPU: the fraction of helpers that found work and started "
           "on the CPU their caller was on when the call began (`sched_getcpu`): the two "
           "would then share one core until the scheduler moves one."]
  return harness.Output("kernel_threads", "The kernel's two-thread split", cols, rows, notes)


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.kernel_threads", argv, parse_args, run)


if __name__ == "__main__":
  main()
