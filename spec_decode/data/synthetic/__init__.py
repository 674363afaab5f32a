"""Offline stand-ins for WMT EnDe and CNN/DM: pure-Python generators and their vocabulary.

No TensorFlow here; `spec_decode.data.synthetic_tasks` registers them as seqio tasks.
"""

from spec_decode.data.synthetic.splits import SPLIT_SIZES, SPLITS, examples
from spec_decode.data.synthetic.vocab import VOCAB_PATH, VOCAB_SIZE, Vocab

__all__ = ["SPLIT_SIZES", "SPLITS", "examples", "VOCAB_PATH", "VOCAB_SIZE", "Vocab"]
