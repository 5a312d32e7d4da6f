"""flatten_sequential: torchvision models as flat nn.Sequentials pipeddp can cut, and flatten_resnet."""

from __future__ import annotations

import copy
import operator
import pickle

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.models.efficientnet import MBConv
from torchvision.models.mobilenetv2 import InvertedResidual
from torchvision.models.resnet import BasicBlock
from torchvision.ops.misc import Conv2dNormActivation

import pipeddp
from pipeddp.tools.models import Functional, flatten_resnet, flatten_sequential


def _image(n: int = 2, side: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, side, side, generator=torch.Generator().manual_seed(seed))


def _residual_blocks(model: nn.Module):
    """The modules that must stay whole: blocks whose forward adds their input back."""
    out = []
    for m in model.modules():
        if isinstance(m, BasicBlock) or (isinstance(m, (InvertedResidual, MBConv)) and m.use_res_connect):
            out.append(m)
    return out


BUILDERS = {
    "resnet18": torchvision.models.resnet18,
    "vgg11": torchvision.models.vgg11,
    "mobilenet_v2": torchvision.models.mobilenet_v2,
    "efficientnet_b0": torchvision.models.efficientnet_b0,
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_torchvision_models_flatten_to_the_same_function(name):
    torch.manual_seed(0)
    model = BUILDERS[name](weights=None, num_classes=10)
    model.train()
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    x = _image()

    flat = flatten_sequential(model, x)

    assert type(flat) is nn.Sequential
    assert len(flat) > len(list(model.children()))  # nested containers were opened up
    for layer in flat:  # nothing left that is only a container of a chain
        assert not (isinstance(layer, nn.Sequential) and type(layer).forward is nn.Sequential.forward)
        assert not isinstance(layer, Conv2dNormActivation)
    blocks = _residual_blocks(model)
    if name != "vgg11":
        assert blocks
    for block in blocks:  # residual blocks stay whole, as one layer each
        assert any(layer is block for layer in flat)
    # the model's own modules and parameters, not copies
    model_modules = {id(m) for m in model.modules()}
    assert all(id(layer) in model_modules for layer in flat if not isinstance(layer, Functional))
    flat_params = list(flat.parameters())
    assert {id(p) for p in flat_params} == {id(p) for p in model.parameters()}
    assert len(flat_params) == len(list(model.parameters()))
    for layer_name in flat._modules:
        assert "." not in layer_name and layer_name
    # the check ran in eval mode without touching the training flags or BatchNorm statistics
    assert all(m.training for m in model.modules())
    assert all(m.training for m in flat.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, buffers[k]), k

    model.eval()
    flat.eval()
    with torch.no_grad():
        x2 = _image(seed=1)
        torch.testing.assert_close(flat(x2), model(x2), rtol=1e-5, atol=1e-6)

    glue = [repr(layer) for layer in flat if isinstance(layer, Functional)]
    if name == "resnet18":  # layers named by their path
        assert list(flat._modules) == ["conv1", "bn1", "relu", "maxpool", "layer1_0", "layer1_1", "layer2_0",
                                       "layer2_1", "layer3_0", "layer3_1", "layer4_0", "layer4_1", "avgpool",
                                       "flatten", "fc"]
        assert flat.layer2_1 is model.layer2[1] and flat.fc is model.fc
        assert glue == ["Functional(torch.flatten(x, 1))"]
    if name == "mobilenet_v2":  # F.adaptive_avg_pool2d and torch.flatten between features and classifier
        assert glue == ["Functional(F.adaptive_avg_pool2d(x, (1, 1)))", "Functional(torch.flatten(x, 1))"]
        assert list(flat._modules)[-4:] == ["adaptive_avg_pool2d", "flatten", "classifier_0", "classifier_1"]
        assert flat.features_1_conv_1 is model.features[1].conv[1]  # a block without a shortcut is opened up


def test_resnet_trains_in_a_pipeline_like_the_flat_model():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).double()
    # micro-batches of 4: layer4 is 1 x 1 at 32 x 32, and BatchNorm over 2 values per channel would turn
    # rounding differences (threads per stage) into large gradient differences
    x = _image(8, 32).double()
    y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    flat = flatten_sequential(model, x[:2])
    ref = copy.deepcopy(flat)

    with pipeddp.Pipeline(flat, ["cpu", "cpu"], chunks=2, balance="params") as pipe:
        assert len(pipe.balance) == 2 and sum(pipe.balance) == len(ref)
        loss = pipe.train_step(x, y, F.cross_entropy)
        grads = {k: p.grad for k, p in pipe.named_parameters()}

    # the same micro-batches on one device (BatchNorm normalises each micro-batch with its own statistics)
    want = 0.0
    for xi, yi in zip(x.chunk(2), y.chunk(2)):
        part = F.cross_entropy(ref(xi), yi) * (len(xi) / len(x))
        part.backward()
        want += part.item()
    assert abs(loss.item() - want) < 1e-9
    ref_params = dict(ref.named_parameters())
    assert set(grads) == set(ref_params)
    for k, p in ref_params.items():
        assert grads[k] is not None, k
        torch.testing.assert_close(grads[k], p.grad, rtol=0, atol=1e-9)


