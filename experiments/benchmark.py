r"""Step costs and throughput of one target/draft pair, all measured in one process.

  python -m experiments.benchmark                      # the big demo EnDe target + small draft (CPU)
  python -m experiments.benchmark --target t5_1_1_tiny --draft t5_1_1_tiny \
      --draft_config '{"num_decoder_layers": 1}' --vocab_size 259 --batch_size 4
  python -m experiments.benchmark --target t5_1_1_xxl --draft t5_1_1_small \
      --dtype bfloat16 --batch_size 1 --input_length 512 --decode_len 128   # GPU / TPU

Reports, for the given mesh and batch size (timings after compilation,
`--repeats` interleaved rounds, median and [25th, 75th] percentiles):
  * T_p, T_q: one single-token decode step of target and draft (cache filled
    to decode_len / 2), timed as --loop_steps steps inside one jitted loop so no
    per-step host dispatch is counted (as in the decoding loops); c = T_q / T_p
    per round;
  * T_verify(gamma + 1) / T_p for gamma in --gammas: the target scoring
    gamma + 1 tokens in one call, relative to one token;
  * autoregressive and speculative tokens/s over --num_examples inputs (the
    task's, or random ids), the measured alpha (mean of sum_x min(p, q)), and
    the speedup Theorem 3.8 predicts from it next to the measured one, plus a
    cost model that charges the measured verify ratio instead of Thm 3.8's
    assumption that verifying gamma + 1 tokens costs one step:
      E[tokens](alpha, gamma) / (gamma c + T_verify(gamma + 1) / T_p);
  * the engine split: every timed end-to-end call's seconds, minus the models' set-up
    (encoder + cross-attention cache, timed alone per input shape), fitted as a fixed cost
    plus a cost per loop iteration (least squares over the calls, which ran different
    numbers of iterations), for both decoders; the speculative iteration's loop work
    beyond its model calls (gamma T_q + T_verify) as a fraction of one verify call, the
    speculative call's fixed cost beyond the autoregressive one's, the loops' own speedup
    and the measured speedup as fractions of the cost model, and as a fraction of the
    speedup of decoders that spend time only on model work (`experiment.measure.model_work_speedup`:
    the set-up charged, at the iterations the calls ran);
  * on GPU/TPU (or with --roofline on): bytes one target step reads / measured
    device copy bandwidth, the step's memory-roofline time, and its ratio to T_p.
Random weights are fine for step costs; alpha and the speedup only mean
something for trained pairs. Writes <results_dir>/benchmark_<name>.{md,csv,json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any, Sequence

import jax
import numpy as np

from experiments import harness, setups
from experiments.harness import Column, fmt, fmt_spread
from spec_decode.decoding import timing


def _inputs(args, vocab_size: int) -> np.ndarray:
  """[num_examples, input_length] encoder ids: the task's examples or random ids."""
  if args.task:
    return harness.task_inputs(args.task, split=args.split, num_examples=args.num_examples,
                               input_length=args.input_length, decode_len=args.decode_len)
  return harness.random_encoder_tokens(args.num_examples, args.input_length, vocab_size,
                                       seed=args.seed)


def _e2e(args, models, inputs: np.ndarray, mesh) -> dict[str, Any]:
  """Autoregressive and speculative decoding of all inputs, batch by batch, interleaved."""
  from spec_decode import decoding
  batches, n_rows = harness.batches(inputs, args.batch_size)
  common = dict(max_decode_len=args.decode_len, rng=jax.random.PRNGKey(args.seed),
                sampling=decoding.Sampling(temperature=args.temperature),
                **({"mesh": mesh} if mesh is not None else
                   {"compiler_options": args.compiler_options}))
  algos = {"autoregressive": decoding.Autoregressive(compact_batch=args.compact_batch),
           "speculative": decoding.Speculative(gamma=args.gamma,
                                               compact_batch=args.compact_batch)}
  draft, dparams = models.draft("draft")
  fns = {name: harness.decode_fn(a, models.target, models.target_params, draft, dparams,
                                 **common) for name, a in algos.items()}
  times = harness.time_decodes(fns, batches, repeats=args.e2e_repeats,
                               target=models.target if mesh is None else None)
  out = {}
  for name, t in times.items():
    st = harness.decode_stats(t.outputs, n_rows)
    med = timing.spread(t.seconds)
    # Loop iterations: a batch runs until its longest row is done.
    per_batch = [int(np.asarray(r.stats.target_calls).max()) for r in t.outputs]
    steps = int(sum(per_batch))
    out[name] = {"seconds": med, "tokens": st["tokens"], "iterations": steps,
                 "seconds_per_iteration": med["median"] / steps if steps else None,
                 "tokens_per_second": st["tokens"] / med["median"] if med["median"] > 0 else None,
                 "call_seconds": t.call_seconds, "call_iterations": per_batch}
    if name == "speculative":
      out.update(alpha=st["alpha"], alpha_observed=st["alpha_observed"],
                 tokens_per_target_call=st["tokens_per_target_call"])
  ar, sp = out["autoregressive"]["tokens_per_second"], out["speculative"]["tokens_per_second"]
  out["speedup"] = sp / ar if ar and sp else None
  return out


