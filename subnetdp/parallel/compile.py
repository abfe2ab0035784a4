"""``torch.compile`` of materialised blocks (``train.compile``)."""

from __future__ import annotations

import os
import shutil
import sysconfig
from typing import Sequence

import torch
from torch import nn

from subnetdp.core.errors import ConfigError


def compile_problem(device: torch.device, backend: str) -> str | None:
    """Why ``torch.compile`` cannot run here with ``backend``, or None if it can.

    Inductor generates C++ on the CPU (it needs a C++ compiler and the Python headers) and Triton
    kernels on a GPU; the ``aot_eager`` and ``eager`` backends need neither.
    """
    if backend != "inductor":
        return None
    if device.type == "cpu":
        if shutil.which("g++") is None and shutil.which("clang++") is None:
            return "inductor compiles C++ for the CPU and no C++ compiler (g++ or clang++) is on PATH"
        include = sysconfig.get_paths().get("include") or ""
        if not os.path.exists(os.path.join(include, "Python.h")):
            return f"inductor needs the Python headers and {include}/Python.h is missing"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "inductor compiles Triton kernels for the GPU and the triton package is not installed"
    return None


def require_compilable(device: torch.device, backend: str) -> None:
    """Raise a :class:`ConfigError` saying why ``train.compile`` cannot work here (before any process group)."""
    problem = compile_problem(device, backend)
    if problem:
        raise ConfigError("train.compile", True, problem,
                          "install what is missing, set train.compile_backend=aot_eager, or train.compile=false")


def apply_compile(blocks: Sequence[nn.Module], backend: str) -> int:
    """Compile each block in place (names of parameters and buffers do not change).

    Blocks are compiled one by one, as torchtitan does, so a model whose blocks share a shape
    compiles once and recompiles nothing, and FSDP2's hooks stay outside the compiled region.
    The loop calls :func:`require_compilable` first, before any process group exists.
    """
    for block in blocks:
        block.compile(backend=backend)
    return len(blocks)
