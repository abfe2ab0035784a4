"""An exported LLaMA loads into the project's plain Llama and scores the run's union-model loss."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from subnetdp.core.contracts import LaunchEnv
from subnetdp.train.loop import train
from subnetdp.sdp.union import evaluate
from subnetdp.evaluate.export import export, load_reference
from subnetdp.evaluate.hf import export_hf
from subnetdp.plugins.models.llama.model import Llama, LlamaArgs
from tests.helpers import plugin_manager, small_config


def test_llama_export_round_trip(tmp_path):
    cfg = small_config("comm.name=local", "masker.coverage=1", "train.steps=3", "train.batch_size=4",
                       "eval.batches=2", "data.stdlib_max_mb=0.5", f"data.cache_dir={tmp_path}/data",
                       "run.name=llama", "checkpoint.enabled=true", "checkpoint.final=always", recipe="llama_tiny_stdlib", run_dir=tmp_path)
    run = train(cfg, LaunchEnv(), plugin_manager())
    ckpt = tmp_path / "llama" / "checkpoints" / "step_00000003"
    export(ckpt, tmp_path / "export", pm=plugin_manager())
    info = json.loads((tmp_path / "export" / "reference.json").read_text())
    # One call rebuilds it, and so does the plain class from the recorded options.
    model = load_reference(tmp_path / "export")
    plain = Llama(LlamaArgs(**info["options"]))
    plain.load_state_dict(load_file(str(tmp_path / "export" / "model.safetensors")))
    for m in (model, plain):
        assert type(m) is Llama
        metrics = evaluate(m, run.context.adapter, run.context.data, run.context.cfg)
        assert metrics["loss"] == pytest.approx(run.result.eval_metrics["loss"], rel=1e-6)
    for (n, a), (_, b) in zip(model.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), n

    # The Hugging Face export: every file, the weights included, has the mode the user's umask gives
    # any new file (0644 under umask 022), so others can read a model shared from this folder.
    out, files = export_hf(ckpt, tmp_path / "hf", pm=plugin_manager())
    umask = os.umask(0)
    os.umask(umask)
    assert "model.safetensors" in files
    assert {f: (out / f).stat().st_mode & 0o777 for f in files} == {f: 0o666 & ~umask for f in files}
    assert set(load_file(str(out / "model.safetensors"))) and (out / "config.json").is_file()
