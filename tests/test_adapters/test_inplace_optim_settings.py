"""Settings of InplaceOptimWrapper: refused when the wrapper is built, and
already when the config is translated, before the runner is built."""
import re

import pytest
import torch.nn as nn
from mmengine.config import Config
from mmengine.optim import build_optim_wrapper

from mmdtr.adapters.config_translation import translate_memory_keys
from mmdtr.adapters.inplace_optim_settings import check_wrapper_config
from mmdtr.errors import MmdtrError


def _refusals():
    sgd = dict(type='SGD', lr=0.1)
    value = dict(type='value', clip_value=0.1)
    bf16 = dict(dtype='bfloat16')
    return {
        'accumulation':
        (dict(accumulative_counts=2,
              step_in_backward=True), sgd, 'accumulative_counts=2'),
        'norm_clip':
        (dict(clip_grad=dict(max_norm=1.0),
              step_in_backward=True), sgd, 'clip_grad='),
        'loss_scale': (dict(amp=dict(dtype='float16'), step_in_backward=True),
                       sgd, "amp.loss_scale='dynamic'"),
        'not_bool':
        (dict(step_in_backward='yes'), sgd, "step_in_backward='yes'"),
        'foreach': (dict(), dict(sgd, foreach=True), 'foreach=True'),
        # truthy: torch steps them as foreach=True; they passed the config
        # check (found by an adversarial search)
        'foreach_one': (dict(), dict(sgd, foreach=1), 'foreach=1'),
        'foreach_str': (dict(), dict(sgd, foreach='True'), "foreach='True'"),
        'lbfgs': (dict(step_in_backward=True), dict(type='LBFGS'), 'LBFGS'),
        'amp_key': (dict(amp=dict(dtype='float16', scale=2.0)), sgd,
                    'amp.scale=2.0 is not accepted'),
        'amp_dtype': (dict(amp=dict(dtype='int8')), sgd, "amp.dtype='int8'"),
        # AmpOptimWrapper's keys: the hint said "rename dtype to type"
        # (found by an adversarial search)
        'amp_keys_at_the_top': (dict(dtype='bfloat16', loss_scale='dynamic'),
                                sgd, "move them into optim_wrapper.amp"),
        'amp_key_misspelt_at_the_top':
        (dict(dtyp='bfloat16'), sgd, "optim_wrapper.dtyp='bfloat16' is not "
         "accepted: AmpOptimWrapper's"),
        'amp_scale': (dict(amp=dict(loss_scale='static')), sgd,
                      "amp.loss_scale='static'"),
        # a negative clip_value clamps every gradient to it
        'clip_negative':
        (dict(clip_grad=dict(value, clip_value=-1), step_in_backward=True),
         sgd, 'clip_grad.clip_value=-1 is not accepted; expected a positive '
         'finite number'),
        'clip_negative_after_backward':
        (dict(clip_grad=dict(value, clip_value=-1)), sgd, 'clip_value=-1'),
        'clip_nan': (dict(clip_grad=dict(value, clip_value=float('nan'))), sgd,
                     'clip_value=nan'),
        'clip_inf': (dict(
            clip_grad=dict(value, clip_value=float('inf')),
            step_in_backward=True), sgd, 'clip_value=inf'),
        'clip_bool': (dict(clip_grad=dict(value, clip_value=True)), sgd,
                      'clip_value=True'),
        'clip_str':
        (dict(clip_grad=dict(value, clip_value='abc'),
              step_in_backward=True), sgd, "clip_value='abc'"),
        'clip_list': (dict(clip_grad=[1.0], step_in_backward=True), sgd,
                      'clip_grad=[1.0] is not accepted'),
        'clip_empty': (dict(clip_grad={}), sgd, 'clip_grad={}'),
        'clip_type': (dict(clip_grad=dict(type='values', clip_value=1.0)), sgd,
                      "clip_grad.type='values'"),
        'clip_key': (dict(clip_grad=dict(max_norm=1.0, norm_typ=2)), sgd,
                     'clip_grad.norm_typ=2 is not accepted'),
        'clip_missing': (dict(clip_grad=dict(type='norm')), sgd,
                         'needs max_norm'),
        'max_norm_zero': (dict(clip_grad=dict(max_norm=0)), sgd,
                          'clip_grad.max_norm=0'),
        'max_norm_inf': (dict(clip_grad=dict(max_norm=float('inf'))), sgd,
                         'clip_grad.max_norm=inf'),
        'norm_type': (dict(clip_grad=dict(max_norm=1.0, norm_type=-2)), sgd,
                      'clip_grad.norm_type=-2'),
        # torch's 0-"norm" counts the non-zero entries (found by mutation
        # testing: 0 was accepted with a bound of >= 0)
        'norm_type_zero': (dict(clip_grad=dict(max_norm=1.0, norm_type=0)),
                           sgd, 'clip_grad.norm_type=0'),
        'norm_type_nan':
        (dict(clip_grad=dict(max_norm=1.0, norm_type=float('nan'))), sgd,
         'clip_grad.norm_type=nan'),
        'clip_foreach': (dict(clip_grad=dict(max_norm=1.0, foreach='yes')),
                         sgd, "clip_grad.foreach='yes'"),
        # an infinite scale makes every step inf and skips it: no training
        'scale_inf': (dict(amp=dict(bf16, loss_scale=float('inf'))), sgd,
                      'amp.loss_scale=inf is not accepted'),
        'scale_nan': (dict(amp=dict(bf16, loss_scale=float('nan'))), sgd,
                      'amp.loss_scale=nan'),
        'scale_bool': (dict(amp=dict(bf16, loss_scale=True)), sgd,
                       'amp.loss_scale=True'),
        'scale_negative': (dict(amp=dict(bf16, loss_scale=-8.0)), sgd,
                           'amp.loss_scale=-8.0'),
        'scale_dict_key':
        (dict(amp=dict(bf16, loss_scale=dict(init_scal=2.0))), sgd,
         'amp.loss_scale.init_scal=2.0 is not accepted: not a '
         'torch.amp.GradScaler argument; accepted: init_scale'),
        'scale_dict_device':
        (dict(amp=dict(bf16, loss_scale=dict(device='cuda'))), sgd,
         "amp.loss_scale.device='cuda'"),
        'scale_dict_init':
        (dict(amp=dict(bf16, loss_scale=dict(init_scale=float('inf')))), sgd,
         'amp.loss_scale.init_scale=inf'),
        'scale_dict_growth':
        (dict(amp=dict(bf16, loss_scale=dict(growth_factor=0.5))), sgd,
         'amp.loss_scale.growth_factor=0.5'),
        'scale_dict_interval':
        (dict(amp=dict(bf16, loss_scale=dict(growth_interval=0))), sgd,
         'amp.loss_scale.growth_interval=0'),
        # the bounds themselves (an audit: a mutant accepting them lived)
        'scale_dict_growth_one':
        (dict(amp=dict(bf16, loss_scale=dict(growth_factor=1.0))), sgd,
         'amp.loss_scale.growth_factor=1.0'),
        'scale_dict_backoff_one':
        (dict(amp=dict(bf16, loss_scale=dict(backoff_factor=1.0))), sgd,
         'amp.loss_scale.backoff_factor=1.0'),
        'scale_dict_backoff_zero':
        (dict(amp=dict(bf16, loss_scale=dict(backoff_factor=0))), sgd,
         'amp.loss_scale.backoff_factor=0'),
        'unknown_key':
        (dict(step_in_backwards=True), sgd,
         'optim_wrapper.step_in_backwards=True is not accepted'),
        'counts_zero': (dict(accumulative_counts=0), sgd,
                        'accumulative_counts=0'),
        'counts_str': (dict(accumulative_counts='2'), sgd,
                       "accumulative_counts='2'"),
        'counts_float': (dict(accumulative_counts=2.5), sgd,
                         'accumulative_counts=2.5'),
        'counts_bool': (dict(accumulative_counts=True, step_in_backward=True),
                        sgd, 'accumulative_counts=True'),
    }


