"""The clustered stores of the cluster campaign; each module registers its `StoreCluster`.

Importing this package imports every module in it, so a new cluster only needs a module.
"""

from __future__ import annotations

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
