"""The contracts between the core and its plugins: data types and base classes.

A plugin class subclasses one of :class:`Masker`, :class:`Communicator`, :class:`ModelAdapter` or
:class:`DataModule` and carries a nested ``Config`` dataclass, its config schema, which is mounted
under the plugin's group key (``masker``, ``comm``, ``model``, ``data``) when it is selected.

One module per contract kind (:mod:`.types`, :mod:`.plugin`, :mod:`.masker`, :mod:`.communicator`,
:mod:`.model`, :mod:`.data`, :mod:`.run`); every name is re-exported here, so
``from subnetdp.core.contracts import X`` is unchanged for plugin authors.
"""

from __future__ import annotations

from subnetdp.core.fields import WRITES, doc, writing_keys  # noqa: F401  (re-exported: plugins declare fields with doc)
from subnetdp.core.contracts.types import TensorSlice, Unit, Partition, Piece, ParamMap, DataSpec, HiddenSite, LaunchEnv  # noqa: F401
from subnetdp.core.contracts.plugin import GROUP_BY, PluginConfig, Plugin, MaskerConfig, CommConfig, DataConfig, ModelConfig, config_fields  # noqa: F401
from subnetdp.core.contracts.masker import Masker  # noqa: F401
from subnetdp.core.contracts.communicator import Handle, DoneHandle, ByteCounter, Communicator, NullCommunicator  # noqa: F401
from subnetdp.core.contracts.model import ModelAdapter  # noqa: F401
from subnetdp.core.contracts.data import DataModule, ResumableLoader  # noqa: F401
from subnetdp.core.contracts.run import RunContext, TrainStateView, RunResult  # noqa: F401