def test_the_language_model_s_head_outweighs_five_blocks_and_trains_in_a_pipeline():
    """The benchmarks' language model (``build("lm")``): where equal layers per stage are not equal work."""
    from pipeddp.tools.models import build, language_model

    full = language_model()
    assert len(full) == 11
    block = sum(p.numel() for p in full[1].parameters())
    assert full[-1].weight.numel() > 5 * block
    torch.manual_seed(0)
    model, sample = build("lm", small=True)
    model = model.double()
    x, y = sample(6), sample(6)
    loss_fn = lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten())  # noqa: E731
    ref = copy.deepcopy(model)
    with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=2, balance=[4, 3]) as pipe:
        loss = pipe.train_step(x, y, loss_fn)
        grads = {k: p.grad for k, p in pipe.named_parameters()}
    want = loss_fn(ref(x), y)
    want.backward()
    assert abs(loss.item() - want.item()) < 1e-10
    for k, p in ref.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=0, atol=1e-10)


def test_flatten_resnet_keeps_its_23_layers():
    model = torchvision.models.resnet50(weights=None)
    flat = flatten_resnet(model)
    names = ["conv1", "bn1", "relu", "maxpool"] + [f"layer{s}_{i}" for s, n in ((1, 3), (2, 4), (3, 6), (4, 3))
                                                 for i in range(n)] + ["avgpool", "flatten", "fc"]
    assert len(flat) == 23 and list(flat._modules) == names
    # flatten_sequential finds the same chain: the same modules under the same names, glue aside
    auto = flatten_sequential(model, _image(1, 32))
    assert list(auto._modules) == names
    for n in names:
        if n != "flatten":
            assert auto._modules[n] is flat._modules[n]


class _UsesTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.layer3 = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        x = self.stem(x)
        y = self.layer3(x)
        return self.head(y) + y


