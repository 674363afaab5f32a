"""Meshes, logical axis rules, parameter shardings, and sharded decoding == unsharded.

Runs on the 8 simulated CPU devices of conftest.py. The decoding target has 6
heads (like T5.1.1-small): on model=8 and model=4 its heads (and joined_kv)
do not divide the model axis and stay replicated while mlp and vocab are
sharded; on model=2 the heads are sharded too; data=8 is pure data parallel.
"""

import gin
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tiers import tiered
from spec_decode import decoding, partitioning
from spec_decode.models import t5

# ------------------------------------------------------------------ shared case

MESHES = ["data=1,model=8", "data=2,model=4", "data=8,model=1", "data=4,model=2"]
SAMPLINGS = {"greedy": decoding.Sampling(), "sampled": decoding.Sampling(temperature=0.9, top_k=40)}
BATCH, MAX_LEN, GAMMA = 8, 10, 3


@pytest.fixture(scope="module")
def case():
  """A 6-head target, a draft with noisy target weights, and 8 inputs."""
  cfg = t5.T5Config.preset("t5_1_1_tiny", num_heads=6, num_encoder_layers=1,
                           num_decoder_layers=1)
  model = t5.T5(cfg)
  params = model.init(jax.random.PRNGKey(0))
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
  draft_params = jax.tree.unflatten(treedef, [
      x + 0.3 * x.std() * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])
  tokens = np.array(jax.random.randint(jax.random.PRNGKey(2), (BATCH, 7), 2, cfg.vocab_size))
  tokens[1, 4:] = 0  # padding in one row
  return model, params, draft_params, tokens


# ------------------------------------------------------------------ meshes and rules


def test_parse_mesh_spec():
  assert partitioning.parse_mesh_spec("data=2,model=4", 8) == {"data": 2, "model": 4}
  assert partitioning.parse_mesh_spec(" data = -1 , model=2", 8) == {"data": 4, "model": 2}
  assert partitioning.parse_mesh_spec({"model": 4}, 8) == {"model": 4}
  for bad in ("data=2,model", "data=2,data=4", "data=0", "data=-1,model=-1", "data=3,model=4",
              "", "data=-1,model=3"):
    with pytest.raises(ValueError):
      partitioning.parse_mesh_spec(bad, 8)


def test_make_mesh():
  mesh = partitioning.make_mesh("data=2,model=4")
  assert dict(mesh.shape) == {"data": 2, "model": 4}
  assert dict(partitioning.make_mesh(num_partitions=2).shape) == {"data": 4, "model": 2}
  assert dict(partitioning.make_mesh("model=4").shape) == {"model": 4}  # a subset of devices
  with pytest.raises(ValueError, match="exactly one"):
    partitioning.make_mesh("data=8", num_partitions=8)
  with pytest.raises(ValueError, match="divisor"):
    partitioning.make_mesh(num_partitions=3)


def test_logical_to_spec_resolution():
  mesh = partitioning.make_mesh("data=2,model=4")
  spec = lambda axes, shape, rules=None, units=None: partitioning.logical_to_spec(
      axes, shape, mesh, rules, units)
  assert spec(("embed", "mlp"), (32, 64)) == P(None, "model")
  assert spec(("batch", "length", "heads", "kv"), (8, 5, 4, 16)) == P("data", None, "model", None)
  # Not divisible: replicated on that dimension only.
  assert spec(("batch", "length", "heads", "kv"), (3, 5, 6, 16)) == P(None, None, None, None)
  # joined_kv splits whole heads: 6 heads * 8 = 48 is divisible by 4, 6 heads are not.
  assert spec(("embed", "joined_kv"), (32, 48), units={"joined_kv": 6}) == P(None, None)
  assert spec(("embed", "joined_kv"), (32, 48)) == P(None, "model")
  # A mesh axis is used once per array; the later dimension falls back.
  assert spec(("vocab", "vocab"), (64, 64)) == P("model", None)
  # Rules are tried in order; a None rule stops; an axis absent from the mesh is skipped.
  rules = (("mlp", "replica"), ("mlp", "data"), ("vocab", None), ("vocab", "model"))
  assert spec(("vocab", "mlp"), (64, 64), rules) == P(None, "data")
  assert spec(("embed", "mlp"), (32, 64), (("mlp", ("data", "model")),)) == P(
      None, ("data", "model"))
  with pytest.raises(ValueError, match="do not match"):
    spec(("embed",), (32, 64))


