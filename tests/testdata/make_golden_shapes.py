"""Writes t5_param_shapes.json from the T5X parameter table in shared/reference/t5x.md.

Deliberately independent of spec_decode.models.t5: the shapes are spelled out
here from the reference (preset sizes and the parameter tree), so the golden
file checks the model code instead of echoing it. Run from the repo root:
  python tests/testdata/make_golden_shapes.py
"""

import json
import os

# (emb_dim, num_heads, enc layers, dec layers, head_dim, mlp_dim), vocab 32128.
PRESETS = {
    "t5_1_1_small": (512, 6, 8, 8, 64, 1024),
    "t5_1_1_base": (768, 12, 12, 12, 64, 2048),
    "t5_1_1_large": (1024, 16, 24, 24, 64, 2816),
    "t5_1_1_xl": (2048, 32, 24, 24, 64, 5120),
    "t5_1_1_xxl": (4096, 64, 24, 24, 64, 10240),
}
VOCAB = 32128


def tree(e, h, n_enc, n_dec, d, f):
  k = h * d
  out = {"token_embedder/embedding": [VOCAB, e],
         "encoder/relpos_bias/rel_embedding": [h, 32],
         "decoder/relpos_bias/rel_embedding": [h, 32],
         "encoder/encoder_norm/scale": [e],
         "decoder/decoder_norm/scale": [e],
         "decoder/logits_dense/kernel": [e, VOCAB]}
  for i in range(n_enc):
    p = f"encoder/layers_{i}"
    out[f"{p}/pre_attention_layer_norm/scale"] = [e]
    out[f"{p}/pre_mlp_layer_norm/scale"] = [e]
    for n in ("query", "key", "value"):
      out[f"{p}/attention/{n}/kernel"] = [e, k]
    out[f"{p}/attention/out/kernel"] = [k, e]
    out[f"{p}/mlp/wi_0/kernel"] = [e, f]
    out[f"{p}/mlp/wi_1/kernel"] = [e, f]
    out[f"{p}/mlp/wo/kernel"] = [f, e]
  for i in range(n_dec):
    p = f"decoder/layers_{i}"
    for norm in ("pre_self_attention_layer_norm", "pre_cross_attention_layer_norm",
                 "pre_mlp_layer_norm"):
      out[f"{p}/{norm}/scale"] = [e]
    for att in ("self_attention", "encoder_decoder_attention"):
      for n in ("query", "key", "value"):
        out[f"{p}/{att}/{n}/kernel"] = [e, k]
      out[f"{p}/{att}/out/kernel"] = [k, e]
    out[f"{p}/mlp/wi_0/kernel"] = [e, f]
    out[f"{p}/mlp/wi_1/kernel"] = [e, f]
    out[f"{p}/mlp/wo/kernel"] = [f, e]
  return dict(sorted(out.items()))


if __name__ == "__main__":
  golden = {name: tree(*shape) for name, shape in PRESETS.items()}
  path = os.path.join(os.path.dirname(__file__), "t5_param_shapes.json")
  with open(path, "w") as f:
    json.dump(golden, f, indent=1)
    f.write("\n")
  print("wrote", path)
