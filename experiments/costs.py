"""Step costs measured in one process: T_p, T_q, c, verify cost, and the memory roofline.

`decode_step` is `spec_decode.timing.decode_loop`: a jitted call running k
decodes of T tokens per row in a `lax.fori_loop` against a cache filled to
`position`, optionally laid out on a mesh the way `decoding.speculative` lays
out target and draft; dividing its time by k is the per-step cost *inside* a
jitted decoding loop (the experiment runs' own c uses the same loop).
`interleaved(fns, repeats=R)` compiles every function, then runs R rounds,
each timing every function once (median of `inner` blocked calls), so slow
drifts of the machine's load hit all functions alike and per-round ratios
(c = T_q / T_p of the same round) stay trustworthy on a busy host.

`decode_bytes` counts what one decode call reads from memory (decoder
weights, the logits projection, the whole self-attention cache, which this
implementation reads up to its full length under a mask, and the
cross-attention cache); `copy_bandwidth` measures device memory bandwidth
with a jitted elementwise pass (read + write) over a large array. Their ratio
gives the memory-roofline time of a step.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from experiments._common import spread
from spec_decode import partitioning
from spec_decode.decoding import timing
from spec_decode.models import t5

decode_step = timing.decode_loop


interleaved = timing.interleaved


def marginal_steps(model, params, encoder_tokens, *, num_tokens: int, steps: int, **kw):
  """(a `steps`-decode loop, a 2 * `steps`-decode loop) of the same decode (`decode_step`
  with `kw`): given to `interleaved`, it times the marginal cost of one more decode."""
  return tuple(decode_step(model, params, encoder_tokens, num_tokens=num_tokens, steps=k, **kw)
               for k in (steps, 2 * steps))


def pair_costs(target, target_params, draft, draft_params, encoder_tokens, *,
               gammas, cache_length: int, position: int, steps: int, repeats: int,
               inner: int, mesh=None, marginal: bool = True,
               compiler_options=None) -> dict[str, Any]:
  """T_p, T_q, c and T_verify(gamma+1) / T_p of a pair, interleaved (`common.spread` dicts).

  With a mesh, the target is laid out by T5X's rules and the draft data-parallel
  (replicated weights), as `decoding.speculative` does. marginal (default):
  every cost is the marginal cost of one more decode in a loop (loops of
  `steps` and 2 * `steps` decodes, see `interleaved`), which is what a step
  costs inside the decoding loops; False: a `steps`-decode call divided by
  `steps`, which charges each step a share of the call's fixed cost.
  compiler_options: as `decoding.run`'s (None: the backend's defaults).
  Returns target_step, draft_step, c, verify {gamma: seconds}, verify_ratio
  {gamma: ratio}, and the target's step function under "target_fn" (for
  `decode_bytes`).
  """
  rules = partitioning.standard_logical_axis_rules() if mesh is not None else None
  draft_rules = partitioning.data_parallel_rules(rules) if mesh is not None else None
  kw = dict(cache_length=cache_length, position=position, mesh=mesh,
            compiler_options=None if mesh is not None else compiler_options)

  def fn(model, params, tokens, rules):
    if marginal:
      return marginal_steps(model, params, encoder_tokens, num_tokens=tokens, steps=steps,
                            rules=rules, **kw)
    return decode_step(model, params, encoder_tokens, num_tokens=tokens, rules=rules,
                       steps=steps, **kw)

  fns = {"target": fn(target, target_params, 1, rules),
         "draft": fn(draft, draft_params, 1, draft_rules)}
  for g in gammas:
    fns[f"verify_{g}"] = fn(target, target_params, g + 1, rules)
  t = interleaved(fns, repeats=repeats, inner=inner)
  target_fn = fns["target"][0] if marginal else fns["target"]
  return {"target_step": spread(t["target"]), "draft_step": spread(t["draft"]),
          "c": spread(ratios(t["draft"], t["target"])),
          "verify": {g: spread(t[f"verify_{g}"]) for g in gammas},
          "verify_ratio": {g: spread(ratios(t[f"verify_{g}"], t["target"])) for g in gammas},
          "target_fn": target_fn, "marginal": marginal}


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


def setup_seconds(model, params, encoder_tokens, *, cache_length: int, repeats: int = 10,
                  compiler_options=None) -> dict[str, float]:
  """Seconds of a decode call's set-up for `model` alone: encoding `encoder_tokens` and
  filling the cross-attention cache, one jitted call on the inputs and parameter layout
  `decoding.run` uses (trimmed padding, packed rows, `decoding_params`); `spread` of
  `repeats` calls."""
  from spec_decode import compile_options
  from spec_decode.decoding import runner
  from spec_decode.models import base
  tokens = runner.trim_padding(np.asarray(encoder_tokens))
  index = runner.pack_index(model, tokens)
  params = base.decoding_params(model, params)
  options = dict(compile_options.resolve(compiler_options))
  encode = lambda p, e, i: model.encode(p, e) if i is None else model.encode(p, e, packed_index=i)
  fn = jax.jit(lambda p, e, i: model.init_cache(p, encode(p, e, i), cache_length),
               compiler_options=options or None)
  t = timing.timed(lambda: fn(params, tokens, index), repeats=repeats, warmup=2)
  return spread(t.seconds)


def ratios(num: list[float], den: list[float]) -> list[float]:
  """Per-round ratios num[r] / den[r]."""
  return [a / b for a, b in zip(num, den)]


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


def random_encoder_tokens(batch: int, length: int, vocab_size: int, seed: int = 0) -> jax.Array:
  """[batch, length] ids in [2, vocab_size) (no PAD, no EOS): a stand-in input."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(2, vocab_size, size=(batch, length)), jnp.int32)
