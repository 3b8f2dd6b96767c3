"""Module names and glob patterns resolved against named_modules()."""
import pytest
import torch
import torch.nn as nn

from mmdtr.errors import MmdtrError
from mmdtr.techniques.module_selection import (as_name_list, called_modules,
                                               closest_names, match_pattern,
                                               outermost, resolve_modules)


def _model():
    backbone = nn.Module()
    for i in range(1, 4):
        setattr(backbone, f'layer{i}',
                nn.Sequential(nn.Conv2d(1, 1, 1), nn.ReLU()))
    backbone.stem = nn.Conv2d(1, 1, 1)
    model = nn.Module()
    model.backbone = backbone
    model.neck = nn.Linear(1, 1)
    return model


@pytest.mark.parametrize('pattern, name, expected', [
    ('backbone.layer*', 'backbone.layer1', True),
    ('backbone.layer*', 'backbone.layer1.0', False),
    ('backbone.layer?', 'backbone.layer2', True),
    ('backbone.layer[12]', 'backbone.layer3', False),
    ('**.0', 'backbone.layer1.0', True),
    ('**', 'neck', True),
    ('backbone.**.1', 'backbone.layer3.1', True),
    ('backbone.**', 'backbone', True),
    ('neck', 'neck.0', False),
])
def test_match_pattern(pattern, name, expected):
    assert match_pattern(pattern, name) is expected


def test_resolve_exact_and_glob_in_model_order():
    model = _model()
    found = resolve_modules(model, ['neck', 'backbone.layer*'])
    assert list(found) == [
        'backbone.layer1', 'backbone.layer2', 'backbone.layer3', 'neck'
    ]
    assert found['neck'] is model.neck
    assert list(resolve_modules(model, 'backbone.stem')) == ['backbone.stem']


def test_shared_module_listed_once():
    model = _model()
    model.alias = model.neck
    assert list(resolve_modules(model, ['neck', 'alias'])) == ['neck']


def test_unknown_name_lists_closest_matches():
    with pytest.raises(MmdtrError) as info:
        resolve_modules(_model(), ['neck', 'backbone.layr1'], key='mykey')
    text = str(info.value)
    assert text.startswith('mmdtr: mykey:')
    assert "'backbone.layr1'" in text
    assert "closest matches: ['backbone.layer1'" in text
    assert 'Hint:' in text


def test_unmatched_glob_suggests_from_its_stem():
    with pytest.raises(MmdtrError, match=r"closest matches: \['backbone"):
        resolve_modules(_model(), 'backbone.stage*')


def test_far_off_name_lists_top_level_modules():
    with pytest.raises(
            MmdtrError, match=r"top-level modules: \['backbone', 'neck'\]"):
        resolve_modules(_model(), 'zzzzzz')


@pytest.mark.parametrize('value', [None, 3, '', [], ['ok', ''], [1], {}])
def test_malformed_values(value):
    with pytest.raises(MmdtrError, match='is not accepted'):
        as_name_list(value, 'mykey')


def test_malformed_value_is_named_as_given():
    with pytest.raises(MmdtrError, match="mykey='' is not accepted"):
        as_name_list('', 'mykey')


def test_containers_stand_for_their_members():
    model = _model()  # backbone: a plain Module, which nothing calls
    model.heads = nn.ModuleList(
        [nn.Linear(1, 1), nn.ModuleDict({'a': model.neck})])
    assert called_modules(model, ['backbone', 'heads']) == [
        'backbone.layer1', 'backbone.layer2', 'backbone.layer3',
        'backbone.stem', 'heads.0', 'heads.1.a'
    ]
    assert called_modules(model, ['neck', 'heads']) == ['neck', 'heads.0']
    # holders of parameters or buffers stand for nothing (a review: '**'
    # refused every model holding one)
    model.empty = nn.ModuleList()
    model.pos = nn.ParameterList([nn.Parameter(torch.zeros(1))])
    assert called_modules(model, ['neck', 'empty', 'pos']) == ['neck']
    with pytest.raises(
            MmdtrError, match=r"mykey: \['empty', 'pos'\] hold no module"):
        called_modules(model, ['empty', 'pos'], 'mykey')


def test_outermost_and_closest():
    assert outermost(['a', 'a.b', 'ab', 'c.d', 'c']) == ['a', 'ab', 'c']
    assert closest_names('layr1', ['layer1', 'neck']) == ['layer1']