def _engine(args, res, e2e, verify, model_row, target, tparams, draft, dparams,
            inputs) -> dict[str, Any] | None:
  """The decoders' costs split into set-up, a fixed cost per call beyond it and a cost per
  loop iteration, against the model calls an iteration makes: what the engine spends
  beyond the models.

  set-up: each model's encoding and cross-attention cache alone, timed for every input
  shape the calls ran at (`runner.compiled_shape`: inputs of different lengths encode at
  different costs, and longer inputs have longer outputs, so a plain fit over iterations
  would charge the encoders to the loop). Each call's seconds minus its set-up (the
  target's; for the speculative call also the draft's) are then fitted as fixed +
  per_iteration x iterations (`experiment.measure.fixed_and_per_iteration`).
  loop_work: per speculative iteration, beyond gamma T_q + T_verify(gamma + 1) (the
    goal: <= 25% of one verify call); ar_loop_work: per autoregressive step,
    beyond T_p. fixed_excess: the speculative call's fixed cost beyond the autoregressive
    call's (both net of set-up: the goal is that speculation adds no fixed cost but the
    draft's set-up). loop_speedup: the two loops alone (per-iteration costs x iterations)
    and its ratio to the cost model; efficiency: the measured end-to-end speedup over the
    cost model. model_work_speedup: `experiment.measure.model_work_speedup` on these calls, and
    model_work_efficiency: the measured speedup over it (the engine's loss alone).
  """
  from spec_decode.decoding import runner
  from spec_decode.experiment import batching, measure
  if verify is None or model_row is None or args.compact_batch:
    return None  # (a compacting loop's iterations cost less as its batch shrinks)
  B = args.batch_size
  batches = [b for b, _ in batching.batches(inputs, B)]
  shapes = [runner.compiled_shape(target, b) for b in batches]
  room = args.decode_len + max(args.gammas) + 1
  setup = {role: {} for role in ("target", "draft")}
  for shape, b in zip(shapes, batches):
    for role, m, p in (("target", target, tparams), ("draft", draft, dparams)):
      if shape not in setup[role]:
        setup[role][shape] = measure.setup_seconds(
            m, p, b, cache_length=room, repeats=args.repeats,
            compiler_options=args.compiler_options)["median"]
  per_call = {r: np.array([setup[r][sh] for sh in shapes]) for r in setup}  # set-up by call
  net = lambda name, roles: np.asarray(e2e[name]["call_seconds"]) - sum(per_call[r]
                                                                        for r in roles)
  ar_fit = measure.fixed_and_per_iteration(net("autoregressive", ("target",)),
                                         e2e["autoregressive"]["call_iterations"])
  sp_fit = measure.fixed_and_per_iteration(net("speculative", ("target", "draft")),
                                         e2e["speculative"]["call_iterations"])
  model_calls = args.gamma * res["draft_step"]["median"] + verify
  mean_setup = {r: float(np.mean(v)) for r, v in per_call.items()}
  bound = measure.model_work_speedup(
      target_setup=per_call["target"], draft_setup=per_call["draft"],
      target_step=res["target_step"]["median"],
      ar_iterations=e2e["autoregressive"]["call_iterations"], spec_iteration=model_calls,
      spec_iterations=e2e["speculative"]["call_iterations"])
  out = {
      "fit_autoregressive": ar_fit, "fit_speculative": sp_fit,
      "setup_seconds_mean": mean_setup,
      "setup_seconds_by_shape": {r: {str(k): v for k, v in d.items()} for r, d in setup.items()},
      "model_calls_per_iteration": model_calls,
      "model_work_speedup": bound,
      "model_work_efficiency": e2e["speedup"] / bound if e2e["speedup"] else None}
  if ar_fit is None or sp_fit is None:
    return out  # (the bound needs no fit: calls of one iteration count, e.g. random weights)
  loop_work = sp_fit["per_iteration"] - model_calls
  loop_ar = ar_fit["per_iteration"] * e2e["autoregressive"]["iterations"]
  loop_sp = sp_fit["per_iteration"] * e2e["speculative"]["iterations"]
  cost_model = model_row.get("cost_model")
  loop_speedup = loop_ar / loop_sp if loop_sp > 0 else None
  return {
      **out,
      "loop_work": loop_work, "loop_work_over_verify": loop_work / verify,
      "ar_loop_work": ar_fit["per_iteration"] - res["target_step"]["median"],
      "fixed_ar": ar_fit["fixed"], "fixed_spec": sp_fit["fixed"],
      "fixed_excess": sp_fit["fixed"] - ar_fit["fixed"],
      "loop_speedup": loop_speedup,
      "loop_efficiency": loop_speedup / cost_model if loop_speedup and cost_model else None,
      "efficiency": e2e["speedup"] / cost_model if e2e["speedup"] and cost_model else None}


