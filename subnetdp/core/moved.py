"""Import paths that moved since 0.1.0 keep working for one release, with a DeprecationWarning.

``import subnetdp.export`` still gives :mod:`subnetdp.evaluate.export` (the same module object, so a
test that patches one patches the other) and warns once, naming the new path. The table is data:
old dotted path -> new dotted path, each old path removed in 0.3.0. A meta path finder rather than
stub files because several old paths sit in ``core/``, which may not import the floors above it:
this module holds their names as strings and imports nothing of the package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

REMOVED_IN = "0.3.0"

#: old module path (0.1.0) -> where it lives now.
MOVED: dict[str, str] = {
    "subnetdp.export": "subnetdp.evaluate.export",
    "subnetdp.hf": "subnetdp.evaluate.hf",
    "subnetdp.data_prep": "subnetdp.plugins.data.corpus",
    "subnetdp.core.sync": "subnetdp.sdp.sync",
    "subnetdp.sdp.synchronizers": "subnetdp.sdp.sync.factory",
    "subnetdp.core.backward": "subnetdp.sdp.backward",
    "subnetdp.core.branches": "subnetdp.sdp.branches",
    "subnetdp.core.layout": "subnetdp.sdp.pieces",
    "subnetdp.core.union": "subnetdp.sdp.union",
    "subnetdp.core.resample": "subnetdp.sdp.resample",
    "subnetdp.core.variants": "subnetdp.sdp.variants",
    "subnetdp.core.loop": "subnetdp.train.loop",
    "subnetdp.core.optim": "subnetdp.train.optim",
    "subnetdp.core.metrics": "subnetdp.train.meter",
    "subnetdp.core.checkpoint": "subnetdp.train.checkpoints.files",
    "subnetdp.core.resume": "subnetdp.train.checkpoints.checkpointer",
    "subnetdp.train.checkpoints.resume": "subnetdp.train.checkpoints.checkpointer",  # named after its class
    "subnetdp.core.runlock": "subnetdp.train.runlock",
    "subnetdp.core.upfront": "subnetdp.train.upfront",
    "subnetdp.core.dryrun": "subnetdp.plan.dryrun",
    "subnetdp.core.planreport": "subnetdp.plan.report",
    "subnetdp.parallel.dryrun": "subnetdp.plan.dryrun_fsdp",
    "subnetdp.plugins.models._resnet_neurons": "subnetdp.plugins.models.resnet.neurons",
    "subnetdp.plugins.models._swin_neurons": "subnetdp.plugins.models.swin.neurons",
    "subnetdp.plugins.models._llama_neurons": "subnetdp.plugins.models.llama.neurons",
}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old path with the module at its new path (see :data:`MOVED`)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        # stacklevel 2 names the importing line: warnings skips the import machinery's own frames.
        warnings.warn(f"{spec.name} moved to {new}: import {new} instead ({spec.name} is removed in "
                      f"{REMOVED_IN})", DeprecationWarning, stacklevel=2)
        # The new module itself: importlib keeps its __name__ and __spec__ (it only fills unset ones).
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module was executed under its new name."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``import subnetdp`` does this)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
