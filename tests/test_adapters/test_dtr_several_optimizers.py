"""DTR with several optimizers (an ``OptimWrapperDict``), as GANs train.

The engine spans the whole ``train_step``: two forwards, two backwards and
two optimizer steps under one engine. The oracle is the same steps without
DTR: losses, parameters, BatchNorm buffers, momenta and the global RNG
stream bit for bit.
"""
import copy
import functools
import uuid

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.logging import MessageHub
from mmengine.model import BaseModel
from mmengine.optim import OptimWrapper, OptimWrapperDict, build_optim_wrapper
from mmengine.registry import DATASETS, MODELS, OPTIM_WRAPPER_CONSTRUCTORS
from torch.utils.data import Dataset

from mmdtr.adapters.dtr_train_step import DTRTrainStep
from mmdtr.adapters.runner import MMDTRRunner
from mmdtr.dtr import engine_active

DTR_CFG = dict(eviction_threshold='64KB', evictee_minimum_size='4KB')

pytestmark = pytest.mark.usefixtures('single_thread')


def _conv_block(cin, cout, dropout=0.0):
    layers = [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout)]
    layers.append(nn.ReLU(inplace=True))
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


@MODELS.register_module(force=True)
class DTRToyGAN(BaseModel):
    """A generator (with dropout) and a discriminator, one optimizer each.

    ``train_step`` updates the discriminator, then the generator, as
    mmagic's GANs do; the noise comes from the global RNG.
    """

    def __init__(self):
        super().__init__()
        self.generator = nn.Sequential(
            _conv_block(8, 8, dropout=0.2), _conv_block(8, 8),
            nn.Conv2d(8, 3, 3, padding=1))
        self.discriminator = nn.Sequential(
            _conv_block(3, 8), _conv_block(8, 8), nn.AdaptiveAvgPool2d(1),
            nn.Flatten(), nn.Linear(8, 1))
        self.fail_after_discriminator = False

    def forward(self, inputs, data_samples=None, mode='tensor'):
        return self.generator(inputs)

    def train_step(self, data, optim_wrapper):
        real = self.data_preprocessor(data, True)['inputs']  # to the device
        noise = torch.randn(
            real.shape[0], 8, *real.shape[2:], device=real.device)
        disc, gen = optim_wrapper['discriminator'], optim_wrapper['generator']
        with disc.optim_context(self.discriminator):
            with torch.no_grad():
                fake = self.generator(noise)
            loss_d = F.softplus(self.discriminator(fake)).mean() + \
                F.softplus(-self.discriminator(real)).mean()
            disc.update_params(loss_d)
        if self.fail_after_discriminator:
            raise RuntimeError('generator step failed')
        with gen.optim_context(self.generator):
            loss_g = F.softplus(-self.discriminator(self.generator(noise)))
            gen.update_params(loss_g.mean())
        return dict(loss_d=loss_d.detach(), loss_g=loss_g.detach().mean())