def _roofline(args, target, step, t_p: float) -> dict[str, Any]:
  from spec_decode.experiment import measure
  nbytes = measure.decode_bytes(target, step)
  bandwidth = measure.copy_bandwidth(mib=args.copy_mib)
  out = {"bytes_per_step": nbytes, "copy_bandwidth_bytes_per_s": bandwidth}
  if nbytes is not None:
    out["roofline_seconds"] = nbytes / bandwidth
    out["roofline_fraction"] = out["roofline_seconds"] / t_p
  return out


def measure_costs(args, models, mesh) -> dict[str, Any]:
  """T_p, the draft's step (its proposal / gamma), c and T_verify(gamma + 1) / T_p for every
  gamma of --gammas, in interleaved rounds (`experiment.measure.step_costs`)."""
  from spec_decode import decoding, experiment, partitioning
  from spec_decode.experiment import batching
  inputs = _inputs(args, models.target.vocab_size)
  enc = batching.pad_rows(inputs[:args.batch_size], args.batch_size)
  rules = partitioning.standard_logical_axis_rules() if mesh is not None else None
  draft, dparams = models.draft("draft")
  workload = timing.Workload(
      target=models.target, target_params=models.target_params, encoder_tokens=enc,
      cache_length=args.decode_len + max(args.gammas) + 1, position=args.decode_len // 2,
      draft=draft, draft_params=dparams, mesh=mesh, rules=rules,
      compiler_options=None if mesh is not None else args.compiler_options)
  decoders = {"speculative": decoding.Speculative(gamma=args.gamma)}
  costs = experiment.step_costs(workload, decoders, verify_tokens=[g + 1 for g in args.gammas],
                                repeats=args.repeats, inner=args.inner, steps=args.loop_steps)
  per_token = {k: v / args.gamma if k != "n" else v
               for k, v in costs["proposal"]["speculative"].items()}
  return {"target_step": costs["target_step"], "draft_step": per_token,
          "c": costs["c"]["speculative"], "c_rounds": costs["c_rounds"]["speculative"],
          "verify": {g: costs["verify"][g + 1] for g in args.gammas},
          "verify_ratio": {g: costs["verify_ratio"][g + 1] for g in args.gammas},
          "verify_ratio_rounds": {g: costs["verify_ratio_rounds"][g + 1] for g in args.gammas},
          "target_loop": costs["target_loop"]}


def _progress(line: str) -> None:
  """A measured figure as soon as it is known (stderr), so a run cut short keeps it."""
  print(f"[benchmark] {line}", file=sys.stderr, flush=True)


