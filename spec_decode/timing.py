"""Wall-clock timing of jitted JAX work: compile separately, then the median of reps.

Every timed call ends with `jax.block_until_ready` on its result, so the time
covers the device work, not only its dispatch. `step_time` measures one
decoder call (T tokens into a cache) of any `Decoder`; the cost coefficient
c of the paper is step_time(draft) / step_time(target) on the same batch.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp


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


def step_time(model, params, encoder_tokens, *, num_tokens: int = 1, cache_length: int,
              position: int | None = None, repeats: int = 10, warmup: int = 2) -> float:
  """Median seconds of one jitted `model.decode` of num_tokens tokens per row.

  The cache holds `cache_length` slots with every row at `position` (default
  cache_length // 2), so attention reads a realistic prefix. The cache is
  donated and rewound each call, as the decoding loops update it in place.
  """
  if not 1 <= num_tokens <= cache_length:
    raise ValueError(f"need 1 <= num_tokens <= cache_length, got {num_tokens}, {cache_length}")
  position = cache_length // 2 if position is None else position
  position = min(position, cache_length - num_tokens)
  cache = model.init_cache(params, model.encode(params, encoder_tokens), cache_length)
  start = jnp.full(cache.lengths.shape, position, jnp.int32)
  cache = cache.rewind(start)
  tokens = jnp.full((encoder_tokens.shape[0], num_tokens), 2, jnp.int32)
  state = {"cache": cache}

  def call():
    logits, state["cache"] = _decode_step(model, params, state["cache"], tokens)
    return logits

  return timed(call, repeats=repeats, warmup=warmup).median


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _decode_step(model, params, cache, tokens):
  """One decoder call; the cache comes back at its input lengths (in place: donated)."""
  logits, new_cache = model.decode(params, cache, tokens)
  return logits, new_cache.rewind(cache.lengths)
