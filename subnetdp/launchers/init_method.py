"""Where the ranks meet: the ``comm.init_method`` URLs that a torch.distributed rendezvous accepts.

Checked when the config is loaded, so a URL no handler takes (or a ``tcp://`` without a port) is one
line naming the key before any worker starts, not a traceback from every rank's
``init_process_group``. Nothing here connects to anything.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlparse

from omegaconf import OmegaConf

from subnetdp.core.errors import ConfigError

RENDEZVOUS_SCHEMES = ("env", "tcp", "file")  # the handlers torch.distributed.rendezvous registers


def check_config(cfg: Any) -> None:
    """``comm.init_method`` (when the communicator has one) has a scheme a rendezvous handler accepts:
    ``env://``, ``tcp://HOST:PORT`` with a port in 1..65535, or ``file://PATH``."""
    method = OmegaConf.select(cfg, "comm.init_method", default=None)
    if method is None:
        return
    url = urlparse(str(method))
    fix = "use env:// (torchrun, mpirun, srun), tcp://HOST:PORT or file:///SHARED/PATH"
    if url.scheme not in RENDEZVOUS_SCHEMES:
        raise ConfigError("comm.init_method", str(method), f"no rendezvous handler for {url.scheme or 'no'} scheme "
                          f"(valid: {', '.join(s + '://' for s in RENDEZVOUS_SCHEMES)})", fix)
    try:
        port = url.port
    except ValueError:
        port = -1
    if url.scheme == "tcp" and (not url.hostname or port is None or not 0 < port < 65536):
        raise ConfigError("comm.init_method", str(method), "tcp:// needs a host and a port in 1..65535", fix)
    if url.scheme == "file" and not url.path:
        raise ConfigError("comm.init_method", str(method), "file:// needs a path", fix)


def check_file_store(cfg: Any) -> None:
    """A ``file://`` rendezvous names a file that does not exist yet.

    torch's FileStore deletes its file when the last rank closes it; a run that was killed leaves it
    behind, holding that run's keys, and the next run's ranks then wait in ``init_process_group``
    for ``comm.timeout_s`` for peers that never come. Checked by the launching process before any
    worker exists (a worker cannot tell a stale file from one a peer has just created).
    """
    method = OmegaConf.select(cfg, "comm.init_method", default=None)
    url = urlparse(str(method or ""))
    if url.scheme != "file" or not url.path:
        return
    if os.path.lexists(url.path):
        raise ConfigError("comm.init_method", str(method), f"{url.path} already exists (left by an earlier run?): the "
                          "ranks would read its keys and wait for peers that never come",
                          f"delete {url.path}, or name a file that does not exist yet")
