"""Vision models for the vision benchmark and the graph rewrites' tests: torchvision's ResNet-18 and
MobileNetV3-small architectures written with plain torch.nn (torchvision's registry build is a CUDA build that
breaks `import transformers` beside our CPU torch), random weights from a fixed seed, in eval mode.

Same layers, shapes and parameter counts as torchvision's `resnet18()` (11,689,512) and `mobilenet_v3_small()`
(2,542,856); the initialization is torch's default, not torchvision's, which changes no speed or memory figure.
"""

from __future__ import annotations

from typing import Any

__all__ = ["resnet18", "mobilenet_v3_small", "IMAGE_SHAPE"]

IMAGE_SHAPE = (3, 224, 224)


def _make_divisible(value: float, divisor: int = 8) -> int:
    # torchvision's rounding of channel counts (from the TensorFlow reference): never more than 10% below `value`.
    new = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * value else new


def _resnet18(num_classes: int) -> Any:
    import torch.nn as nn

    class BasicBlock(nn.Module):
        def __init__(self, inplanes: int, planes: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.downsample = None
            if stride != 1 or inplanes != planes:
                self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

        def forward(self, x):
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            return self.relu(self.bn2(self.conv2(out)) + identity)

    class ResNet18(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            widths, inplanes, stages = (64, 128, 256, 512), 64, []
            for i, planes in enumerate(widths):
                stride = 1 if i == 0 else 2
                stages.append(nn.Sequential(BasicBlock(inplanes, planes, stride), BasicBlock(planes, planes, 1)))
                inplanes = planes
            self.layer1, self.layer2, self.layer3, self.layer4 = stages
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(512, num_classes)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(self.avgpool(x).flatten(1))

    return ResNet18()


# torchvision's mobilenet_v3_small table: kernel, expanded channels, out channels, squeeze-excite, activation
# (RE: ReLU, HS: Hardswish), stride.
_MOBILENET_V3_SMALL = (
    (3, 16, 16, True, "RE", 2),
    (3, 72, 24, False, "RE", 2),
    (3, 88, 24, False, "RE", 1),
    (5, 96, 40, True, "HS", 2),
    (5, 240, 40, True, "HS", 1),
    (5, 240, 40, True, "HS", 1),
    (5, 120, 48, True, "HS", 1),
    (5, 144, 48, True, "HS", 1),
    (5, 288, 96, True, "HS", 2),
    (5, 576, 96, True, "HS", 1),
    (5, 576, 96, True, "HS", 1),
)


def _mobilenet_v3_small(num_classes: int) -> Any:
    import torch.nn as nn

    def conv_bn(cin: int, cout: int, kernel: int, stride: int, groups: int, act: type | None) -> nn.Sequential:
        layers = [nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(cout, eps=0.001, momentum=0.01)]
        return nn.Sequential(*layers, act()) if act is not None else nn.Sequential(*layers)

    class SqueezeExcitation(nn.Module):
        def __init__(self, channels: int) -> None:
            super().__init__()
            squeeze = _make_divisible(channels // 4)
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc1 = nn.Conv2d(channels, squeeze, 1)
            self.fc2 = nn.Conv2d(squeeze, channels, 1)
            self.relu = nn.ReLU()
            self.scale = nn.Hardsigmoid()

        def forward(self, x):
            return x * self.scale(self.fc2(self.relu(self.fc1(self.avgpool(x)))))

    class InvertedResidual(nn.Module):
        def __init__(self, cin: int, kernel: int, expanded: int, cout: int, se: bool, act: str, stride: int) -> None:
            super().__init__()
            activation = nn.Hardswish if act == "HS" else nn.ReLU
            layers: list[nn.Module] = []
            if expanded != cin:
                layers.append(conv_bn(cin, expanded, 1, 1, 1, activation))
            layers.append(conv_bn(expanded, expanded, kernel, stride, expanded, activation))
            if se:
                layers.append(SqueezeExcitation(expanded))
            layers.append(conv_bn(expanded, cout, 1, 1, 1, None))
            self.block = nn.Sequential(*layers)
            self.use_residual = stride == 1 and cin == cout

        def forward(self, x):
            y = self.block(x)
            return y + x if self.use_residual else y

    class MobileNetV3Small(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layers: list[nn.Module] = [conv_bn(3, 16, 3, 2, 1, nn.Hardswish)]
            cin = 16
            for kernel, expanded, cout, se, act, stride in _MOBILENET_V3_SMALL:
                layers.append(InvertedResidual(cin, kernel, expanded, cout, se, act, stride))
                cin = cout
            layers.append(conv_bn(cin, 6 * cin, 1, 1, 1, nn.Hardswish))
            self.features = nn.Sequential(*layers)
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.classifier = nn.Sequential(nn.Linear(6 * cin, 1024), nn.Hardswish(), nn.Dropout(0.2),
                                            nn.Linear(1024, num_classes))

        def forward(self, x):
            return self.classifier(self.avgpool(self.features(x)).flatten(1))

    return MobileNetV3Small()


def _seeded(build, num_classes: int, seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    model = build(num_classes).eval()
    # Fresh BatchNorm statistics are zero mean, unit variance: random statistics make eval-mode BatchNorm do real
    # per-channel work and keep activations in a realistic range through the network.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.1, 0.1, generator=generator)
                module.running_var.uniform_(0.5, 1.5, generator=generator)
                module.weight.uniform_(0.5, 1.5, generator=generator)
                module.bias.uniform_(-0.1, 0.1, generator=generator)
    return model


def resnet18(num_classes: int = 1000, seed: int = 0):
    """torchvision's ResNet-18 (11.69 M parameters), random weights from `seed`, in eval mode; input [B, 3, 224, 224]."""
    return _seeded(_resnet18, num_classes, seed)


def mobilenet_v3_small(num_classes: int = 1000, seed: int = 0):
    """torchvision's MobileNetV3-small (2.54 M parameters), random weights from `seed`, in eval mode; input
    [B, 3, 224, 224]."""
    return _seeded(_mobilenet_v3_small, num_classes, seed)
