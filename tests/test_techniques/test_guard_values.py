"""A Conv-BN trace's guards compare the settings it read exactly, by type
and value, and refuse a value they cannot compare."""
import collections
import copy
import math

import pytest
import torch
import torch.nn as nn
from mmengine.config import ConfigDict

from .conftest import fuse

_Pair = collections.namedtuple('_Pair', 'scale shift')


class _ReadsSettings(nn.Module):
    """Reads ``self.settings`` through ``read``, given at construction."""

    def __init__(self, settings, read):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.settings, self.read = settings, read

    def forward(self, x):
        return self.bn(self.conv(x)) * self.read(self.settings)


_SETTINGS_CASES = {
    # (value, how it is read, a change made in place or a replacement)
    'namedtuple': (_Pair(1.0, 0.0), lambda s: s.scale, _Pair(2.0, 0.0)),
    'ordered_dict_reordered':
    (collections.OrderedDict(a=1.0, b=2.0), lambda s: list(s.values())[0],
     lambda s: s.move_to_end('a')),
    'dict_reordered': ({
        'a': 1.0,
        'b': 2.0
    }, lambda s: list(s.values())[0], {
        'b': 2.0,
        'a': 1.0
    }),
    'negative_zero': ([0.0], lambda s: 1 / (s[0] - 1e-3), [-0.0]),
    'key_type': ({
        1: 'x'
    }, lambda s: list(s)[0], {
        1.0: 'x'
    }),
    'nan_unchanged': ([float('nan'), 1.0], lambda s: s[1], None),
    'config_dict_flag': (ConfigDict(c=1), lambda s: 2.0
                         if s.c is True else 1, ConfigDict(c=True)),
    'namedtuple_flag': (_Pair(1, 0), lambda s: 2.0
                        if s.scale is True else 1, _Pair(True, 0)),
    'config_dict_negative_zero':
    (ConfigDict(c=0.0), lambda s: s.c + 1, ConfigDict(c=-0.0)),
    'set_member_type': ({(1, )}, lambda s: len(s), {(True, )}),
    'config_dict_of_a_class': (ConfigDict(type=nn.ReLU), lambda s: 2.0
                               if s.type is nn.ReLU else 1.0,
                               ConfigDict(type=nn.GELU)),
    # a loop over a list, unrolled by the trace: a value appended must be
    # seen (found by mutation testing: lengths were not compared)
    'list_grown': ([0.5], math.prod, lambda s: s.append(3.0)),
}


@pytest.mark.parametrize('case', sorted(_SETTINGS_CASES))
def test_settings_of_every_shape_are_guarded_exactly(case):
    # found by two reviews: a namedtuple raised TypeError at fusion, an
    # OrderedDict or dict reordered, -0.0 and a key's type were not seen, a
    # NaN in a list never held; 1 and True, 0.0 and -0.0 were one inside a
    # ConfigDict, a namedtuple or a set; a ConfigDict holding a class left
    # the module unfused
    value, read, change = _SETTINGS_CASES[case]
    torch.manual_seed(0)
    plain = _ReadsSettings(copy.deepcopy(value), read)
    model = copy.deepcopy(plain)
    assert fuse(model)[0].fused_pairs == 1
    assert all(g.holds() for g in model.forward.guards)  # runs the trace
    x = torch.randn(2, 4, 5, 5)
    assert torch.equal(plain(x), model(x))
    if change is None:
        return
    for net in (plain, model):
        if callable(change):
            change(net.settings)
        else:
            net.settings = copy.deepcopy(change)
    assert not all(g.holds() for g in model.forward.guards)
    out, ref = model(x), plain(x)
    assert out.dtype == ref.dtype and torch.equal(out, ref)


def test_a_method_bound_to_an_object_leaves_the_module_unfused():
    # found by a review: it was kept by identity, and the object it reads
    # changed unseen
    config = {'scale': 1.0}
    model = _ReadsSettings('scale', config.get)
    result, messages = fuse(model)
    assert result.fused_pairs == 0 and 'reads _ReadsSettings.read' in \
        messages[0], messages
