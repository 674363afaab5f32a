"""The weight-streaming CPU decoding kernel (spec_decode/kernels/cpu_matmul)."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import float64_reference as f64
from spec_decode import decoding
from spec_decode.kernels import cpu_matmul
from spec_decode.models import base, t5

HAVE_COMPILER = shutil.which("g++") is not None or shutil.which("c++") is not None
needs_kernel = pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler to build the kernel")


@needs_kernel
def test_kernel_builds_on_cpu():
  assert cpu_matmul.available(), cpu_matmul.unavailable_reason()
  assert cpu_matmul.unavailable_reason() is None


# Instruction sets the kernel's source must build for, whatever CPU runs the tests: the
# machines it meets range from AVX2-only EPYCs to Xeons with AVX512-BF16 and AMX, and
# `-march=native` builds only the host's variants, so a variant that breaks another
# CPU's build would pass here unseen.
ISA_FLAGS = {
    "x86-64 (vector extensions only)": ["-march=x86-64"],
    "AVX2 + FMA": ["-march=x86-64-v3"],
    "AVX-512": ["-march=x86-64-v4"],
    "AVX-512 + AVX512-BF16": ["-march=x86-64-v4", "-mavx512bf16"],
}


@needs_kernel
@pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="x86 flags")
@pytest.mark.parametrize("isa", list(ISA_FLAGS))
def test_kernel_source_builds_for_every_x86_instruction_set(isa):
  compiler = shutil.which("g++") or shutil.which("c++")
  flags = [f for f in cpu_matmul._FLAGS if f not in ("-march=native", "-shared", "-fPIC")]
  result = subprocess.run(
      [compiler, *flags, *ISA_FLAGS[isa], "-fsyntax-only", f"-I{jax.ffi.include_dir()}",
       str(cpu_matmul._SOURCE)], capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]


def test_pack_round_trip_and_layout():
  w = np.arange(24 * 40, dtype=np.float32).reshape(24, 40)
  p = cpu_matmul.pack(w)
  assert p.panels.shape == (3, 24, 16) and p.shape == (24, 40) and p.n == 40
  np.testing.assert_array_equal(np.asarray(p.panels[1, 5]), w[5, 16:32])
  np.testing.assert_array_equal(np.asarray(p.panels[2, 0, 8:]), 0)  # zero padding past N
  np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack(p)), w)
  with pytest.raises(ValueError, match="float32"):
    cpu_matmul.pack(w.astype(np.float16))
  with pytest.raises(ValueError, match=r"\[K, N\]"):
    cpu_matmul.pack(w[0])


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 8, 9, 13, 40])
@pytest.mark.parametrize("k,n", [(33, 50), (64, 16), (256, 200)])
def test_matmul_matches_numpy(m, k, n):
  rng = np.random.default_rng(m * 1000 + k + n)
  x = rng.standard_normal((2, m, k)).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  got = np.asarray(jax.jit(cpu_matmul.matmul)(x, cpu_matmul.pack(w)))
  want = x.astype(np.float64) @ w.astype(np.float64)
  assert got.shape == (2, m, n)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@needs_kernel
def test_rows_do_not_depend_on_their_neighbours(monkeypatch):
  """A row's product is the same bits alone, in a verify-sized call and in a large one,
  with one thread or several: accumulation over k is in order for every output."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((23, 512)).astype(np.float32)
  w = cpu_matmul.pack(rng.standard_normal((512, 1024)).astype(np.float32) / 20)
  full = np.asarray(jax.jit(cpu_matmul.matmul)(x, w))
  for rows in (slice(0, 1), slice(3, 8), slice(7, 18)):
    part = np.asarray(jax.jit(cpu_matmul.matmul)(x[rows], w))
    np.testing.assert_array_equal(part, full[rows])
  monkeypatch.setenv(cpu_matmul.ENV_THREADS, "1")
  one_thread = np.asarray(jax.jit(lambda a, b: cpu_matmul.matmul(a, b))(x, w))
  np.testing.assert_array_equal(one_thread, full)
  monkeypatch.setenv(cpu_matmul.ENV_THREADS, "zero")
  with pytest.raises(ValueError, match=cpu_matmul.ENV_THREADS):
    jax.jit(lambda a, b: cpu_matmul.matmul(a, b))(x, w)


@needs_kernel
def test_joined_kernels_give_the_separate_products_bit_for_bit():
  rs = np.random.RandomState(5)
  w = [rs.normal(size=(40, n)).astype(np.float32) for n in (24, 40, 7)]
  x = jnp.asarray(rs.normal(size=(6, 40)).astype(np.float32))
  joined = np.asarray(cpu_matmul.matmul(x, cpu_matmul.pack(np.concatenate(w, axis=1))))
  separate = np.concatenate([np.asarray(cpu_matmul.matmul(x, cpu_matmul.pack(k))) for k in w],
                            axis=1)
  np.testing.assert_array_equal(joined, separate)


@needs_kernel
def test_t5_joins_projections_of_one_input(pack_small):
  model, params = _mini()
  packed = model.decode_params(params)
  for block in (packed["encoder"]["layers_0"]["attention"],
                packed["decoder"]["layers_1"]["self_attention"]):
    assert sorted(block) == ["out", t5.JOINED[("query", "key", "value")]]
    assert block["qkv_joined"]["kernel"].shape == (96, 3 * 64)
  cross = packed["decoder"]["layers_1"]["encoder_decoder_attention"]
  assert sorted(cross) == [t5.JOINED[("key", "value")], "out", "query"]
  assert model.decode_params(packed) is packed


@needs_kernel
def test_matmul_refuses_a_feature_mismatch():
  w = cpu_matmul.pack(np.ones((8, 16), np.float32))
  with pytest.raises(ValueError, match="7 features, the kernel wants 8"):
    cpu_matmul.matmul(jnp.ones((2, 7)), w)


def _check_kernel_and_xla_dots(model, packed, params, enc, dec):
  """The model's logits with packed kernels (the CPU kernel) and with XLA's dots: each
  within float32 rounding of the float64 run (tests/float64_reference.py)."""
  ref64, noise = f64.t5_float64_reference(model.config, params, enc, dec)
  kernel, dots = (np.asarray(model.forward(p, enc, dec)) for p in (packed, params))
  f64.assert_float32_rounding(kernel, ref64, noise, "CPU kernel", others=[("XLA dots", dots)])
  f64.assert_float32_rounding(dots, ref64, noise, "XLA dots", others=[("CPU kernel", kernel)])


@pytest.fixture
def pack_small(monkeypatch):
  """Pack even the tests' small models (by default only large ones are packed)."""
  monkeypatch.setattr(cpu_matmul, "MIN_PACKED_ELEMENTS", 0)


def _mini(**overrides):
  model = t5.T5(t5.T5Config.preset("t5_1_1_mini", vocab_size=100, emb_dim=96, mlp_dim=200,
                                   **overrides))
  return model, model.init(jax.random.PRNGKey(0))


@needs_kernel
def test_small_models_keep_xla_dots():
  model = t5.T5(t5.T5Config.preset("t5_1_1_tiny"))  # 32 x 64 at most: below 2**12 elements
  params = model.init(jax.random.PRNGKey(0))
  assert model.decode_params(params) is params
  model, params = _mini()  # 96 x 200 at most: packed by default, not above a larger threshold
  assert model.decode_params(params) is not params
  bigger = dataclasses.replace(model, packed_min_elements=96 * 200 + 1)
  assert bigger.decode_params(params) is params


def test_packed_min_elements_is_checked():
  config = t5.T5Config.preset("t5_1_1_tiny")
  for bad in (-1, 1.5, True, "4096"):
    with pytest.raises(ValueError, match="packed_min_elements"):
      t5.T5(config, packed_min_elements=bad)


@needs_kernel
def test_only_large_kernels_are_packed(monkeypatch):
  model, params = _mini()
  monkeypatch.setattr(cpu_matmul, "MIN_PACKED_ELEMENTS", 96 * 200)  # the MLP's, not attention's
  packed = model.decode_params(params)
  layer = packed["decoder"]["layers_0"]
  # The gated MLP's two input kernels are joined into one packed kernel [96, 400].
  assert sorted(layer["mlp"]) == [t5.JOINED_MLP, "wo"]
  assert layer["mlp"][t5.JOINED_MLP]["kernel"].shape == (96, 400)
  assert isinstance(layer["mlp"]["wo"]["kernel"], cpu_matmul.PackedKernel)
  # Attention's q/k/v (3 x 96 x 64 = 18432 elements joined) stay separate XLA dots.
  assert not isinstance(layer["self_attention"]["query"]["kernel"], cpu_matmul.PackedKernel)
  assert model.decode_params(packed) is packed  # a packed tree is not packed again
  enc = jax.random.randint(jax.random.PRNGKey(1), (2, 7), 2, 100)
  dec = jax.random.randint(jax.random.PRNGKey(2), (2, 5), 2, 100)
  _check_kernel_and_xla_dots(model, packed, params, enc, dec)


