"""Draft heads: networks that read a frozen target's decoder states (no separate draft model).

Each module here defines one network (its config, parameters and forward functions)
and registers its checkpoint kind (`checkpoints.heads`); every module is imported with
this package, so a new head is one file. The drafters that decode with them are in
`decoding.drafters`, their training recipes in `spec_decode.train`.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):  # registration: every network's kind
  importlib.import_module(f"{__name__}.{_module.name}")
