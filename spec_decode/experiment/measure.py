"""Step costs, measured the one way the library times a step (`decoding.timing`): the
marginal cost of one more call inside a jitted loop, every loop of a measurement timed in
the same interleaved rounds.

  step_costs           T_p, each decoder's proposal (its drafter's own `proposal_loop`) and
                       c, T_verify(n) / T_p: for the runner, the gamma choice and every
                       driver under experiments/
  measure_step_times   a run's step costs on its first batch, as results.json keeps them
  setup_seconds        a decode call's set-up alone (encoding, cross-attention cache)
  example_setup_seconds  a run's set-up per example (target, draft model), for its model-work
                       bound
  fixed_and_per_iteration, model_work_speedup   the engine split of end-to-end calls
  decode_bytes, copy_bandwidth                  a step's memory roofline
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from spec_decode import compile_options, decoding, partitioning
from spec_decode.decoding import runner, timing
from spec_decode.decoding.drafters.base import FixedProposal
from spec_decode.experiment import setup
from spec_decode.models import base, t5


def step_costs(workload: timing.Workload, decoders: Mapping[str, decoding.Algorithm], *,
               drafts: Mapping[str, tuple[Any, Any]] | None = None, verify_tokens=(),
               repeats: int, inner: int = 1, steps: int = 8,
               in_loop: bool = False) -> dict[str, Any]:
  """Step costs of decoders on one batch, as their loops run them: every cost the marginal
  cost of one more call inside a jitted loop, all timed in the same interleaved rounds
  (`timing.interleaved`), so ratios are taken within a round.

  target_step: T_p, the target's single-token step; proposal[name]: one proposal of each
  decoder that drafts (its drafter's own `proposal_loop` at its gamma); verify[n]: a target
  call on n tokens, for every n = K + 1 some decoder verifies at once (K its largest
  proposal) and every n in verify_tokens. Each is a `timing.spread` over the rounds, its
  median the cost. From those medians: c[name] = proposal / (gamma T_p), the decoder's
  cost per drafted token (for the model drafter the paper's c = T_q / T_p), and
  verify_ratio[n] = T_verify(n) / T_p; c_rounds and verify_ratio_rounds: the spreads of
  the same ratios taken within each round (their noise). target_loop: the target's step
  loop (what it reads: `costs.decode_bytes`). drafts: {name: (draft model, params)} of
  decoders whose draft is not the workload's.

  in_loop: also time each drafting decoder's proposals each followed by its verify call
  (K + 1 tokens; `Drafter.proposal_loop(verify_tokens=...)`) and, right before it, the
  same loop with a `FixedProposal` (the verify call and bookkeeping alone), giving
  c_in_loop[name] = (the first loop's cost - the second's) / (gamma T_p), the median over
  rounds, at least the proposal's own c (`_in_loop_c`): a proposal's cost where the
  decoding loop runs it, after the target's weights went through the caches. A draft
  whose weights fit the CPU's last-level cache alone but not beside the target's
  (measured: the big EnDe target's first layer and an exit adapter, 14 MB beside 52 MB
  with a 32 MB L3) costs more there than in its own loop, and so does a small draft whose
  step runs many XLA thunks, each a cold call after the verify call
  (`experiments.draft_layout`).
  """
  if in_loop and workload.mesh is not None:
    raise ValueError("proposal costs in the loop (in_loop=True, GammaChoice.in_loop_costs) are "
                     "measured on unsharded runs only (mesh=None)")
  sizes = sorted({a.max_proposal + 1 for a in decoders.values() if a.max_proposal is not None}
                 | set(verify_tokens))
  target = lambda n: timing.marginal_pair(
      lambda k: workload.decode_loop("target", num_tokens=n, steps=k), steps)
  loops = {"target": target(1)}
  drafting = {name: a for name, a in decoders.items() if a.drafter is not None}
  for name, a in drafting.items():
    w = workload
    if drafts and name in drafts:
      w = dataclasses.replace(workload, draft=drafts[name][0], draft_params=drafts[name][1])
    loops[f"proposal:{name}"] = timing.marginal_pair(
        lambda k, a=a, w=w: a.drafter.proposal_loop(w, gamma=a.gamma, steps=k), steps)
    if in_loop:  # the same loop without a proposal right before it (see `_in_loop_c`)
      loops[f"fixed+verify:{name}"] = timing.marginal_pair(
          lambda k, a=a, w=w: FixedProposal().proposal_loop(w, gamma=a.gamma, steps=k,
                                                             verify_tokens=a.max_proposal + 1),
          steps)
      loops[f"proposal+verify:{name}"] = timing.marginal_pair(
          lambda k, a=a, w=w: a.drafter.proposal_loop(w, gamma=a.gamma, steps=k,
                                                      verify_tokens=a.max_proposal + 1),
          steps)
  for n in sizes:
    loops[f"verify:{n}"] = target(n)
  t = timing.interleaved(loops, repeats=repeats, inner=inner)
  t_p = t["target"]
  spreads = {name: timing.spread(v) for name, v in t.items()}
  median = lambda name: spreads[name]["median"]
  per_round = lambda num, scale=1.0: timing.spread([a / (scale * b) for a, b in zip(num, t_p)])
  c_alone = {n: median(f"proposal:{n}") / (a.gamma * median("target"))
             for n, a in drafting.items()}
  out = {}
  if in_loop:
    out["proposal_in_loop"] = {n: spreads[f"proposal+verify:{n}"] for n in drafting}
    out["c_in_loop"] = {n: _in_loop_c(t[f"proposal+verify:{n}"], t[f"fixed+verify:{n}"],
                                      t_p, a.gamma, floor=c_alone[n])
                         for n, a in drafting.items()}
  return {
      **out,
      "target_step": spreads["target"],
      "proposal": {n: spreads[f"proposal:{n}"] for n in drafting},
      "verify": {n: spreads[f"verify:{n}"] for n in sizes},
      "c": c_alone,
      "c_rounds": {n: per_round(t[f"proposal:{n}"], a.gamma) for n, a in drafting.items()},
      "verify_ratio": {n: median(f"verify:{n}") / median("target") for n in sizes},
      "verify_ratio_rounds": {n: per_round(t[f"verify:{n}"]) for n in sizes},
      "target_loop": loops["target"][0]}


def _in_loop_c(with_verify, verify, target, gamma: int, *, floor: float) -> float:
  """c in the loop from per-round seconds: the median over rounds of (proposal + verify
  - verify) / (gamma T_p), where `verify` is the same jitted loop with a `FixedProposal`
  timed right before the drafter's (the target's own step loop has another structure, and
  on a noisy 2-core AMD EPYC family 25 the two verify loops differed by up to 0.4 ms, the
  size of a proposal; neighbours in a round see the same moment of the machine); at least
  `floor`, the proposal's c in its own loop (after a verify call its weights can
  only be colder, and a difference lost in the noise must not read as a free draft:
  a run on a noisy 2-core AMD EPYC family 25 read c = 0.000 here and chose its gamma as
  if drafting cost nothing)."""
  rounds = [(pv - v) / (gamma * tp) for pv, v, tp in zip(with_verify, verify, target)]
  return max(floor, float(np.median(rounds)))


def measure_step_times(s: setup.Setup, *, repeats: int, verify_tokens=(),
                       in_loop: bool = False, example_setup: bool = False) -> dict[str, Any]:
  """The run's step costs on its first batch (`step_costs`, medians), as results.json keeps
  them: target_step_seconds T_p; per decoder that drafts proposal_seconds[name] and
  c_by_decoder[name]; for the primary decoder draft_step_seconds (its cost per drafted
  token) and c, verify_seconds and verify_ratio (T_verify(K + 1) / T_p);
  verify_ratio_by_tokens[n] for every n measured (see `step_costs`). in_loop: also
  c_in_loop_by_decoder[name] and the primary's c_in_loop (`step_costs(in_loop=True)`).
  example_setup (unsharded runs): also setup_seconds, the set-up per example
  (`example_setup_seconds`)."""
  cfg = s.config
  batch = s.examples[:cfg.batch_size]
  enc, _ = setup.inputs(s, batch, rows=cfg.batch_size)  # a refilled loop runs at one batch
  algorithms = cfg.algorithms
  sizes = [a.max_proposal + 1 for a in algorithms.values() if a.max_proposal is not None]
  length = cfg.decode_len + max(sizes + list(verify_tokens), default=1)  # the loop's cache
  rules = cfg.rules if s.mesh is not None else None
  workload = timing.Workload(
      target=s.target, target_params=s.target_params, encoder_tokens=enc, cache_length=length,
      position=cfg.decode_len // 2, draft=s.draft, draft_params=s.draft_params,
      sampling=cfg.sampling, mesh=s.mesh, rules=rules,
      draft_rules=partitioning.data_parallel_rules(rules) if s.mesh is not None else None,
      compiler_options=cfg.compiler_options)
  costs = step_costs(workload, algorithms, verify_tokens=verify_tokens, repeats=repeats,
                     in_loop=in_loop)
  out: dict[str, Any] = {"target_step_seconds": costs["target_step"]["median"]}
  if costs["proposal"]:
    out["proposal_seconds"] = {k: v["median"] for k, v in costs["proposal"].items()}
    out["c_by_decoder"] = dict(costs["c"])
  if in_loop and costs["proposal"]:
    out["c_in_loop_by_decoder"] = dict(costs["c_in_loop"])
  primary = cfg.primary
  if primary in costs["proposal"]:
    gamma = algorithms[primary].gamma
    out.update(draft_step_seconds=costs["proposal"][primary]["median"] / gamma,
               c=costs["c"][primary])
    if in_loop:
      out["c_in_loop"] = costs["c_in_loop"][primary]
  out["verify_ratio_by_tokens"] = {str(n): v for n, v in costs["verify_ratio"].items()}
  K = algorithms[primary].max_proposal if primary is not None else None
  if K is not None:
    out["verify_seconds"] = costs["verify"][K + 1]["median"]
    out["verify_ratio"] = costs["verify_ratio"][K + 1]
  if example_setup and s.mesh is None:
    out["setup_seconds"] = example_setup_seconds(s, cache_length=length, repeats=repeats)
  return out


SETUP_BATCHES = 4  # batches of a run's examples whose set-up `example_setup_seconds` times


def example_setup_seconds(s: setup.Setup, *, cache_length: int, repeats: int
                          ) -> dict[str, float]:
  """Seconds of set-up per example that a run's decode calls pay (encoding and the
  cross-attention cache, `setup_seconds`), unsharded: {'target': ..., and 'draft': ... when
  the draft is a model with its own encoder}, each the mean over the first SETUP_BATCHES
  batches of the run's examples (at its batch size, as the refill loop encodes entering
  rows a batch at a time) of a call's median over `repeats`, divided by the batch size.
  The step costs leave the set-up out; a run's model-work bound charges it
  (experiments/reproduce.py's Table 4)."""
  cfg = s.config
  B = cfg.batch_size
  batches = [s.examples[i:i + B] for i in range(0, len(s.examples), B)][:SETUP_BATCHES]
  if not batches:
    return {}
  models = {"target": (s.target, s.target_params)}
  if s.draft is not None and hasattr(s.draft, "encode") and hasattr(s.draft, "init_cache"):
    models["draft"] = (s.draft, s.draft_params)
  encoder_tokens = [setup.inputs(s, batch, rows=B)[0] for batch in batches]
  out = {}
  for role, (model, params) in models.items():
    calls = [setup_seconds(model, params, tokens, cache_length=cache_length,
                           repeats=repeats, compiler_options=cfg.compiler_options)["median"]
             for tokens in encoder_tokens]
    out[role] = float(np.mean(calls)) / B
  return out


# ------------------------------------------------------------------ engine and roofline
@functools.lru_cache(maxsize=16)
def _setup_call(model, cache_length: int, options: tuple):
  """`model`'s set-up (encode, then its cross-attention cache), jitted once per model, cache
  length and XLA options, so that timing several batches compiles each input shape once."""
  def call(params, tokens, index):
    encoded = (model.encode(params, tokens) if index is None
               else model.encode(params, tokens, packed_index=index))
    return model.init_cache(params, encoded, cache_length)
  return jax.jit(call, compiler_options=dict(options) or None)


def setup_seconds(model, params, encoder_tokens, *, cache_length: int, repeats: int = 10,
                  compiler_options=None) -> dict[str, float]:
  """Seconds of a decode call's set-up for `model` alone: encoding `encoder_tokens` and
  filling the cross-attention cache, one jitted call on the inputs and parameter layout
  `decoding.run` uses (trimmed padding, packed rows, `decoding_params`); `timing.spread` of
  `repeats` calls."""
  tokens = runner.trim_padding(np.asarray(encoder_tokens))
  index = runner.pack_index(model, tokens)
  params = base.decoding_params(model, params)
  fn = _setup_call(model, cache_length, compile_options.resolve(compiler_options))
  t = timing.timed(lambda: fn(params, tokens, index), repeats=repeats, warmup=2)
  return timing.spread(t.seconds)


def fixed_and_per_iteration(seconds, iterations) -> dict[str, float] | None:
  """Least-squares fit seconds = fixed + per_iteration * iterations over decode calls.

  A decode call pays a fixed cost (encoding, cache set-up, loop entry, host work) once and
  its loop body once per iteration; timing calls that ran different numbers of iterations
  separates the two without instrumenting the loop. None when the calls do not span at
  least two distinct iteration counts (the fit is then undetermined).
  """
  t = np.asarray(seconds, np.float64)
  it = np.asarray(iterations, np.float64)
  if t.shape != it.shape or t.ndim != 1:
    raise ValueError(f"seconds and iterations must be equal-length vectors, got {t.shape}, "
                     f"{it.shape}")
  if np.unique(it).size < 2:
    return None
  a = np.stack([np.ones_like(it), it], axis=1)
  (fixed, per_iteration), *_ = np.linalg.lstsq(a, t, rcond=None)
  residual = t - a @ np.array([fixed, per_iteration])
  return {"fixed": float(fixed), "per_iteration": float(per_iteration),
          "residual_rms": float(np.sqrt(np.mean(residual ** 2))), "calls": int(t.size)}


def model_work_speedup(*, target_setup, draft_setup, target_step: float, ar_iterations,
                       spec_iteration: float, spec_iterations) -> float:
  """The end-to-end speedup of decoders that spend time only in model work, on the calls
  that ran: per call the target's set-up (autoregressive) or the target's and the draft's
  (speculative), then `target_step` per autoregressive iteration and `spec_iteration`
  (gamma T_q + T_verify(gamma + 1)) per speculative one, at the iteration counts the calls
  made. The cost model leaves the set-up (the encoders) out and charges E[tokens] per
  iteration; this bound keeps both as measured, so measured / bound is what the engine
  (fixed costs, loop work, dispatch) loses, whatever the encoders cost.

  target_setup, draft_setup, ar_iterations, spec_iterations: one value per call.
  """
  st, sd, ia, isp = (np.asarray(v, np.float64) for v in (target_setup, draft_setup,
                                                          ar_iterations, spec_iterations))
  if not st.shape == sd.shape == ia.shape == isp.shape or st.ndim != 1 or not st.size:
    raise ValueError(f"per-call vectors of one length wanted, got {st.shape}, {sd.shape}, "
                     f"{ia.shape}, {isp.shape}")
  if min(target_step, spec_iteration) <= 0 or (st < 0).any() or (sd < 0).any():
    raise ValueError(f"costs must be positive and set-ups non-negative, got target_step "
                     f"{target_step}, spec_iteration {spec_iteration}, smallest set-ups "
                     f"{st.min()}, {sd.min()}")
  autoregressive = st.sum() + target_step * ia.sum()
  speculative = st.sum() + sd.sum() + spec_iteration * isp.sum()
  return float(autoregressive / speculative)


def _bytes(tree) -> int:
  """Bytes one device holds of a tree of placed arrays (the largest shard per device)."""
  leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "sharding")]
  return partitioning.shard_bytes(leaves, [x.sharding for x in leaves])


def decode_bytes(model, step: Callable[[], Any]) -> int | None:
  """Bytes one T5 decode call reads per device; None for other model kinds.

  Decoder weights (all of them: each layer is applied to the new tokens), the
  output projection (the shared embedding when `logits_via_embedding`; the
  embedding lookup itself touches only B rows and is left out), and the
  self- and cross-attention K/V caches in full.
  """
  if not isinstance(model, t5.T5):
    return None
  params, cache = step.state["params"], step.state["cache"]
  total = _bytes(params["decoder"])
  if model.config.logits_via_embedding:
    total += _bytes(params["token_embedder"])
  total += _bytes((cache.self_k, cache.self_v, cache.cross_k, cache.cross_v))
  return int(total)


def copy_bandwidth(*, mib: int = 256, repeats: int = 5) -> float:
  """Device memory bandwidth in bytes/s: a jitted x + 1 over `mib` MiB reads and writes it."""
  n = mib * (1 << 20) // 4
  x = jax.device_put(jnp.zeros((n,), jnp.float32), jax.devices()[0])
  f = jax.jit(lambda x: x + 1.0)
  seconds = timing.timed(lambda: f(x), repeats=repeats, warmup=1).median
  return 2.0 * n * 4 / seconds