class _ViewBySize(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
        self.classifier = nn.Linear(4 * 6 * 6, 2)

    def forward(self, x):
        x = self.features(x)
        x = x.view(x.size(0), -1)
        return self.classifier(x)


class _Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.a(x)
        return x


class _ReadsParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.pos = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return self.a(x) + self.pos


class _TrainingOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        x = self.a(x)
        if self.training:
            x = x * 2
        return self.b(x)


@pytest.mark.parametrize("model, x, where", [
    (_UsesTwice(), torch.randn(2, 4), r"layer3 output is used twice \(by self\.head\(layer3\) and head \+ layer3\)"),
    (_ViewBySize(), torch.randn(2, 3, 8, 8), r"features\.size\(0\) depends on the input and is an argument of "
                                              r"features\.view\(size, -1\)"),
    (_Branches(), torch.randn(2, 4), r"torch\.fx cannot trace _Branches\.forward"),
    (_ReadsParameter(), torch.randn(2, 4), r"self\.pos is read directly"),
    (_TrainingOnly(), torch.randn(2, 4), r"reads self\.training: at this step training mode runs a \* 2"),
])
def test_a_forward_that_is_not_a_chain_is_refused_naming_the_place(model, x, where):
    with pytest.raises(ValueError, match=where) as info:
        flatten_sequential(model, x)
    assert "Wrap the parts of the model in order by hand" in str(info.value)


def test_a_result_that_differs_is_refused_with_the_largest_difference():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model.register_forward_hook(lambda mod, inp, out: out + 0.5)  # the flat model cannot see the root's hook
    with pytest.raises(ValueError, match=r"does not compute model\(sample\).*largest difference 0\.5"):
        flatten_sequential(model, torch.randn(2, 4))


class _Block(nn.Module):
    """A chain child (opened up) holding a residual child (kept) and a hooked Sequential (kept)."""

    def __init__(self):
        super().__init__()
        self.res = BasicBlock(4, 4)
        self.hooked = nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU())
        self.hooked.register_forward_hook(lambda mod, inp, out: out)

    def forward(self, x):
        return self.hooked(self.res(x))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True))
        self.body = _Block()
        self.act = nn.ReLU()
        self.fc = nn.Linear(4, 3)
        self.drop = 0.5

    def forward(self, x):
        x = self.act(self.body(self.stem(x)))
        x = self.act(x)  # one module used twice
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        x = F.dropout(x, self.drop, training=self.training)
        return self.fc(x)[:, :2]


def test_custom_model_children_glue_and_training_flag():
    model = _Net()
    flat = flatten_sequential(model, torch.randn(2, 3, 8, 8))
    assert list(flat._modules) == ["stem_0", "stem_1", "stem_2", "body_res", "body_hooked", "act", "act_1",
                                   "adaptive_avg_pool2d", "flatten", "dropout", "fc", "getitem"]
    assert flat.body_res is model.body.res and flat.body_hooked is model.body.hooked
    assert flat.act is flat.act_1 is model.act
    assert repr(flat.flatten) == "Functional(x.flatten(1))"
    assert repr(flat.getitem) == "Functional(x[:, :2])"
    assert repr(flat.dropout) == "Functional(F.dropout(x, p=0.5, training=self.training, inplace=False))"
    x = torch.randn(4, 3, 8, 8)
    model.train()
    flat.train()
    torch.manual_seed(3)
    want = model(x)
    torch.manual_seed(3)
    got = flat(x)
    torch.testing.assert_close(got, want)  # dropout is on in training mode, in both
    flat.eval()
    with torch.no_grad():
        assert torch.equal(flat.dropout(torch.ones(2, 3)), torch.ones(2, 3))


def test_functional_layers_are_readable_and_can_be_copied():
    f = Functional(torch.flatten, 1)
    assert repr(f) == "Functional(torch.flatten(x, 1))"
    assert repr(Functional("view", -1, 512)) == "Functional(x.view(-1, 512))"
    assert repr(Functional(operator.getitem, Functional.INPUT, (slice(None), 0))) == "Functional(x[:, 0])"
    assert repr(Functional(operator.mul, Functional.INPUT, 2)) == "Functional(x * 2)"
    assert Functional(F.relu, inplace=True).inplace and not f.inplace
    x = torch.randn(2, 3, 4)
    for g in (pickle.loads(pickle.dumps(f)), copy.deepcopy(f)):
        assert g.args[0] is Functional.INPUT
        assert torch.equal(g(x), torch.flatten(x, 1))
    drop = Functional(F.dropout, p=0.5, training=Functional.TRAINING)
    assert pickle.loads(pickle.dumps(drop)).kwargs["training"] is Functional.TRAINING
    assert torch.equal(drop.eval()(x), x)