@needs_kernel
def test_t5_decode_params_packs_once_and_keeps_the_function(pack_small):
  model, params = _mini()
  packed = model.decode_params(params)
  assert model.decode_params(params) is packed  # cached by the leaves' identity
  kernel = packed["decoder"]["layers_1"]["mlp"]["wo"]["kernel"]
  assert isinstance(kernel, cpu_matmul.PackedKernel) and kernel.shape == (200, 96)
  assert not isinstance(packed["token_embedder"]["embedding"], cpu_matmul.PackedKernel)
  np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack(kernel)),
                                np.asarray(params["decoder"]["layers_1"]["mlp"]["wo"]["kernel"]))
  enc = jax.random.randint(jax.random.PRNGKey(1), (3, 9), 2, 100)
  dec = jax.random.randint(jax.random.PRNGKey(2), (3, 6), 2, 100)
  _check_kernel_and_xla_dots(model, packed, params, enc, dec)
  # Another tree (same values, new arrays) is packed anew; models without the hook pass through.
  other = jax.tree_util.tree_map(jnp.array, params)
  assert model.decode_params(other) is not packed
  assert base.decoding_params(object(), params) is params
  assert base.decoding_params(model, None) is None


def test_t5_decode_params_leaves_streamed_and_bfloat16_params_alone(pack_small):
  model, params = _mini()
  assert t5.T5(model.config, stream_params=True).decode_params(params) is params
  bf16 = t5.T5(model.config.replace(dtype=jnp.bfloat16))
  assert bf16.decode_params(params) is params


@needs_kernel
def test_speculative_equals_autoregressive_with_packed_kernels(pack_small):
  target, tparams = _mini()
  draft = t5.T5(t5.T5Config.preset("t5_1_1_tiny", vocab_size=100))
  dparams = draft.init(jax.random.PRNGKey(3))
  enc = jax.random.randint(jax.random.PRNGKey(4), (4, 11), 2, 100)
  ar = decoding.run(decoding.Autoregressive(), target, tparams, enc, max_decode_len=16)
  spec = decoding.run(decoding.Speculative(gamma=4), target, tparams, enc, draft=draft,
                      draft_params=dparams, max_decode_len=16)
  np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
  hlo = jax.jit(lambda p, e: target.forward(p, e, e)).lower(
      target.decode_params(tparams), enc).as_text()
  assert "spec_decode_small_m_matmul" in hlo


def _python(code: str, **env) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env={**os.environ, "JAX_PLATFORMS": "cpu", **env}, timeout=300)


_PROBE = """
import jax
from spec_decode.kernels import cpu_matmul
from spec_decode.models import t5
cpu_matmul.MIN_PACKED_ELEMENTS = 0
m = t5.T5(t5.T5Config.preset("t5_1_1_tiny"))
p = m.init(jax.random.PRNGKey(0))
print(cpu_matmul.available(), m.decode_params(p) is p, cpu_matmul.unavailable_reason())
"""


def test_disabled_by_environment():
  out = _python(_PROBE, SPEC_DECODE_CPU_KERNELS="0")
  assert out.returncode == 0, out.stderr
  assert out.stdout.startswith("False True disabled by SPEC_DECODE_CPU_KERNELS"), out.stdout


def test_a_failing_compiler_falls_back_to_xla_dots(tmp_path):
  out = _python(_PROBE, CXX="/bin/false", SPEC_DECODE_KERNEL_CACHE=str(tmp_path))
  assert out.returncode == 0, out.stderr
  assert out.stdout.startswith("False True /bin/false failed on cpu_matmul.cc"), out.stdout
  assert "using XLA dots" in out.stderr
  assert not list(tmp_path.iterdir())  # no partial library left behind


def test_pack_cache_evicts_and_tracks_identity():
  cache = cpu_matmul.PackCache(size=2)
  calls = []
  make = lambda tree: calls.append(1) or {"packed": tree}
  trees = [{"w": jnp.full((2,), i, jnp.float32)} for i in range(3)]
  first = cache.get(trees[0], make)
  assert cache.get(trees[0], make) is first and len(calls) == 1
  cache.get(trees[1], make)
  cache.get(trees[2], make)  # evicts trees[0], the least recently used
  cache.get(trees[0], make)
  assert len(calls) == 4


# ---------------------------------------------------------------- variants and weight types
def _operands(m, k, n, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((m, k)).astype(np.float32)
  # bfloat16 values held in float32: the float32 and bfloat16 panels hold the same numbers
  w = rng.standard_normal((k, n)).astype(jnp.bfloat16).astype(np.float32)
  return x, w


def test_tuning_rows():
  # few rows each timed at their count (the kernel's blocks differ by count), more rows in
  # power-of-two buckets timed at the top, all buckets above TUNE_MAX_ROWS as one
  assert [cpu_matmul.tuning_rows(m) for m in (0, 1, 5, 8, 16)] == [1, 1, 5, 8, 16]
  assert [cpu_matmul.tuning_rows(m) for m in (17, 32, 33, 40, 160)] == [32, 32, 64, 64, 256]
  assert cpu_matmul.tuning_rows(10 ** 6) == cpu_matmul.TUNE_MAX_ROWS


def test_variant_names_and_codes():
  # every width with each option (full blocks first, registers, prefetch), one code each
  names = [f"{w}{o}" for w in (8, 16) for o in cpu_matmul.VARIANT_OPTIONS]
  assert names == ["8", "8p", "8r", "8rp", "8f", "8fp", "8fr", "8frp",
                   "16", "16p", "16r", "16rp", "16f", "16fp", "16fr", "16frp"]
  codes = [cpu_matmul._variant_code(v) for v in names]
  assert codes == list(range(64, 72)) + list(range(128, 136))
  assert [cpu_matmul.variant_width(v) for v in names] == [8] * 8 + [16] * 8


def test_row_blocks_and_the_variants_the_tuner_times():
  # as even as possible, or full blocks first; the tuner skips an 'f' variant where both
  # split the rows alike (one code path)
  assert cpu_matmul.row_blocks(8, "8r") == (4, 4) and cpu_matmul.row_blocks(8, "8fr") == (6, 2)
  assert cpu_matmul.row_blocks(13, "8") == (5, 4, 4)
  assert cpu_matmul.row_blocks(13, "8f") == (6, 6, 1)
  assert cpu_matmul.row_blocks(13, "16p") == (7, 6)
  assert cpu_matmul.row_blocks(13, "16fp") == (12, 1)
  for m in (1, 5, 6, 12, 40):
    for v in ("8", "8f", "16fp"):
      assert sum(cpu_matmul.row_blocks(m, v)) == m
  names = ("8", "8p", "8f", "8fp", "16", "16f")
  assert cpu_matmul.distinct_variants(5, names) == ("8", "8p", "16")
  assert cpu_matmul.distinct_variants(8, names) == ("8", "8p", "8f", "8fp", "16")
  assert cpu_matmul.distinct_variants(13, names) == names
  assert cpu_matmul.distinct_variants(12, names) == ("8", "8p", "16")


@needs_kernel
def test_the_kernel_reads_the_width_from_every_code():
  # the C side decodes the same code: a width this build lacks is refused with each option
  x, w = _operands(2, 32, 16)
  p = cpu_matmul.pack(w, "float32")
  for option in cpu_matmul.VARIANT_OPTIONS:
    for width in (8, 16):
      variant = f"{width}{option}"
      if width in cpu_matmul.widths():
        np.testing.assert_allclose(
            cpu_matmul.raw_matmul(x, np.asarray(p.panels), None, p.n, variant), x @ w,
            rtol=1e-5, atol=1e-5)
      else:
        with pytest.raises(ValueError, match=f"variant {variant} "):
          cpu_matmul.raw_matmul(x, np.asarray(p.panels), None, p.n, variant)


@needs_kernel
@pytest.mark.parametrize("m", [1, 3, 5, 8, 9, 13, 40, 160])  # 3, 9: blocks of 3 rows x 2 panels
def test_bfloat16_panels_give_the_float32_bits_in_every_variant(m):
  x, w = _operands(m, 96, 200, seed=m)
  want = None
  for variant in cpu_matmul.variants():
    for weights in ("float32", "bfloat16"):
      p = cpu_matmul.pack(w, weights)
      assert p.dtype == jnp.dtype(weights)
      got = cpu_matmul.raw_matmul(x, np.asarray(p.panels), None, p.n, variant)
      want = got if want is None else want
      np.testing.assert_array_equal(got, want, err_msg=f"variant {variant}, {weights}")
  np.testing.assert_allclose(want, x.astype(np.float64) @ w.astype(np.float64),
                             rtol=1e-5, atol=1e-5 * np.sqrt(96))


@needs_kernel
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8"])
def test_every_weight_type_through_xla_keeps_rows_independent(weights):
  x, w = _operands(23, 512, 1030, seed=1)
  p = cpu_matmul.pack(w, weights)
  full = np.asarray(jax.jit(cpu_matmul.matmul)(x, p))
  for rows in (slice(0, 1), slice(3, 8), slice(7, 18)):
    np.testing.assert_array_equal(np.asarray(jax.jit(cpu_matmul.matmul)(x[rows], p)),
                                  full[rows])
  # the raw entry point (one thread, no XLA) computes the same bits in every variant
  for variant in cpu_matmul.variants():
    np.testing.assert_array_equal(
        cpu_matmul.raw_matmul(x, np.asarray(p.panels),
                              None if p.scales is None else np.asarray(p.scales), p.n, variant),
        full)
  # against float64 with the weights the kernel multiplies by (int8: q * scale)
  w_used = np.asarray(cpu_matmul.unpack(p), np.float64)
  np.testing.assert_allclose(full, x.astype(np.float64) @ w_used, rtol=1e-5,
                             atol=1e-5 * np.sqrt(512))


def test_int8_packing_quantizes_per_column():
  w = np.random.default_rng(2).standard_normal((64, 40)).astype(np.float32)
  w[:, 3] = 0  # an all-zero column keeps a usable scale
  p = cpu_matmul.pack(w, "int8")
  assert p.panels.dtype == jnp.int8 and p.scales.shape == (48,)
  np.testing.assert_allclose(np.asarray(p.scales)[:40], np.maximum(np.abs(w).max(0) / 127,
                                                                    (w == 0).all(0) * 1.0),
                             rtol=1e-6)
  back = np.asarray(cpu_matmul.unpack(p))
  assert np.all(np.abs(back - w) <= np.asarray(p.scales)[:40] / 2 + 1e-7)
  assert not np.any(back[:, 3])
  with pytest.raises(ValueError, match="weights must be one of"):
    cpu_matmul.pack(w, "int4")


def test_auto_packs_bfloat16_values_as_bfloat16():
  _, w = _operands(1, 32, 48)
  assert cpu_matmul.pack(w, "auto").dtype == jnp.bfloat16
  assert cpu_matmul.pack(w + 1e-3, "auto").dtype == jnp.float32


@needs_kernel
def test_t5_kernel_weights(pack_small):
  model, params = _mini()
  enc = jax.random.randint(jax.random.PRNGKey(1), (2, 7), 2, 100)
  dec = jax.random.randint(jax.random.PRNGKey(2), (2, 5), 2, 100)
  wo = lambda p: p["decoder"]["layers_0"]["mlp"]["wo"]["kernel"]
  assert wo(model.decode_params(params)).dtype == jnp.float32  # float32 values: 'auto' keeps them
  # A checkpoint stored in bfloat16 (values exact in bfloat16), decoded in float32:
  stored = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
  auto = model.decode_params(stored)
  assert wo(auto).dtype == jnp.bfloat16
  forced = t5.T5(model.config, kernel_weights="float32").decode_params(stored)
  assert wo(forced).dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(model.forward(auto, enc, dec)),
                                np.asarray(model.forward(forced, enc, dec)))
  # int8 is an option; each setting packs its own copy of the same tree
  int8 = t5.T5(model.config, kernel_weights="int8")
  assert wo(int8.decode_params(stored)).dtype == jnp.int8
  assert model.decode_params(stored) is auto
  with pytest.raises(ValueError, match="kernel_weights must be one of"):
    t5.T5(model.config, kernel_weights="fp8")