def run_benchmark(args) -> dict[str, Any]:
  from spec_decode import partitioning, theory
  mesh = partitioning.make_mesh(args.mesh) if args.mesh else None
  tspec = harness.model_spec(args.target, config=args.target_config, dtype=args.dtype, seed=0,
                             vocab_size=args.vocab_size, role="target")
  if args.setup_kernel_weights != "same":  # as the demo run configs set it
    tspec = dataclasses.replace(tspec, setup_kernel_weights=args.setup_kernel_weights)
  dspec = harness.model_spec(args.draft, config=args.draft_config, dtype=args.dtype,
                             seed=args.draft_seed,
                             vocab_size=args.vocab_size, role="draft")
  models = harness.load_models(tspec, {"draft": dspec}, mesh=mesh)
  target, tparams = models.target, models.target_params
  draft, dparams = models.draft("draft")
  inputs = _inputs(args, target.vocab_size)
  pc = measure_costs(args, models, mesh)
  c = pc["c"]
  _progress(f"T_p {pc['target_step']['median'] * 1e3:.3f} ms, T_q "
            f"{pc['draft_step']['median'] * 1e3:.3f} ms, c {c:.4f}; T_verify(gamma+1)/T_p: "
            + ", ".join(f"{g}: {r:.3f}" for g, r in pc["verify_ratio"].items()))
  result: dict[str, Any] = {
      "target": tspec.to_json(), "draft": dspec.to_json(),
      "target_params": int(sum(x.size for x in jax.tree.leaves(tparams))),
      "draft_params": int(sum(x.size for x in jax.tree.leaves(dparams))),
      "target_step": pc["target_step"], "draft_step": pc["draft_step"], "c": c,
      "c_rounds": pc["c_rounds"], "marginal_step_costs": True}
  e2e = _e2e(args, models, inputs, mesh) if args.e2e else None
  result["e2e"] = e2e
  if e2e is not None:
    _progress(f"autoregressive {e2e['autoregressive']['tokens_per_second']:.1f} tokens/s, "
              f"speculative {e2e['speculative']['tokens_per_second']:.1f} tokens/s, "
              f"speedup {e2e['speedup']:.3f}X, alpha {e2e['alpha']:.3f}")
  alpha = None if e2e is None or math.isnan(e2e["alpha"]) else e2e["alpha"]
  if alpha is not None:
    e2e["expected_tokens"] = float(theory.expected_tokens(alpha, args.gamma))
  rows = []
  for g in args.gammas:
    r = pc["verify_ratio"][g]
    row = {"gamma": g, "verify_seconds": pc["verify"][g], "verify_ratio": r,
           "verify_ratio_rounds": pc["verify_ratio_rounds"][g]}
    if alpha is not None:
      row["thm38"] = float(theory.walltime_improvement(alpha, g, c))
      row["cost_model"] = float(theory.expected_tokens(alpha, g)) / (g * c + r)
    rows.append(row)
  result["gammas"] = rows
  if e2e is not None:
    # What the loops spend beyond the decode steps they make (encoding, sampling, control).
    ar, sp = e2e["autoregressive"], e2e["speculative"]
    verify = next((r["verify_seconds"]["median"] for r in rows if r["gamma"] == args.gamma), None)
    e2e["ar_overhead_per_iteration"] = ar["seconds_per_iteration"] - result["target_step"][
        "median"] if ar["seconds_per_iteration"] else None
    e2e["spec_overhead_per_iteration"] = (
        sp["seconds_per_iteration"] - args.gamma * result["draft_step"]["median"] - verify
        if sp["seconds_per_iteration"] and verify is not None else None)
    model_row = next((r for r in rows if r["gamma"] == args.gamma), None)
    e2e["engine"] = _engine(args, result, e2e, verify, model_row, target, tparams, draft,
                            dparams, inputs)
  roofline = args.roofline == "on" or (args.roofline == "auto" and
                                       jax.default_backend() in ("gpu", "tpu"))
  result["roofline"] = _roofline(args, target, pc["target_loop"],
                                 result["target_step"]["median"]) if roofline else None
  return result


def _ms(seconds) -> str:
  return "n/a" if seconds is None else f"{seconds * 1e3:.3f}"


def _iteration(args, res) -> float | None:
  verify = next((r["verify_seconds"]["median"] for r in res["gammas"]
                 if r["gamma"] == args.gamma), None)
  return None if verify is None else args.gamma * res["draft_step"]["median"] + verify


