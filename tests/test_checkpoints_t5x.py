"""T5X legacy checkpoints written independently of our writer, corrupt checkpoints, msgpack.

`write_t5x_checkpoint` below builds checkpoint_<step>/ with tensorstore and
msgpack directly, in the layout of reference/t5x.md: a msgpack `checkpoint`
file whose leaves are relative TensorStore specs (file- and gcs-style, new and
old spec forms), inline ext-type arrays and a `__msgpack_chunked_array__`
leaf, plus gzip zarr arrays (one split into many chunks).
"""

import os
import shutil

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
import tensorstore as ts

from spec_decode import checkpoints
from spec_decode.checkpoints import common, msgpack_codec, t5x_legacy
from spec_decode.models import t5

CONFIG = t5.T5Config.preset("t5_1_1_tiny", num_decoder_layers=3)
EMBEDDING = "token_embedder/embedding"
GCS_OLD = "decoder/layers_1/self_attention/query/kernel"  # gcs driver, top-level path
GCS_NEW = "encoder/layers_1/mlp/wo/kernel"  # gcs driver with a kvstore path
INLINE = "encoder/encoder_norm/scale"
CHUNKED_INLINE = "decoder/relpos_bias/rel_embedding"


def _ext(obj):
  if isinstance(obj, (np.ndarray, np.generic)):
    arr = np.asarray(obj)
    payload = msgpack.packb((list(arr.shape), arr.dtype.name, arr.tobytes()), use_bin_type=True)
    return msgpack.ExtType(1 if isinstance(obj, np.ndarray) else 3, payload)
  raise TypeError(type(obj))


def _nest(flat):
  tree = {}
  for path, value in flat.items():
    *parents, leaf = path.split("/")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return tree


def write_t5x_checkpoint(directory, params_flat, *, version=3, dtype="float32"):
  """An independent T5X legacy writer (tensorstore + msgpack only)."""
  os.makedirs(directory)
  target = {}
  for name, value in params_flat.items():
    value = np.asarray(value)
    key = "target." + name.replace("/", ".")
    if name == INLINE:
      target[name] = value
      continue
    if name == CHUNKED_INLINE:
      flat = value.reshape(-1)
      target[name] = {"__msgpack_chunked_array__": True,
                      "shape": {str(i): d for i, d in enumerate(value.shape)},
                      "chunks": {str(i): flat[j:j + 40]
                                 for i, j in enumerate(range(0, flat.size, 40))}}
      continue
    chunks = [8, 16] if name == EMBEDDING else list(value.shape)
    metadata = {"compressor": {"id": "gzip"}, "shape": list(value.shape), "chunks": chunks}
    store = ts.open({"driver": "zarr", "dtype": dtype, "metadata": metadata,
                     "kvstore": {"driver": "file", "path": os.path.join(directory, key)}},
                    create=True).result()
    store.write(value.astype(store.dtype.numpy_dtype)).result()
    if name == GCS_OLD:
      spec = {"driver": "zarr", "dtype": dtype, "path": key, "metadata": metadata,
              "kvstore": {"driver": "gcs", "bucket": "t5x-dummy-bucket"}}
    elif name == GCS_NEW:
      spec = {"driver": "zarr", "dtype": dtype, "metadata": metadata,
              "kvstore": {"driver": "gcs", "bucket": "t5x-dummy-bucket", "path": key + "/"}}
    else:
      spec = {"driver": "zarr", "dtype": dtype, "metadata": metadata,
              "kvstore": {"driver": "file", "path": key}}
    target[name] = spec
  # Optimizer state pointing at arrays that were never written: the reader must not open them.
  missing_slot = {"driver": "zarr", "dtype": "float32",
                  "kvstore": {"driver": "file", "path": "state.param_states.v_row"},
                  "metadata": {"compressor": {"id": "gzip"}, "shape": [4], "chunks": [4]}}
  state = {"target": _nest(target),
           "state": {"step": np.asarray(1000000, np.int32),
                     "param_states": {"token_embedder": {"embedding": {"v_row": missing_slot}}}}}
  contents = state if version == 0 else {"version": version, "optimizer": state}
  with open(os.path.join(directory, "checkpoint"), "wb") as f:
    f.write(msgpack.packb(contents, default=_ext, use_bin_type=True))


