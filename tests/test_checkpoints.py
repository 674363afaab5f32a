"""checkpoints.save/load round trips in every format, dtype handling, config checks, meshes."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_decode import checkpoints, partitioning
from spec_decode.checkpoints import common, infer, t5x_legacy
from spec_decode.models import t5

FORMATS = ("t5x", "orbax", "hf")


def random_params(config, seed=0):
  return t5.T5(config).init(jax.random.PRNGKey(seed))


def assert_bit_equal(a_tree, b_tree):
  a_flat, b_flat = common.flatten(a_tree), common.flatten(b_tree)
  assert a_flat.keys() == b_flat.keys()
  for name in a_flat:
    a, b = np.asarray(a_flat[name]), np.asarray(b_flat[name])
    assert a.dtype == b.dtype, name
    assert a.shape == b.shape, name
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_round_trip_bit_exact(tmp_path, fmt, dtype):
  config = t5.T5Config.preset("t5_1_1_tiny", num_decoder_layers=3, dtype=dtype)
  params = random_params(config)
  path = tmp_path / "checkpoint_7"
  checkpoints.save(path, config, params, format=fmt, step=7)
  assert checkpoints.detect_format(path) == fmt
  loaded_config, loaded = checkpoints.load(path, dtype=dtype)
  assert loaded_config == config
  assert_bit_equal(loaded, params)


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_t5_1_0(tmp_path, fmt):
  """ReLU 'wi' MLP and logits_via_embedding are inferred back (T5X, Orbax) or read (HF)."""
  config = t5.T5Config.preset("t5_tiny")
  params = random_params(config, seed=1)
  checkpoints.save(tmp_path / "ckpt", config, params, format=fmt)
  loaded_config, loaded = checkpoints.load(tmp_path / "ckpt", dtype=jnp.float32)
  assert loaded_config == config
  assert loaded_config.logits_via_embedding and loaded_config.mlp_activations == ("relu",)
  assert_bit_equal(loaded, params)


def test_alternative_paths(tmp_path):
  """T5X: the msgpack file itself; Orbax: the state/ directory itself."""
  config = t5.T5Config.preset("t5_1_1_tiny")
  params = random_params(config)
  checkpoints.save(tmp_path / "t5x", config, params, format="t5x")
  checkpoints.save(tmp_path / "orbax", config, params, format="orbax")
  for path, fmt in ((tmp_path / "t5x" / "checkpoint", "t5x"),
                    (tmp_path / "orbax" / "state", "orbax")):
    assert checkpoints.detect_format(path) == fmt
    _, loaded = checkpoints.load(path, dtype=jnp.float32)
    assert_bit_equal(loaded, params)


@pytest.mark.parametrize("fmt", FORMATS)
def test_cast_on_load(tmp_path, fmt):
  config = t5.T5Config.preset("t5_1_1_tiny")
  params = random_params(config)
  checkpoints.save(tmp_path / "c", config, params, format=fmt)
  loaded_config, loaded = checkpoints.load(tmp_path / "c", dtype=jnp.bfloat16)
  assert loaded_config.dtype == jnp.bfloat16
  assert_bit_equal(loaded, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
  # dtype=None: float32 on the CPU backend the tests run on.
  default_config, default = checkpoints.load(tmp_path / "c")
  assert default_config.dtype == jnp.float32
  assert_bit_equal(default, params)


def test_loaded_model_runs(tmp_path):
  config = t5.T5Config.preset("t5_1_1_tiny")
  params = random_params(config)
  checkpoints.save(tmp_path / "c", config, params, format="t5x")
  loaded_config, loaded = checkpoints.load(tmp_path / "c", dtype=jnp.float32)
  enc = np.array([[4, 5, 6, 1], [7, 1, 0, 0]], np.int32)
  dec = np.array([[0, 3, 9], [0, 2, 2]], np.int32)
  np.testing.assert_array_equal(t5.T5(loaded_config).forward(loaded, enc, dec),
                                t5.T5(config).forward(params, enc, dec))


def test_explicit_config_is_checked(tmp_path):
  config = t5.T5Config.preset("t5_1_1_tiny")
  checkpoints.save(tmp_path / "c", config, random_params(config), format="t5x")
  same, _ = checkpoints.load(tmp_path / "c", config=config, dtype=jnp.float32)
  assert same == config
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"encoder/layers_0/mlp/wi_0/kernel has shape \(32, 64\).*\(32, 96\)"):
    checkpoints.load(tmp_path / "c", config=config.replace(mlp_dim=96))
  with pytest.raises(checkpoints.CheckpointError, match=r"missing parameters: decoder/layers_2/"):
    checkpoints.load(tmp_path / "c", config=config.replace(num_decoder_layers=3))
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"unexpected parameters: decoder/logits_dense/kernel"):
    checkpoints.load(tmp_path / "c", config=config.replace(logits_via_embedding=True))


def test_save_rejects_bad_input(tmp_path):
  config = t5.T5Config.preset("t5_1_1_tiny")
  params = random_params(config)
  assert issubclass(checkpoints.CheckpointError, ValueError)
  with pytest.raises(checkpoints.CheckpointError, match="unknown checkpoint format 'tf'"):
    checkpoints.save(tmp_path / "a", config, params, format="tf")
  bad = jax.tree.map(lambda x: x, params)
  bad["decoder"]["layers_1"]["self_attention"]["key"]["kernel"] = jnp.zeros((32, 16))
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"decoder/layers_1/self_attention/key/kernel has shape \(32, 16\)"):
    checkpoints.save(tmp_path / "b", config, bad)
  checkpoints.save(tmp_path / "c", config, params)
  with pytest.raises(checkpoints.CheckpointError, match="not empty"):
    checkpoints.save(tmp_path / "c", config, params)


def test_load_errors(tmp_path):
  with pytest.raises(checkpoints.CheckpointError, match="does not exist"):
    checkpoints.load(tmp_path / "nowhere")
  (tmp_path / "empty").mkdir()
  with pytest.raises(checkpoints.CheckpointError, match="unknown checkpoint format"):
    checkpoints.detect_format(tmp_path / "empty")
  (tmp_path / "notes.txt").write_text("hello")
  with pytest.raises(checkpoints.CheckpointError, match="unknown checkpoint format"):
    checkpoints.load(tmp_path / "notes.txt")
  (tmp_path / "tf").mkdir()
  (tmp_path / "tf" / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-1000000"\n')
  with pytest.raises(checkpoints.CheckpointError, match="TensorFlow checkpoint"):
    checkpoints.load(tmp_path / "tf")
  with pytest.raises(checkpoints.CheckpointError, match="floating dtype"):
    checkpoints.load(tmp_path / "tf", dtype=jnp.int32)


def test_t5x_layout_matches_t5x(tmp_path):
  """Our msgpack decodes with flax.serialization and its specs open the way T5X opens them."""
  flax_serialization = pytest.importorskip("flax.serialization")
  ts = pytest.importorskip("tensorstore")
  config = t5.T5Config.preset("t5_1_1_tiny")
  params = random_params(config)
  path = tmp_path / "checkpoint_5"
  checkpoints.save(path, config, params, format="t5x", step=5)
  contents = flax_serialization.msgpack_restore((path / "checkpoint").read_bytes())
  assert contents["version"] == 3
  assert int(contents["optimizer"]["state"]["step"]) == 5
  spec = contents["optimizer"]["target"]["encoder"]["layers_0"]["attention"]["query"]["kernel"]
  assert spec["driver"] == "zarr" and spec["dtype"] == "float32"
  # T5X's msgpack holds ts.Spec(spec).to_json(): a trailing '/' and the gzip level.
  assert spec["kvstore"] == {"driver": "file",
                             "path": "target.encoder.layers_0.attention.query.kernel/"}
  assert spec["metadata"]["compressor"] == {"id": "gzip", "level": 1}
  assert list(spec["metadata"]["shape"]) == [32, 32]
  assert spec == ts.Spec(spec).to_json()
  # T5X's reader: drop chunks/compressor, join the relative path with the checkpoint dir.
  spec = ts.Spec(spec).to_json()
  del spec["metadata"]["chunks"], spec["metadata"]["compressor"]
  spec["kvstore"]["path"] = os.path.join(str(path), spec["kvstore"]["path"])
  array = ts.open(spec).result().read().result()
  np.testing.assert_array_equal(
      array, params["encoder"]["layers_0"]["attention"]["query"]["kernel"])
  assert sorted(p.name for p in path.iterdir() if p.is_dir()) == sorted(
      "target." + k.replace("/", ".") for k in common.flatten(params))


def test_chunk_shape():
  assert t5x_legacy.chunk_shape([32128, 4096], 16 * 1024 * 1024) == [4016, 4096]
  assert t5x_legacy.chunk_shape([64, 32], 1 << 20) == [64, 32]
  assert t5x_legacy.chunk_shape([64, 32], 128) == [8, 16]
  assert t5x_legacy.chunk_shape([7], 3) == [1]
  for shape, limit in (([32128, 4096], 1 << 24), ([10240, 4096], 1 << 24), ([96, 36], 100)):
    chunks = t5x_legacy.chunk_shape(shape, limit)
    assert np.prod(chunks) <= limit and all(s % c == 0 for s, c in zip(shape, chunks))


def test_multi_chunk_t5x_write(tmp_path):
  config = t5.T5Config.preset("t5_1_1_tiny")
  params = random_params(config)
  t5x_legacy.write(str(tmp_path), common.flatten(params), step=0, chunk_bytes=512)
  chunks = [f for f in os.listdir(tmp_path / "target.token_embedder.embedding")
            if not f.startswith(".")]
  assert len(chunks) == 16  # [64, 32] float32 in 128-element chunks of [8, 16]
  _, loaded = checkpoints.load(tmp_path, dtype=jnp.float32)
  assert_bit_equal(loaded, params)


@pytest.fixture(scope="module")
def mesh():
  return partitioning.make_mesh("data=2,model=4")


@pytest.mark.parametrize("fmt", FORMATS)
def test_mesh_load_reads_shards(tmp_path, mesh, fmt, monkeypatch):
  config = t5.T5Config.preset("t5_1_1_tiny")
  params = random_params(config)
  checkpoints.save(tmp_path / "c", config, params, format=fmt)
  reads = []
  original = common._read_cast
  monkeypatch.setattr(common, "_read_cast",
                      lambda src, index, dtype: reads.append((src.name, index))
                      or original(src, index, dtype))
  loaded_config, loaded = checkpoints.load(tmp_path / "c", dtype=jnp.float32, mesh=mesh)
  want = common.flatten(partitioning.param_shardings(t5.T5(loaded_config), mesh))
  got = common.flatten(loaded)
  for name, array in got.items():
    assert array.sharding.is_equivalent_to(want[name], array.ndim), name
  assert want["decoder/logits_dense/kernel"].spec == jax.sharding.PartitionSpec(None, "model")
  assert_bit_equal(loaded, params)
  if fmt != "orbax":  # orbax reads its own shards; the others go through _read_cast
    logits_reads = [index for name, index in reads if name == "decoder/logits_dense/kernel"]
    assert len(logits_reads) == 4  # one per model shard, replicas over `data` read once
    assert all(i[1].stop - i[1].start == config.vocab_size // 4 for i in logits_reads)
  # Saving sharded arrays (the T5X writer writes shard by shard) round-trips too.
  checkpoints.save(tmp_path / "resaved", loaded_config, loaded, format=fmt)
  _, reloaded = checkpoints.load(tmp_path / "resaved", dtype=jnp.float32)
  assert_bit_equal(reloaded, params)


def test_mesh_load_with_rules(tmp_path, mesh):
  config = t5.T5Config.preset("t5_1_1_tiny")
  params = random_params(config)
  checkpoints.save(tmp_path / "c", config, params, format="t5x")
  _, loaded = checkpoints.load(tmp_path / "c", dtype=jnp.float32, mesh=mesh,
                               rules=partitioning.data_parallel_rules())
  for array in jax.tree.leaves(loaded):
    assert array.sharding.is_fully_replicated and len(array.sharding.device_set) == 8
  assert_bit_equal(loaded, params)


@pytest.mark.parametrize("preset", ["t5_1_1_small", "t5_1_1_base", "t5_1_1_large", "t5_1_1_xl",
                                    "t5_1_1_xxl", "t5_small", "t5_11b"])
def test_infer_config_of_presets(preset):
  config = t5.T5Config.preset(preset)
  shapes = {k: tuple(v.shape) for k, v in common.flatten(t5.T5(config).param_shapes()).items()}
  assert infer.config_from_shapes(shapes) == config
