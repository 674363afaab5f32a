"""Wall-clock timing of jitted JAX work: compile separately, then medians over rounds.

Every timed call ends with `jax.block_until_ready` on its result, so the time
covers the device work, not only its dispatch. The cost of a step is always
measured the same way, as the MARGINAL cost of one more step inside a jitted
loop: a loop of k steps and one of 2k steps are timed in the same round, and
(t(2k) - t(k)) / k is that round's cost (`interleaved`). A decoding loop pays a
call's fixed cost (dispatch, argument transfer, loop entry) once per call, not
per step, so dividing a whole call by its steps would charge it to every step
and bias small models' step times (and c, and the verify ratio) upwards.

  decode_loop      k decodes of T tokens of any `Decoder` into a cache (a target step, a
                   verify call of gamma + 1 tokens, a draft model's step)
  proposal_loop    k proposals of any drafter (`Drafter.proposal_loop` falls back to it)
  interleaved      rounds that time every loop once each, so slow drifts of the machine's
                   load hit all of them alike and per-round ratios (c) stay trustworthy
  step_time        one decoder call's marginal seconds (a single loop pair)

`Workload` names what a timed call works on: the models, one batch, the sampling and
the cache size and fill the decoding loops run at.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from spec_decode import compile_options, partitioning
from spec_decode.decoding import runner
from spec_decode.decoding.sampling import Sampling, argmax
from spec_decode.decoding.types import Committed
from spec_decode.models import base


@dataclasses.dataclass(frozen=True)
class Timed:
  """result: the last call's output; seconds: each rep's wall time; median of them."""
  result: Any
  seconds: tuple[float, ...]

  @property
  def median(self) -> float:
    return statistics.median(self.seconds)


def timed(fn: Callable[[], Any], *, repeats: int = 1, warmup: int = 0) -> Timed:
  """Runs fn() `warmup` times untimed, then `repeats` timed calls (each blocked until ready)."""
  if not isinstance(repeats, int) or repeats < 1 or not isinstance(warmup, int) or warmup < 0:
    raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats!r}, {warmup!r}")
  for _ in range(warmup):
    jax.block_until_ready(fn())
  seconds, result = [], None
  for _ in range(repeats):
    start = time.perf_counter()
    result = jax.block_until_ready(fn())
    seconds.append(time.perf_counter() - start)
  return Timed(result=result, seconds=tuple(seconds))


def timed_in_turns(calls: Mapping[str, Callable[[], Any]], repeats: int
                   ) -> tuple[dict[str, Any], dict[str, float]]:
  """({name: its last call's result}, {name: median seconds}) over `repeats` rounds in which
  every call runs once (`timed`), in reverse order every other round: a drift in the
  machine's speed falls on all of them alike, not on whichever was being timed during it."""
  if not isinstance(repeats, int) or repeats < 1:
    raise ValueError(f"timed_in_turns needs repeats >= 1, got {repeats!r}")
  outputs, times = {}, {name: [] for name in calls}
  order = list(calls)
  for r in range(repeats):
    for name in (order if r % 2 == 0 else order[::-1]):
      t = timed(calls[name])
      outputs[name] = t.result
      times[name].append(t.seconds[0])
  return outputs, {name: statistics.median(ts) for name, ts in times.items()}


@dataclasses.dataclass(frozen=True, eq=False)
class Workload:
  """What a timed decoder call works on, as the decoding loops see it.

  target, target_params; draft, draft_params (None without a draft); encoder_tokens
  [B, S]: one batch; sampling: the run's (a drafter's proposal depends on it);
  cache_length: the cache slots a loop allocates (max_decode_len + K + 1 for a
  speculative one); position: the entries already in it (default cache_length // 2), so
  attention reads a realistic prefix. mesh, rules, draft_rules: lay the models out as a
  sharded run does (rules default T5X's, draft_rules data-parallel); compiler_options:
  as `decoding.run`'s (None: the backend's defaults).
  """
  target: Any
  target_params: Any
  encoder_tokens: Any
  cache_length: int
  position: int | None = None
  draft: Any = None
  draft_params: Any = None
  sampling: Sampling = Sampling()
  mesh: Any = None
  rules: Any = None
  draft_rules: Any = None
  compiler_options: Any = None

  def decode_loop(self, role: str, *, num_tokens: int, steps: int) -> Callable[[], jax.Array]:
    """`decode_loop` of the role's model ('target' or 'draft') on this workload."""
    if role == "target":
      model, params, rules = self.target, self.target_params, self.rules
    elif role == "draft":
      model, params = self.draft, self.draft_params
      rules = self.draft_rules
      if self.mesh is not None and rules is None:
        rules = partitioning.data_parallel_rules(
            self.rules or partitioning.standard_logical_axis_rules())
    else:
      raise ValueError(f"role must be 'target' or 'draft', got {role!r}")
    return decode_loop(model, params, self.encoder_tokens, num_tokens=num_tokens,
                       cache_length=self.cache_length, position=self.position, steps=steps,
                       mesh=self.mesh, rules=rules,
                       compiler_options=None if self.mesh is not None else self.compiler_options)


def decode_loop(model, params, encoder_tokens, *, num_tokens: int, cache_length: int,
                position: int | None = None, steps: int = 1, mesh=None,
                rules=None, compiler_options=None,
                decode_layout: bool = True, compiled: bool = False) -> Callable[[], jax.Array]:
  """A zero-argument function running `steps` decodes of num_tokens tokens per row in one jit.

  The cache holds `cache_length` slots with every row at `position` (default
  cache_length // 2), so attention reads a realistic prefix; each decode is
  rewound afterwards, as the decoding loops rewind, and is fed the argmax of
  the previous one, so none can be hoisted or skipped. Timing k decodes in one
  call and dividing by k gives the per-step cost *inside* a jitted decoding
  loop (one host dispatch per k steps; timing single calls adds a dispatch to
  every step, which for small models on a CPU is as large as the step and
  pulls c towards 1). With a mesh, params are laid out by `rules` (default
  T5X's), the batch over `data` and the cache by its logical axes, the way
  `decoding.speculative` lays them out. The function's `.steps` is `steps`;
  `.state` holds params, tokens and the current cache (the cache is donated);
  `.compiled_text()` the loop's optimized HLO.
  compiler_options: as `decoding.run`'s (None: the backend's defaults, which
  the decoding loops use too), unsharded runs only. Unsharded, the encoder tokens are
  trimmed of all-padding columns as `decoding.run` trims them (cross-attention then reads
  what it reads in the decoding loops). decode_layout (default): unsharded params in the
  layout `decoding.run` gives them (`models.base.decoding_params`, e.g. packed CPU
  kernels); False times them as given (XLA's dots).
  compiled: compile the loop now, ahead of time, and call that executable: it keeps the
  kernel handlers and trace-time switches in force now (`cpu_matmul.handlers_under`,
  `t5.switched`) whatever is traced later. (A loop jitted as usual traces at its first call,
  and the model's jitted methods inside it reuse traces made earlier under other
  handlers.) Each such loop compiles its own executable.
  """
  if not 1 <= num_tokens <= cache_length:
    raise ValueError(f"need 1 <= num_tokens <= cache_length, got {num_tokens}, {cache_length}")
  if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
    raise ValueError(f"steps must be an int >= 1, got {steps!r}")
  position = cache_length // 2 if position is None else position
  position = max(0, min(position, cache_length - num_tokens))
  if mesh is not None:
    rules = partitioning.standard_logical_axis_rules() if rules is None else rules
    params = partitioning.put(params, partitioning.param_shardings(model, mesh, rules,
                                                                   params=params))
    encoder_tokens = partitioning.put(
        encoder_tokens, partitioning.batch_sharding(mesh, encoder_tokens.shape, rules))
  else:  # as `decoding.run` does: padding trimmed (few lengths), params in its layout
    encoder_tokens = runner.trim_padding(jnp.asarray(encoder_tokens))
    if decode_layout:
      params = base.decoding_params(model, params)
  cache = model.init_cache(params, model.encode(params, encoder_tokens), cache_length)
  cache = cache.rewind(jnp.full(cache.lengths.shape, position, jnp.int32))
  if mesh is not None:
    axes = partitioning.cache_axes(cache)
    if axes is not None:
      cache = partitioning.put(cache, partitioning.tree_shardings(
          axes, cache, mesh, rules, partitioning.model_units(model)))
  tokens = jnp.full((encoder_tokens.shape[0], num_tokens), 2, jnp.int32)
  if mesh is not None:
    tokens = partitioning.put(tokens, partitioning.batch_sharding(mesh, tokens.shape, rules))
  options = compile_options.resolve(compiler_options) if mesh is None else ()
  run = _jitted_steps(model, mesh, rules, options)
  state = {"cache": cache, "params": params, "tokens": tokens}
  trips = jnp.int32(steps)
  if compiled:
    run = run.lower(params, cache, tokens, trips).compile()

  def call():
    logits, state["cache"] = run(params, state["cache"], tokens, trips)
    return logits

  call.state = state
  call.steps = steps
  # The optimized HLO of the loop as compiled (for counting what a step launches).
  call.compiled_text = (
      run.as_text if compiled
      else lambda: run.lower(params, state["cache"], tokens, trips).compile().as_text())
  return call


def spread(values) -> dict[str, float]:
  """median, 25th/75th percentiles, min, max and count of repeated measurements."""
  import numpy as np
  v = np.asarray(list(values), np.float64)
  if v.size == 0:
    raise ValueError("spread of no values")
  p25, med, p75 = np.percentile(v, [25, 50, 75])
  return {"median": float(med), "p25": float(p25), "p75": float(p75), "min": float(v.min()),
          "max": float(v.max()), "n": int(v.size)}


def interleaved(loops: Mapping[str, Any], *, repeats: int, warmup: int = 2,
                inner: int = 1, alternate: bool = False) -> dict[str, list[float]]:
  """Seconds per step of each loop, one value per round.

  A value of `loops` is a zero-argument loop with `.steps` (its time is divided by it),
  or a pair (a k-step loop, a 2k-step loop of the same work): its round value is then
  the marginal cost of one more step, (t(2k) - t(k)) / k, free of the fixed cost every
  call pays once (t(2k) / 2k in a round where noise makes the difference non-positive).
  Everything is compiled and warmed up first; then `repeats` rounds time every loop in
  turn (the median of `inner` calls each); alternate: in reverse order every other round
  (for an A/B of two loops, where the second of a round can lose to the first).
  """
  if repeats < 1 or inner < 1 or warmup < 1:
    raise ValueError(f"need repeats, inner and warmup >= 1, got {repeats}, {inner}, {warmup}")
  for f in loops.values():  # compile and warm up everything before any timing
    for g in (f if isinstance(f, tuple) else (f,)):
      timed(g, repeats=1, warmup=warmup - 1)
  out: dict[str, list[float]] = {name: [] for name in loops}
  order = list(loops.items())
  for r in range(repeats):
    for name, f in (order[::-1] if alternate and r % 2 else order):
      if isinstance(f, tuple):
        short, long = f
        t_short = timed(short, repeats=inner).median
        t_long = timed(long, repeats=inner).median
        diff = t_long - t_short
        out[name].append(diff / (long.steps - short.steps) if diff > 0 else
                         t_long / long.steps)
      else:
        out[name].append(timed(f, repeats=inner).median / f.steps)
  return out


def marginal_pair(make: Callable[[int], Callable[[], Any]], steps: int) -> tuple:
  """(make(steps), make(2 * steps)): a loop pair whose `interleaved` value is the marginal
  cost of one more step."""
  return make(steps), make(2 * steps)


def step_time(model, params, encoder_tokens, *, num_tokens: int = 1, cache_length: int,
              position: int | None = None, steps: int = 8, repeats: int = 10, warmup: int = 2,
              mesh=None, rules=None, marginal: bool = True, compiler_options=None,
              decode_layout: bool = True) -> float:
  """Median seconds of one `model.decode` of num_tokens tokens per row inside a jitted loop.

  marginal (default): the marginal cost of one more decode inside a loop (`interleaved`
  rounds of loops of `steps` and 2 * `steps` decodes; the median of the rounds).
  marginal=False: one call of `steps` decodes divided by `steps`, which charges each step
  a share of the call's fixed cost. decode_layout: as `decode_loop`'s.
  """
  kw = dict(num_tokens=num_tokens, cache_length=cache_length, position=position, mesh=mesh,
            rules=rules, compiler_options=compiler_options, decode_layout=decode_layout)
  make = lambda k: decode_loop(model, params, encoder_tokens, steps=k, **kw)
  if not marginal:
    return timed(make(steps), repeats=repeats, warmup=warmup).median / steps
  rounds = interleaved({"step": marginal_pair(make, steps)}, repeats=repeats,
                       warmup=max(warmup, 1))
  return statistics.median(rounds["step"])


def _perturbed(tree, zero):
  """Every array leaf of `tree` plus a traced zero written into one element (in place), so
  nothing computed from it is invariant across the iterations of a timing loop."""
  def leaf(x):
    if not isinstance(x, jax.Array) or not jnp.issubdtype(x.dtype, jnp.number):
      return x
    z = zero.astype(x.dtype)
    return x + z if x.ndim == 0 else x.at[(0,) * x.ndim].add(z)
  return jax.tree.map(leaf, tree)


def proposal_loop(drafter, workload: Workload, *, gamma: int, steps: int,
                  verify_tokens: int = 0) -> Callable[[], jax.Array]:
  """A zero-argument function running `steps` proposals of gamma tokens of `drafter` in one
  jit (its `.steps` is `steps`): `drafter.init` on the workload's batch (outside the loop),
  then its own `propose` each iteration, with the cache filled to `position` and the
  committed tokens fixed (a proposal's work does not depend on the tokens' values).

  Each iteration proposes from the state the last one returned, as the decoding loop does,
  with a traced zero added to one element of every state, token and key array, so no part
  of a proposal is invariant across iterations (XLA would hoist it out of the loop).
  Unsharded; the parameters in `decoding.run`'s layout (`models.base.decoding_params`).

  verify_tokens n > 0: each iteration also runs the target on n tokens after the proposal
  (its last committed token and the proposed ones), as the decoding loop's verify call
  does, so the proposal runs on what that call leaves in the caches: a draft whose weights
  the target's streamed weights evict from the CPU's last-level cache pays their reads from
  memory in every proposal, which the proposal alone, timed in a loop of its own, does not
  (`experiment.measure.step_costs(in_loop=True)` subtracts the verify call's own loop).
  """
  if not isinstance(verify_tokens, int) or isinstance(verify_tokens, bool) or verify_tokens < 0:
    raise ValueError(f"verify_tokens must be an int >= 0, got {verify_tokens!r}")
  w = workload
  tokens = runner.trim_padding(jnp.asarray(w.encoder_tokens))
  position = w.cache_length // 2 if w.position is None else w.position
  fn = _jitted_proposals(drafter, w.target, w.draft, w.sampling, gamma, w.cache_length,
                         position, compile_options.resolve(w.compiler_options), verify_tokens)
  args = (base.decoding_params(w.target, w.target_params),
          base.decoding_params(w.draft, w.draft_params), tokens, jax.random.PRNGKey(0),
          jnp.int32(steps))

  def call():
    return fn(*args)

  call.steps = steps
  return call


@functools.lru_cache(maxsize=64)
def _jitted_proposals(drafter, target, draft, sampling, gamma: int, room: int,
                      position: int, options=(), verify_tokens: int = 0):
  """One jitted proposal loop per setting (see `proposal_loop`), its trip count an argument:
  equal settings and shapes share a compile, and so do a marginal pair's two loops."""

  def run(target_params, draft_params, encoder_tokens, rng, steps):
    B = encoder_tokens.shape[0]
    ctx = runner.LoopContext(
        target=target, target_params=target_params, draft=draft, draft_params=draft_params,
        encoder_tokens=encoder_tokens, draft_encoder_tokens=encoder_tokens, rng=rng,
        row_ids=jnp.arange(B, dtype=jnp.int32), max_decode_len=room, sampling=sampling)
    ctx = ctx.with_target_encoded()
    state = drafter.init(ctx, room)
    committed = Committed(tokens=jnp.full((B, room), 2, jnp.int32),
                          length=jnp.full((B,), position, jnp.int32), it=jnp.int32(1))
    keys = jax.vmap(lambda k: jax.random.split(k, gamma))(ctx.keys(0))  # [B, gamma, key]
    target_cache = None
    if verify_tokens:
      target_cache = ctx.start_cache("target", room).rewind(
          jnp.full((B,), position, jnp.int32))

    def body(_, carry):
      state, committed, keys, target_cache, z = carry
      zero = (z > 3e38).astype(jnp.int32)  # 0, but not known to be 0
      state, committed, keys = _perturbed((state, committed, keys), zero)
      proposal, state = drafter.propose(ctx, state, committed, keys, gamma)
      z = z + 1e-30 * jnp.sum(proposal.tokens.astype(jnp.float32))
      if verify_tokens:  # the verify call, on the proposal (after it, as in the loop)
        tokens = jnp.concatenate([committed.token_at(committed.length)[:, None],
                                  proposal.tokens], axis=1)[:, :verify_tokens]
        tokens = jnp.pad(tokens, ((0, 0), (0, verify_tokens - tokens.shape[1])))
        out = target.decode(ctx.target_params, target_cache, tokens)
        target_cache = out.cache.rewind(target_cache.lengths)
        z = z + 1e-30 * jnp.sum(out.logits[:, -1, :1])
      return state, committed, keys, target_cache, z

    return jax.lax.fori_loop(0, steps, body,
                             (state, committed, keys, target_cache, jnp.float32(0)))[-1]

  return jax.jit(run, compiler_options=dict(options) or None)


@functools.lru_cache(maxsize=64)
def _jitted_steps(model, mesh, rules, options=()):
  """One jitted decode loop per (model, layout), its trip count an argument: equal shapes
  share a compile, and so do a marginal pair's k- and 2k-step loops."""

  def _run(params, cache, tokens, steps):
    lengths = cache.lengths

    def body(_, carry):
      cache, tokens, _ = carry
      out = model.decode(params, cache, tokens)
      logits = out.logits
      cache = partitioning.constrain_cache(out.cache, model, mesh, rules).rewind(lengths)
      return cache, argmax(logits), logits

    logits = jnp.zeros(tokens.shape + (model.vocab_size,), jnp.float32)
    cache, _, logits = jax.lax.fori_loop(0, steps, body, (cache, tokens, logits))
    return logits, cache

  return jax.jit(_run, donate_argnums=1, compiler_options=dict(options) or None)
