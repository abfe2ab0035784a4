"""The own-loop examples, run as a user runs them: plain ``torchrun``, 2 gloo ranks, no subnetdp config."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def _torchrun(script: str, *args: str) -> str:
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(ROOT / "examples" / script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def test_own_loop_example(tmp_path):
    out = _torchrun("own_loop.py", "--steps", "6", "--out", str(tmp_path / "union.pt"))
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", out)]
    assert len(losses) == 2 and losses[-1] < losses[0], out  # steps 0 and 5
    spec = importlib.util.spec_from_file_location("own_loop", ROOT / "examples" / "own_loop.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    gpt = example.GPT()
    gpt.load_state_dict(torch.load(tmp_path / "union.pt"))  # strict: the union is the whole model
    held = int(re.search(r"held (\d+) parameters \(blocks\.0, blocks\.1\)", out).group(1))
    block = sum(p.numel() for p in gpt.blocks[0].parameters())
    assert held == sum(p.numel() for p in gpt.parameters()) - 2 * block  # 2 of 4 blocks never allocated


def test_hf_llama_example(tmp_path):
    pytest.importorskip("transformers")
    out = _torchrun("hf_llama.py", "--steps", "2", "--out", str(tmp_path / "union"))
    assert "reloaded logits equal: True" in out, out
    assert json.loads((tmp_path / "union" / "config.json").read_text())["num_hidden_layers"] == 4
    assert "rank 0: layers ['model.layers.0', 'model.layers.1']" in out and "rank 1: layers ['model.layers.2', 'model.layers.3']" in out
