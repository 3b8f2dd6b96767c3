"""Runner and optimizer types checked when the config is read: a misspelt
name of mmdtr's or MMEngine's scope failed in the runner's build or in
``runner.train()``, in a traceback, after the work dir was made."""
import pytest
import torch
from mmengine.runner import Runner

from mmdtr.adapters.config_translation import translate_memory_keys
from mmdtr.errors import MmdtrError
from mmdtr.registry import OPTIMIZERS, RUNNERS


@pytest.fixture
def make_cfg(toy_runner_cfg, tmp_path):

    def make(model='LinearToyModel', **keys):
        return toy_runner_cfg(tmp_path, model, 'RangeToyDataset',
                              'runner_config_checks', **keys)

    return make


@pytest.mark.parametrize(
    'keys, match',
    [
        (dict(runner_type='MMDTRrunner'),
         r"runner_type='MMDTRrunner' is not registered.*closest match: "
         r"'MMDTRRunner'"),
        (dict(runner_type='mmengine.Runer'),
         r"runner_type='mmengine.Runer' is not registered.*closest match: "
         r"'Runner'"),
        (dict(runner_type=3), 'runner_type=3 is not accepted'),
        (dict(optimizer=dict(type='SGDD', lr=0.1)),
         r"optimizer.type='SGDD' is not registered.*closest match: 'SGD'"),
        (dict(optimizer=dict(type='mmdtr.AdamWW', lr=0.1)),
         r"optimizer.type='mmdtr.AdamWW' is not registered"),
        # a raw TypeError of SGD.__init__ in runner.train()
        (dict(optimizer=dict(type='SGD', lr=0.1, accumulative_counts=2)),
         r'optimizer.accumulative_counts=2 is not accepted: not an argument '
         r'of SGD.*belong to optim_wrapper itself'),
        (dict(optimizer=dict(type='SGD', lr=0.1, momentm=0.9)),
         'rename momentm to momentum'),
        # a KeyError when the runner built the model, after its work dir;
        # --check-config passed it (found by a new-user walkthrough)
        (dict(model=dict(type='LinearToyModl')),
         r"model.type='LinearToyModl' is not registered.*closest match: "
         r"'LinearToyModel'; mmdtr's: \[.*'ResNetClassifier'"),
        (dict(model=dict(type='mmengine.LinearToyModl')),
         r"model.type='mmengine.LinearToyModl' is not registered"),
        (dict(model=dict(depth=50)), r"model=\{'depth': 50\} has no type"),
        # looked up as MMEngine's builder does (found by a review): under
        # mmdtr's scope, 'mmdtr.X' is looked for in mmdtr's registry alone
        (dict(default_scope='mmdtr', model=dict(type='mmdtr.LinearToyModel')),
         r"model.type='mmdtr.LinearToyModel' is not registered"),
        (dict(default_scope='mmdtr', optimizer=dict(type='mmdtr.SGD', lr=0.1)),
         r"optimizer.type='mmdtr.SGD' is not registered"),
        # mmdtr's model by its plain name, no default_scope: MMEngine's
        # root registry does not have it
        (dict(model=dict(type='ResNetClassifier', depth=18, num_classes=2)),
         r"model: type='ResNetClassifier' is mmdtr's, but MMEngine's builder "
         r'looks it up in the config.s scope \(no default_scope'),
        # its arguments are checked on the class found (they were not)
        (dict(optimizer=dict(type='mmdtr.SGD', lr=0.1, momentm=0.9)),
         'rename momentm to momentum'),
        # values torch.optim refuses: a raw TypeError or ValueError of its
        # __init__ in runner.train(), after the work dir was made
        (dict(optimizer=dict(type='SGD', lr='abc', momentum=0.9)),
         r"optim_wrapper.optimizer.lr='abc': not accepted by "
         r'torch.optim.SGD, which raised TypeError'),
        (dict(optimizer=dict(type='Adam', lr=0.1, betas=(1.5, 0.9))),
         r'optimizer.betas=\(1.5, 0.9\): not accepted by torch.optim.Adam, '
         r'which raised ValueError: Invalid beta'),
        (dict(optimizer=dict(type='SGD', lr=0.1, nesterov=True)),
         r'optimizer.nesterov=True: not accepted by .*Nesterov'),
    ],
    ids=[
        'runner_typo', 'runner_scoped_typo', 'runner_int', 'optimizer_typo',
        'optimizer_scoped_typo', 'optimizer_wrapper_key', 'optimizer_arg_typo',
        'model_typo', 'model_scoped_typo', 'model_without_type',
        'mmdtr_scoped_model_in_mmdtr_scope',
        'mmdtr_scoped_optimizer_in_mmdtr_scope', 'mmdtr_model_unscoped',
        'mmdtr_scoped_optimizer_arg_typo', 'optimizer_value_type',
        'optimizer_value_range', 'optimizer_values_together'
    ])