def _summary_md(args, res: dict[str, Any]) -> str:
  ms = lambda s: fmt_spread(s, scale=1e3)
  lines = ["## Summary", "",
           f"- target: {res['target'].get('name') or res['target']}, "
           f"{res['target_params']:,} parameters",
           f"- draft: {res['draft'].get('name') or res['draft']}, "
           f"{res['draft_params']:,} parameters",
           f"- T_p (target step): {ms(res['target_step'])} ms",
           f"- T_q (draft step): {ms(res['draft_step'])} ms",
           f"- c = T_q / T_p: {fmt(res['c'])} (per round: {fmt_spread(res['c_rounds'])})"]
  e = res["e2e"]
  if e is not None:
    lines += [
        f"- autoregressive: {fmt(e['autoregressive']['tokens_per_second'], 1)} tokens/s "
        f"({fmt(e['autoregressive']['tokens'], 0)} tokens, "
        f"{fmt_spread(e['autoregressive']['seconds'])} s)",
        f"- speculative (gamma {args.gamma}): {fmt(e['speculative']['tokens_per_second'], 1)} "
        f"tokens/s ({fmt(e['speculative']['tokens'], 0)} tokens, "
        f"{fmt_spread(e['speculative']['seconds'])} s)",
        f"- measured alpha {fmt(e['alpha'])} (observed acceptance {fmt(e['alpha_observed'])}), "
        f"{fmt(e['tokens_per_target_call'], 2)} tokens per target call (E[tokens] at this "
        f"alpha and gamma: {fmt(e.get('expected_tokens'), 2)}; fewer where a sequence ends "
        f"inside an iteration's block)",
        f"- loop overhead beyond the decode steps (encoding, sampling, control): "
        f"autoregressive {_ms(e['ar_overhead_per_iteration'])} ms per token step "
        f"(T_p {_ms(res['target_step']['median'])} ms); speculative "
        f"{_ms(e['spec_overhead_per_iteration'])} ms per iteration "
        f"(gamma T_q + T_verify = {_ms(_iteration(args, res))} ms)",
        f"- speedup: measured {fmt(e['speedup'], 2, 'X')}; Thm 3.8 at the measured alpha and c: "
        + next((fmt(r.get('thm38'), 2, 'X') + "; cost model: " + fmt(r.get('cost_model'), 2, 'X')
                for r in res["gammas"] if r["gamma"] == args.gamma),
               "n/a (gamma not among --gammas)")]
    lines += _engine_md(e)
  rl = res["roofline"]
  if rl is None:
    lines.append(f"- memory roofline: not measured on {jax.default_backend()} "
                 "(measured by default on GPU/TPU; --roofline on forces it)")
  else:
    gb = rl["copy_bandwidth_bytes_per_s"] / 1e9
    if rl["bytes_per_step"] is None:
      lines.append(f"- memory roofline: copy bandwidth {gb:.1f} GB/s; bytes per step unknown "
                   "for this model kind")
    else:
      lines.append(f"- memory roofline: {rl['bytes_per_step'] / 1e6:.2f} MB read per target step "
                   f"/ {gb:.1f} GB/s copy bandwidth = {rl['roofline_seconds'] * 1e3:.4f} ms, "
                   f"{rl['roofline_fraction']:.3f} of T_p")
  return "\n".join(lines) + "\n"


