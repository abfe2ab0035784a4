"""model.stochastic_depth and model.hidden_dropout: off is the plain model, eval is deterministic,
and the training-time expectation equals the evaluation-time value (enumerated exactly)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from subnetdp.sdp.branches import DropChannels, DropPath, fold_branch_scales
from subnetdp.core.contracts import DataSpec
from subnetdp.sdp.construct import build_model
from subnetdp.core.errors import ConfigError
from tests.helpers import plugin_manager, small_config

CASES = {  # model: (recipe overrides, spec, input)
    "resnet": ([], DataSpec(in_channels=1, image_size=8, num_classes=10), lambda: torch.randn(2, 1, 8, 8)),
    "llama": (["model.variant=tiny", "model.vocab_size=64"], DataSpec(vocab_size=64, seq_len=8),
              lambda: torch.randint(0, 64, (2, 8))),
    "swin": (["model.variant=cifar", "model.stochastic_depth_prob=0"], DataSpec(in_channels=3, image_size=32, num_classes=10),
             lambda: torch.randn(2, 3, 32, 32)),
}


def _build(name: str, *overrides: str) -> nn.Module:
    extra, spec, _ = CASES[name]
    recipe = {"resnet": "resnet18_digits", "llama": "llama_tiny_stdlib", "swin": "swin_t_cifar10"}[name]
    cfg = small_config(*extra, *overrides, recipe=recipe)
    adapter = plugin_manager().registries["model"].create(cfg.model.name, cfg.model)
    torch.manual_seed(0)
    return build_model(adapter, spec)


@pytest.mark.parametrize("name", list(CASES))
def test_off_is_plain_and_eval_is_deterministic(name):
    x = CASES[name][2]()
    plain = _build(name)
    off = _build(name, "model.stochastic_depth=0", "model.hidden_dropout=0")
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in off.modules())  # nothing attached at 0
    on = _build(name, "model.stochastic_depth=0.5", "model.hidden_dropout=0.5")
    plain.eval(), on.eval()  # before any training forward moves BatchNorm statistics
    with torch.no_grad():
        first, second = on(x), on(x)
        assert torch.equal(first, second)  # evaluation: deterministic ...
        assert torch.equal(first, plain(x))  # ... and the plain model (inverted scaling in training)
    plain.train(), off.train()
    torch.manual_seed(1)
    ref = plain(x)
    torch.manual_seed(1)
    assert torch.equal(off(x), ref)  # keep rate 1: exactly the plain model, in training too
    on.train()
    torch.manual_seed(1)
    assert not torch.equal(on(x), ref)  # the options do act in training


def _expectation(module: nn.Module, hook, x: torch.Tensor, mask_shape: tuple[int, ...]) -> torch.Tensor:
    """The exact training-time expectation of ``module(x)`` over every 0/1 mask the hook can draw."""
    keep = 1.0 - hook.p
    total = torch.zeros_like(module(x))
    n = int(torch.tensor(mask_shape).prod())
    for bits in itertools.product((0.0, 1.0), repeat=n):
        mask = torch.tensor(bits, dtype=x.dtype).reshape(mask_shape)
        hook.sample = lambda shape, k, like, m=mask: m.reshape(shape)
        weight = keep ** sum(bits) * (1 - keep) ** (n - sum(bits))
        total += weight * module(x)
    return total


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.branch = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.branch(x)


def test_stochastic_depth_expectation_is_the_eval_value_exactly():
    torch.manual_seed(0)
    block = Residual().double()
    hook = DropPath(0.3)
    block.branch.register_forward_hook(hook)
    x = torch.randn(3, 3, dtype=torch.float64)
    expected = _expectation(block.train(), hook, x, (3, 1))  # one decision per sample: 2^3 masks
    torch.testing.assert_close(expected, block.eval()(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("where", ["input", "output"])
def test_hidden_dropout_expectation_is_the_eval_value_exactly(where):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    hook = DropChannels(0.4, dim=-1)
    if where == "input":
        mlp[2].register_forward_pre_hook(hook.pre_hook)
    else:
        mlp[1].register_forward_hook(hook.hook)
    x = torch.randn(2, 5, 3, dtype=torch.float64)  # 2 samples x 5 tokens: one mask per sample and channel
    expected = _expectation(mlp.train(), hook, x, (2, 1, 4))
    torch.testing.assert_close(expected, mlp.eval()(x), rtol=1e-12, atol=1e-12)


def test_llama_swiglu_hidden_dropout_expectation_exact():
    """The adapter's own hook site (the input of w2): E over all masks = the eval output."""
    model = _build("llama", "model.hidden_dropout=0.5", "model.hidden_dim=6", "model.n_layers=1").double()
    ff = model.layers["0"].feed_forward
    (hook,) = [h.__self__ for h in ff.w2._forward_pre_hooks.values()]
    x = torch.randn(1, 3, model.args.dim, dtype=torch.float64)
    expected = _expectation(ff.train(), hook, x, (1, 1, 6))
    torch.testing.assert_close(expected, ff.eval()(x), rtol=1e-12, atol=1e-12)