@pytest.fixture(scope="module")
def params():
  return common.flatten(t5.T5(CONFIG).init(jax.random.PRNGKey(3)))


@pytest.mark.parametrize("version", [0, 3])
def test_reads_independent_checkpoint(tmp_path, params, version, caplog):
  path = str(tmp_path / "checkpoint_1000000")
  write_t5x_checkpoint(path, params, version=version)
  assert len([f for f in os.listdir(os.path.join(path, "target.token_embedder.embedding"))
              if not f.startswith(".")]) == 16
  assert checkpoints.detect_format(path) == "t5x"
  for where in (path, os.path.join(path, "checkpoint")):
    config, loaded = checkpoints.load(where, dtype=jnp.float32)
    assert config == CONFIG
    loaded = common.flatten(loaded)
    assert loaded.keys() == params.keys()
    for name in params:
      np.testing.assert_array_equal(loaded[name], params[name], err_msg=name)
  assert "absent" not in caplog.text


def test_reads_bfloat16_arrays(tmp_path, params):
  path = str(tmp_path / "ckpt")
  write_t5x_checkpoint(path, params, dtype="bfloat16")
  config, loaded = checkpoints.load(path, dtype=jnp.bfloat16)
  assert config.dtype == jnp.bfloat16
  loaded = common.flatten(loaded)
  for name in (EMBEDDING, GCS_OLD, "decoder/logits_dense/kernel"):
    np.testing.assert_array_equal(np.asarray(loaded[name]).view(np.uint16),
                                  np.asarray(params[name].astype(jnp.bfloat16)).view(np.uint16))


def test_resolve_spec():
  local = {"driver": "zarr", "dtype": "float32", "kvstore": {"driver": "file", "path": "target.a"},
           "metadata": {"shape": [2], "chunks": [2], "compressor": {"id": "gzip"}}}
  gcs_old = {"driver": "zarr", "path": "target.a",
             "kvstore": {"driver": "gcs", "bucket": "t5x-dummy-bucket"}}
  for spec in (local, gcs_old):
    assert t5x_legacy.resolve_spec(spec, "gs://my-bucket/models/checkpoint_5") == {
        "driver": "zarr",
        "kvstore": {"driver": "gcs", "bucket": "my-bucket",
                    "path": "models/checkpoint_5/target.a"}}
    assert t5x_legacy.resolve_spec(spec, "/data/checkpoint_5") == {
        "driver": "zarr", "kvstore": {"driver": "file", "path": "/data/checkpoint_5/target.a"}}
  with pytest.raises(checkpoints.CheckpointError, match="kvstore driver 's3'"):
    t5x_legacy.resolve_spec({"driver": "zarr", "kvstore": {"driver": "s3", "path": "x"}}, "/d")


def test_msgpack_codec_round_trip():
  tree = {"a": np.arange(10, dtype=np.float32).reshape(2, 5),
          "b": {"c": np.asarray(3, np.int32), "d": np.int64(7), "e": "text", "f": [1, 2.5]},
          "g": np.arange(6, dtype=np.float32).reshape(2, 3).astype(jnp.bfloat16),
          "big": np.arange(1000, dtype=np.float32).reshape(10, 100)}
  data = msgpack_codec.encode(tree, max_inline_bytes=1000)
  raw = msgpack.unpackb(data, strict_map_key=False)
  assert raw["big"]["__msgpack_chunked_array__"] and len(raw["big"]["chunks"]) == 4
  out = msgpack_codec.decode(data)
  for key in ("a", "g", "big"):
    assert out[key].dtype == tree[key].dtype
    np.testing.assert_array_equal(out[key], tree[key])
  assert out["b"]["c"].shape == () and int(out["b"]["c"]) == 3
  assert isinstance(out["b"]["d"], np.int64) and out["b"]["d"] == 7
  assert out["b"]["e"] == "text" and out["b"]["f"] == [1, 2.5]
  flax_serialization = pytest.importorskip("flax.serialization")  # the same wire format
  np.testing.assert_array_equal(flax_serialization.msgpack_restore(data)["big"], tree["big"])
  np.testing.assert_array_equal(
      msgpack_codec.decode(flax_serialization.msgpack_serialize({"x": tree["a"]}))["x"],
      tree["a"])


