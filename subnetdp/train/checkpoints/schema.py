"""What a checkpoint's ``MANIFEST.json`` must hold before any reader uses it.

:func:`~subnetdp.train.checkpoints.files.read_manifest` checks every manifest against
:data:`MANIFEST` (after its format), so a damaged or crafted one is refused in one line naming the
field, what was found and what was expected, before any other file of the checkpoint is read. Every
file name the manifest carries (the keys of ``files``, each piece's ``file`` and ``copies``) must be
a plain name inside the checkpoint's own directory: a manifest never leads a reader elsewhere.

Fields no reader uses (``config_digest``) are left alone; optional ones are checked when present
(manifests written by earlier releases of this format lack some).
"""

from __future__ import annotations

from dataclasses import fields

from subnetdp.core.contracts import DataSpec
from subnetdp.core.records import Anything, FileName, Int, ListOf, MapOf, Nullable, Number, Record, Str

SHA256 = Str(r"[0-9a-f]{64}", "a sha256 (64 hex digits)")

#: One entry of ``files``: the size and checksum every read is verified against.
FILE_ENTRY = Record({"bytes": Int(0), "sha256": SHA256})

#: One entry of ``pieces``: the file holding the piece, its writer (named in that file's metadata),
#: its unit (None: a shared tensor) and shape; under local steps every owner's copy (rank -> file).
PIECE = Record({"file": FileName(), "writer": Int(0), "shape": ListOf(Int(0))},
               optional={"unit": Nullable(Int(0)), "copies": MapOf(Str(r"[0-9]+", "a rank"), FileName())})

#: The data spec the model is built for: DataSpec's own fields only (they become its arguments).
DATA_SPEC = Record({}, optional={f.name: Int(0) for f in fields(DataSpec)}, closed=True)

MANIFEST = Record(
    {"format": Str(), "run_id": Str(), "step": Int(0), "world_size": Int(1), "plan_digest": Str(),
     "files": MapOf(FileName(), FILE_ENTRY),
     "model": MapOf(Str(), Anything()),
     "data_spec": DATA_SPEC,
     "pieces": MapOf(Str(), PIECE)},
    optional={"fsdp_shard_size": Int(1), "partition_digest": Str(), "config_digest": Str(),
              "partition": Record({}, optional={"granularity": Str(), "units": Int(0), "units_per_layer": Int(0)}),
              "reference": Nullable(MapOf(Str(), Anything())),
              "consumed": Nullable(ListOf(Number())),  # [step, samples or tokens seen, FLOPs] by the step
              # a checkpoint assembled from the survivors' files: the ranks that wrote none, and those that did
              "absent_ranks": ListOf(Int(0)), "recovered_from": ListOf(Int(0)),
              # ...and the survivors' losses of the steps after the run's last log row (checkpoints.unlogged)
              "unlogged_losses": ListOf(Record({"rank": Int(0), "step": Int(0), "loss": Number()})),
              # the history of the state: the run's start and every explicit resume (checkpoints.lineage)
              "lineage": ListOf(Record({"id": Str(), "from_step": Int(0)}))},
)
