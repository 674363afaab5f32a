"""Zero-initialised optimizer state in T5X's layout, so T5X can resume training from our files.

T5X's train state dict is {'target': params, 'state': {'step': int32,
'param_states': <one entry per parameter, nested like target>}}. Its Adafactor
(t5x/adafactor.py, the optimizer of T5's gin configs) keeps four slots per
parameter, `_AdafactorParamState(v_row, v_col, v, m)`, and
`Adafactor.init_param_state` initializes them, with T5X's defaults
(factored=True, min_dim_size_to_factor=128, beta1=None), as:
  * a 2-D parameter whose second-largest dimension is >= 128: factored second
    moments, v_row = zeros(shape without its largest dimension) and v_col =
    zeros(shape without its second-largest one) (for T5's 2-D kernels the
    logical factor rules fall back to this heuristic);
  * any other parameter: v = zeros(shape);
  * every unused slot, and m (no momentum): a float32 [1] placeholder.
All float32. T5X's `Adafactor.derive_logical_axes` gives v_row, v_col, m and a
placeholder v no partitioning, so its Checkpointer stores them inline in the
msgpack file; a full-size v is partitioned like its parameter and stored as a
TensorStore array (`tensorstore_slots`).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from spec_decode.checkpoints.common import CheckpointError

OPTIMIZER_STATES = (None, "adafactor")
ADAFACTOR_SLOTS = ("v_row", "v_col", "v", "m")
MIN_DIM_SIZE_TO_FACTOR = 128  # t5x.adafactor.Adafactor's default
_PLACEHOLDER = (1,)


def adafactor_slot_shapes(name: str, shape) -> dict[str, tuple[int, ...]]:
  """{slot: shape} of T5X's default Adafactor state for parameter `name` of `shape`."""
  shape = tuple(int(d) for d in shape)
  if len(shape) > 2:
    raise CheckpointError(f"parameter {name} has rank {len(shape)}: T5X's Adafactor needs an "
                          "explicit factor rule for it, which this writer does not know")
  slots = dict.fromkeys(ADAFACTOR_SLOTS, _PLACEHOLDER)
  order = np.argsort(shape, kind="stable")  # ties: the earlier dimension counts as smaller
  if len(shape) == 2 and shape[order[-2]] >= MIN_DIM_SIZE_TO_FACTOR:
    slots["v_row"] = tuple(np.delete(shape, order[-1]).tolist())
    slots["v_col"] = tuple(np.delete(shape, order[-2]).tolist())
  else:
    slots["v"] = shape
  return slots


def tensorstore_slots(slots: Mapping[str, tuple[int, ...]]) -> set[str]:
  """The slots T5X's Checkpointer writes as TensorStore arrays (the rest go inline)."""
  return {"v"} if slots["v"] != _PLACEHOLDER else set()


def check_optimizer_state(optimizer_state) -> None:
  if optimizer_state not in OPTIMIZER_STATES:
    raise CheckpointError(f"unknown optimizer_state {optimizer_state!r}; expected one of "
                          f"{OPTIMIZER_STATES}")


def zero_state(optimizer_state: str | None, shapes: Mapping[str, tuple[int, ...]]
               ) -> dict[str, dict[str, np.ndarray]]:
  """{parameter path: {slot: float32 zeros}} for `optimizer_state` (None: no slots)."""
  check_optimizer_state(optimizer_state)
  if optimizer_state is None:
    return {}
  return {name: {slot: np.zeros(slot_shape, np.float32)
                 for slot, slot_shape in adafactor_slot_shapes(name, shape).items()}
          for name, shape in shapes.items()}
