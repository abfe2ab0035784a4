"""The launchers ``subnetdp launch`` can start a job under, and what each one's choice decides.

A :class:`Launcher` is looked up once by name (:func:`launcher_named`); the code that checks a job
before it starts or claims its run directory asks it, never compares the launcher's name.
"""

from __future__ import annotations

from dataclasses import dataclass

from subnetdp.core.errors import ConfigError, suggest


@dataclass(frozen=True)
class Launcher:
    """What the choice of a launcher decides.

    Attributes:
        name: as ``--launcher`` names it.
        workers_descend: on one node its workers descend from the launching process, which can hold
            the run directory's lock for them (torchrun ``--standalone``); otherwise the job's rank 0,
            which may run on another node, takes it.
        workers_here: its workers run on this machine, so this machine's threads and memory are
            checked before they start (srun's run on the nodes SLURM gives).
    """

    name: str
    workers_descend: bool
    workers_here: bool


LAUNCHERS: dict[str, Launcher] = {k.name: k for k in (
    Launcher("torchrun", workers_descend=True, workers_here=True),
    Launcher("mpirun", workers_descend=False, workers_here=True),
    Launcher("srun", workers_descend=False, workers_here=False),
)}


def launcher_named(name: str, key: str = "--launcher") -> Launcher:
    """The launcher called ``name``; an unknown one is one line naming ``key``, the choices and the closest."""
    if name not in LAUNCHERS:
        raise ConfigError(key, name, f"unknown launcher; valid choices: {', '.join(LAUNCHERS)}" + suggest(name, LAUNCHERS))
    return LAUNCHERS[name]