@DATASETS.register_module(force=True)
class DTRToyImages(Dataset):
    """Eight seeded random 3x12x12 images."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return dict(inputs=torch.randn(3, 12, 12, generator=g))


@OPTIM_WRAPPER_CONSTRUCTORS.register_module(force=True)
class PerSubmoduleOptimWrapperConstructor:
    """One optimizer wrapper per named submodule, in an OptimWrapperDict
    (what mmagic's ``MultiOptimWrapperConstructor`` does for GANs)."""

    def __init__(self, optim_wrapper_cfg, paramwise_cfg=None):
        self.cfgs = optim_wrapper_cfg

    def __call__(self, model):
        model = getattr(model, 'module', model)
        return OptimWrapperDict(
            **{
                name: build_optim_wrapper(getattr(model, name), cfg)
                for name, cfg in self.cfgs.items()
            })


def _optim_wrappers(model):
    """SGD with momentum: the generator's a foreach step (one op writes all
    its parameters), the discriminator's a loop."""

    def sgd(module, foreach):
        return OptimWrapper(
            torch.optim.SGD(
                module.parameters(), lr=0.1, momentum=0.9, foreach=foreach))

    return OptimWrapperDict(
        generator=sgd(model.generator, True),
        discriminator=sgd(model.discriminator, False))


def _images(i):
    """Batch ``i`` of four images, as the runner's dataloader makes it."""
    images = DTRToyImages()
    return dict(
        inputs=torch.stack(
            [images[j]['inputs'] for j in range(4 * i, 4 * i + 4)]))


def assert_same_training_state(model_a, optims_a, model_b, optims_b):
    state_b = model_b.state_dict()
    for name, value in model_a.state_dict().items():  # params and buffers
        assert torch.equal(value, state_b[name]), name
    for key in ('generator', 'discriminator'):
        states_a = optims_a[key].optimizer.state_dict()['state']
        states_b = optims_b[key].optimizer.state_dict()['state']
        assert states_a.keys() == states_b.keys()
        for i, state in states_a.items():
            assert torch.equal(state['momentum_buffer'],
                               states_b[i]['momentum_buffer']), (key, i)


def test_two_optimizers_bit_identical_under_dtr():
    torch.manual_seed(0)
    plain = DTRToyGAN()
    model = copy.deepcopy(plain)
    plain_optims, optims = _optim_wrappers(plain), _optim_wrappers(model)
    steps_under_dtr = []
    for name, wrapper in optims.items():
        wrapper.optimizer.register_step_pre_hook(
            lambda *_, name=name: steps_under_dtr.append(
                (name, engine_active())))
    step = DTRTrainStep(
        DTR_CFG, message_hub=MessageHub.get_instance(uuid.uuid4().hex))
    for i in range(2):
        torch.manual_seed(10 + i)
        expected = plain.train_step(_images(i), plain_optims)
        after_plain = torch.get_rng_state()
        torch.manual_seed(10 + i)
        got = step(model.train_step, _images(i), optims)
        assert torch.equal(torch.get_rng_state(), after_plain)
        for key, value in expected.items():
            assert torch.equal(value, got[key]), key
        assert step.stats.evictions > 0 and step.stats.recomputations > 0
        assert torch._C._len_torch_dispatch_stack() == 0
    assert_same_training_state(plain, plain_optims, model, optims)
    assert steps_under_dtr == [('discriminator', True),
                               ('generator', True)] * 2

    model.fail_after_discriminator = True
    stats = step.stats
    with pytest.raises(RuntimeError, match='generator step failed'):
        step(model.train_step, _images(0), optims)
    assert step.stats is stats  # nothing published for a failed step
    assert not engine_active()
    assert torch._C._len_torch_dispatch_stack() == 0


def _train_gan(toy_runner_cfg, tmp_path, name, **keys):
    """Train DTRToyGAN with one SGD per sub-module; ``keys`` override."""
    sgd = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))
    cfg = toy_runner_cfg(
        tmp_path / name,
        'DTRToyGAN',
        'DTRToyImages',
        name,
        optim_wrapper=dict(
            constructor='PerSubmoduleOptimWrapperConstructor',
            generator=sgd,
            discriminator=sgd),
        log_level='WARNING',
        randomness=dict(seed=1),
        **keys)
    runner = MMDTRRunner.from_cfg(cfg)
    runner.train()
    return runner


def test_runner_with_dtr_key_and_two_optimizers(tmp_path, toy_runner_cfg):
    run = functools.partial(_train_gan, toy_runner_cfg, tmp_path)
    plain = run('plain')
    dtr = run('dtr', dtr=DTR_CFG)
    assert isinstance(dtr.optim_wrapper, OptimWrapperDict)
    assert_same_training_state(plain.model, plain.optim_wrapper, dtr.model,
                               dtr.optim_wrapper)
    evictions = dtr.message_hub.get_scalar('train/dtr_evictions').data[0]
    assert len(evictions) == 2 and min(evictions) > 0


def test_separate_ddp_with_two_optimizers_under_dtr(single_rank_env, tmp_path,
                                                    toy_runner_cfg):
    # MMEngine's MMSeparateDistributedDataParallel passed CUDA device_ids to
    # each sub-module's DDP and failed on CPU, where mmdtr's takes its
    # place; on CUDA MMEngine's own runs (nccl). A run per rank is bit for
    # bit the same steps as one process (a group of one here; two
    # processes on CPU were checked by an adversarial search)
    from mmengine.model import MMSeparateDistributedDataParallel

    from mmdtr.adapters.distributed import MMDTRSeparateDistributedDataParallel
    run = functools.partial(_train_gan, toy_runner_cfg, tmp_path)
    plain = run('plain')
    dtr = run(
        'dtr',
        dtr=DTR_CFG,
        launcher='pytorch',
        model_wrapper_cfg=dict(type='MMSeparateDistributedDataParallel'))
    assert type(dtr.model) is (MMSeparateDistributedDataParallel
                               if torch.cuda.is_available() else
                               MMDTRSeparateDistributedDataParallel)
    # each sub-module is wrapped: 'generator.module.0.0.weight'
    state = {
        name.replace('.module.', '.'): value
        for name, value in dtr.model.module.state_dict().items()
    }
    assert state.keys() == plain.model.state_dict().keys()
    for name, value in plain.model.state_dict().items():
        assert torch.equal(value, state[name]), name
    for key in ('generator', 'discriminator'):
        momenta = [
            (s['momentum_buffer'], t['momentum_buffer'])
            for s, t in zip(plain.optim_wrapper[key].optimizer.state.values(),
                            dtr.optim_wrapper[key].optimizer.state.values())
        ]
        assert momenta and all(torch.equal(a, b) for a, b in momenta)
    evictions = dtr.message_hub.get_scalar('train/dtr_evictions').data[0]
    assert min(evictions) > 0