def test_unregistered_types_are_refused_before_the_runner(
        keys, match, make_cfg, tmp_path):
    cfg = make_cfg(**keys)
    with pytest.raises(MmdtrError, match=match) as info:
        translate_memory_keys(cfg)
    assert 'Hint:' in str(info.value)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    'keys',
    [
        dict(runner_type='MMDTRRunner'),
        dict(runner_type='mmdtr.MMDTRRunner'),
        dict(runner_type='Runner'),
        dict(runner_type=Runner),
        dict(runner_type='mmdet.AnyRunner'),  # another scope's: MMEngine's
        dict(runner_type='AnyRunner', default_scope='mmdet'),
        dict(optimizer=dict(type='AdamW', lr=0.1)),
        dict(optimizer=dict(type='mmdet.AnyOptimizer', lr=0.1)),
        dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9, nesterov=True)),
        dict(optimizer=dict(type='ZeroRedundancyOptimizer', lr=0.1, any=1)),
        # MMEngine's, by mmdtr's scope: its builder finds them in mmdtr's
        # registry's parent (the check refused them)
        dict(model=dict(type='mmdtr.LinearToyModel')),
        dict(runner_type='mmdtr.Runner'),
        dict(optimizer=dict(type='mmdtr.SGD', lr=0.1)),
        dict(model=dict(type='mmpretrain.ImageClassifier')),  # MMEngine's
        dict(model=dict(type='ImageClassifier'), default_scope='mmpretrain'),
        dict(model=dict(type='AnyNet', _scope_='mmrazor')),  # MMEngine's
        dict(
            model=dict(type='ResNetClassifier', depth=18, num_classes=2),
            default_scope='mmdtr'),
        dict(
            model=dict(type='mmdtr.ResNetClassifier', depth=18,
                       num_classes=2)),
        dict(model=dict(type='LinearToyModel', _scope_='mmdtr')),
    ])
def test_registered_types_and_other_scopes_pass(keys, make_cfg):
    translate_memory_keys(make_cfg(**keys))


def test_an_optimizer_of_another_scope_may_take_other_arguments(make_cfg):
    # its own SGD, registered in its scope, was checked against torch's (a
    # review)
    translate_memory_keys(
        make_cfg(
            default_scope='myproj',
            optimizer=dict(type='SGD', lr=0.1, grad_centralization=True)))
    translate_memory_keys(
        make_cfg(
            optimizer=dict(
                type='SGD', _scope_='myproj', lr=0.1, grad_centralization=1)))


def test_a_custom_constructor_reads_the_optimizer_its_own_way(make_cfg):
    cfg = make_cfg(optimizer=dict(type='NotAnOptimizer', lr=0.1))
    cfg.optim_wrapper.constructor = 'mmdet.LayerDecayConstructor'
    translate_memory_keys(cfg)


@RUNNERS.register_module(force=True)
class _RunnerOfMmdtrsAlone(Runner):
    """A runner only mmdtr's registry has."""


@OPTIMIZERS.register_module(force=True)
class _OptimizerOfMmdtrsAlone(torch.optim.SGD):
    """An optimizer only mmdtr's registry has."""


def test_lookups_follow_mmengines_builders(make_cfg):
    # found by a review: a runner only mmdtr's registry has, built by a
    # script under mmdtr's scope, was refused (looked up in MMEngine's root
    # alone)
    translate_memory_keys(
        make_cfg(default_scope='mmdtr', runner_type='_RunnerOfMmdtrsAlone'))
    # the default constructor looks the optimizer up in the config's scope
    # whatever its _scope_ (then builds it there): it failed in train()
    with pytest.raises(
            MmdtrError,
            match="optimizer.type='_OptimizerOfMmdtrsAlone' is not "
            "registered. Hint: closest match: "
            "'mmdtr._OptimizerOfMmdtrsAlone'"):
        translate_memory_keys(
            make_cfg(
                optimizer=dict(
                    type='_OptimizerOfMmdtrsAlone', _scope_='mmdtr', lr=0.1)))
    translate_memory_keys(
        make_cfg(
            optimizer=dict(
                type='mmdtr._OptimizerOfMmdtrsAlone', _scope_='mmdtr',
                lr=0.1)))
    # the closest match is given as MMEngine finds it out of mmdtr's scope
    # (the plain name was refused next)
    with pytest.raises(
            MmdtrError, match="closest match: 'mmdtr.ResNetClassifier'"):
        translate_memory_keys(
            make_cfg(model=dict(type='ResNetClasifier', depth=18)))


