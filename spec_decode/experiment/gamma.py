"""Choosing a chain decoder's gamma from warm-up measurements (`config.GammaChoice`)."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Sequence

from absl import logging
import numpy as np

from spec_decode import distributed, metrics, theory
from spec_decode.decoding import timing
from spec_decode.experiment import measure, results, setup

def verify_probe_tokens(max_gamma: int) -> tuple[int, ...]:
  """The verify sizes N = gamma + 1 whose cost `choose_gamma` measures for its cost model:
  2 .. 6 and then every other size up to max_gamma + 1 (the cost model interpolates
  between them; each size is one more compiled step timer)."""
  top = max_gamma + 1
  return tuple(sorted({n for n in range(2, min(top, 6) + 1)} | set(range(6, top + 1, 2))
                      | {top}))


GAMMA_FILE = results.GAMMA


def _max_gamma(s: setup.Setup) -> int:
  """The largest gamma a warm-up may choose: GammaChoice.max_gamma, no more than the tokens
  decoded per example (no call keeps more), and no more than the decoder's drafter can
  propose with the run's draft (`Drafter.max_gamma`: 4 MTP modules propose 4 tokens)."""
  cfg = s.config
  limit = min(cfg.gamma_choice.max_gamma, cfg.decode_len)
  own = cfg.decoders[cfg.gamma_choice.decoder].drafter.max_gamma(s.draft)
  return limit if own is None else min(limit, own)


