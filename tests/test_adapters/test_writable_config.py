"""A config the runner cannot write (an object in it) is refused before the
work dir is made: MMEngine's Runner failed in yapf's raw SyntaxError after
making it (found by an adversarial search)."""
import pytest
import torch
from mmengine.config import Config

from mmdtr.adapters.runner import MMDTRRunner
from mmdtr.adapters.writable_config import refuse_unwritable
from mmdtr.core.policies import LRUPolicy
from mmdtr.errors import MmdtrError


@pytest.mark.parametrize(
    'keys,where,hint',
    [
        (dict(custom_hooks=[
            dict(
                type='mmdtr.DTRHook',
                eviction_threshold='3GB',
                policy=LRUPolicy())
        ]), 'custom_hooks[0].policy=', 'register_policy'),
        (dict(model_wrapper_cfg=dict(dtr=dict(policy=LRUPolicy()))),
         'model_wrapper_cfg.dtr.policy=', 'register_policy'),
        (dict(P=LRUPolicy), "P=<class 'mmdtr.core.policies.LRUPolicy'>",
         'register_policy'),
        # the policy hint is for eviction policies only (a review)
        (dict(custom_hooks=[dict(type='MyHook', lr_policy=print)]),
         'custom_hooks[0].lr_policy=<built-in function print>', "type='...'"),
        (dict(a={'from': 1}), 'a.from=1', 'rename the key'),
        (dict(model=torch.nn.Sequential(torch.nn.Linear(2, 2))),
         'model=Sequential(', 'type='),
    ])
def test_a_value_without_source_is_named(keys, where, hint):
    cfg = Config(dict(work_dir='w', **keys))
    with pytest.raises(MmdtrError, match='cannot be written') as info:
        refuse_unwritable(cfg)
    assert where in info.value.message
    assert hint in info.value.hint


def test_writable_configs_pass():
    # a repr that is a Python expression is written as it is by MMEngine
    refuse_unwritable(
        Config(
            dict(
                model=torch.nn.Linear(2, 2),
                dtr=dict(eviction_threshold='3GB', policy='lru'),
                dtype=torch.float32,
                custom_hooks=[dict(type='mmdtr.DTRHook')],
                sizes=(1, 2.5, None, True))))


def test_runner_refuses_before_making_the_work_dir(toy_runner_cfg, tmp_path):
    work_dir = tmp_path / 'work'
    cfg = toy_runner_cfg(
        str(work_dir),
        'LinearToyModel',
        'RangeToyDataset',
        'writable_config',
        custom_hooks=[
            dict(
                type='mmdtr.DTRHook',
                eviction_threshold='1GB',
                policy=LRUPolicy())
        ])
    with pytest.raises(MmdtrError, match=r'custom_hooks\[0\]\.policy='):
        MMDTRRunner.from_cfg(cfg)
    assert not work_dir.exists()


def test_check_config_refuses_it(train_tool, toy_config, tmp_path, capsys):
    # --check-config said the config was accepted
    config = tmp_path / 'with_object.py'
    config.write_text(
        f'_base_ = [{toy_config!r}]\n'
        "P = __import__('mmdtr.core.policies', fromlist=['x']).LRUPolicy\n")
    work_dir = tmp_path / 'work'
    with pytest.raises(SystemExit):
        train_tool.main(
            [str(config), '--check-config', '--work-dir',
             str(work_dir)])
    assert 'P=<class' in capsys.readouterr().err
    assert not work_dir.exists()


NEW_STYLE = """
from mmengine.runner import IterBasedTrainLoop
train_cfg = dict(type=IterBasedTrainLoop, max_iters=1)
"""


def test_new_style_configs_name_the_value_not_an_import(tmp_path):
    # reading its keys turns a new-style config's imports into classes,
    # which were named instead of the value at fault (a review)
    path = tmp_path / 'new_style.py'
    path.write_text(NEW_STYLE + "bad = dict(a={'from': 1})\n")
    cfg = Config.fromfile(str(path))
    with pytest.raises(MmdtrError, match=r'bad\.a\.from=1 cannot be written'):
        refuse_unwritable(cfg)
    path.write_text(NEW_STYLE)
    refuse_unwritable(Config.fromfile(str(path)))  # written as MMEngine does


class _WrittenByStr:
    """Its repr is Python, its str not: MMEngine writes str."""

    def __repr__(self):
        return '_WrittenByStr()'

    def __str__(self):
        return '<written by str>'


def test_values_are_read_as_written_and_shown_on_one_line():
    # repr was parsed where MMEngine writes str, and a multi-line value
    # broke the message over lines (a review)
    with pytest.raises(MmdtrError, match='a=<written by str> cannot'):
        refuse_unwritable(Config(dict(a=_WrittenByStr())))
    with pytest.raises(MmdtrError) as info:
        refuse_unwritable(
            Config(dict(model=torch.nn.Sequential(torch.nn.ReLU()))))
    assert 'model=Sequential( (0): ReLU() )' in info.value.message