@needs_kernel
def test_model_spec_kernel_weights(pack_small, tmp_path):
  """`ModelSpec.kernel_weights` and `setup_kernel_weights` reach the loaded T5 (random or
  from a checkpoint), are recorded in config.json only when set, and are refused where they
  could have no effect."""
  from spec_decode import checkpoints
  from spec_decode.experiment import model_specs
  shape = dict(vocab_size=100, emb_dim=96, mlp_dim=200)
  model, params = _mini()
  path = str(tmp_path / "ckpt")
  checkpoints.save(path, model.config, params, format="t5x")
  wo = lambda p: p["decoder"]["layers_0"]["mlp"]["wo"]["kernel"]
  for spec in (model_specs.ModelSpec(preset="t5_1_1_mini", config=shape, kernel_weights="int8"),
               model_specs.ModelSpec(checkpoint=path, kernel_weights="int8")):
    loaded, p = model_specs.load(spec, model_specs.LoadContext("target"))
    assert loaded.kernel_weights == "int8" and wo(loaded.decode_params(p)).dtype == jnp.int8
    assert spec.to_json()["kernel_weights"] == "int8"
  for field in ("kernel_weights", "setup_kernel_weights"):
    spec = model_specs.ModelSpec(checkpoint=path, **{field: "bfloat16_dot_if_supported"})
    loaded, _ = model_specs.load(spec, model_specs.LoadContext("target"))
    assert getattr(loaded, field) == "bfloat16_dot_if_supported"
    assert spec.to_json()[field] == "bfloat16_dot_if_supported"
  plain, _ = model_specs.load(model_specs.ModelSpec(checkpoint=path),
                              model_specs.LoadContext("target"))
  for field, value, default in (("kernel_weights", "int8", "auto"),
                                ("setup_kernel_weights", "bfloat16_dot", "same")):
    assert getattr(plain, field) == default  # and recorded only when set
    assert field not in model_specs.ModelSpec(checkpoint=path).to_json()
    with pytest.raises(ValueError, match=f"{field} must be one of"):
      model_specs.ModelSpec(checkpoint=path, **{field: "fp8"})
    with pytest.raises(ValueError, match="'ngram' model has no such weights"):
      model_specs.ModelSpec(kind="ngram", **{field: value})


@needs_kernel
def test_variant_override_and_tuning_cache(tmp_path, monkeypatch):
  monkeypatch.setenv(cpu_matmul.ENV_CACHE, str(tmp_path))
  monkeypatch.delenv(cpu_matmul.ENV_VARIANT, raising=False)  # conftest fixes it for the suite
  monkeypatch.setattr(cpu_matmul, "_CHOSEN", {})
  monkeypatch.setattr(cpu_matmul, "TUNE_STREAM_BYTES", 1 << 20)
  variant = cpu_matmul.chosen_variant(3, 96, 200, jnp.bfloat16)
  assert variant in cpu_matmul.variants()
  # measured once, then read back from the cache file
  saved = json.loads(next(tmp_path.glob("variants_*.json")).read_text())
  assert saved == {"3x96x200:bfloat16": variant}  # few rows: timed at their own count
  monkeypatch.setattr(cpu_matmul, "_CHOSEN", {})
  monkeypatch.setattr(cpu_matmul, "time_variants", None)  # a second measurement would fail
  assert cpu_matmul.chosen_variant(3, 96, 200, jnp.bfloat16) == variant
  monkeypatch.setenv(cpu_matmul.ENV_VARIANT, "8")
  assert cpu_matmul.chosen_variant(3, 96, 200, jnp.bfloat16) == "8"
  monkeypatch.setenv(cpu_matmul.ENV_VARIANT, "12")
  with pytest.raises(ValueError,
                     match=f"{cpu_matmul.ENV_VARIANT} must be one of 8, 8p, 8r, 8rp, 8f, .*, 16"):
    cpu_matmul.chosen_variant(3, 96, 200, jnp.float32)
  if 16 not in cpu_matmul.widths():
    monkeypatch.setenv(cpu_matmul.ENV_VARIANT, "16p")
    with pytest.raises(ValueError, match="has variants"):
      cpu_matmul.chosen_variant(3, 96, 200, jnp.float32)