def test_fold_branch_scales_equals_scaling_the_branch_outputs():
    model = _build("llama", "model.n_layers=2").double().eval()
    adapter = plugin_manager().registries["model"].create("llama", small_config(recipe="llama_tiny_stdlib").model)
    x = CASES["llama"][2]()
    scaled = {"layers.0": 0.5, "layers.1": 0.75}
    hooked = _build("llama", "model.n_layers=2").double().eval()
    for name, modules in adapter.residual_branches(hooked).items():
        for m in modules:
            m.register_forward_hook(lambda mod, a, out, s=scaled[name]: out * s)
    assert fold_branch_scales(adapter.branch_output_layers(model), scaled) == 4
    with torch.no_grad():
        torch.testing.assert_close(model(x), hooked(x), rtol=1e-12, atol=1e-12)


def test_bad_values_are_config_errors():
    with pytest.raises(ConfigError, match=r"model\.stochastic_depth.*\[0, 1\)"):
        small_config("model.stochastic_depth=1.0")
    with pytest.raises(ConfigError, match=r"model\.stochastic_depth.*stack on torchvision"):
        small_config("model.variant=cifar", "model.stochastic_depth=0.5", recipe="swin_t_cifar10")
    with pytest.raises(ConfigError, match=r"eval\.block_union"):
        small_config("eval.block_union=x2")
    with pytest.raises(ConfigError, match=r"model\.n_heads"):
        small_config("model.dim=66", recipe="llama_tiny_stdlib")


def test_batchnorm_recalibration_gathers_the_statistics_of_the_evaluated_network():
    """Recalibration runs BatchNorm in training mode: the regularisers must not thin the network
    then, or a model trained with them is evaluated on statistics of random sub-networks."""
    from subnetdp.sdp.union import recalibrate_batchnorm

    torch.manual_seed(2)
    batches = [torch.randn(4, 1, 8, 8) for _ in range(3)]
    plain = _build("resnet")
    on = _build("resnet", "model.stochastic_depth=0.5", "model.hidden_dropout=0.5")
    on.load_state_dict(plain.state_dict())
    for model in (plain, on):
        torch.manual_seed(3)
        assert recalibrate_batchnorm(model, iter(batches), 3, lambda b: b) == 3
    for (name, a), (_, b) in zip(plain.named_buffers(), on.named_buffers()):
        assert torch.equal(a, b), name  # the same statistics as the plain model's
    hooks = [h for m in on.modules() for h in m._forward_hooks.values() if isinstance(h, DropPath)]
    assert hooks and all(h.p == 0.5 for h in hooks)  # and the regularisers are back on afterwards
    on.train()
    torch.manual_seed(1)
    x = CASES["resnet"][2]()
    assert not torch.equal(on(x), plain.train()(x))


