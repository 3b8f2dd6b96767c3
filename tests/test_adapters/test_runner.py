"""MMDTRRunner: registered names, and memory keys translated exactly once."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.registry import HOOKS, MODELS
from mmengine.registry import RUNNERS as MMENGINE_RUNNERS
from mmengine.registry import DefaultScope

from mmdtr.adapters.config_translation import (MEMORY_KEY_HOOKS,
                                               MEMORY_KEY_TRANSLATORS,
                                               memory_key)
from mmdtr.adapters.runner import MMDTRRunner, check_amp_available
from mmdtr.errors import MmdtrError
from mmdtr.registry import RUNNERS

DUMMY_KEY = '_mmdtr_test_dummy_key'


@HOOKS.register_module(force=True)
class DummyMemoryHook(Hook):

    def __init__(self, value):
        self.value = value


@pytest.fixture
def dummy_key():
    """Register a dummy memory key; count its translations; clean up."""
    calls = []

    @memory_key(DUMMY_KEY, hook='DummyMemoryHook')
    def _translate(value):
        if value == 'bad':
            raise MmdtrError(f'{DUMMY_KEY}={value!r} is not accepted.')
        calls.append(value)
        return dict(type='DummyMemoryHook', value=value)

    yield calls
    MEMORY_KEY_TRANSLATORS.pop(DUMMY_KEY)
    MEMORY_KEY_HOOKS.pop(DUMMY_KEY)


@pytest.fixture
def make_cfg(toy_runner_cfg):

    def make(work_dir, **kwargs):
        return toy_runner_cfg(
            work_dir,
            'LinearToyModel',
            'RangeToyDataset',
            'runner',
            batch_size=2,
            log_level='WARNING',
            **kwargs)

    return make


def test_registered_names():
    assert RUNNERS.get('MMDTRRunner') is MMDTRRunner
    assert MMENGINE_RUNNERS.get('MMDTRRunner') is MMDTRRunner
    assert MMENGINE_RUNNERS.get('mmdtr.MMDTRRunner') is MMDTRRunner
    # a downstream repo's default scope does not hide the plain name
    with DefaultScope.overwrite_default_scope('mmengine'):
        with MMENGINE_RUNNERS.switch_scope_and_registry(None) as registry:
            assert registry.get('MMDTRRunner') is MMDTRRunner


def _from_cfg(cfg, load_train_tool):
    return MMDTRRunner.from_cfg(cfg)


def _downstream_build(runner_type):
    """What a downstream tools/train.py does with ``runner_type``."""

    def build(cfg, load_train_tool):
        cfg.runner_type = runner_type
        return MMENGINE_RUNNERS.build(cfg)

    return build


def _train_tool(cfg, load_train_tool):
    # tools/train.py translates, then builds: the runner must not redo it
    tool = load_train_tool()
    return tool.build_runner(tool.translate_memory_keys(cfg))


@pytest.mark.parametrize(
    'build', [
        _from_cfg,
        _downstream_build('MMDTRRunner'),
        _downstream_build('mmdtr.MMDTRRunner'), _train_tool
    ],
    ids=['from_cfg', 'runner_type', 'scoped_type', 'train_tool'])
def test_memory_keys_translated_once(make_cfg, load_train_tool, dummy_key,
                                     tmp_path, build):
    cfg = make_cfg(tmp_path, **{DUMMY_KEY: 'on'})
    runner = build(cfg, load_train_tool)
    assert isinstance(runner, MMDTRRunner)
    assert dummy_key == ['on']
    hooks = [h for h in runner.hooks if isinstance(h, DummyMemoryHook)]
    assert len(hooks) == 1 and hooks[0].value == 'on'
    assert DUMMY_KEY not in runner.cfg
    assert DUMMY_KEY in cfg  # the caller's config is left untouched
    runner.train()
    assert runner.iter == 2


def test_absent_key_adds_no_hook(make_cfg, dummy_key, tmp_path):
    runner = MMDTRRunner.from_cfg(make_cfg(tmp_path))
    assert dummy_key == []
    assert not any(isinstance(h, DummyMemoryHook) for h in runner.hooks)


def test_bad_key_fails_before_building(make_cfg, dummy_key, tmp_path):
    cfg = make_cfg(tmp_path / 'never', **{DUMMY_KEY: 'bad'})
    with pytest.raises(MmdtrError, match=DUMMY_KEY):
        MMDTRRunner.from_cfg(cfg)
    assert not (tmp_path / 'never').exists()


def test_plain_dict_config(make_cfg, linear_toy_model, dummy_key, tmp_path):
    cfg = copy.deepcopy(make_cfg(tmp_path, **{DUMMY_KEY: 3}).to_dict())
    runner = MMDTRRunner.from_cfg(cfg)
    assert dummy_key == [3]
    assert not runner.distributed
    assert isinstance(runner.model, linear_toy_model)  # not wrapped


@pytest.mark.skipif(torch.cuda.is_available(), reason='needs a CPU-only box')
@pytest.mark.parametrize('optim_wrapper, key', [
    (dict(type='AmpOptimWrapper', optimizer=dict(type='SGD',
                                                 lr=0.1)), 'optim_wrapper'),
    (dict(type='mmengine.AmpOptimWrapper',
          optimizer=dict(type='SGD')), 'optim_wrapper'),
    (dict(
        gen=dict(type='AmpOptimWrapper', optimizer=dict(type='SGD')),
        disc=dict(type='OptimWrapper',
                  optimizer=dict(type='SGD'))), 'optim_wrapper.gen'),
])
def test_amp_on_cpu_raises(make_cfg, tmp_path, optim_wrapper, key):
    # the message and its hint name the wrapper's key (a review)
    with pytest.raises(MmdtrError, match='AmpOptimWrapper') as info:
        check_amp_available(optim_wrapper)
    assert str(info.value).count(f'{key}.type=') == 2
    cfg = make_cfg(tmp_path, optim_wrapper=optim_wrapper)
    with pytest.raises(MmdtrError, match='AmpOptimWrapper'):
        MMDTRRunner.from_cfg(cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason='needs a CPU-only box')
def test_amp_on_cpu_raises_for_the_class_and_a_subclass():
    # new-style configs give the class (an audit: a mutant refusing names
    # only lived)
    from mmengine.optim import AmpOptimWrapper

    class MyAmp(AmpOptimWrapper):
        pass

    for cls in (AmpOptimWrapper, MyAmp):
        with pytest.raises(MmdtrError, match='needs a CUDA, NPU or MLU'):
            check_amp_available(dict(type=cls, optimizer=dict(type='SGD')))


def test_plain_optim_wrapper_passes():
    check_amp_available(dict(type='OptimWrapper', optimizer=dict(type='SGD')))
    check_amp_available(dict(optimizer=dict(type='SGD')))
    check_amp_available(None)


@MODELS.register_module(force=True)
class _FrozenConvBNToy(BaseModel):
    """A Conv-BN pair with a frozen norm, which efficient_conv_bn_eval
    traces into ``backbone``."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.backbone[1].eval()
        self.head = nn.Linear(4, 2)

    def forward(self, inputs, labels=None, mode='tensor'):
        logits = self.head(self.backbone(inputs).mean((2, 3)))
        if mode == 'loss':
            return dict(loss=F.cross_entropy(logits, labels))
        return logits