@needs_kernel
def test_tuner_interleaves_variants_so_a_burst_of_load_does_not_decide(tmp_path, monkeypatch):
  # '8' takes 1.0 s a sweep, '8p' 0.9 s; sweeps 4-7 (in call order) run during a burst of
  # load from another process (+0.5 s). Timed one variant after the other (4 sweeps each,
  # the first a warm-up), all of '8p''s sweeps would fall in the burst and '8' would win.
  monkeypatch.setenv(cpu_matmul.ENV_CACHE, str(tmp_path))
  monkeypatch.delenv(cpu_matmul.ENV_VARIANT, raising=False)
  monkeypatch.setattr(cpu_matmul, "_CHOSEN", {})
  monkeypatch.setattr(cpu_matmul, "variants", lambda: ("8", "8p"))
  true = {cpu_matmul._variant_code("8"): 1.0, cpu_matmul._variant_code("8p"): 0.9}
  calls = []

  def sweep(args):
    calls.append(args[8])
    return true[args[8]] + (0.5 if 4 <= len(calls) - 1 < 8 else 0.0)

  monkeypatch.setattr(cpu_matmul, "_sweep", sweep)
  assert cpu_matmul.chosen_variant(2, 64, 48, np.float32) == "8p"
  a, b = cpu_matmul._variant_code("8"), cpu_matmul._variant_code("8p")
  assert calls == [a, b, b, a, a, b, b, a]  # turns within rounds, reversed every other round
  calls.clear()
  times = cpu_matmul.time_variants(2, 64, 48, np.float32, ["8", "8p"], repeats=1,
                                   stream_bytes=1)
  assert times == {"8": 1.0, "8p": 0.9}  # the warm-up round is not counted
  monkeypatch.setattr(cpu_matmul, "_sweep", lambda args: -1.0)
  with pytest.raises(ValueError, match="not built"):
    cpu_matmul.time_variants(2, 64, 48, np.float32, ["8"], repeats=1, stream_bytes=1)


@needs_kernel
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8"])
def test_time_variant_measures_every_variant(weights):
  dtype = {"float32": np.float32, "bfloat16": jnp.bfloat16, "int8": np.int8}[weights]
  for variant in cpu_matmul.variants():
    assert 0 < cpu_matmul.time_variant(2, 64, 48, dtype, variant, repeats=1,
                                       stream_bytes=1 << 16) < 1


@needs_kernel
def test_t5_logits_are_the_same_bits_in_every_variant(pack_small, monkeypatch):
  model, params = _mini()
  stored = model.decode_params(jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32),
                                            params))
  enc = jax.random.randint(jax.random.PRNGKey(1), (3, 7), 2, 100)
  dec = jax.random.randint(jax.random.PRNGKey(2), (3, 6), 2, 100)
  logits = {}
  for variant in cpu_matmul.variants():
    monkeypatch.setenv(cpu_matmul.ENV_VARIANT, variant)
    jax.clear_caches()  # the variant is fixed when a product is traced
    hlo = jax.jit(lambda p: model.forward(p, enc, dec)).lower(stored).as_text()
    assert f"variant = {cpu_matmul._variant_code(variant)} : i64" in hlo
    logits[variant] = np.asarray(model.forward(stored, enc, dec))
  for got in logits.values():
    np.testing.assert_array_equal(got, logits["8"])


def _has_dot():
  return HAVE_COMPILER and cpu_matmul.available() and cpu_matmul.has_bfloat16_dot()


@pytest.mark.skipif(not _has_dot(), reason="no AVX512-BF16 on this CPU")
@pytest.mark.parametrize("m", [1, 6, 40])
def test_bfloat16_dot_products(m):
  """Pairs of bfloat16 weights times activations rounded to bfloat16 (round to nearest
  even), float32 sums: within float32 rounding of that product in float64, the same bits
  in every variant and at every row count."""
  x, w = _operands(m, 512, 1030, seed=m)
  p = cpu_matmul.pack(w, "bfloat16_dot")
  assert p.pairs and p.panels.shape == (65, 256, 16, 2) and p.shape == (512, 1030)
  np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack(p)), w)
  got = np.asarray(jax.jit(cpu_matmul.matmul)(x, p))
  x16 = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
  np.testing.assert_allclose(got, x16 @ w.astype(np.float64), rtol=1e-5,
                             atol=1e-5 * np.sqrt(512))
  for variant in cpu_matmul.variants():
    np.testing.assert_array_equal(cpu_matmul.raw_matmul(x, np.asarray(p.panels), None, p.n,
                                                        variant), got)
  if m > 1:
    np.testing.assert_array_equal(np.asarray(jax.jit(cpu_matmul.matmul)(x[1:2], p))[0], got[1])
  with pytest.raises(ValueError, match="even K"):
    cpu_matmul.pack(w[:511], "bfloat16_dot")


@needs_kernel
def test_t5_bfloat16_dot_weights(pack_small):
  model, params = _mini()
  dot = t5.T5(model.config, kernel_weights="bfloat16_dot")
  if not cpu_matmul.has_bfloat16_dot():
    with pytest.raises(ValueError, match="needs a CPU with AVX512-BF16"):
      dot.decode_params(params)
    return
  packed = dot.decode_params(params)
  assert packed["decoder"]["layers_0"]["mlp"]["wo"]["kernel"].pairs
  enc = jax.random.randint(jax.random.PRNGKey(1), (2, 7), 2, 100)
  dec = jax.random.randint(jax.random.PRNGKey(2), (2, 5), 2, 100)
  got = np.asarray(dot.forward(packed, enc, dec))
  ref = np.asarray(model.forward(params, enc, dec))
  # bfloat16 activations: errors of bfloat16's 8-bit mantissa, compounded over the layers
  np.testing.assert_allclose(got, ref, atol=0.1 * np.abs(ref).max())
  assert np.abs(got - ref).max() > 0  # a different function than the float32 model


def _pairs_by_part(packed):
  """{(part, name): pairs} of a packed tree's layer-0 kernels, part 'encoder' / 'decoder'."""
  out = {}
  for part in ("encoder", "decoder"):
    for block, tree in packed[part]["layers_0"].items():
      if not isinstance(tree, dict):
        continue
      for name, leaf in tree.items():
        if isinstance(leaf, dict) and hasattr(leaf.get("kernel"), "pairs"):
          out[(part, f"{block}/{name}")] = bool(leaf["kernel"].pairs)
  return out


@needs_kernel
def test_t5_setup_kernel_weights(pack_small, monkeypatch):
  """`setup_kernel_weights` packs only the kernels the set-up multiplies by (the encoder's,
  the cross-attention key/value) its own way: decode steps from a given cache are the
  bits of the model without it, the encoder's states a bfloat16 rounding of them."""
  model, params = _mini()
  with pytest.raises(ValueError, match="setup_kernel_weights must be one of"):
    t5.T5(model.config, setup_kernel_weights="bfloat16x")
  enc = jax.random.randint(jax.random.PRNGKey(1), (2, 7), 2, 100)
  dec = jax.random.randint(jax.random.PRNGKey(2), (2, 5), 2, 100)
  same = t5.T5(model.config, setup_kernel_weights="same").decode_params(params)
  jax.tree.map(np.testing.assert_array_equal, same, model.decode_params(params))
  if not cpu_matmul.has_bfloat16_dot():
    with pytest.raises(ValueError, match="setup_kernel_weights='bfloat16_dot' needs a CPU"):
      t5.T5(model.config, setup_kernel_weights="bfloat16_dot").decode_params(params)
    return
  setup = t5.T5(model.config, setup_kernel_weights="bfloat16_dot")
  packed = setup.decode_params(params)
  pairs = _pairs_by_part(packed)
  on = {k for k, v in pairs.items() if v}
  assert on == {k for k in pairs if k[0] == "encoder"} | {
      ("decoder", "encoder_decoder_attention/kv_joined")}, pairs
  assert ("decoder", "self_attention/qkv_joined") in pairs  # packed, as the decode weights
  # The set-up is a different function (bfloat16 activations), within bfloat16's rounding:
  got = np.asarray(setup.encode(packed, enc).hidden)
  ref = np.asarray(model.encode(params, enc).hidden)
  np.testing.assert_allclose(got, ref, atol=0.1 * np.abs(ref).max())
  assert np.abs(got - ref).max() > 0
  # ... and the decode steps the same bits as the model's from the same cache.
  cache = model.init_cache(model.decode_params(params), model.encode(params, enc), 8)
  np.testing.assert_array_equal(
      np.asarray(setup.decode(packed, cache, dec).logits),
      np.asarray(model.decode(model.decode_params(params), cache, dec).logits))
  # Where the CPU has no AVX512-BF16, 'bfloat16_dot_if_supported' packs as 'same'.
  anywhere = t5.T5(model.config, setup_kernel_weights="bfloat16_dot_if_supported")
  assert _pairs_by_part(anywhere.decode_params(params)) == pairs
  monkeypatch.setattr(cpu_matmul, "has_bfloat16_dot", lambda: False)
  fresh = jax.tree.map(lambda x: x + 0, params)  # another tree: packed again
  assert not any(_pairs_by_part(anywhere.decode_params(fresh)).values())
  with pytest.raises(ValueError, match="setup_kernel_weights='bfloat16_dot' needs a CPU"):
    setup.decode_params(fresh)


