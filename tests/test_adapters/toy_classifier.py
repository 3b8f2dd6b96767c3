"""A tiny image classifier and its seeded dataset, registered in MMEngine.

One module for the Runner-level tests in process (conftest imports it) and
for the subprocesses of ``tools/train.py`` and ``tools/dist_train.sh``,
which import it by name through ``PYTHONPATH``.
"""
import torch
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, MODELS
from torch import nn
from torch.utils.data import Dataset


@MODELS.register_module(force=True)
class ToyClassifier(BaseModel):
    """Conv, optional BatchNorm, ReLU, global mean and a linear head.

    Args:
        norm (bool): Whether a BatchNorm follows the conv. Defaults to True.
    """

    def __init__(self, norm=True):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4) if norm else nn.Identity()
        self.fc = nn.Linear(4, 2)

    def forward(self, inputs, labels=None, mode='tensor'):
        out = self.fc(self.bn(self.conv(inputs)).relu().mean((2, 3)))
        if mode == 'loss':
            return dict(loss=nn.functional.cross_entropy(out, labels))
        return out


@DATASETS.register_module(force=True)
class ToyClassDataset(Dataset):
    """``size`` seeded random 3x6x6 images with labels 0 or 1."""
    metainfo = dict(classes=('a', 'b'))

    def __init__(self, size=24):
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 3, 6, 6, generator=gen)
        self.y = torch.randint(0, 2, (size, ), generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return dict(inputs=self.x[i], labels=self.y[i])
