"""What a dropped unit of a user's model computes (``subnetdp/sdp/units.py``), without a process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from subnetdp.core.errors import ConfigError
from subnetdp.sdp.units import DroppedBlock, SkipBlock, block_partition, find_units, skip_module

torchvision = pytest.importorskip("torchvision")


def test_torchvision_blocks_skip_to_their_shortcut():
    with torch.device("meta"):
        meta = torchvision.models.resnet18()
    names = find_units(meta, "layer*.*")
    assert names == [f"layer{s}.{b}" for s in range(1, 5) for b in range(2)]
    skips = {n: skip_module(n, meta.get_submodule(n), None) for n in names}
    assert isinstance(skips["layer1.0"], SkipBlock) and isinstance(skips["layer2.0"], DroppedBlock)
    part = block_partition(meta, names, skips)
    # The projection shortcut is what a dropped block still computes: shared, in no unit.
    assert "layer2.0.downsample.0.weight" in part.shared and "conv1.weight" in part.shared
    assert all(not s.name.startswith("layer2.0.downsample") for u in part.units for s in u.slices)
    assert [s.name for s in part.units[2].slices][:2] == ["layer2.0.conv1.weight", "layer2.0.bn1.weight"]
    # The rule is the block with its residual branch silenced (bn2 scale and shift 0), exactly.
    torch.manual_seed(0)
    for block in (torchvision.models.resnet18().layer2[0].eval(), torchvision.models.resnet50().layer2[0].eval()):
        last_bn = block.bn3 if hasattr(block, "bn3") else block.bn2
        nn.init.zeros_(last_bn.weight)
        nn.init.zeros_(last_bn.bias)
        x = torch.randn(2, block.conv1.in_channels, 8, 8)
        torch.testing.assert_close(skip_module("b", block, None)(x), block(x), rtol=0, atol=0)


def test_decoder_layers_keep_their_call_and_output_structure():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config)
    layer = model.model.layers[0]
    skip = skip_module("model.layers.0", layer, None)
    h = torch.randn(1, 5, 16)
    pos = model.model.rotary_emb(h, torch.arange(5).unsqueeze(0))
    real = layer(h, attention_mask=None, position_embeddings=pos, position_ids=torch.arange(5).unsqueeze(0))
    out = skip(h, attention_mask=None, position_embeddings=pos, position_ids=torch.arange(5).unsqueeze(0))
    assert type(out) is type(real)  # a tensor or a tuple, as the installed transformers returns
    assert (out[0] if isinstance(out, tuple) else out) is h


def test_unknown_blocks_and_bad_globs_are_refused_in_one_line():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ConfigError) as e:
        skip_module("1", model[1], None)
    assert "'1' (Sequential) has no known skip rule" in str(e.value) and "skip='identity'" in str(e.value)
    assert isinstance(skip_module("1", model[1], {"Sequential": "identity"}), SkipBlock)
    assert isinstance(skip_module("1", model[1], {"1": lambda n, m: nn.Identity()}), nn.Identity)
    with pytest.raises(ConfigError, match="matches no module"):
        find_units(model, "layers.*")
    with pytest.raises(ConfigError, match="lies inside unit '1'"):
        find_units(model, ["1", "1.*"])
