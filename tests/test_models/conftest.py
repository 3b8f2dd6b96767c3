import pytest
import torch.nn as nn


def _biases_cancelled_by_next_bn(model: nn.Module) -> set:
    """Names of BN biases whose gradient is zero by construction.

    In ``conv, BN, conv, BN`` with no non-linearity between the BNs, the
    first BN's bias adds a per-channel constant that the linear conv maps
    to a per-channel constant, which the second (train-mode) BN subtracts:
    the bias gets an exactly-zero gradient (up to rounding).
    """
    names = set()
    for seq_name, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        layers = list(seq.named_children())
        for i in range(len(layers) - 2):
            (bn_name, bn), (_, conv), (_, next_bn) = layers[i:i + 3]
            if (isinstance(bn, nn.BatchNorm2d) and isinstance(conv, nn.Conv2d)
                    and isinstance(next_bn, nn.BatchNorm2d)):
                names.add(f'{seq_name}.{bn_name}.bias')
    return names


@pytest.fixture
def biases_cancelled_by_next_bn():
    return _biases_cancelled_by_next_bn