def test_only_branches_with_output_layers_are_rescaled_and_the_rest_are_named():
    from subnetdp.sdp.union import scalable_branches

    cfg = small_config(recipe="resnet18_digits")
    adapter = plugin_manager().registries["model"].create(cfg.model.name, cfg.model)
    spec = CASES["resnet"][1]
    scales = {"layer1.0": 0.5, "layer4.1": 0.5}
    assert scalable_branches(adapter, spec, scales) == (scales, [])

    class NoOutputLayers(type(adapter)):  # the base class's default: no branch can be scaled
        def branch_output_layers(self, model):
            return {}

    blind = NoOutputLayers(cfg.model)
    assert scalable_branches(blind, spec, scales) == ({}, ["layer1.0", "layer4.1"])
    assert scalable_branches(blind, spec, {}) == ({}, [])


def test_a_rising_keep_rate_scales_the_branch_with_its_optimizer_and_synchroniser_state():
    from subnetdp.core.errors import SubnetdpError
    from subnetdp.sdp.keep_rates import rescale_branches, rising_rates

    model = _build("llama", "model.n_layers=2").double()
    adapter = plugin_manager().registries["model"].create("llama", small_config(recipe="llama_tiny_stdlib").model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(CASES["llama"][2]()).float().pow(2).mean().backward()
    optimizer.step()
    before = {n: ({k: v.clone() for k, v in optimizer.state[p].items()}, p.detach().clone())
              for n, p in model.named_parameters()}
    anchor = {n: p.detach().clone() for n, p in model.named_parameters()}  # local steps' outer state
    rising = rising_rates({"layers.0": 0.5, "layers.1": 0.5}, {"layers.0": 1.0, "layers.1": 0.25})
    assert rising == {"layers.0": (0.5, 1.0)}  # a rate that falls is left alone
    scales = {name: old / new for name, (old, new) in rising.items()}
    extra = [("outer_anchor/", n, t) for n, t in anchor.items()]
    assert rescale_branches(model, adapter.branch_output_layers(model), scales, optimizer, extra) == 2
    for n, p in model.named_parameters():
        state, value = before[n]
        s = 0.5 if n in ("layers.0.attention.wo.weight", "layers.0.feed_forward.w2.weight") else 1.0
        assert torch.equal(p, value * s) and torch.equal(anchor[n], value * s), n
        assert torch.equal(optimizer.state[p]["exp_avg"], state["exp_avg"] * s), n
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], state["exp_avg_sq"] * s * s), n
        assert torch.equal(optimizer.state[p]["step"], state["step"]), n
    optimizer.state[model.layers["0"].attention.wo.weight]["velocity"] = torch.zeros(1)
    with pytest.raises(SubnetdpError, match="cannot rescale the optimizer state 'velocity' of layers.0.attention.wo"):
        rescale_branches(model, adapter.branch_output_layers(model), scales, optimizer)


def test_a_branch_is_scaled_once_when_its_rate_rises_and_not_again_at_the_same_rate(tmp_path, capsys):
    from subnetdp.core.contracts import LaunchEnv
    from subnetdp.train.setup import setup

    class Trained:  # a source that loads nothing, whose values ran at half the forwards
        def __init__(self, rates):
            self.trained_rates = rates

        def load(self, state, previous):
            return None

    cfg = small_config("comm.name=local", "masker.coverage=1", f"run.dir={tmp_path}", "run.name=r")
    ctx, state = setup(cfg, LaunchEnv(0, 1, 0, 1, "test"), plugin_manager())
    try:
        bn = state.model.get_submodule("layer1.0.bn2")
        bn.weight.data.fill_(1.0)
        state.replan(state.plan, Trained({u.name: 0.5 for u in state.partition.units}))
        assert torch.equal(bn.weight, torch.full_like(bn.weight, 0.5))
        assert "layer1.0, layer1.1, layer2.0, layer2.1, layer3.0, layer3.1, layer4.0, layer4.1 (0.5 -> 1)" in \
            capsys.readouterr().out
        state.replan(state.plan, Trained(None))  # the values ran at 1 since: nothing more
        assert torch.equal(bn.weight, torch.full_like(bn.weight, 0.5)) and capsys.readouterr().out == ""
    finally:
        ctx.comm.shutdown()
        if ctx.lock is not None:
            ctx.lock.release()