@pytest.mark.parametrize(
    'optimizer',
    [
        dict(type='SGD', lr=0.1, momentum=0.9, nesterov=True),
        dict(type='Adam', lr=1e-3, betas=[0.9, 0.999]),
        # the parameters' argument, which MMEngine's constructor sets
        # (found by a review: "got multiple values for argument 'params'")
        dict(type='SGD', lr=0.1, params=None),
        # Muon takes 2-D parameters only: the probe is 1x1, and one it
        # refuses with no values is not blamed on a value (found by a
        # review: every Muon config was refused)
        pytest.param(
            dict(type='Muon', lr=0.02),
            marks=pytest.mark.skipif(
                not hasattr(torch.optim, 'Muon'),
                reason='torch.optim.Muon is new in PyTorch 2.9')),
    ],
    ids=['sgd', 'adam_betas_list', 'params_key', 'muon'])
def test_optimizer_values_torch_accepts_pass(optimizer, make_cfg):
    translate_memory_keys(make_cfg(optimizer=optimizer))


def test_values_of_other_optimizers_are_left_to_them(make_cfg):
    # one that is not torch.optim's may need the model or a process group
    # to be built: not built for the check

    class Picky(torch.optim.SGD):

        def __init__(self, params, lr=0.1):
            raise ValueError('needs the whole model')

    translate_memory_keys(make_cfg(optimizer=dict(type=Picky, lr=0.1)))


def test_device_switches_are_not_checked_on_a_cpu_parameter(make_cfg):
    # fused and capturable may need the parameters' device (CUDA), which
    # the one CPU parameter the check builds has not

    class CudaFused(torch.optim.SGD):

        def __init__(self, params, lr=0.1, fused=None):
            if fused and params[0].device.type != 'cuda':
                raise ValueError('fused=True needs CUDA parameters')
            super().__init__(params, lr=lr)

    CudaFused.__module__ = 'torch.optim.sgd'  # as torch.optim's own
    translate_memory_keys(
        make_cfg(optimizer=dict(type=CudaFused, lr=0.1, fused=True)))
    with pytest.raises(MmdtrError, match=r'optimizer.lr=-1: not accepted'):
        translate_memory_keys(
            make_cfg(optimizer=dict(type=CudaFused, lr=-1, fused=True)))


@pytest.mark.parametrize(
    'mp_cfg, match',
    [
        (dict(mp_start_method='bogus'),
         "mp_start_method='bogus' is not a start method of this platform; "
         'accepted: '),
        (dict(mp_start_methd='fork'),
         "env_cfg.mp_cfg.mp_start_methd='fork' is "
         'not accepted.*rename mp_start_methd to mp_start_method'),
        ('fork', "env_cfg.mp_cfg='fork' is not accepted"),
        # MMEngine's setup_env passes it with ** (a review)
        (None, 'env_cfg.mp_cfg=None is not accepted'),
    ])
def test_mp_cfg_is_checked_before_the_runner(mp_cfg, match, make_cfg):
    # MMEngine's set_multi_processing raised it as the runner set up, after
    # the work dir was made, once per rank (found by an adversarial search)
    with pytest.raises(MmdtrError, match=match):
        translate_memory_keys(make_cfg(env_cfg=dict(mp_cfg=mp_cfg)))


@pytest.mark.parametrize(
    'mp_cfg',
    [
        None,
        dict(),
        dict(mp_start_method='spawn', opencv_num_threads=0),
        dict(mp_start_method='fork'),
        dict(mp_start_method=None),  # the platform's default (a review)
    ])
def test_mp_cfg_of_set_multi_processing_passes(mp_cfg, make_cfg):
    env_cfg = dict(mp_cfg=mp_cfg) if mp_cfg is not None else dict()
    translate_memory_keys(make_cfg(env_cfg=env_cfg))
