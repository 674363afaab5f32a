"""Wall-clock timing of jitted JAX work: compile separately, then the median of reps.

Every timed call ends with `jax.block_until_ready` on its result, so the time
covers the device work, not only its dispatch. `step_time` measures one
decoder call (T tokens into a cache) of any `Decoder` as it runs inside a
jitted decoding loop (`decode_loop`: k calls per dispatch); the cost
coefficient c of the paper is step_time(draft) / step_time(target) on the
same batch.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from spec_decode import compile_options, partitioning
from spec_decode.decoding import runner
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


def decode_loop(model, params, encoder_tokens, *, num_tokens: int, cache_length: int,
                position: int | None = None, steps: int = 1, mesh=None,
                rules=None, compiler_options=None,
                decode_layout: bool = True) -> Callable[[], jax.Array]:
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
  `.state` holds params, tokens and the current cache (the cache is donated).
  compiler_options: as `decoding.run`'s (None: the backend's defaults, which
  the decoding loops use too), unsharded runs only. Unsharded, the encoder tokens are
  trimmed of all-padding columns as `decoding.run` trims them (cross-attention then reads
  what it reads in the decoding loops). decode_layout (default): unsharded params in the
  layout `decoding.run` gives them (`models.base.decoding_params`, e.g. packed CPU
  kernels); False times them as given (XLA's dots).
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
  run = _jitted_steps(model, steps, mesh, rules, options)
  state = {"cache": cache, "params": params, "tokens": tokens}

  def call():
    logits, state["cache"] = run(params, state["cache"], tokens)
    return logits

  call.state = state
  call.steps = steps
  return call


def step_time(model, params, encoder_tokens, *, num_tokens: int = 1, cache_length: int,
              position: int | None = None, steps: int = 8, repeats: int = 10, warmup: int = 2,
              mesh=None, rules=None, marginal: bool = True, compiler_options=None,
              decode_layout: bool = True) -> float:
  """Median seconds of one `model.decode` of num_tokens tokens per row inside a jitted loop.

  marginal (default): the cost of one more decode inside a loop, i.e. the
  difference between a loop of 2 * steps decodes and one of `steps`, divided
  by `steps` (rounds interleaved; median of the per-round differences). Each
  timed call also pays a fixed cost (dispatch, argument transfer, loop entry:
  about 2 ms on the 2-core CPU, as much as eight demo target steps), which a
  decoding loop pays once per call, not per step; dividing a whole call by its
  steps charges it to every step and biases small-model step times (and c,
  and the verify ratio) upwards. When noise makes the difference non-positive
  the per-step time of the longer loop is returned (an upper bound).
  marginal=False: one call of `steps` decodes divided by `steps`. decode_layout: as
  `decode_loop`'s.
  """
  kw = dict(num_tokens=num_tokens, cache_length=cache_length, position=position, mesh=mesh,
            rules=rules, compiler_options=compiler_options, decode_layout=decode_layout)
  short = decode_loop(model, params, encoder_tokens, steps=steps, **kw)
  if not marginal:
    return timed(short, repeats=repeats, warmup=warmup).median / steps
  long = decode_loop(model, params, encoder_tokens, steps=2 * steps, **kw)
  return _marginal_seconds(short, long, steps, repeats=repeats, warmup=warmup)


def _marginal_seconds(short, long, steps: int, *, repeats: int, warmup: int) -> float:
  """Seconds per step from zero-argument calls running `steps` and 2 * steps steps:
  the median of interleaved (long - short) / steps, or, when noise makes it
  non-positive, the longer call's per-step time (an upper bound)."""
  timed(short, repeats=1, warmup=warmup)
  timed(long, repeats=1, warmup=warmup)
  diffs, longs = [], []
  for _ in range(repeats):
    a = timed(short).seconds[0]
    b = timed(long).seconds[0]
    diffs.append(b - a)
    longs.append(b)
  diff = statistics.median(diffs)
  return diff / steps if diff > 0 else statistics.median(longs) / (2 * steps)


@functools.lru_cache(maxsize=64)
def _jitted_steps(model, steps: int, mesh, rules, options=()):
  """One jitted k-step decode loop per (model, k, layout): equal shapes share a compile."""

  def _run(params, cache, tokens):
    lengths = cache.lengths

    def body(_, carry):
      cache, tokens, _ = carry
      out = model.decode(params, cache, tokens)
      logits = out.logits
      cache = partitioning.constrain_cache(out.cache, model, mesh, rules).rewind(lengths)
      return cache, jnp.argmax(logits, axis=-1).astype(jnp.int32), logits

    logits = jnp.zeros(tokens.shape + (model.vocab_size,), jnp.float32)
    cache, _, logits = jax.lax.fori_loop(0, steps, body, (cache, tokens, logits))
    return logits, cache

  return jax.jit(_run, donate_argnums=1, compiler_options=dict(options) or None)


def loop_seconds(fn, arg, *, steps: int = 8, repeats: int = 10, warmup: int = 2,
                 compiler_options=None) -> float:
  """Marginal seconds of one `fn(arg)` call inside a jitted loop (as `step_time`: loops of
  `steps` and 2 * steps calls), each call's input depending on the last output (fn must
  return an array that broadcasts against arg). compiler_options: as `decode_loop`'s (None:
  the options the decoding loops compile with), so the loop costs what a step in them does."""
  options = dict(compile_options.resolve(compiler_options))

  def make(k):
    def run(x):
      return jax.lax.fori_loop(0, k, lambda i, c: c + 1e-9 * fn(c), x)
    loop = jax.jit(run, compiler_options=options or None)
    return lambda: loop(arg)

  return _marginal_seconds(make(steps), make(2 * steps), steps, repeats=repeats, warmup=warmup)
