r"""A peer on the same weights: Hugging Face transformers' decoders next to this project's.

  python -m experiments.peers                      # the big demo EnDe target + small draft (CPU)
  python -m experiments.peers --task synthetic_cnndm --target demo:cnndm_target \
      --draft demo:cnndm_small --input_length 320 --name demo_cnndm

The target and draft are written with `checkpoints.save(format="hf")` and read
back by `transformers.T5ForConditionalGeneration` (PyTorch, CPU, float32).
Then, back to back in this process, on the same examples (batch 1, greedy,
up to --decode_len new tokens, EOS ends a row), each decoder decodes every
example once per round, rounds interleaved (median over rounds):
  ours:  autoregressive, speculative (gamma, the model drafter), source lookup (gamma
         tokens, no draft model: `LookupDrafter`);
  HF:    greedy `generate`, assisted generation with the draft
         (`assistant_model=`, a constant --gamma draft tokens per call, no
         confidence cut-off), assisted generation with HF's default schedule
         (heuristic draft length, confidence threshold), prompt-lookup decoding
         (`prompt_lookup_num_tokens=gamma`, no draft model).
Reported per decoder: tokens/s, speedup over its own baseline (ours over our
autoregressive decoding, HF's over HF greedy), tokens per target call where
known, and the fraction of examples whose tokens equal our autoregressive
output. Timings include everything a user call pays (encoding, host work).
torch runs with --torch_threads threads (default: all cores, as XLA:CPU).
Writes <results_dir>/peers_<name>.{md,csv,json}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from typing import Any, Sequence

import numpy as np

from experiments import benchmark, harness
from experiments.harness import Column, fmt
from spec_decode.models.base import EOS_ID


def _cut(tokens: Sequence[int]) -> tuple[int, ...]:
  """Tokens up to and including the first EOS (the padding after it dropped)."""
  out = []
  for t in tokens:
    out.append(int(t))
    if t == EOS_ID:
      break
  return tuple(out)


def _ours(target, tparams, draft, dparams, gamma: int, decode_len: int):
  import jax
  from spec_decode import decoding
  from spec_decode.decoding.drafters.lookup import LookupDrafter
  algos = {"ours: autoregressive": decoding.Autoregressive(),
           f"ours: speculative (gamma {gamma})": decoding.Speculative(gamma=gamma),
           f"ours: source lookup ({gamma} tokens)": decoding.Speculative(
               gamma=gamma, drafter=LookupDrafter())}

  def make(algo):
    kw = dict(draft=draft, draft_params=dparams) if algo.needs_draft else {}

    def run(enc: np.ndarray, ids=None):
      r = decoding.run(algo, target, tparams, enc, max_decode_len=decode_len, **kw)
      jax.block_until_ready(r.tokens)
      calls = int(np.asarray(r.stats.target_calls)[0])
      return _cut(np.asarray(r.tokens)[0]), calls
    return run
  return {name: make(a) for name, a in algos.items()}


def _hf(target_dir: str, draft_dir: str, gamma: int, decode_len: int):
  import torch
  import transformers
  tgt = transformers.T5ForConditionalGeneration.from_pretrained(target_dir).eval()
  dft = transformers.T5ForConditionalGeneration.from_pretrained(draft_dir).eval()
  common = dict(max_new_tokens=decode_len, do_sample=False, num_beams=1,
                decoder_start_token_id=0, eos_token_id=EOS_ID, pad_token_id=0)
  variants = {
      "HF: greedy generate": {},
      f"HF: assisted (gamma {gamma}, constant)": dict(
          assistant_model=dft, num_assistant_tokens=gamma,
          num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0),
      "HF: assisted (HF default schedule)": dict(assistant_model=dft),
      f"HF: prompt lookup ({gamma} tokens)": dict(prompt_lookup_num_tokens=gamma)}

  def make(extra):
    def run(enc: np.ndarray, row_ids=None):
      ids = torch.from_numpy(np.asarray(enc).astype(np.int64))
      with torch.inference_mode():
        out = tgt.generate(input_ids=ids, attention_mask=(ids > 0).long(), **common, **extra)
      return _cut(out[0, 1:].tolist()), None  # drop the decoder start token
    return run
  return {name: make(extra) for name, extra in variants.items()}


def compare(args) -> dict[str, Any]:
  import jax
  import torch
  from spec_decode import checkpoints
  tspec = harness.model_spec(args.target, config=args.target_config, dtype="float32", seed=0,
                             vocab_size=args.vocab_size, role="target")
  dspec = harness.model_spec(args.draft, config=args.draft_config, dtype="float32", seed=1,
                             vocab_size=args.vocab_size, role="draft")
  models = harness.load_models(tspec, {"draft": dspec})
  target, tparams = models.target, models.target_params
  draft, dparams = models.draft("draft")
  inputs = benchmark._inputs(args, target.vocab_size)
  torch.set_num_threads(args.torch_threads)
  with tempfile.TemporaryDirectory() as tmp:
    tdir, ddir = os.path.join(tmp, "target"), os.path.join(tmp, "draft")
    checkpoints.save(tdir, target.config, jax.device_get(tparams), format="hf")
    checkpoints.save(ddir, draft.config, jax.device_get(dparams), format="hf")
    fns = dict(_ours(target, tparams, draft, dparams, args.gamma, args.decode_len))
    fns.update(_hf(tdir, ddir, args.gamma, args.decode_len))
  batches = [(inputs[i:i + 1], None) for i in range(len(inputs))]
  times = harness.time_decodes(fns, batches, repeats=args.repeats)
  names = list(fns)
  outputs = {n: [toks for toks, _ in times[n].outputs] for n in names}
  calls = {n: [c for _, c in times[n].outputs] for n in names}
  ref = outputs[names[0]]  # our autoregressive decoding
  own_base = {n: names[0] if n.startswith("ours") else "HF: greedy generate" for n in names}
  rows = []
  for n in names:
    toks = sum(len(o) for o in outputs[n])
    med = statistics.median(times[n].seconds)
    rows.append({"decoder": n, "tokens": toks, "seconds": harness.spread(times[n].seconds),
                 "tokens_per_second": toks / med,
                 "identical": float(np.mean([a == b for a, b in zip(outputs[n], ref)])),
                 "tokens_per_target_call": (toks / sum(calls[n]) if None not in calls[n]
                                            else None)})
  by_name = {r["decoder"]: r for r in rows}
  for r in rows:
    base = by_name[own_base[r["decoder"]]]
    r["speedup_over_own_baseline"] = r["tokens_per_second"] / base["tokens_per_second"]
  ours = by_name[f"ours: speculative (gamma {args.gamma})"]
  hf_assisted = by_name[f"HF: assisted (gamma {args.gamma}, constant)"]
  lookup = by_name[f"ours: source lookup ({args.gamma} tokens)"]
  hf_lookup = by_name[f"HF: prompt lookup ({args.gamma} tokens)"]
  summary = {"ours_speculative_over_hf_assisted": (ours["tokens_per_second"]
                                                   / hf_assisted["tokens_per_second"]),
             "ours_speedup": ours["speedup_over_own_baseline"],
             "hf_assisted_speedup": hf_assisted["speedup_over_own_baseline"],
             "ours_lookup_speedup": lookup["speedup_over_own_baseline"],
             "hf_prompt_lookup_speedup": hf_lookup["speedup_over_own_baseline"],
             "torch_threads": args.torch_threads, "torch_version": torch.__version__,
             "num_examples": len(batches),
             "target": tspec.to_json(), "draft": dspec.to_json()}
  return {"rows": rows, "summary": summary}


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.peers", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  benchmark.add_pair_arguments(p)
  p.add_argument("--task", default=None, help="take inputs from this task (else random ids)")
  p.add_argument("--split", default="test")
  p.add_argument("--input_length", type=int, default=None)
  p.add_argument("--decode_len", type=int, default=None)
  p.add_argument("--gamma", type=int, default=4)
  p.add_argument("--num_examples", type=int, default=20)
  p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median)")
  p.add_argument("--torch_threads", type=int, default=os.cpu_count() or 1)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--name", default=None, help="output stem peers_<name>")
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  args = p.parse_args(list(argv))
  benchmark.fill_pair_defaults(p, args)
  for name in ("gamma", "num_examples", "repeats", "torch_threads", "input_length",
               "decode_len"):
    if getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1")
  args.name = args.name or "custom"
  return args


def run(args, meta) -> harness.Output:
  res = compare(args)
  s = res["summary"]
  cols = [Column("decoder", "decoder", str),
          Column("tokens_per_second", "tokens/s", lambda v: fmt(v, 1)),
          Column("speedup_over_own_baseline", "speedup over own baseline",
                 lambda v: fmt(v, 2, "X")),
          Column("tokens_per_target_call", "tokens per target call", lambda v: fmt(v, 2)),
          Column("identical", "identical to ours (AR)", lambda v: fmt(v, 2))]
  notes = [f"{s['num_examples']} examples ({args.task or 'random ids'}, {args.split}), batch 1, "
           f"greedy, up to {args.decode_len} new tokens; {args.repeats} interleaved rounds, "
           f"median. torch {s['torch_version']} with {args.torch_threads} threads, float32; "
           "ours: JAX/XLA:CPU, float32, the default compile options.",
           "Speedups are each family's own: ours over our autoregressive decoding, HF's over "
           "HF greedy generate. 'identical' compares each decoder's tokens (up to EOS) with "
           "our autoregressive output."]
  extra_md = (f"\n## Summary\n\n- our speculative tokens/s / HF assisted (constant gamma) "
              f"tokens/s: {fmt(s['ours_speculative_over_hf_assisted'], 2, 'X')}\n"
              f"- speedup over own baseline: ours {fmt(s['ours_speedup'], 2, 'X')}, HF assisted "
              f"{fmt(s['hf_assisted_speedup'], 2, 'X')}\n"
              f"- without a draft model: our source lookup {fmt(s['ours_lookup_speedup'], 2, 'X')}"
              f", HF prompt lookup {fmt(s['hf_prompt_lookup_speedup'], 2, 'X')} (HF searches "
              "the decoder's own tokens; ours the encoder input, then the output)\n")
  return harness.Output(f"peers_{args.name}",
                        f"Peers on the same weights: {args.target} / {args.draft}", cols,
                        res["rows"], notes, extra_md=extra_md, extra={"summary": s})


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.peers", argv, parse_args, run)


if __name__ == "__main__":
  main()