@needs_kernel
def test_t5_kernel_weights_bfloat16_dot_if_supported(pack_small, monkeypatch):
  """`kernel_weights='bfloat16_dot_if_supported'` packs every kernel as 'bfloat16_dot' does
  on a CPU with AVX512-BF16 (the same bits), and as 'auto' does on one without it; the
  set-up's 'same' follows what it resolved to."""
  model, params = _mini()
  enc = jax.random.randint(jax.random.PRNGKey(1), (2, 7), 2, 100)
  anywhere = t5.T5(model.config, kernel_weights="bfloat16_dot_if_supported")
  packed = anywhere.decode_params(params)
  if cpu_matmul.has_bfloat16_dot():
    dot = t5.T5(model.config, kernel_weights="bfloat16_dot")
    assert all(_pairs_by_part(packed).values())
    np.testing.assert_array_equal(np.asarray(anywhere.encode(packed, enc).hidden),
                                  np.asarray(dot.encode(dot.decode_params(params), enc).hidden))
  monkeypatch.setattr(cpu_matmul, "has_bfloat16_dot", lambda: False)
  fresh = jax.tree.map(lambda x: x + 0, params)  # another tree: packed again
  without = anywhere.decode_params(fresh)
  assert not any(_pairs_by_part(without).values())
  jax.tree.map(np.testing.assert_array_equal, without, model.decode_params(fresh))
  with pytest.raises(ValueError, match="kernel_weights must be one of"):
    t5.T5(model.config, kernel_weights="bfloat16_dot_if_possible")


@needs_kernel
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8"])
def test_fused_rms_norm(weights):
  """matmul(x, W, norm=s) multiplies T5's RMS norm of x (x * rsqrt(mean(x^2) + eps) * s) by W
  in the kernel's own call: within float32 rounding of that product in float64, each row's
  bits independent of the other rows."""
  rng = np.random.default_rng(3)
  x = (rng.standard_normal((9, 256)) * 3).astype(np.float32)
  s = (1 + 0.3 * rng.standard_normal(256)).astype(np.float32)
  w = rng.standard_normal((256, 100)).astype(np.float32)
  p = cpu_matmul.pack(w, weights)
  fused = jax.jit(lambda a, b, c: cpu_matmul.matmul(a, b, norm=c, eps=1e-6))
  got = np.asarray(fused(x, p, s))
  x64 = x.astype(np.float64)
  normed = x64 / np.sqrt(np.mean(x64 ** 2, axis=1, keepdims=True) + 1e-6) * s
  np.testing.assert_allclose(got, normed @ np.asarray(cpu_matmul.unpack(p), np.float64),
                             rtol=1e-5, atol=1e-5 * np.sqrt(256))
  np.testing.assert_array_equal(np.asarray(fused(x[2:5], p, s)), got[2:5])
  with pytest.raises(ValueError, match=r"norm must be \[256\]"):
    cpu_matmul.matmul(x, p, norm=s[:10])


@needs_kernel
@pytest.mark.parametrize("weights", ["float32", "bfloat16_dot"])
def test_fused_norm_and_pairs_past_the_kept_scratch(weights):
  """The normed rows (and bfloat16 pairs) of a call larger than the per-thread scratch that is
  kept between calls (8 MB) go to a buffer of the call's own: each row's bits equal those of a
  small call before and after it."""
  if weights == "bfloat16_dot" and not cpu_matmul.has_bfloat16_dot():
    pytest.skip("no AVX512-BF16 on this CPU")
  rng = np.random.default_rng(5)
  K, M = 512, 8320  # M x K floats: 17 MB, M x K / 2 pairs: 8.5 MB
  x = rng.standard_normal((M, K)).astype(np.float32)
  s = (1 + 0.3 * rng.standard_normal(K)).astype(np.float32)
  p = cpu_matmul.pack(rng.standard_normal((K, 16)).astype(np.float32), weights)
  fused = jax.jit(lambda a, b, c: cpu_matmul.matmul(a, b, norm=c, eps=1e-6))
  before = np.asarray(fused(x[-7:], p, s))
  got = np.asarray(fused(x, p, s))
  np.testing.assert_array_equal(got[-7:], before)
  np.testing.assert_array_equal(np.asarray(fused(x[:7], p, s)), got[:7])


def test_bandwidth_and_peak_probes_keep_their_highest_reading(monkeypatch):
  """A burst of load from elsewhere lowers one reading; the probes report the capability."""
  readings = {"gbps": iter([99.0, 12.8, 26.5, 25.1]), "gflops": iter([150.0, 190.0, 60.0])}

  class Fake:
    def spec_decode_read_gbps(self, buf, nbytes, passes, threads):
      return next(readings["gbps"])  # the first call is the warm-up

    def spec_decode_fma_gflops(self, width, iters, threads):
      return next(readings["gflops"])

  monkeypatch.setattr(cpu_matmul, "_library", lambda: Fake())
  assert cpu_matmul.read_bandwidth(4096, threads=1, repeats=3) == 26.5
  assert cpu_matmul.fma_peak(8, threads=1, repeats=3) == 190.0


def test_dot_product_peak_probe_keeps_its_highest_reading_or_says_none(monkeypatch):
  """The bfloat16 dot-product peak: the highest reading, and None where the library has no
  dot products (it answers -1)."""
  readings = iter([300.0, 410.0, 120.0, -1.0])

  class Fake:
    def spec_decode_dot_gflops(self, width, iters, threads):
      return next(readings)

  monkeypatch.setattr(cpu_matmul, "_library", lambda: Fake())
  assert cpu_matmul.dot_peak(16, threads=1, repeats=3) == 410.0
  assert cpu_matmul.dot_peak(16, threads=1, repeats=1) is None


@needs_kernel
def test_dot_product_peak_where_the_kernel_has_dot_products():
  """Measured where the build has AVX512-BF16 (a sanity bound: more than half the
  multiply-add chains' rate at the same width; it is about twice that on the AMD EPYC of
  family 26, two multiply-adds per lane and instruction), None elsewhere and for a width
  the kernel lacks."""
  if not cpu_matmul.has_bfloat16_dot():
    assert cpu_matmul.dot_peak(8, threads=1, iters=10_000) is None
    return
  for width in cpu_matmul.widths():
    got = cpu_matmul.dot_peak(width, threads=1, iters=200_000, repeats=3)
    assert got is not None and got > 0.5 * cpu_matmul.fma_peak(width, threads=1,
                                                                 iters=200_000, repeats=3)
  assert cpu_matmul.dot_peak(4, threads=1, iters=10_000) is None


@needs_kernel
def test_describe_names_the_cpu_and_the_variants():
  info = cpu_matmul.describe()
  assert info["kernel"] == "on" and info["model"] and 8 in info["widths"]
  assert set(info["chosen_variants"].values()) <= set(cpu_matmul.variants())
  assert ("avx512f" in info["features"]) == (16 in info["widths"]) or not info["features"]
  assert cpu_matmul.read_bandwidth(1 << 20, threads=1, passes=2) > 0
  assert cpu_matmul.fma_peak(8, threads=1, iters=10_000) > 0


@needs_kernel
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8"])
def test_matmul_rows_multiplies_the_leading_rows_only(weights):
  """`rows`: the first rows are the bits of the whole product, the others zeros; a traced
  count (one compile for every count), 0, and counts past M (clamped)."""
  rng = np.random.default_rng(0)
  w = cpu_matmul.pack(rng.standard_normal((64, 48)).astype(np.float32), weights)
  x = jnp.asarray(rng.standard_normal((2, 7, 64)).astype(np.float32))
  norm = jnp.asarray(rng.random(64).astype(np.float32))
  with_rows = jax.jit(lambda x, r, norm: cpu_matmul.matmul(x, w, norm=norm, rows=r))
  for norm_arg in (None, norm):
    full = np.asarray(cpu_matmul.matmul(x, w, norm=norm_arg)).reshape(14, 48)
    for r in (0, 1, 5, 13, 14, 40):
      got = np.asarray(with_rows(x, np.int32(r), norm_arg)).reshape(14, 48)
      k = min(r, 14)
      np.testing.assert_array_equal(got[:k], full[:k])
      np.testing.assert_array_equal(got[k:], 0)