def _frozen_toy_cfg(toy_runner_cfg, work_dir, **keys):
    return toy_runner_cfg(
        work_dir,
        '_FrozenConvBNToy',
        dict(type='SeededToyImages', size=8),
        'names',
        runner_type='MMDTRRunner',
        **keys)


@pytest.mark.parametrize('keys, match', [
    (dict(activation_checkpointing=['backbone.7']), 'closest'),
    (dict(
        efficient_conv_bn_eval=['backbone'],
        activation_checkpointing=['backbone.1']), 'torch.fx trace'),
])
def test_module_names_are_checked_before_the_work_dir(tmp_path, toy_runner_cfg,
                                                      keys, match):
    # a downstream tools/train.py builds the runner from the config: a bad
    # name was refused in before_run, after the work dir was made, and a
    # module checkpointed inside a fused trace in before_train, after the
    # fusion changed the model (found by a review); as tools/train.py
    # does, the names are checked on a model built for it first
    work_dir = tmp_path / 'work'
    cfg = _frozen_toy_cfg(toy_runner_cfg, work_dir, **keys)
    with pytest.raises(MmdtrError, match=match):
        MMENGINE_RUNNERS.build(cfg)
    assert not work_dir.exists()
    cfg.launcher = 'pytorch'  # each rank checks in before_run instead
    with pytest.raises(MmdtrError, match='RANK'):  # the launcher's check
        MMENGINE_RUNNERS.build(cfg)
    assert not work_dir.exists()


@pytest.mark.parametrize('device', ['cpu', 'cuda'])
def test_a_launcher_without_its_variables_is_refused_before_the_work_dir(
        tmp_path, toy_runner_cfg, monkeypatch, device):
    # a downstream script built the runner under --launcher pytorch outside
    # torchrun: on a GPU machine MMEngine's init_dist raised KeyError: 'RANK'
    # (seen on an H200), on CPU the refusal came after the work dir was made
    monkeypatch.setattr('mmdtr.adapters.runner.get_device', lambda: device)
    for name in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK'):
        monkeypatch.delenv(name, raising=False)
    work_dir = tmp_path / 'work'
    cfg = _frozen_toy_cfg(toy_runner_cfg, work_dir, launcher='pytorch')
    with pytest.raises(MmdtrError, match='variable RANK'):
        MMENGINE_RUNNERS.build(cfg)
    assert not work_dir.exists()
