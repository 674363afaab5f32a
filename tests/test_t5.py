"""T5 model: incremental decode == teacher forcing, golden shapes, errors."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import float64_reference as f64
from spec_decode.models import t5

GOLDEN = os.path.join(os.path.dirname(__file__), "testdata", "t5_param_shapes.json")
# Published parameter counts of the T5.1.1 checkpoints.
PUBLISHED_COUNTS = {
    "t5_1_1_small": 76_961_152,
    "t5_1_1_base": 247_577_856,
    "t5_1_1_large": 783_150_080,
    "t5_1_1_xl": 2_849_757_184,
    "t5_1_1_xxl": 11_135_332_352,
}


def _flatten(tree, prefix=""):
  out = {}
  for k, v in tree.items():
    path = f"{prefix}/{k}" if prefix else k
    out.update(_flatten(v, path) if isinstance(v, dict) else {path: v})
  return out


@pytest.fixture(scope="module", params=["t5_1_1_tiny", "t5_tiny"])
def model_and_params(request):
  model = t5.T5(t5.T5Config.preset(request.param))
  return model, model.init(jax.random.PRNGKey(3))


def _inputs(vocab, batch=3, src=9, tgt=7, seed=0):
  rs = np.random.RandomState(seed)
  enc = rs.randint(2, vocab, (batch, src)).astype(np.int32)
  enc[1, 4:] = 0  # padded row
  enc[2, 7:] = 0
  dec = rs.randint(2, vocab, (batch, tgt)).astype(np.int32)
  dec[:, 0] = t5.BOS_ID
  return enc, dec


@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_decode_matches_forward(model_and_params, chunk):
  model, params = model_and_params
  enc, dec = _inputs(model.config.vocab_size)
  full = model.forward(params, enc, dec)
  cache = model.init_cache(params, model.encode(params, enc), 12)
  pieces = []
  for start in range(0, dec.shape[1], chunk):
    out = model.decode(params, cache, dec[:, start:start + chunk])
    logits, cache = out.logits, out.cache
    pieces.append(logits)
  np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(cache.lengths, [dec.shape[1]] * 3)


def test_ragged_rows_after_rewind(model_and_params):
  """Rows at different lengths decode their own next tokens; stale entries are ignored."""
  model, params = model_and_params
  V = model.config.vocab_size
  enc, dec = _inputs(V, tgt=8, seed=1)
  cache = model.init_cache(params, model.encode(params, enc), 12)
  # Fill 6 positions with unrelated tokens, then rewind rows to different lengths.
  junk = np.random.RandomState(9).randint(2, V, (3, 6)).astype(np.int32)
  junk[:, 0] = 0
  out = model.decode(params, cache, junk)
  _, cache = out.logits, out.cache
  lengths = np.array([2, 4, 0], np.int32)
  # Re-feed each row's true prefix up to its length (per-row ragged writes).
  cache = cache.rewind(np.zeros(3, np.int32))
  for t in range(4):
    step_tokens = dec[:, t:t + 1]
    out = model.decode(params, cache, step_tokens)
    _, stepped = out.logits, out.cache
    cache = stepped.rewind(np.minimum(cache.lengths + 1, lengths))
  np.testing.assert_array_equal(cache.lengths, lengths)
  chunk = np.stack([dec[b, lengths[b]:lengths[b] + 3] for b in range(3)])
  out = model.decode(params, cache, chunk)
  logits, cache = out.logits, out.cache
  full = model.forward(params, enc, dec)
  expected = np.stack([full[b, lengths[b]:lengths[b] + 3] for b in range(3)])
  np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(cache.lengths, lengths + 3)


def test_golden_param_shapes_all_presets():
  with open(GOLDEN) as f:
    golden = json.load(f)
  for name, expected in golden.items():
    model = t5.T5(t5.T5Config.preset(name))
    shapes = {k: list(v.shape) for k, v in _flatten(model.param_shapes()).items()}
    assert shapes == expected, name
    assert model.num_params() == PUBLISHED_COUNTS[name], name
    assert sum(int(np.prod(s)) for s in expected.values()) == PUBLISHED_COUNTS[name]
    axes = _flatten(model.logical_axes())
    assert set(axes) == set(shapes)
    for path, ax in axes.items():
      assert len(ax) == len(shapes[path]), path


def test_logical_axes_names():
  axes = _flatten(t5.T5(t5.T5Config.preset("t5_1_1_tiny")).logical_axes())
  assert axes["token_embedder/embedding"] == ("vocab", "embed")
  assert axes["encoder/layers_0/attention/query/kernel"] == ("embed", "joined_kv")
  assert axes["decoder/layers_1/self_attention/out/kernel"] == ("joined_kv", "embed")
  assert axes["decoder/layers_0/mlp/wi_0/kernel"] == ("embed", "mlp")
  assert axes["decoder/layers_0/mlp/wo/kernel"] == ("mlp", "embed")
  assert axes["decoder/relpos_bias/rel_embedding"] == ("heads", "relpos_buckets")
  assert axes["decoder/logits_dense/kernel"] == ("embed", "vocab")
  assert axes["encoder/encoder_norm/scale"] == ("embed",)


def test_t5_1_0_has_no_logits_dense_and_single_wi():
  flat = _flatten(t5.T5(t5.T5Config.preset("t5_small")).param_shapes())
  assert "decoder/logits_dense/kernel" not in flat
  assert flat["encoder/layers_0/mlp/wi/kernel"].shape == (512, 2048)


def test_relative_position_buckets_known_values():
  rel = jnp.array([-200, -128, -20, -8, -1, 0, 1, 8, 20, 128, 200])
  bi = t5.relative_position_bucket(rel, bidirectional=True, num_buckets=32, max_distance=128)
  causal = t5.relative_position_bucket(rel, bidirectional=False, num_buckets=32,
                                       max_distance=128)
  # Values from Hugging Face's T5Attention._relative_position_bucket (independent code).
  # Bidirectional: keys after the query use buckets 16..31; exact below 8, log above.
  np.testing.assert_array_equal(bi, [15, 15, 10, 8, 1, 0, 17, 24, 26, 31, 31])
  # Causal: keys after the query all map to bucket 0; exact below 16.
  np.testing.assert_array_equal(causal, [31, 31, 17, 8, 1, 0, 0, 0, 0, 0, 0])


def test_bfloat16_model_returns_float32_logits_close_to_float32():
  cfg = t5.T5Config.preset("t5_1_1_tiny")
  m32, m16 = t5.T5(cfg), t5.T5(cfg.replace(dtype=jnp.bfloat16))
  p32 = m32.init(jax.random.PRNGKey(0))
  p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p32)
  enc, dec = _inputs(cfg.vocab_size)
  l32, l16 = m32.forward(p32, enc, dec), m16.forward(p16, enc, dec)
  assert l16.dtype == jnp.float32
  assert m16.init(jax.random.PRNGKey(0))["token_embedder"]["embedding"].dtype == jnp.bfloat16
  # bfloat16 has 8 mantissa bits; errors compound over 2+2 layers.
  np.testing.assert_allclose(l16, l32, atol=0.15 * float(np.abs(l32).max()), rtol=0)


_TINY = t5.T5(t5.T5Config.preset("t5_1_1_tiny"))


@pytest.fixture(scope="module")
def params():
  return _TINY.init(jax.random.PRNGKey(0))


class TestErrors:
  model = _TINY

  def test_unknown_preset(self):
    with pytest.raises(ValueError, match="Unknown T5 preset 't5_1_1_huge'"):
      t5.T5Config.preset("t5_1_1_huge")

  def test_bad_config_fields(self):
    with pytest.raises(ValueError, match="num_heads"):
      t5.T5Config(num_heads=0)
    with pytest.raises(ValueError, match="mlp_activations"):
      t5.T5Config(mlp_activations=("swish",))

  def test_token_ids_outside_vocab(self, params):
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 64\)"):
      self.model.encode(params, np.array([[3, 64]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
      self.model.forward(params, np.array([[3, 4]]), np.array([[0, -1]]))

  def test_wrong_rank_and_dtype(self, params):
    with pytest.raises(ValueError, match=r"shape \[batch, length\]"):
      self.model.encode(params, np.array([3, 4]))
    with pytest.raises(ValueError, match="integer array"):
      self.model.encode(params, np.array([[3.0, 4.0]]))

  def test_tokens_beyond_cache_length(self, params):
    cache = self.model.init_cache(params, self.model.encode(params, np.array([[5, 6]])), 4)
    out = self.model.decode(params, cache, np.array([[0, 5, 6]]))
    _, cache = out.logits, out.cache
    with pytest.raises(ValueError, match="overflows the cache"):
      self.model.decode(params, cache, np.array([[7, 8]]))
    with pytest.raises(ValueError, match="cache of length 4"):
      self.model.decode(params, cache, np.zeros((1, 5), np.int32))

  def test_batch_mismatch(self, params):
    cache = self.model.init_cache(params, self.model.encode(params, np.array([[5, 6]])), 4)
    with pytest.raises(ValueError, match="batch"):
      self.model.decode(params, cache, np.zeros((2, 1), np.int32))
    with pytest.raises(ValueError, match="rewind lengths must have shape"):
      cache.rewind(np.zeros(3, np.int32))

  def test_bad_max_decode_len(self, params):
    with pytest.raises(ValueError, match="max_decode_len"):
      self.model.init_cache(params, self.model.encode(params, np.array([[5, 6]])), 0)


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("T", [1, 5])
def test_decode_step_moves_no_whole_cache(params, T, B):
  """The caches are laid out as attention's products read them (`DecodeCache`): the
  optimized HLO of a decode step copies or transposes no buffer of a whole layer's K or V
  cache (T5X's [B, L, N, H] made XLA transpose every cache on every call). The exception is
  a one-token step at batch 1 with the self-attention's products as dots (the default):
  XLA:CPU copies every cache 4 times there, which `t5.ROWWISE_SELF_ATTENTION` avoids (off
  by default: it made the speculative decoders slower end to end)."""
  import re
  from spec_decode import compile_options
  from spec_decode.decoding import timing
  c = _TINY.config
  L = 24
  cache_dims = {tuple(sorted((B, L, c.num_heads, c.head_dim))),
                tuple(sorted((B, 10, c.num_heads, c.head_dim)))}

  def moved(rowwise):
    with t5.switched(ROWWISE_SELF_ATTENTION=rowwise):
      cache = _TINY.init_cache(params, _TINY.encode(params, np.full((B, 10), 5)), L)
      loop = timing._jitted_steps(_TINY, None, None, compile_options.resolve(None))
      hlo = loop.lower(params, cache, jnp.full((B, T), 3, jnp.int32),
                       jnp.int32(2)).compile().as_text()
    assert "dot" in hlo
    return [f"{name} {dims}" for name, dims in re.findall(r"%([\w.-]+) = f32\[([\d,]+)\]", hlo)
            if ("copy" in name or "transpose" in name)
            and tuple(sorted(int(d) for d in dims.split(","))) in cache_dims]

  assert not moved(True)
  if B == 1 and T == 1:
    assert moved(False)  # the dots' copies (the default's cost)
  else:
    assert not moved(False)


def _one_token_steps(model, params, enc, dec, two, steps: int = 4):
  """Teacher-forced one-token steps of `dec` at batch 1 with t5.ONE_ROW_AS_TWO = `two`:
  (logits [1, steps, V], the last cache, the lowered step's text)."""
  with t5.switched(ONE_ROW_AS_TWO=two):  # read at trace time: traced anew inside
    step = jax.jit(model.decode)
    cache = model.init_cache(params, model.encode(params, enc), 8)
    logits = []
    for t in range(steps):
      out = step(params, cache, dec[:, t:t + 1])
      logits.append(np.asarray(out.logits))
      cache = out.cache
    return np.concatenate(logits, axis=1), cache, step.lower(params, cache, dec[:, :1]).as_text()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_row_as_two_rows_is_the_same_step(dtype):
  """A one-token step at batch 1 with its products stacked to two rows (the GPU default,
  `t5.ONE_ROW_AS_TWO`) gives the one-row step's logits and cache; it is off on CPU.

  In float64 the two forms agree to float64 rounding (the same function, logits and
  cache). In float32 they are two shapes of XLA's product, which may sum in different
  orders (an AVX2-only AMD EPYC rounds a one-row and a two-row product apart by 7 units in
  the last place), so each is checked against the float64 run within float32 rounding
  (tests/float64_reference.py) rather than against each other."""
  assert not t5._one_row_as_two() and jax.default_backend() == "cpu"
  model = t5.T5(t5.T5Config.preset("t5_1_1_tiny", dtype=dtype))
  params = model.init(jax.random.PRNGKey(5))
  enc, dec = (x[:1] for x in _inputs(model.config.vocab_size))
  steps = {}
  for two in (False, True, "broadcast"):
    logits, cache, text = _one_token_steps(model, params, enc, dec, two)
    steps[two] = (logits, cache)
    first_product = text.split("dot_general")[1].split("->")[0]  # its operand types
    assert ("(tensor<1x2x" in first_product) == bool(two)
  assert t5.ONE_ROW_AS_TWO is None  # restored after the block
  np.testing.assert_array_equal(steps["broadcast"][0], steps[True][0])
  with t5.switched(ONE_ROW_AS_TWO="stack"), pytest.raises(ValueError, match="ONE_ROW_AS_TWO"):
    model.decode(params, steps[True][1], dec[:, :1])
  if dtype == jnp.bfloat16:
    # Compared directly, as before: it holds on every CPU met so far (each layer's output is
    # rounded to bfloat16, which absorbed the summation-order differences seen in float32).
    # The float64 bounds below are float32 rounding's, so they do not apply here.
    np.testing.assert_allclose(steps[True][0], steps[False][0], atol=1e-6, rtol=0)
    for a, b in zip(jax.tree_util.tree_leaves(steps[True][1]),
                    jax.tree_util.tree_leaves(steps[False][1])):
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 atol=1e-6, rtol=0)
    return
  with jax.enable_x64(True):
    model64 = t5.T5(model.config.replace(dtype=jnp.float64))
    params64 = f64.as_float64(params)
    one, two = (_one_token_steps(model64, params64, enc, dec, form) for form in (False, True))
  first_product = two[2].split("dot_general")[1].split("->")[0]
  assert "(tensor<1x2x" in first_product and "f64>" in first_product  # stacked, in float64
  f64.assert_same_function(two[0], one[0], "logits, stacked against one row")
  for a, b in zip(jax.tree_util.tree_leaves(two[1]), jax.tree_util.tree_leaves(one[1])):
    if jnp.issubdtype(a.dtype, jnp.floating):
      f64.assert_same_function(a, b, "cache, stacked against one row")
  ref64, noise = f64.t5_float64_reference(model.config, params, enc, dec[:, :4])
  for form, name in ((False, "one row"), (True, "stacked to two rows")):
    f64.assert_float32_rounding(steps[form][0], ref64, noise, name)


def test_switched_refuses_an_unknown_switch_and_restores():
  with pytest.raises(ValueError, match="unknown t5 switches"):
    with t5.switched(SKIP_PADDING=False):
      pass
  with pytest.raises(RuntimeError):
    with t5.switched(SKIP_PADDING_ROWS=False):
      assert t5.SKIP_PADDING_ROWS is False
      raise RuntimeError("inside")
  assert t5.SKIP_PADDING_ROWS is True