# ---------------------------------------------------------------- corrupt checkpoints
@pytest.fixture
def saved(tmp_path):
  params = t5.T5(CONFIG).init(jax.random.PRNGKey(0))
  path = tmp_path / "checkpoint_0"
  checkpoints.save(path, CONFIG, params, format="t5x")
  return path


def test_truncated_chunk(saved):
  chunk = saved / "target.decoder.logits_dense.kernel" / "0.0"
  data = chunk.read_bytes()
  chunk.write_bytes(data[: len(data) // 2])
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"parameter target/decoder/logits_dense/kernel: reading .* failed"):
    checkpoints.load(saved)


def test_missing_chunk_is_an_error_unless_allowed(saved, caplog):
  """Zarr reads an absent chunk as zeros (alpha fell from 0.83 to 0.39): refuse, unless allowed."""
  os.remove(saved / "target.decoder.logits_dense.kernel" / "0.0")
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"target/decoder/logits_dense/kernel: 1 of 1 chunk files are absent .*"
                           r"copy the checkpoint again, or pass allow_missing_chunks=True"):
    checkpoints.load(saved, dtype=jnp.float32)
  _, params = checkpoints.load(saved, dtype=jnp.float32, allow_missing_chunks=True)
  assert "decoder/logits_dense/kernel: 1 of 1 chunks are absent" in caplog.text
  assert not np.any(np.asarray(params["decoder"]["logits_dense"]["kernel"]))


def test_writer_stores_all_zero_chunks(tmp_path):
  """Our own checkpoints are complete even where a chunk is all zeros."""
  params = jax.tree.map(jnp.zeros_like, t5.T5(CONFIG).init(jax.random.PRNGKey(0)))
  path = tmp_path / "zeros"
  checkpoints.save(path, CONFIG, params, format="t5x")
  assert os.listdir(path / "target.decoder.logits_dense.kernel") != [".zarray"]
  _, loaded = checkpoints.load(path, dtype=jnp.float32)  # no absent chunks: no error
  assert not np.any(np.asarray(loaded["decoder"]["logits_dense"]["kernel"]))


@pytest.mark.parametrize("bad", ["/etc/target.a", "../other/target.a", "a/../../x",
                                 "gs://elsewhere/x"])
def test_spec_paths_outside_the_checkpoint_are_refused(bad):
  spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": bad}}
  with pytest.raises(checkpoints.CheckpointError, match="lies outside the checkpoint"):
    t5x_legacy.resolve_spec(spec, "/data/checkpoint_5")
  if not bad.startswith("gs://"):
    allowed = t5x_legacy.resolve_spec(spec, "/data/checkpoint_5", allow_outside_paths=True)
    assert allowed["kvstore"]["driver"] == "file"


def test_loading_refuses_an_outside_spec_path(saved, tmp_path):
  """A msgpack whose spec points at ../ is refused before anything is read."""
  from spec_decode.checkpoints import msgpack_codec
  file = saved / "checkpoint"
  tree = msgpack_codec.decode(file.read_bytes())
  leaf = tree["optimizer"]["target"]["decoder"]["logits_dense"]["kernel"]
  shutil.move(saved / leaf["kvstore"]["path"], tmp_path / "stolen")
  leaf["kvstore"]["path"] = "../stolen"
  file.write_bytes(msgpack_codec.encode(tree))
  with pytest.raises(checkpoints.CheckpointError, match="'../stolen', which lies outside"):
    checkpoints.load(saved)
  _, params = checkpoints.load(saved, dtype=jnp.float32, allow_outside_paths=True)
  assert params["decoder"]["logits_dense"]["kernel"].shape == (CONFIG.emb_dim, CONFIG.vocab_size)