def choose_gamma(s: setup.Setup, output_dir: str) -> dict[str, Any]:
  """The gamma of decoder `GammaChoice.decoder` maximizing the expected speedup for alpha
  and costs measured on warm-up examples, by `GammaChoice.rule`.

  alpha: the estimator (sum of beta over decided positions / decisions) of that decoder's
  decode of the first `warmup_examples` examples at its configured gamma (the warm-up's;
  alpha does not depend on gamma); c: its cost per drafted token over the target's step
  on one batch (`measure.measure_step_times`); with the 'cost_model' rule also
  t(N) = T_verify(N) / T_p on that batch for N in `verify_probe_tokens(max_gamma)`, made
  non-decreasing in N (`theory.nondecreasing_costs`) and interpolated between them
  (`theory.optimal_gamma(..., verify_ratio=t)`): on a target whose verify call costs
  more than a step (a CPU, a large batch) Thm 3.8 picks too large a gamma. Both rules'
  choices and predictions are recorded. The choice falls back to gamma 0 when the
  prediction is below `GammaChoice.fallback_below`, or when the decoder at the chosen gamma
  measured slower than `measured_fallback_below` times the baseline on the warm-up
  examples (`warmup_speedup`, recorded as 'warmup_timing'). The choice is written to
  output_dir/gamma.json and reused on resume. Process 0 decides whether a recorded choice
  exists, so every process either reads it or joins the same warm-up decodes.
  """
  gc = s.config.gamma_choice
  path = f"{output_dir}/{GAMMA_FILE}"
  recorded = setup.is_writer() and os.path.exists(path)
  if bool(setup.broadcast(np.bool_(recorded))):
    choice = None
    if setup.is_writer():
      choice = results.read_state_json(path, "the gamma chosen from warm-up measurements")
      g = choice.get("gamma")
      if not isinstance(g, int) or isinstance(g, bool) or g < 0:
        raise results.OutputDirError(f"{path} (the gamma chosen from warm-up measurements) "
                                     f"is corrupt: gamma {g!r} is not an int >= 0; delete it "
                                     "to choose again")
      if g > _max_gamma(s):  # no choice the warm-up could make
        raise results.OutputDirError(
            f"{path} (the gamma chosen from warm-up measurements) is corrupt: gamma {g} is "
            f"above the largest this run may choose ({_max_gamma(s)}: GammaChoice.max_gamma "
            f"{gc.max_gamma}, {s.config.decode_len} tokens decoded per example, and what "
            "the drafter can propose); delete it to choose again")
  else:
    cfg = s.config
    warmup = s.examples[:gc.warmup_examples]
    decode = setup.decode_fns(s)[gc.decoder]
    sums = np.zeros(4)
    rows = setup.call_rows(s)
    for i in range(0, len(warmup), rows):
      batch = warmup[i:i + rows]
      stats = distributed.gather(decode(*setup.inputs(s, batch)).stats)
      n = len(batch)
      sums += [np.sum(stats.min_pq_sum[:n]), np.sum(stats.decisions[:n]),
               np.sum(stats.draft_tokens[:n]), np.sum(stats.target_calls[:n])]
    alpha = metrics.alpha_estimate(min_pq_sum=sums[0], decisions=sums[1])
    if math.isnan(alpha):
      raise ValueError(f"the {len(warmup)} warm-up examples made no draft decisions (every "
                       "output ended at once), so alpha is unknown: set gamma explicitly "
                       "(ExperimentConfig.gamma_choice = None) or raise "
                       "GammaChoice.warmup_examples")
    measured = gc.rule == "cost_model"
    max_gamma = _max_gamma(s)
    steps = measure.measure_step_times(s, repeats=cfg.step_timing_repeats, verify_tokens=(
        verify_probe_tokens(max_gamma) if measured else ()), in_loop=gc.in_loop_costs)
    c = steps["c_in_loop_by_decoder" if gc.in_loop_costs else "c_by_decoder"][gc.decoder]
    thm_gamma = int(theory.optimal_gamma(alpha, c, max_gamma=max_gamma))
    choice = {"rule": gc.rule, "alpha": alpha, "c": c, "warmup_examples": len(warmup),
              **({"c_in_loop": True, "c_alone": steps["c_by_decoder"][gc.decoder]}
                 if gc.in_loop_costs else {}),
              "thm_3_8": {"gamma": thm_gamma, "predicted_speedup": float(
                  theory.walltime_improvement(alpha, thm_gamma, c))}}
    if measured:
      raw = {int(n): r for n, r in steps["verify_ratio_by_tokens"].items()}
      ratios = theory.nondecreasing_costs(raw)  # timing noise must not pick gamma
      cm_gamma = int(theory.optimal_gamma(alpha, c, max_gamma=max_gamma,
                                          verify_ratio=ratios))
      choice["verify_ratio_by_tokens"] = {str(n): r for n, r in sorted(raw.items())}
      choice["verify_ratio_fitted"] = {str(n): r for n, r in sorted(ratios.items())}
      choice["cost_model"] = {"gamma": cm_gamma, "predicted_speedup": float(
          theory.cost_model_improvement(alpha, cm_gamma, c, ratios))}
    algo = cfg.decoders[gc.decoder]
    if algo.drafter.varies_length:
      # Proposals shorter than gamma (a lookup that matched nothing): the drafter predicts
      # its own yield at its mean proposed length (`Drafter.expected_tokens`), at the
      # warm-up gamma, and the full verify call is charged (an upper bound of its cost).
      choice["rule"] = "drafter"
      tokens = algo.drafter.expected_tokens(
          alpha=alpha, gamma=gc.warmup_gamma,
          counters={"draft_tokens": sums[2], "target_calls": sums[3]})
      ratio = steps["verify_ratio_by_tokens"][str(gc.warmup_gamma + 1)]
      choice["drafted_per_call"] = float(sums[2] / max(sums[3], 1))
      choice["drafter"] = {"gamma": gc.warmup_gamma, "verify_ratio": ratio,
                           "predicted_speedup": float(tokens / (gc.warmup_gamma * c + ratio))}
    choice["gamma"] = choice[choice["rule"]]["gamma"]
    choice["predicted_speedup"] = choice[choice["rule"]]["predicted_speedup"]
    if gc.fallback_below is not None and choice["predicted_speedup"] < gc.fallback_below:
      choice["fallback"] = fallback_message(gc, choice)
      choice["gamma"] = 0
    elif gc.times_warmup(cfg.baseline is not None):
      choice["warmup_timing"] = warmup_speedup(s, warmup, choice["gamma"])
      if choice["warmup_timing"]["speedup"] < gc.measured_fallback_below:
        choice["fallback"] = measured_fallback_message(gc, choice)
        choice["gamma"] = 0
    if setup.is_writer():
      results.write_json(path, choice)
  gamma = int(setup.broadcast(np.int32(choice["gamma"] if setup.is_writer() else 0)))
  choice = dict(choice or {}, gamma=gamma)  # every process decodes with process 0's choice
  logging.info("gamma chosen: %s", choice)
  return choice