def test_rules_and_gin_override():
  rules = partitioning.standard_logical_axis_rules()
  assert rules == partitioning.DEFAULT_RULES
  assert ("heads", "model") in rules and ("batch", "data") in rules
  two_d = partitioning.standard_logical_axis_rules(parameter_partitioning_dims=2)
  mesh = partitioning.make_mesh("data=2,model=4")
  assert partitioning.logical_to_spec(("embed", "mlp"), (32, 64), mesh, two_d) == P("data", "model")
  assert partitioning.logical_to_spec(("batch", "length", "embed"), (4, 5, 32), mesh,
                                      two_d) == P("data", None, None)
  assert partitioning.data_parallel_rules() == (("batch", "data"),)
  for bad in [("heads",), (("heads", 3),), ((1, "model"),)]:
    with pytest.raises(ValueError):
      partitioning.validate_rules(bad)
  # Overridable from gin (main.py registers the function the same way).
  gin.clear_config()
  configurable = gin.external_configurable(partitioning.standard_logical_axis_rules,
                                           module="test_partitioning")
  gin.parse_config("test_partitioning.standard_logical_axis_rules.additional_rules = "
                   "[('heads', None), ('joined_kv', None)]")
  try:
    rules = configurable()
  finally:
    gin.clear_config()
  assert rules[:2] == (("heads", None), ("joined_kv", None))
  assert partitioning.logical_to_spec(("heads", "relpos_buckets"), (8, 32), mesh, rules) == P(
      None, None)


# ------------------------------------------------------------------ parameter shardings


@pytest.mark.parametrize("preset,model_axis,heads_sharded", [
    ("t5_1_1_small", 4, False), ("t5_1_1_small", 2, True), ("t5_1_1_xxl", 8, True)])
def test_param_shardings(preset, model_axis, heads_sharded):
  model = t5.T5(t5.T5Config.preset(preset))
  mesh = partitioning.make_mesh(f"data={8 // model_axis},model={model_axis}")
  shardings = partitioning.param_shardings(model, mesh)
  shapes = model.param_shapes()
  assert jax.tree.structure(shardings) == jax.tree.structure(shapes)
  assert all(isinstance(s, NamedSharding) for s in jax.tree.leaves(shardings))
  layer = shardings["decoder"]["layers_0"]
  heads = "model" if heads_sharded else None
  assert layer["self_attention"]["query"]["kernel"].spec == P(None, heads)
  assert layer["self_attention"]["out"]["kernel"].spec == P(heads, None)
  assert shardings["decoder"]["relpos_bias"]["rel_embedding"].spec == P(heads, None)
  assert layer["mlp"]["wi_0"]["kernel"].spec == P(None, "model")
  assert layer["mlp"]["wo"]["kernel"].spec == P("model", None)
  assert shardings["token_embedder"]["embedding"].spec == P("model", None)
  assert shardings["decoder"]["logits_dense"]["kernel"].spec == P(None, "model")
  assert layer["pre_mlp_layer_norm"]["scale"].spec == P(None)
  total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))
  per_device = partitioning.shard_bytes(shapes, shardings)
  if heads_sharded:  # only norms (and nothing else) are replicated
    np.testing.assert_allclose(per_device, total / model_axis, rtol=0.01)
  else:
    assert total / model_axis < per_device < total


def test_param_shardings_without_logical_axes():
  class Bare:
    pass
  mesh = partitioning.make_mesh("data=2,model=4")
  params = {"w": np.zeros((4, 4), np.float32)}
  shardings = partitioning.param_shardings(Bare(), mesh, params=params)
  assert shardings["w"].spec == P()
  with pytest.raises(ValueError, match="logical_axes"):
    partitioning.param_shardings(Bare(), mesh)


def test_put_keeps_laid_out_arrays(case):
  model, params = case[:2]
  mesh = partitioning.make_mesh("data=2,model=4")
  shardings = partitioning.param_shardings(model, mesh)
  placed = partitioning.put(params, shardings)
  for x, s in zip(jax.tree.leaves(placed), jax.tree.leaves(shardings)):
    assert x.sharding == s
  again = partitioning.put(placed, shardings)
  assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(placed)))