def test_gcs_without_network_times_out_with_a_clear_error(monkeypatch):
  """No network here: the GCS driver would retry for minutes; the loader gives up in time."""
  import time
  from spec_decode.checkpoints import storage
  monkeypatch.setattr(storage, "GCS_TIMEOUT_S", 1.0)
  start = time.monotonic()
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"no answer from Google Cloud Storage within 1 s while .* "
                           r"gs://spec-decode-test-bucket/ckpt.*Copy the checkpoint"):
    checkpoints.load("gs://spec-decode-test-bucket/ckpt/checkpoint_1")
  assert time.monotonic() - start < 30


def test_missing_array_directory(saved):
  shutil.rmtree(saved / "target.encoder.layers_1.attention.value.kernel")
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"target/encoder/layers_1/attention/value/kernel: cannot open"):
    checkpoints.load(saved)


def test_array_shape_disagrees_with_spec(saved):
  name = "target.decoder.layers_0.mlp.wo.kernel"
  shutil.rmtree(saved / name)
  ts.open({"driver": "zarr", "dtype": "float32",
           "kvstore": {"driver": "file", "path": str(saved / name)},
           "metadata": {"shape": [64, 16], "chunks": [64, 16]}}, create=True).result()
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"decoder/layers_0/mlp/wo/kernel: the msgpack spec says shape "
                           r"\(64, 32\) but the array .* has shape \(64, 16\)"):
    checkpoints.load(saved)


def test_wrong_shape_in_checkpoint(tmp_path, params):
  bad = dict(params)
  bad["decoder/layers_2/encoder_decoder_attention/out/kernel"] = np.zeros((32, 24), np.float32)
  write_t5x_checkpoint(str(tmp_path / "c"), bad)
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"decoder/layers_2/encoder_decoder_attention/out/kernel has shape "
                           r"\(32, 24\) but the config expects \(32, 32\)"):
    checkpoints.load(tmp_path / "c")


def test_missing_parameter(tmp_path, params):
  partial = {k: v for k, v in params.items() if k != "encoder/layers_1/mlp/wi_1/kernel"}
  write_t5x_checkpoint(str(tmp_path / "c"), partial)
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"missing parameters: encoder/layers_1/mlp/wi_1/kernel"):
    checkpoints.load(tmp_path / "c")


def test_corrupt_msgpack_and_missing_target(tmp_path):
  (tmp_path / "a").mkdir()
  (tmp_path / "a" / "checkpoint").write_bytes(b"\x82\xa7version\x03\xa9optimizer\xc1\xff")
  with pytest.raises(checkpoints.CheckpointError, match="not a readable msgpack checkpoint"):
    checkpoints.load(tmp_path / "a")
  (tmp_path / "b").mkdir()
  (tmp_path / "b" / "checkpoint").write_bytes(
      msgpack.packb({"version": 3, "optimizer": {"state": {}}}))
  with pytest.raises(checkpoints.CheckpointError, match="has no 'target' parameter tree"):
    checkpoints.load(tmp_path / "b")


def test_model_spec_passes_allow_missing_chunks_and_records_it(saved):
  from spec_decode.experiment import model_specs
  os.remove(saved / "target.decoder.logits_dense.kernel" / "0.0")
  spec = model_specs.ModelSpec(checkpoint=str(saved), dtype="float32")
  assert "allow_missing_chunks" not in spec.to_json()
  with pytest.raises(checkpoints.CheckpointError, match="chunk files are absent"):
    model_specs.load(spec, model_specs.LoadContext("target"))
  allowed = model_specs.ModelSpec(checkpoint=str(saved), dtype="float32",
                                  allow_missing_chunks=True)
  model_specs.load(allowed, model_specs.LoadContext("target"))
  assert allowed.to_json()["allow_missing_chunks"] is True
  with pytest.raises(ValueError, match="allow_missing_chunks must be True or False"):
    model_specs.ModelSpec(checkpoint=str(saved), allow_missing_chunks="yes")