def warmup_calls(warmup: Sequence[Any], rows: int) -> list[list[Any]]:
  """The warm-up examples in decode calls of `rows` examples, the last call filled up by
  cycling through the warm-up examples again. `setup.inputs` would fill it with copies of
  the last example: rows that all accept alike and finish together, which a batch of a
  real dataset never does, so the warm-up would time speculation in its best case (big
  EnDe pair at batch 8 with refill chunk 4, 32 rows per call for 16 warm-up examples,
  AMD EPYC family 26 model 2: with copies the warm-up measured 1.01X and the run
  speculated at 0.94X; cycled, the warm-up measured 0.82X and the run fell back, 1.01X)."""
  if rows < 1 or not warmup:
    raise ValueError(f"need warm-up examples and rows >= 1, got {len(warmup)} and {rows}")
  n = -(-len(warmup) // rows) * rows
  cycled = [warmup[i % len(warmup)] for i in range(n)]
  return [cycled[i:i + rows] for i in range(0, n, rows)]


def warmup_speedup(s: setup.Setup, warmup, gamma: int) -> dict[str, Any]:
  """The baseline's and decoder `GammaChoice.decoder`'s (at `gamma`) decode time of the
  warm-up examples, in calls of the run's rows (`warmup_calls`): one compiling call of each
  (its seconds kept as 'first_call_seconds', baseline then decoder), then
  `GammaChoice.timing_rounds` rounds, the two decoders interleaved (the order alternating
  by round); the speedup is the ratio of each decoder's fastest round (another process on
  the machine only ever adds time)."""
  gc = s.config.gamma_choice
  chosen = dataclasses.replace(s, config=s.config.with_gamma(gc.decoder, gamma))
  fns = setup.decode_fns(chosen)
  names = (s.config.baseline_name, gc.decoder)
  batches = [setup.inputs(s, call) for call in warmup_calls(warmup, setup.call_rows(s))]
  # compiles (so the run's own first calls, timed as compilation, find it done)
  first = [timing.timed(lambda f=fns[name]: f(*batches[0])).seconds[0] for name in names]
  seconds: dict[str, list[float]] = {name: [] for name in names}
  for r in range(gc.timing_rounds):
    for name in (names if r % 2 == 0 else names[::-1]):
      every_batch = lambda f=fns[name]: [f(*batch) for batch in batches]
      seconds[name] += timing.timed(every_batch).seconds
  return {"gamma": gamma, "examples": len(warmup), "rounds": gc.timing_rounds,
          "first_call_seconds": first,
          "baseline_seconds": seconds[names[0]], "decoder_seconds": seconds[names[1]],
          "speedup": min(seconds[names[0]]) / min(seconds[names[1]])}


def measured_fallback_message(gc, choice: dict[str, Any]) -> str:
  """Why a prediction that passed fell back after the warm-up's timed decodes."""
  t = choice["warmup_timing"]
  return (f"speculation did not pay on the warm-up: at gamma {t['gamma']} (predicted "
          f"{choice['predicted_speedup']:.2f}X; alpha {choice['alpha']:.3f}, c "
          f"{choice['c']:.3f}) decoder {gc.decoder!r} measured {t['speedup']:.2f}X against "
          f"the autoregressive decoder on the {t['examples']} warm-up examples (fastest of "
          f"{t['rounds']} rounds each), below GammaChoice.measured_fallback_below = "
          f"{gc.measured_fallback_below:g}, so it ran the autoregressive loop (gamma 0); "
          "GammaChoice.measured_fallback_below = None speculates at the predicted gamma")


def fallback_message(gc, choice: dict[str, Any]) -> str:
  """Why a gamma choice fell back to the autoregressive loop (gamma 0), in one sentence."""
  rule = choice.get("rule", gc.rule)
  name = {"cost_model": "the cost model", "thm_3_8": "Thm 3.8",
          "drafter": "the cost model at the drafter's mean proposed length "
                     f"{choice.get('drafted_per_call', 0.0):.2f}"}[rule]
  return (f"speculation cannot pay here: {name} predicts {choice['predicted_speedup']:.2f}X at "
          f"its best gamma ({choice[rule]['gamma']}; alpha {choice['alpha']:.3f}, c "
          f"{choice['c']:.3f}{_verify_cost(choice, rule)}), below GammaChoice.fallback_below "
          f"= {gc.fallback_below:g}, so decoder {gc.decoder!r} ran the autoregressive loop "
          "(gamma 0); GammaChoice.fallback_below = None speculates anyway")


def _verify_cost(choice: dict[str, Any], rule: str) -> str:
  if rule == "thm_3_8":
    return ""
  n = str(choice[rule]["gamma"] + 1)
  ratio = choice[rule].get("verify_ratio", choice.get("verify_ratio_fitted", {}).get(n))
  return "" if ratio is None else f", T_verify({n}) / T_p {ratio:.2f}"
