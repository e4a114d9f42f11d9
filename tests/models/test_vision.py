import torch

from onecopy.models import builtin_model
from onecopy.models.vision import mobilenet_v3_small, resnet18


def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_vision_models_have_torchvisions_parameter_counts():
    # torchvision's resnet18() 11,689,512 and mobilenet_v3_small() 2,542,856 parameters
    assert parameters(resnet18()) == 11_689_512
    assert parameters(mobilenet_v3_small()) == 2_542_856


def test_vision_models_are_reproducible_from_their_seed_and_in_eval_mode():
    x = torch.randn(1, 3, 224, 224)
    for build in (resnet18, mobilenet_v3_small):
        a, b, other = build(), build(), build(seed=1)
        assert not a.training
        with torch.no_grad():
            assert torch.equal(a(x), b(x))
            assert a(x).shape == (1, 1000)
            assert not torch.equal(a(x), other(x))


def test_the_models_package_keeps_its_builtin_models():
    assert parameters(builtin_model()) == 8 * (1024 * 1024 + 1024)