def test_real_rows_counts_up_to_the_last_real_token():
  mask = jnp.asarray([[1, 1, 0, 0, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0, 0, 0]], bool)
  assert int(t5._real_rows(mask)) == 11  # flat positions 0..10: row 1 ends at position 2
  assert int(t5._real_rows(mask[:1])) == 2
  assert int(t5._real_rows(jnp.zeros((1, 4), bool))) == 0
  index = base.packing_index(np.asarray(mask, np.int32))  # 4 real tokens, padded to 8
  assert index.size == 8 and int(t5._real_rows(mask, jnp.asarray(index))) == 4


@needs_kernel
@pytest.mark.parametrize("packed_batch", [False, True])
def test_encoder_skips_padding_rows_with_the_same_states(pack_small, monkeypatch, packed_batch):
  """The kernel multiplies an encoder input's real rows only (`_real_rows`); the real
  positions' states and cross-attention K/V are the bits of multiplying every row."""
  model, params = _mini()
  packed = model.decode_params(params)
  tokens = np.zeros((2 if packed_batch else 1, 16), np.int32)
  tokens[0, :11] = np.arange(2, 13)
  if packed_batch:
    tokens[1, :5] = np.arange(20, 25)
  index = jnp.asarray(base.packing_index(tokens)) if packed_batch else None
  assert packed_batch == (index is not None)
  mask = tokens > 0

  def states():
    # The unjitted bodies, so that each run traces `_real_rows` as patched.
    enc = type(model)._encode.__wrapped__(model, packed, jnp.asarray(tokens), index)
    cache = type(model)._init_cache.__wrapped__(model, packed, enc, 4)
    return np.asarray(enc.hidden), [np.asarray(k) for k in cache.cross_k]

  skipped = states()
  monkeypatch.setattr(t5, "_real_rows", lambda *args, **kwargs: None)
  every = states()
  np.testing.assert_array_equal(skipped[0][mask], every[0][mask])
  for k_skipped, k_every in zip(skipped[1], every[1]):  # K [B, N, H, S]
    np.testing.assert_array_equal(np.moveaxis(k_skipped, 3, 1)[mask],
                                  np.moveaxis(k_every, 3, 1)[mask])
  assert np.isfinite(skipped[0]).all()


@needs_kernel
def test_thread_stats_count_the_split_calls(monkeypatch):
  """`thread_stats`: one count per call split between the caller and a helper, the helpers'
  share of the panels in [0, 1], durations; zero after a reset."""
  monkeypatch.delenv(cpu_matmul.ENV_THREADS, raising=False)
  w = cpu_matmul.pack(np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32),
                      "bfloat16")
  f = jax.jit(lambda x: cpu_matmul.matmul(x, w))
  x = jnp.ones((5, 512))
  f(x).block_until_ready()
  cpu_matmul.thread_stats(reset=True)
  for _ in range(3):
    f(x).block_until_ready()
  stats = cpu_matmul.thread_stats(reset=True)
  if stats["split_calls"] == 0:
    pytest.skip("XLA's intra-op pool has one thread here: no call is split")
  assert stats["split_calls"] == 3
  assert stats["helpers_per_call"] >= 0
  assert 0 <= stats["helper_share"] <= 1 and 0 <= stats["helper_idle"] <= 1
  assert stats["call_us"] > 0 and stats["wait_us"] >= 0 and stats["helper_start_us"] >= 0
  assert 0 <= stats["helper_same_cpu"] <= 1
  assert cpu_matmul.thread_stats()["split_calls"] == 0


def _attention_operands(B=3, T=5, N=4, H=24, L=37, seed=0):
  """Random queries and caches; rows filled to ragged lengths, causal new tokens, and one
  query that sees no slot at all."""
  rng = np.random.default_rng(seed)
  q = (rng.standard_normal((B, T, N, H)) * 0.3).astype(np.float32)
  k = rng.standard_normal((B, N, H, L)).astype(np.float32)
  v = rng.standard_normal((B, N, L, H)).astype(np.float32)
  bias = rng.standard_normal((B, N, T, L)).astype(np.float32)
  offsets = rng.integers(0, L - T, B)
  offsets[0] = 0
  mask = np.arange(L)[None, None, :] <= offsets[:, None, None] + np.arange(T)[None, :, None]
  mask[B - 1, 1] = False
  return q, k, v, bias, mask


def _attention_f64(q, k, v, bias, mask):
  logits = np.einsum("btnh,bnhl->bntl", q.astype(np.float64), k.astype(np.float64))
  if bias is not None:
    logits = logits + bias
  logits = np.where(mask[:, None], logits, -1e10)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  return np.einsum("bntl,bnlh->btnh", w, v.astype(np.float64))


@needs_kernel
@pytest.mark.parametrize("bias_rows", [None, 1, 3])
@pytest.mark.parametrize("H,T", [(24, 5), (64, 5), (64, 11)])
def test_attention_kernel_against_float64(bias_rows, H, T):
  """The kernel's masked softmax attention (no bias, a bias shared by the batch or one per
  row; H a multiple of the vector width or not; more queries than a tile of 8) within
  float32 rounding of float64's; a query that sees no slot averages all L, as the masked
  softmax does."""
  q, k, v, bias, mask = _attention_operands(H=H, T=T)
  bias = None if bias_rows is None else bias[:bias_rows]
  got = np.asarray(jax.jit(cpu_matmul.attention)(q, k, v, bias, mask))
  want = _attention_f64(q, k, v, bias, mask)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[-1, 1], v[-1].mean(axis=1), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got, np.asarray(t5._attend(q, k, v, bias, mask)), rtol=1e-5,
                             atol=1e-5)


@needs_kernel
def test_attention_kernel_rows_do_not_depend_on_the_call():
  """Each query is the same bits alone as in the call, and in a cache of more slots whose
  extra slots it does not see (a verify call's rows equal single-token steps')."""
  q, k, v, bias, mask = _attention_operands(H=64, L=40)
  full = np.asarray(jax.jit(cpu_matmul.attention)(q, k, v, bias, mask))
  for t in range(q.shape[1]):
    one = jax.jit(cpu_matmul.attention)(q[:, t:t + 1], k, v, bias[:, :, t:t + 1],
                                        mask[:, t:t + 1])
    np.testing.assert_array_equal(np.asarray(one)[:, 0], full[:, t])
  more = 29  # extra slots, none visible: the sums are over the same terms, in the same order
  pad = lambda x, axis: np.concatenate(
      [x, np.random.default_rng(1).standard_normal(
          x.shape[:axis] + (more,) + x.shape[axis + 1:]).astype(x.dtype)], axis=axis)
  wide_mask = np.concatenate([mask, np.zeros(mask.shape[:2] + (more,), bool)], axis=2)
  wide = np.asarray(jax.jit(cpu_matmul.attention)(q, pad(k, 3), pad(v, 2), pad(bias, 3),
                                                  wide_mask))
  seen = mask.any(axis=2)  # the query that sees nothing averages over all slots instead
  np.testing.assert_array_equal(wide[seen], full[seen])
  # One row and head per call runs on the calling thread alone; the call of all of them
  # (245 KB of K and V) splits its (row, head) items between threads: the same bits.
  for b in range(q.shape[0]):
    for n in range(q.shape[2]):
      one = jax.jit(cpu_matmul.attention)(q[b:b + 1, :, n:n + 1], k[b:b + 1, n:n + 1],
                                          v[b:b + 1, n:n + 1], bias[b:b + 1, n:n + 1],
                                          mask[b:b + 1])
      np.testing.assert_array_equal(np.asarray(one)[0, :, 0], full[b, :, n])
  with pytest.raises(ValueError, match="want K"):
    cpu_matmul.attention(q, v, v, bias, mask)


@needs_kernel
def test_attention_kernel_long_caches_read_by_rows():
  """Past 16 KB of K per (row, head) (~64 slots of 64 features) and more slots than one
  register pass holds, the logits read K row by row, summed in memory: the same bits as
  the register passes. A query alone (few slots: register passes) equals itself in a tile
  whose widest query reads by rows; a cross-attention of 300 slots (a CNN/DM article)
  within float32 rounding of float64's, each query the same bits alone as in the call."""
  rng = np.random.default_rng(3)
  att = jax.jit(cpu_matmul.attention)
  B, T, N, H = 2, 6, 3, 64
  for L, offsets in ((80, (58, 61)), (300, (294, 0))):
    q = (rng.standard_normal((B, T, N, H)) * 0.3).astype(np.float32)
    k = rng.standard_normal((B, N, H, L)).astype(np.float32)
    v = rng.standard_normal((B, N, L, H)).astype(np.float32)
    bias = rng.standard_normal((1, N, T, L)).astype(np.float32)
    if L == 300:  # row 1: every query sees all 300 slots (cross-attention)
      mask = np.ones((B, T, L), bool)
      mask[0] = np.arange(L)[None, :] <= offsets[0] + np.arange(T)[:, None]
    else:  # causal: the tile's widest query reads 67 slots, the narrowest 59
      mask = np.arange(L)[None, None, :] <= (np.asarray(offsets)[:, None, None]
                                             + np.arange(T)[None, :, None])
    full = np.asarray(att(q, k, v, bias, mask))
    np.testing.assert_allclose(full, _attention_f64(q, k, v, bias, mask), rtol=1e-5, atol=1e-5)
    for t in range(T):
      one = np.asarray(att(q[:, t:t + 1], k, v, bias[:, :, t:t + 1], mask[:, t:t + 1]))
      np.testing.assert_array_equal(one[:, 0], full[:, t], err_msg=f"L {L}, query {t}")