def _engine_md(e) -> list[str]:
  g = e.get("engine")
  if g is None:
    return ["- engine split (fixed cost per call, cost per iteration): n/a (a compacting "
            "loop's iterations do not cost alike, or the calls ran too few distinct iteration "
            "counts to separate them)"]
  ar, sp = g["fit_autoregressive"], g["fit_speculative"]
  bound_line = (
      f"  - decoders that spent time only on model work (both models' set-up per call, T_p per "
      f"autoregressive step, gamma T_q + T_verify per speculative iteration, at the "
      f"iterations the calls ran; no fixed cost, no loop work): "
      f"{fmt(g.get('model_work_speedup'), 2, 'X')}; measured: "
      f"**{fmt(g.get('model_work_efficiency'), 2)} of it** (what the engine loses; the rest of "
      f"the gap to the cost model is the encoders' set-up and the iterations' partial "
      f"acceptance near the end of a sequence, which no engine removes)")
  if ar is None or sp is None:
    return ["- engine split (fixed cost per call, cost per iteration): n/a (every call ran the "
            "same number of iterations, so the fit cannot separate them)", bound_line]
  return [
      "- engine split (each call's seconds minus the models' set-up, timed per input shape, "
      "fitted as fixed + per iteration x iterations by least squares; residual rms "
      f"autoregressive {_ms(ar['residual_rms'])} ms, speculative {_ms(sp['residual_rms'])} ms):",
      f"  - per iteration: autoregressive {_ms(ar['per_iteration'])} ms "
      f"(T_p + {_ms(g['ar_loop_work'])} ms of loop work); speculative "
      f"{_ms(sp['per_iteration'])} ms = model calls (gamma T_q + T_verify) "
      f"{_ms(g['model_calls_per_iteration'])} ms + loop work {_ms(g['loop_work'])} ms "
      f"(**{fmt(g['loop_work_over_verify'], 2)} of one verify call**; goal <= 0.25)",
      f"  - per call: set-up (encoder + cross-attention cache, mean over calls) target "
      f"{_ms(g['setup_seconds_mean']['target'])} ms, draft "
      f"{_ms(g['setup_seconds_mean']['draft'])} ms; fixed cost beyond set-up: autoregressive "
      f"{_ms(g['fixed_ar'])} ms, speculative {_ms(g['fixed_spec'])} ms, excess "
      f"**{_ms(g['fixed_excess'])} ms** (goal <= 0: speculation adds only the draft's set-up)",
      f"  - the loops alone (per-iteration cost x iterations, no fixed costs): "
      f"{fmt(g['loop_speedup'], 2, 'X')}, **{fmt(g['loop_efficiency'], 2)} of the cost "
      f"model**; end to end: **{fmt(g['efficiency'], 2)} of the cost model** (goal >= 0.9)",
      bound_line]


def add_pair_arguments(p: argparse.ArgumentParser) -> None:
  """--target/--draft (preset, checkpoint or demo:NAME), their config overrides, vocab_size."""
  p.add_argument("--target", default=None, help="T5 preset (random weights), checkpoint path, or "
                 "demo:NAME; default: the big demo EnDe target (demo:ende_target_big) and the "
                 "small draft on synthetic_ende")
  p.add_argument("--draft", default=None)
  p.add_argument("--target_config", default=None, help="JSON T5Config overrides of a preset")
  p.add_argument("--draft_config", default=None)
  p.add_argument("--vocab_size", type=int, default=None, help="vocab_size of both presets")