@pytest.mark.parametrize('case', sorted(_refusals()))
def test_refusals(case):
    wrapper_kwargs, optimizer, match = _refusals()[case]
    cfg = dict(
        type='mmdtr.InplaceOptimWrapper',
        optimizer=optimizer,
        **wrapper_kwargs)
    with pytest.raises(MmdtrError, match=re.escape(match)) as info:
        build_optim_wrapper(nn.Linear(2, 2), cfg)
    assert info.value.hint, 'every refusal says how to fix it'


def test_norm_clip_refusal_names_the_inherited_key(tmp_path):
    # every mmdtr config inherits clip_grad=dict(max_norm=...) or none; a
    # user who sets step_in_backward in a child config never wrote the
    # clip_grad refused, MMEngine merged it in (found by a new-user
    # walkthrough of the docs): the hint says how to replace the base's
    base = tmp_path / 'base.py'
    base.write_text("optim_wrapper = dict(type='OptimWrapper', optimizer="
                    "dict(type='SGD', lr=0.1), clip_grad=dict(max_norm=1.0))")
    child = tmp_path / 'child.py'
    child.write_text("_base_ = ['base.py']\n"
                     "optim_wrapper = dict(type='mmdtr.InplaceOptimWrapper', "
                     'step_in_backward=True)')
    cfg = Config.fromfile(str(child))
    with pytest.raises(MmdtrError, match=re.escape('clip_grad=')) as info:
        build_optim_wrapper(nn.Linear(2, 2), cfg.optim_wrapper)
    assert '_delete_=True' in info.value.hint
    assert 'clip_grad=None' in info.value.hint