_NARROW_BUILD_CHECK = """
import pathlib, sys
import numpy as np, jax
sys.path.insert(0, {tests!r})
from spec_decode.kernels import cpu_matmul
cpu_matmul._build = lambda: pathlib.Path({library!r})
assert cpu_matmul.widths() == (8,), cpu_matmul.widths()
from test_cpu_matmul import _attention_operands
att = jax.jit(cpu_matmul.attention)
for L in (40, 300):  # 300: most rows' K read by rows
  q, k, v, bias, mask = _attention_operands(H=64, L=L)
  full = np.asarray(att(q, k, v, bias, mask))
  for t in range(q.shape[1]):
    one = np.asarray(att(q[:, t:t + 1], k, v, bias[:, :, t:t + 1], mask[:, t:t + 1]))[:, 0]
    np.testing.assert_array_equal(one, full[:, t], err_msg=f"L {{L}}, query {{t}}")
print("ok")
"""


@needs_kernel
@pytest.mark.slow
@pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="x86 flags")
@pytest.mark.parametrize("isa", ["x86-64 (vector extensions only)", "host without AVX-512"])
def test_attention_rows_alone_in_a_build_of_8_wide_vectors(isa, tmp_path):
  """The 8-wide attention (AVX2 hosts, or none) keeps each query's bits whatever tile it
  shares: built for this host without AVX-512 (its own tuning, which on AMD Zen declines to
  fuse some multiply-add chains) and for plain x86-64, then loaded in a fresh process."""
  if isa == "host without AVX-512" and 16 not in cpu_matmul.widths():
    # ~20 s of compiling on 2 AVX2 EPYC cores for a library equal to the one loaded here
    pytest.skip("this host has no AVX-512: its own build, which every other test of the "
                "8-wide attention loads, is this build")
  compiler = shutil.which("g++") or shutil.which("c++")
  flags = [f for f in cpu_matmul._FLAGS if f != "-march=native"]
  march = (ISA_FLAGS[isa] if isa in ISA_FLAGS
           else ["-march=native", "-mno-avx512f"])
  library = tmp_path / "narrow.so"
  built = subprocess.run([compiler, *flags, *march, f"-I{jax.ffi.include_dir()}", "-o",
                          str(library), str(cpu_matmul._SOURCE)],
                         capture_output=True, text=True, timeout=600)
  assert built.returncode == 0, built.stderr[-3000:]
  result = _python(_NARROW_BUILD_CHECK.format(tests=os.path.dirname(__file__),
                                              library=str(library)))
  assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]

@needs_kernel
def test_t5_attends_in_the_kernel_where_packed(pack_small):
  """With packed weights the decoder's attention runs in the kernel (t5.ATTENTION_KERNEL,
  None: where packed); its logits match XLA's dots' up to rounding."""
  model, params = _mini()
  stored = model.decode_params(params)
  enc = jax.random.randint(jax.random.PRNGKey(1), (3, 7), 2, 100)
  dec = jax.random.randint(jax.random.PRNGKey(2), (3, 4), 2, 100)

  def step(p):
    cache = model.init_cache(p, model.encode(p, enc), 12)
    cache = cache.rewind(jnp.asarray([0, 3, 7], jnp.int32))
    return model.decode(p, cache, dec).logits

  logits = {}
  for setting in (None, False):
    jax.clear_caches()  # the switch is read when the step is traced
    with t5.switched(ATTENTION_KERNEL=setting):
      hlo = jax.jit(step).lower(stored).as_text()
      assert ("spec_decode_decode_attention" in hlo) == (setting is None)
      logits[setting] = np.asarray(jax.jit(step)(stored))
      assert "spec_decode_decode_attention" not in jax.jit(step).lower(params).as_text()
  jax.clear_caches()
  np.testing.assert_allclose(logits[None], logits[False], rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="ATTENTION_KERNEL"):
    with t5.switched(ATTENTION_KERNEL="yes"):
      step(stored)


@needs_kernel
def test_t5_writes_the_cache_per_row_where_it_attends_in_the_kernel(pack_small, monkeypatch):
  """Layers that attend in the kernel write each row's new K/V with its own in-place
  dynamic-update-slice (t5.ROW_WRITES None), not a vmapped scatter: the same logits and
  caches bit for bit on ragged rows, at a batch over ROW_WRITES_MAX_BATCH too (the scatter
  then), with XLA's dots as well (True), and a compiled step copies no whole cache."""
  import re
  from spec_decode import compile_options
  from spec_decode.decoding import timing
  model, params = _mini()
  stored = model.decode_params(params)
  enc = jax.random.randint(jax.random.PRNGKey(1), (3, 7), 2, 100)
  dec = jax.random.randint(jax.random.PRNGKey(2), (3, 4), 2, 100)
  L = 12

  def start(p):
    cache = model.init_cache(p, model.encode(p, enc), L)
    junk = model.decode(p, cache, jnp.full((3, 9), 5, jnp.int32)).cache  # stale slots
    return junk.rewind(jnp.asarray([0, 3, 7], jnp.int32))

  def step(p):
    out = model.decode(p, start(p), dec)
    return out.logits, out.cache.self_k, out.cache.self_v

  def run(p, **switches):
    with t5.switched(**switches):
      hlo = jax.jit(step).lower(p).compile().as_text()
      return hlo, jax.tree.map(np.asarray, jax.jit(step)(p))

  hlo_rows, rows = run(stored, ROW_WRITES=None)
  hlo_scatter, scatter = run(stored, ROW_WRITES=False)
  assert "scatter" in hlo_scatter and "scatter" not in hlo_rows
  jax.tree.map(np.testing.assert_array_equal, rows, scatter)
  monkeypatch.setattr(t5, "ROW_WRITES_MAX_BATCH", 2)  # batch 3: the scatter again
  hlo_over, over = run(stored, ROW_WRITES=None)
  assert "scatter" in hlo_over
  jax.tree.map(np.testing.assert_array_equal, over, rows)
  monkeypatch.setattr(t5, "ROW_WRITES_MAX_BATCH", 32)
  _, dots_rows = run(stored, ROW_WRITES=True, ATTENTION_KERNEL=False)
  _, dots = run(stored, ROW_WRITES=False, ATTENTION_KERNEL=False)
  jax.tree.map(np.testing.assert_array_equal, dots_rows, dots)
  np.testing.assert_allclose(rows[0], dots[0], rtol=1e-5, atol=1e-5)

  cache = start(stored)  # the decoding loop's step: no copy of a whole layer's K or V
  loop = timing._jitted_steps(model, None, None, compile_options.resolve(None))
  c = model.config
  whole = {tuple(sorted((3, L, c.num_heads, c.head_dim)))}
  for T in (1, 4):
    text = loop.lower(stored, cache, jnp.full((3, T), 3, jnp.int32),
                      jnp.int32(2)).compile().as_text()
    copies = [name for name, dims in re.findall(r"%([\w.-]+) = f32\[([\d,]+)\]", text)
              if ("copy" in name or "transpose" in name)
              and tuple(sorted(int(d) for d in dims.split(","))) in whole]
    assert not copies, (T, copies)
  with pytest.raises(ValueError, match="ROW_WRITES"):
    run(stored, ROW_WRITES="yes")


