"""Package metadata for spec_decode."""

import setuptools

setuptools.setup(
    name="spec_decode",
    version="0.1.0",
    description=(
        "Speculative decoding (Leviathan et al., ICML 2023) for T5.1.1 "
        "encoder-decoder models in JAX/Flax."
    ),
    python_requires=">=3.11",
    packages=setuptools.find_packages(include=["spec_decode", "spec_decode.*"]),
    package_data={"spec_decode.data.synthetic": ["*.model"], "spec_decode.kernels": ["*.cc"],
                  "spec_decode": ["*.cc"]},
    install_requires=[
        "jax>=0.4.30",
        "flax>=0.8",
        "optax",
        "orbax-checkpoint",
        "absl-py",
        "gin-config",
        "numpy",
        "tensorstore",
        "msgpack",
        "ml_dtypes",
        "safetensors",
        "sentencepiece",
        "tqdm",
        "filelock",  # JAX's compilation cache evicts with it (`compile_cache`)
    ],
    extras_require={
        "test": [
            "pytest",
            "pytest-xdist",
            "scipy",
            "torch==2.13.0",
            "transformers",
            "matplotlib",
        ],
        # seqio pulls TensorFlow; versions tested together with jax 0.10 / numpy 2.4.
        # tensorflow-datasets imports importlib_resources lazily (when it builds a
        # dataset) without declaring it; the paper configs fail without it.
        "data": [
            "seqio==0.0.20",
            "tensorflow==2.21.0",
            "tensorflow-text==2.21.1",
            "tensorflow-datasets==4.9.10",
            "importlib_resources",
            "sacrebleu==2.6.0",
            "rouge-score==0.1.2",
        ],
    },
)