def fill_pair_defaults(p: argparse.ArgumentParser, args) -> None:
  """No --target: the big demo EnDe target and the small draft on their task and lengths
  (name demo_ende_big; the 3.7M pair is --target demo:ende_target --draft demo:ende_small);
  else both models are required, and lengths default to 64."""
  if args.target is None:
    if args.draft is not None:
      p.error("--draft needs --target")
    task, inputs, targets = setups.DEMO_TASKS["ende"]
    args.target, args.draft = "demo:ende_target_big", "demo:ende_small"
    args.task = args.task or task
    args.input_length = args.input_length or inputs
    args.decode_len = args.decode_len or targets
    args.name = args.name or "demo_ende_big"
  if args.draft is None:
    p.error("--target needs --draft")
  args.input_length = args.input_length or 64
  args.decode_len = args.decode_len or 64


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.benchmark", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  add_pair_arguments(p)
  p.add_argument("--dtype", default=None, help="e.g. bfloat16 (default float32)")
  p.add_argument("--setup_kernel_weights", default="same",
                 help="the target's ModelSpec.setup_kernel_weights (how the CPU kernel "
                 "multiplies its set-up's weights), e.g. bfloat16_dot_if_supported as the "
                 "demo run configs set it (default 'same': as the decode steps)")
  p.add_argument("--task", default=None, help="take inputs (and alpha) from this task")
  p.add_argument("--split", default="test")
  p.add_argument("--mesh", default=None, help="e.g. data=1,model=4")
  p.add_argument("--batch_size", type=int, default=1)
  p.add_argument("--input_length", type=int, default=None)
  p.add_argument("--decode_len", type=int, default=None)
  p.add_argument("--gammas", default="1-10")
  p.add_argument("--gamma", type=int, default=None, help="gamma of the end-to-end run "
                 "(default: 4 or the largest of --gammas if smaller)")
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--repeats", type=int, default=10, help="interleaved timing rounds")
  p.add_argument("--inner", type=int, default=3, help="calls per round (median)")
  p.add_argument("--loop_steps", type=int, default=8,
                 help="k: step costs are marginal, from jitted loops of k and 2k calls "
                 "(spec_decode.decoding.timing)")
  p.add_argument("--num_examples", type=int, default=None,
                 help="end-to-end inputs (default max(8, batch_size))")
  p.add_argument("--e2e_repeats", type=int, default=5,
                 help="timed passes over the end-to-end inputs (tokens/s: median pass; the "
                 "engine split: each call's fastest)")
  p.add_argument("--compiler_options", default=None,
                 help="JSON XLA options of every compiled loop, e.g. '{}' for XLA's defaults "
                 "(default: spec_decode.compile_options' defaults for the backend)")
  p.add_argument("--compact_batch", action="store_true",
                 help="end-to-end decoders shrink their batch as rows finish (batch > 1)")
  p.add_argument("--no_e2e", dest="e2e", action="store_false")
  p.add_argument("--roofline", default="auto", choices=("auto", "on", "off"))
  p.add_argument("--copy_mib", type=int, default=512)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--draft_seed", type=int, default=1,
                 help="random init of a preset draft; the target's (0) with --draft equal to "
                 "--target makes the draft a copy of the target (alpha 1 at temperature 0)")
  p.add_argument("--name", default=None, help="output stem benchmark_<name> (default from models)")
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  args = p.parse_args(list(argv))
  fill_pair_defaults(p, args)
  args.gammas = harness.parse_ints(args.gammas, "gammas")
  args.gamma = args.gamma or min(4, max(args.gammas))
  args.num_examples = args.num_examples or max(8, args.batch_size)
  if args.compiler_options is not None:
    try:
      args.compiler_options = json.loads(args.compiler_options)
    except json.JSONDecodeError as e:
      p.error(f"--compiler_options must be a JSON object: {e}")
    if not isinstance(args.compiler_options, dict):
      p.error(f"--compiler_options must be a JSON object, got {args.compiler_options!r}")
  for name in ("batch_size", "repeats", "inner", "loop_steps", "num_examples", "e2e_repeats",
               "copy_mib"):
    if getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1")
  if args.name is None:
    base = lambda s: os.path.basename(os.path.normpath(s.replace("demo:", "")))
    args.name = f"{base(args.target)}_{base(args.draft)}_b{args.batch_size}"
  return args


def run(args, meta) -> harness.Output:
  res = run_benchmark(args)
  cols = [Column("gamma", "gamma"),
          Column("verify_seconds", "T_verify(gamma+1) ms", lambda s: fmt_spread(s, scale=1e3)),
          Column("verify_ratio_rounds", "T_verify(gamma+1) / T_p", fmt_spread),
          Column("thm38", "Thm 3.8 speedup", lambda v: fmt(v, 2, "X")),
          Column("cost_model", "cost-model speedup", lambda v: fmt(v, 2, "X"))]
  notes = [f"batch {args.batch_size}" + (" (both end-to-end decoders shrink their batch as "
                                          "rows finish, compact_batch)"
                                          if args.compact_batch else "")
           + f", mesh {args.mesh or 'none (one device)'}, inputs "
           f"{args.input_length} tokens ({args.task or 'random ids'}"
           + ("; unsharded runs encode them trimmed of all-padding columns to a power of "
              "two, decoding.runner.input_length" if not args.mesh else "") + "), cache of "
           f"{args.decode_len + max(args.gammas) + 1} slots filled to {args.decode_len // 2}; "
           f"{args.repeats} interleaved rounds of {args.inner} calls of {args.loop_steps} and "
           f"{2 * args.loop_steps} decode steps in one jitted loop; a step's cost is the "
           "marginal cost of one more decode, (t(2k) - t(k)) / k, without the call's fixed "
           "cost (spec_decode.decoding.timing); cells are median [25th, 75th percentile] over "
           "rounds. XLA options: "
           + ("the backend defaults (spec_decode.compile_options)"
              if args.compiler_options is None else json.dumps(args.compiler_options)) + ".",
           "Speedup columns use the measured alpha of the end-to-end run and c = T_q / T_p, "
           "the ratio of the medians."]
  return harness.Output(f"benchmark_{args.name}", f"Benchmark: {args.target} / {args.draft}",
                        cols, res["gammas"], notes, extra_md=_summary_md(args, res),
                        extra={"summary": res})


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.benchmark", argv, parse_args, run)


if __name__ == "__main__":
  main()
