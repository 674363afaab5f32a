"""models.grow: a grown T5 computes the small one's function and every new parameter trains."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import float64_reference as f64
from spec_decode import checkpoints, decoding, train
from spec_decode.models import grow, t5

SMALL = t5.T5Config.preset("t5_1_1_tiny", vocab_size=96, emb_dim=24, num_heads=2, head_dim=8,
                           mlp_dim=40, num_encoder_layers=2, num_decoder_layers=2)
BIG = SMALL.replace(emb_dim=40, num_heads=3, mlp_dim=72, num_encoder_layers=3,
                    num_decoder_layers=5)


def _inputs(seed=0, batch=3, src=9, tgt=7):
  rng = np.random.default_rng(seed)
  enc = rng.integers(2, SMALL.vocab_size, (batch, src)).astype(np.int32)
  enc[0, -3:] = 0  # a padded row
  dec = np.concatenate([np.zeros((batch, 1)), rng.integers(2, SMALL.vocab_size,
                                                           (batch, tgt - 1))], 1)
  return jnp.asarray(enc), jnp.asarray(dec, jnp.int32)


def _assert_small_function(config, params, small_params, enc, dec):
  """The grown model's float32 logits within float32 rounding of the small model's float64
  logits (tests/float64_reference.py): growing rounds its rescaled weights to float32, no
  more."""
  small64, noise = f64.t5_float64_reference(SMALL, small_params, enc, dec)
  f64.assert_float32_rounding(np.asarray(t5.T5(config).forward(params, enc, dec)), small64,
                              noise, "grown model")


@pytest.fixture(scope="module")
def grown():
  small_params = t5.T5(SMALL).init(jax.random.PRNGKey(1))
  big_params = grow.grow(SMALL, small_params, BIG, jax.random.PRNGKey(2))
  return small_params, big_params


def test_grown_model_has_the_big_shape_and_the_small_function(grown):
  small_params, big_params = grown
  shapes = jax.tree_util.tree_map(lambda x: x.shape, big_params)
  assert shapes == jax.tree_util.tree_map(lambda x: x.shape, t5.T5(BIG).param_shapes())
  enc, dec = _inputs()
  _assert_small_function(BIG, big_params, small_params, enc, dec)
  # Greedy decoding (cache path, one token per call) gives the same tokens.
  ra = decoding.autoregressive(t5.T5(SMALL), small_params, enc, max_decode_len=8)
  rb = decoding.autoregressive(t5.T5(BIG), big_params, enc, max_decode_len=8)
  np.testing.assert_array_equal(rb.tokens, ra.tokens)


def test_new_parameters_are_not_all_frozen_at_zero(grown):
  """New rows/columns of the writer kernels are zero but get gradients, so they train."""
  _, big_params = grown
  model = t5.T5(BIG)
  enc, dec = _inputs(seed=3)
  labels = jnp.roll(dec, -1, axis=1)

  def loss(p):
    logits = model.forward(p, enc, dec)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1))

  grads = jax.grad(loss)(jax.tree_util.tree_map(jnp.asarray, big_params))
  new_layer = grow.layer_map(SMALL.num_decoder_layers, BIG.num_decoder_layers)
  fresh = next(i for i in range(BIG.num_decoder_layers) if i not in new_layer)
  layer_p = big_params["decoder"][f"layers_{fresh}"]
  layer_g = grads["decoder"][f"layers_{fresh}"]
  for path in (("self_attention", "out"), ("encoder_decoder_attention", "out"), ("mlp", "wo")):
    assert not np.any(layer_p[path[0]][path[1]]["kernel"]), path
    assert np.any(np.asarray(layer_g[path[0]][path[1]]["kernel"])), path
  # The embedding's new dimensions start at zero and train.
  emb_g = np.asarray(grads["token_embedder"]["embedding"])[:, SMALL.emb_dim:]
  assert not np.any(big_params["token_embedder"]["embedding"][:, SMALL.emb_dim:])
  assert np.any(emb_g)
  # A kept layer's new MLP units: zero output rows that get gradients.
  kept = grads["encoder"]["layers_0"]["mlp"]["wo"]["kernel"]
  assert np.any(np.asarray(kept)[SMALL.mlp_dim:])


def test_layer_map_spreads_the_small_layers():
  assert grow.layer_map(3, 8) == {0: 0, 2: 1, 5: 2}
  assert grow.layer_map(2, 2) == {0: 0, 1: 1}


@pytest.mark.parametrize("big,match", [
    (SMALL.replace(vocab_size=97), "vocab_size"),
    (SMALL.replace(head_dim=4, num_heads=4), "head_dim"),
    (SMALL.replace(emb_dim=16), "emb_dim: 24 > 16"),
    (SMALL.replace(num_decoder_layers=1), "num_decoder_layers: 2 > 1"),
])
def test_grow_refuses_what_it_cannot_preserve(big, match):
  params = t5.T5(SMALL).init(jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match=match):
    grow.grow(SMALL, params, big, jax.random.PRNGKey(0))


def test_trainer_grows_an_init_checkpoint_and_refuses_a_mismatched_one(tmp_path):
  path = str(tmp_path / "small")
  small_params = t5.T5(SMALL).init(jax.random.PRNGKey(1))
  checkpoints.save(path, SMALL, small_params, format="t5x", step=0)
  big = {f: getattr(BIG, f) for f in ("vocab_size", "emb_dim", "num_heads", "head_dim",
                                      "mlp_dim", "num_encoder_layers", "num_decoder_layers")}
  cfg = train.TrainConfig(model=big, init_checkpoint=path, grow_init=True)
  params = train._initial_params(cfg, cfg.model_config(), jax.random.PRNGKey(2))
  enc, dec = _inputs(seed=5)
  _assert_small_function(BIG, params, small_params, enc, dec)
  with pytest.raises(ValueError, match="holds a different model.*grow_init"):
    train._initial_params(train.TrainConfig(model=big, init_checkpoint=path),
                          cfg.model_config(), jax.random.PRNGKey(2))
  with pytest.raises(ValueError, match="grow_init needs init_checkpoint"):
    train.TrainConfig(model=big, grow_init=True)