@needs_kernel
@pytest.mark.parametrize("packed_rows", [False, True])
def test_t5_encoder_attends_in_the_kernel_where_packed(pack_small, packed_rows, monkeypatch):
  """The encoder's attention runs in the kernel too where its weights are packed, each row
  over its real tokens only (rows of 9, 5 and 2 tokens padded to 12, encoded padded or
  packed): the real tokens' states match XLA's dots' up to rounding, padding stays zeros
  where packed."""
  monkeypatch.setattr(t5, "SET_UP_LAYOUT_MIN_LENGTH", 0)
  model, params = _mini()
  stored = model.decode_params(params)
  lengths = np.array([9, 5, 2])
  enc = np.array(jax.random.randint(jax.random.PRNGKey(3), (3, 12), 2, 100))
  enc[np.arange(12)[None, :] >= lengths[:, None]] = 0
  index = base.packing_index(enc) if packed_rows else None
  assert (index is not None) == packed_rows
  states = {}
  for setting in (None, False):
    jax.clear_caches()  # the switch is read when the encoder is traced
    with t5.switched(ATTENTION_KERNEL=setting):
      hlo = jax.jit(lambda p: model.encode(p, enc, index).hidden).lower(stored).as_text()
      assert ("spec_decode_self_attention" in hlo) == (setting is None)
      states[setting] = np.asarray(model.encode(stored, enc, index).hidden)
  jax.clear_caches()
  real = enc > 0
  np.testing.assert_allclose(states[None][real], states[False][real], rtol=2e-5, atol=2e-5)
  if packed_rows:
    np.testing.assert_array_equal(states[None][~real], 0.0)


def _self_attention_operands(B, S, N, H, lengths, seed=0):
  """A joined q/k/v product [B, S, 3 N H], a bias by key - query [N, 2S - 1], a key mask
  [B, S] of rows `lengths` long (0: a row that sees nothing), and the same attention's
  operands in `attention`'s layouts (split q, K, V, the full bias, the mask per query)."""
  rng = np.random.default_rng(seed)
  qkv = (rng.standard_normal((B, S, 3 * N * H)) * 0.5).astype(np.float32)
  bias = rng.standard_normal((N, 2 * S - 1)).astype(np.float32)
  mask = np.arange(S)[None, :] < np.asarray(lengths)[:, None]
  q, k, v = (qkv[..., i * N * H:(i + 1) * N * H].reshape(B, S, N, H) for i in range(3))
  t = np.arange(S)
  full = bias[:, S - 1 - t[:, None] + t[None, :]][None]  # [1, N, S, S]: query t, key l
  return (qkv, bias, mask), (q, *map(np.asarray, t5._kv_layout(k, v)), full,
                             np.broadcast_to(mask[:, None, :], (B, S, S)))


@needs_kernel
@pytest.mark.parametrize("B,S,N,H,lengths", [(1, 40, 6, 64, [33]), (3, 21, 3, 20, [21, 6, 0]),
                                             (2, 9, 2, 16, [9, 1]),
                                             (2, 301, 2, 64, [283, 0]), (1, 77, 3, 32, [70])])
def test_self_attention_is_attention_over_the_split_projection(B, S, N, H, lengths):
  """The encoder's attention read from the joined q/k/v product (K and V copied into the
  kernel's scratch, q read in place, the bias by key - query) is the decode attention over
  split q, K, V with the full bias and the mask per query, bit for bit: with and without a
  bias, rows of different lengths, a row that sees nothing, head_dims that the register
  blocks divide (64; 32: a whole block on 16-wide vectors) and ones that fall back to the
  decode tiles (20, 16), lengths that fill neither the last block of queries nor of slots;
  and within float32 rounding of float64's."""
  (qkv, bias, mask), (q, k, v, full, mask_t) = _self_attention_operands(B, S, N, H, lengths)
  run = jax.jit(cpu_matmul.self_attention, static_argnums=3)
  got = np.asarray(run(qkv, bias, mask, N))
  np.testing.assert_array_equal(got, np.asarray(jax.jit(cpu_matmul.attention)(q, k, v, full,
                                                                                mask_t)))
  np.testing.assert_allclose(got, _attention_f64(q, k, v, full, mask_t), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(
      np.asarray(run(qkv, None, mask, N)),
      np.asarray(jax.jit(cpu_matmul.attention)(q, k, v, None, mask_t)))
  with pytest.raises(ValueError, match="heads"):
    cpu_matmul.self_attention(qkv, bias, mask, 7)
  with pytest.raises(ValueError, match="bias"):
    cpu_matmul.self_attention(qkv, bias[:, 1:], mask, N)


@needs_kernel
def test_kv_layout_is_the_cache_layout():
  """A joined key/value product copied into the cache's layouts by the kernel's threads is
  XLA's transposes of it, bit for bit (a call large enough to split between threads, and
  a small one)."""
  for B, S, N, H in ((2, 300, 6, 64), (1, 5, 2, 8)):
    kv = np.random.default_rng(1).standard_normal((B, S, 2 * N * H)).astype(np.float32)
    k, v = jax.jit(cpu_matmul.kv_layout, static_argnums=1)(kv, N)
    split = (kv[..., :N * H].reshape(B, S, N, H), kv[..., N * H:].reshape(B, S, N, H))
    for got, want in zip((k, v), t5._kv_layout(*split)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(ValueError, match="heads"):
    cpu_matmul.kv_layout(kv, 3)


@needs_kernel
@pytest.mark.parametrize("packed_rows", [False, True])
def test_t5_set_up_without_transposed_copies(pack_small, monkeypatch, packed_rows):
  """Where the encoder's q/k/v and the cross-attention's k/v are joined packed kernels, the
  set-up attends from the joined product (`cpu_matmul.self_attention`) and copies the
  cross-attention's K/V into the cache's layouts in the kernel (`kv_layout`): the encoder
  states and every cache entry are the bits of the split path (XLA's transposes, the decode
  attention), padded or packed, and no transposed copy of K is left to XLA in the set-up."""
  monkeypatch.setattr(t5, "SET_UP_LAYOUT_MIN_LENGTH", 0)  # the tests' inputs are short
  model, params = _mini()
  stored = model.decode_params(params)
  enc = np.array(jax.random.randint(jax.random.PRNGKey(4), (3, 12), 2, 100))
  enc[np.arange(12)[None, :] >= np.array([12, 7, 3])[:, None]] = 0
  index = base.packing_index(enc) if packed_rows else None
  set_up = lambda p: model.init_cache(p, model.encode(p, enc, index), 6)
  jax.clear_caches()
  hlo = jax.jit(set_up).lower(stored).as_text()
  assert "spec_decode_self_attention" in hlo and "spec_decode_kv_layout" in hlo
  assert "spec_decode_decode_attention" not in hlo
  new = jax.tree.leaves(set_up(stored))
  monkeypatch.setattr(t5, "SET_UP_LAYOUT_MIN_LENGTH", 13)  # 12 positions: the split path
  jax.clear_caches()
  hlo = jax.jit(set_up).lower(stored).as_text()
  assert "spec_decode_kv_layout" not in hlo and "spec_decode_self_attention" not in hlo
  monkeypatch.setattr(t5, "SET_UP_LAYOUT_MIN_LENGTH", 0)
  monkeypatch.setattr(t5, "JOINED_QKV", "no such kernel")  # the split path
  monkeypatch.setattr(t5, "JOINED_KV", "no such kernel")
  jax.clear_caches()
  assert "spec_decode_self_attention" not in jax.jit(set_up).lower(stored).as_text()
  old = jax.tree.leaves(set_up(stored))
  jax.clear_caches()
  assert len(new) == len(old)
  for a, b in zip(new, old):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@needs_kernel
@pytest.mark.skipif(not (HAVE_COMPILER and cpu_matmul.has_bfloat16_dot()),
                    reason="no AVX512-BF16 on this CPU")
@pytest.mark.parametrize("B,S,N,H,lengths", [(1, 70, 2, 64, [61]), (3, 33, 3, 32, [33, 1, 0])])
def test_self_attention_in_bfloat16_dot_products(B, S, N, H, lengths):
  """dot=True: the attention of q, K, the softmax's weights and V rounded to bfloat16 with
  float32 sums (float64's of the rounded operands up to float32 rounding and the weights'
  rounding boundaries), a row that sees nothing averaging all values; head_dims the dot
  products cannot take are refused."""
  import ml_dtypes
  (qkv, bias, mask), (q, k, v, full, mask_t) = _self_attention_operands(B, S, N, H, lengths)
  got = np.asarray(jax.jit(lambda x, b, m: cpu_matmul.self_attention(x, b, m, N, dot=True))(
      qkv, bias, mask))
  bf = lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float64)
  logits = np.einsum("btnh,bnhl->bntl", bf(q), bf(k)) + full
  logits = np.where(mask_t[:, None], logits, -1e10)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  want = np.einsum("bntl,bnlh->btnh", bf(w), bf(v))
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
  f32 = np.asarray(jax.jit(cpu_matmul.self_attention, static_argnums=3)(qkv, bias, mask, N))
  assert 0 < np.abs(got - f32).max() < 2e-2 * np.abs(f32).max()  # bfloat16's rounding, no more
  with pytest.raises(ValueError, match="multiple of 32"):
    cpu_matmul.self_attention(qkv[..., :3 * N * 16], bias, mask, N, dot=True)