@pytest.mark.parametrize('case', sorted(_refusals()))
def test_refused_before_the_runner_is_built(case):
    # MMEngine builds the wrapper only in runner.train(): the work dir, the
    # process group and the before_train hooks came first (LBFGS was left
    # to the constructor; found by an adversarial search)
    wrapper_kwargs, optimizer, match = _refusals()[case]
    cfg = Config(
        dict(
            optim_wrapper=dict(
                type='mmdtr.InplaceOptimWrapper',
                optimizer=optimizer,
                **wrapper_kwargs)))
    with pytest.raises(MmdtrError, match=re.escape(match)):
        translate_memory_keys(cfg)


@pytest.mark.parametrize('launcher', ['pytorch', 'slurm', 'mpi'])
def test_step_in_backward_refused_with_a_launcher(launcher):
    wrapper = dict(
        type='mmdtr.InplaceOptimWrapper',
        optimizer=dict(type='SGD', lr=0.1),
        step_in_backward=True)
    check_wrapper_config(wrapper, distributed=False)
    with pytest.raises(MmdtrError, match='cannot train with a launcher'):
        translate_memory_keys(
            Config(dict(optim_wrapper=wrapper, launcher=launcher)))
    # one wrapper of several (OptimWrapperDict)
    with pytest.raises(MmdtrError, match='cannot train with a launcher'):
        translate_memory_keys(
            Config(
                dict(
                    optim_wrapper=dict(
                        generator=wrapper,
                        discriminator=dict(
                            optimizer=dict(type='SGD', lr=0.1))),
                    launcher=launcher)))


def test_keys_of_the_builder_and_of_subclasses_pass(tmp_path):
    # MMEngine's registry takes _scope_ itself, and a subclass may take
    # arguments of its own (its constructor checks them): both were refused
    # at translation, where MMEngine builds them
    from mmdtr.adapters.inplace_optim_wrapper import InplaceOptimWrapper

    class LoggingInplace(InplaceOptimWrapper):

        def __init__(self, *args, log_every=5, **kwargs):
            super().__init__(*args, **kwargs)
            self.log_every = log_every

    sgd = dict(type='SGD', lr=0.1)
    for wrapper in (dict(
            type='InplaceOptimWrapper', _scope_='mmdtr', optimizer=sgd),
                    dict(type=LoggingInplace, optimizer=sgd, log_every=2)):
        translate_memory_keys(Config(dict(optim_wrapper=wrapper)))
        built = build_optim_wrapper(nn.Linear(2, 2), wrapper)
        assert isinstance(built, InplaceOptimWrapper)
