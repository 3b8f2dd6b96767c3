"""Shared pieces of the Conv-BN trace tests: a Conv and a BN, fused."""
import copy
import warnings

import torch
import torch.nn as nn
from mmengine.model.efficient_conv_bn_eval import \
    efficient_conv_bn_eval_control as fused

from mmdtr.techniques.efficient_conv_bn_eval import \
    apply_efficient_conv_bn_eval


class ConvBn(nn.Module):
    """A Conv and a BN for the tests' forwards."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)


def fuse(module):
    """Fuses ``module`` alone; returns the result and the warnings."""
    root = nn.Sequential(module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        (result, ) = apply_efficient_conv_bn_eval(root, '0', fused)
    return result, [str(w.message) for w in caught]


def pair(cls):
    """A plain module of ``cls`` and a copy of it to fuse."""
    torch.manual_seed(0)
    plain = cls().train()
    model = copy.deepcopy(plain)
    return plain, model