# ------------------------------------------------------------------ sharded decoding


def _run(fn, case, sampling, **kwargs):
  model, params, draft_params, tokens = case
  common = dict(max_decode_len=MAX_LEN, sampling=sampling, rng=jax.random.PRNGKey(5))
  if fn == "autoregressive":
    return decoding.autoregressive(model, params, tokens, **common, **kwargs)
  return decoding.speculative(model, params, model, draft_params, tokens, gamma=GAMMA, **common,
                              **kwargs)


_REFERENCE = {}


def _reference(fn, name, case):
  if (fn, name) not in _REFERENCE:
    _REFERENCE[fn, name] = _run(fn, case, SAMPLINGS[name])
  return _REFERENCE[fn, name]


def _assert_same(got, ref):
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
  np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(ref.lengths))
  assert got.stats.names == ref.stats.names
  for field in ref.stats.names:  # every counter the algorithm declares
    g, r = np.asarray(getattr(got.stats, field)), np.asarray(getattr(ref.stats, field))
    if r.dtype.kind == "f":
      np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    else:
      np.testing.assert_array_equal(g, r)


@pytest.mark.parametrize("fn", ["autoregressive", "speculative"])
@pytest.mark.parametrize("name", list(SAMPLINGS))
@pytest.mark.parametrize("spec", tiered(MESHES, fast=("data=2,model=4",)))
def test_sharded_equals_unsharded(case, fn, name, spec):
  ref = _reference(fn, name, case)
  mesh = partitioning.make_mesh(spec)
  kwargs = {}
  if fn == "speculative" and spec == "data=4,model=2" and name == "sampled":
    kwargs["draft_rules"] = partitioning.DEFAULT_RULES  # the draft sharded like the target
  got = _run(fn, case, SAMPLINGS[name], mesh=mesh, **kwargs)
  _assert_same(got, ref)
  assert got.tokens.sharding.spec == P("data")  # BATCH divides every data axis here
  # The decodes are not degenerate.
  assert np.any(np.asarray(ref.lengths) > 3)
  if fn == "speculative":
    assert 0 < np.sum(np.asarray(ref.stats.accepted)) < np.sum(np.asarray(ref.stats.draft_tokens))


def test_odd_batch_presharded_params_custom_rules(case):
  """A batch of 3 on data=2 (replicated over `data`), params placed beforehand (as
  checkpoints.load(mesh=...) does) and rules overridden from the defaults."""
  model, params, _, tokens = case
  mesh = partitioning.make_mesh("data=2,model=4")
  rules = partitioning.standard_logical_axis_rules(additional_rules=[("mlp", None)])
  placed = partitioning.put(params, partitioning.param_shardings(model, mesh, rules))
  assert placed["decoder"]["layers_0"]["mlp"]["wo"]["kernel"].sharding.spec == P(None, None)
  got = decoding.autoregressive(model, placed, tokens[:3], max_decode_len=MAX_LEN, mesh=mesh,
                                rules=rules)
  ref = _reference("autoregressive", "greedy", case)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens)[:3])
  np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(ref.lengths)[:3])
  assert got.tokens.sharding.spec == P(None)


def test_layer_skip_reusing_its_layers_sharded_equals_unsharded():
  """Self-speculation whose verify call reuses the draft's first layer (`T5.decode_reusing`:
  the draft cache's entries copied into the target's, sharded alike) on a data x model mesh:
  the unsharded run's tokens and counters."""
  cfg = t5.T5Config.preset("t5_1_1_tiny", num_heads=6, num_encoder_layers=1,
                           num_decoder_layers=2)
  model = t5.T5(cfg)
  params = model.init(jax.random.PRNGKey(6))
  tokens = np.random.RandomState(7).randint(2, cfg.vocab_size, (BATCH, 6)).astype(np.int32)
  algo = decoding.Speculative(gamma=GAMMA, drafter=decoding.LayerSkipDrafter(layers=1))
  run = lambda **kw: decoding.run(algo, model, params, tokens, max_decode_len=MAX_LEN,
                                  sampling=SAMPLINGS["sampled"], rng=jax.random.PRNGKey(5), **kw)
  ref = run()
  _assert_same(run(mesh=partitioning.make_mesh("data=2,model=4")), ref)
  assert 0 < np.sum(np.asarray(ref.stats.accepted))
