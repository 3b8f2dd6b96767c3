"""Gradient accumulation with activation checkpointing and Conv-BN eval.

Each case trains the same toy model for 4 iterations with
``optim_wrapper.accumulative_counts=2`` (2 optimizer steps) through
``translate_memory_keys`` and ``Runner.from_cfg``, and compares the final
parameters and buffers with the run without the feature.
"""

import pytest
import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.registry import HOOKS
from mmengine.runner import Runner

from mmdtr.adapters.config_translation import translate_memory_keys
from mmdtr.errors import MmdtrError
from mmdtr.techniques.activation_checkpointing import is_checkpointed


@HOOKS.register_module(force=True)
class CountOptimizerSteps(Hook):

    def before_train(self, runner):
        self.steps = 0

        def count(*args):
            self.steps += 1

        runner.optim_wrapper.optimizer.register_step_post_hook(count)


@pytest.fixture(scope='module')
def train_accum(toy_runner_cfg):
    """``train_accum(work_dir, norm_eval=False, inplace_relu=False,
    **keys)`` -> trained model."""

    def train(work_dir, norm_eval=False, inplace_relu=False, **keys):
        cfg = toy_runner_cfg(
            work_dir,
            dict(
                type='ConvToyNet',
                norm_eval=norm_eval,
                scales=(0.5, 1.0),
                running_var=1.5,
                inplace_relu=inplace_relu),
            dict(type='SeededToyImages', length=16),
            'accum',
            max_iters=4,
            optimizer=dict(type='SGD', lr=0.1, momentum=0.9),
            custom_hooks=[dict(type='CountOptimizerSteps')],
            default_hooks=dict(checkpoint=None),
            randomness=dict(seed=0),
            log_level='WARNING',
            **keys)
        cfg.optim_wrapper.accumulative_counts = 2
        runner = Runner.from_cfg(translate_memory_keys(cfg))
        runner.train()
        (counter, ) = [
            h for h in runner.hooks if isinstance(h, CountOptimizerSteps)
        ]
        assert counter.steps == 2  # 4 iterations, 2 accumulated per step
        return runner.model

    return train


def _state(model):
    return dict(model.named_parameters()), dict(model.named_buffers())


@pytest.fixture(scope='module')
def plain(tmp_path_factory, train_accum):
    return _state(train_accum(tmp_path_factory.mktemp('plain')))


@pytest.fixture(scope='module')
def plain_frozen(tmp_path_factory, train_accum):
    return _state(
        train_accum(tmp_path_factory.mktemp('frozen'), norm_eval=True))


@pytest.mark.parametrize('value', [
    'backbone.layer*',
    pytest.param(
        dict(modules=['backbone.*'], policy='save_compute_heavy'),
        marks=pytest.mark.needs_selective_checkpointing)
])
def test_checkpointing_bit_identical(tmp_path, plain, value, train_accum):
    model = train_accum(tmp_path, activation_checkpointing=value)
    assert is_checkpointed(model.backbone.layer1)
    params, buffers = _state(model)
    for name, p in plain[0].items():
        assert torch.equal(p, params[name]), name
    for name, b in plain[1].items():
        assert torch.equal(b, buffers[name]), name
    assert int(buffers['backbone.layer1.blocks.0.1.num_batches_tracked']) \
        == 4


@pytest.mark.parametrize(
    'checkpointing',
    [
        ['backbone.layer*'],
        pytest.param(
            # techniques.md's example: the fused Conv-BN's output is a kept
            # convolution's, written by ReLU(inplace=True), which was refused
            # (found by an adversarial search)
            dict(modules='backbone.layer*', policy='save_compute_heavy'),
            marks=pytest.mark.needs_selective_checkpointing)
    ])
def test_conv_bn_eval_and_checkpointing(tmp_path, plain_frozen, train_accum,
                                        checkpointing):
    fused = _state(
        train_accum(
            tmp_path / 'fused',
            norm_eval=True,
            efficient_conv_bn_eval=['backbone']))
    both_model = train_accum(
        tmp_path / 'both',
        norm_eval=True,
        inplace_relu=True,  # the same values as ReLU()'s
        efficient_conv_bn_eval=['backbone'],
        activation_checkpointing=checkpointing)
    assert is_checkpointed(both_model.backbone.layer2)
    both = _state(both_model)
    # the fusion took effect: its rounding shows (an audit: the test passed
    # with the fusion turned off)
    assert any(not torch.equal(p, fused[0][name])
               for name, p in plain_frozen[0].items())
    for name, p in plain_frozen[0].items():
        # folding BN into the conv changes rounding only
        assert torch.allclose(p, fused[0][name], rtol=1e-5, atol=1e-6), name
        # checkpointing on top changes nothing at all
        assert torch.equal(fused[0][name], both[0][name]), name
    for name, b in plain_frozen[1].items():
        assert torch.equal(b, fused[1][name]) and torch.equal(
            b, both[1][name]), name


@pytest.mark.parametrize('counts', [0, -1, 2.5, True, '2'])
def test_bad_counts_fail_at_translation(counts):
    # MMEngine's OptimWrapper accepts 2.5 and True and asserts on 0 later
    cfg = Config(
        dict(
            optim_wrapper=dict(
                optimizer=dict(type='SGD', lr=0.1),
                accumulative_counts=counts)))
    with pytest.raises(
            MmdtrError,
            match=f'optim_wrapper.accumulative_counts={counts!r} is not'):
        translate_memory_keys(cfg)
    cfg.optim_wrapper.accumulative_counts = 2
    assert translate_memory_keys(cfg).optim_wrapper.accumulative_counts == 2


SGD = dict(type='SGD', lr=0.1)


@pytest.mark.parametrize(
    'optim_wrapper, match',
    [
        (dict(optimizer=SGD, accumulative_count=4),
         r'optim_wrapper.accumulative_count=4 is not accepted: not an '
         r'argument of OptimWrapper.*rename accumulative_count to '
         r'accumulative_counts'),
        (dict(type='AmpOptimWrapper', optimizer=SGD, loss_scal='dynamic'),
         r"optim_wrapper.loss_scal='dynamic' is not accepted: not an "
         r'argument of AmpOptimWrapper.*rename loss_scal to loss_scale'),
        (dict(type='InplaceOptimWrapperr', optimizer=SGD),
         "type='InplaceOptimWrapperr' is not registered.*closest match: "
         "'mmdtr.InplaceOptimWrapper'"),
        ('InplaceOptimWrapper', 'MMEngine takes a dict'),
        # one of a dict of wrappers is named by its key (found by an
        # adversarial search: optim_wrapper.accumulative_counts, a key the
        # config does not have)
        (dict(
            generator=dict(optimizer=SGD),
            discriminator=dict(optimizer=SGD, accumulative_count=2)),
         r'optim_wrapper\.discriminator\.accumulative_count=2 is not '
         'accepted'),
        (dict(
            constructor='MultiOptimWrapperConstructor',
            generator=dict(optimizer=SGD, accumulative_counts=0),
            discriminator=dict(optimizer=SGD)),
         r'optim_wrapper\.generator\.accumulative_counts=0 is not'),
        (dict(
            constructor='MultiOptimWrapperConstructor',
            generator=dict(optimizer=SGD, clip_grad=dict(max_norm=-1)),
            discriminator=dict(optimizer=SGD)),
         r'optim_wrapper\.generator\.clip_grad\.max_norm=-1 is not'),
        (dict(
            constructor='MultiOptimWrapperConstructor',
            generator=dict(optimizer=SGD),
            discriminator=dict(
                type='mmdtr.InplaceOptimWrapper',
                optimizer=SGD,
                step_in_backward=True,
                accumulative_counts=2)),
         r'optim_wrapper\.discriminator\.step_in_backward=True cannot'),
        (dict(optimizer=SGD,
              clip_grad=3), r'optim_wrapper.clip_grad=3 is not accepted'),
        (dict(optimizer=SGD, clip_grad=dict(type='foo', max_norm=1)),
         r"optim_wrapper.clip_grad.type='foo' is not accepted"),
        (dict(type='mmengine.OptimWrapper', optimizer=[1]),
         r'optim_wrapper.optimizer=\[1\] is not accepted'),
        (dict(type='mmdtr.InplaceOptimWrapper', optimizer=[1]),
         r'optim_wrapper.optimizer=\[1\] is not accepted'),
        # raw TypeErrors and RuntimeErrors of MMEngine's registry in the
        # checks (found by an adversarial search)
        (dict(type=None, optimizer=SGD),
         'optim_wrapper: type=None is not accepted: a registered name'),
        (dict(type='', optimizer=SGD), "optim_wrapper: type='' is not"),
        (dict(type=1, optimizer=SGD), 'optim_wrapper: type=1 is not'),
    ],
    ids=[
        'key_typo', 'amp_key_typo', 'type_typo', 'a_string', 'in_a_dict',
        'counts_in_a_dict', 'clip_in_a_dict', 'inplace_in_a_dict',
        'clip_grad_not_a_dict', 'clip_grad_type', 'optimizer_a_list',
        'inplace_optimizer_a_list', 'type_none', 'type_empty', 'type_int'
    ])
def test_bad_wrapper_configs_fail_at_translation(optim_wrapper, match):
    # MMEngine failed on each in runner.train(), in a traceback (found by
    # an adversarial search)
    with pytest.raises(MmdtrError, match=match):
        translate_memory_keys(Config(dict(optim_wrapper=optim_wrapper)))


@pytest.mark.parametrize(
    'optim_wrapper',
    [
        dict(
            type='AmpOptimWrapper',
            optimizer=SGD,
            loss_scale='dynamic',
            accumulative_counts=2,
            clip_grad=dict(max_norm=1.0)),
        dict(optimizer=SGD, paramwise_cfg=dict(norm_decay_mult=0.0)),
        # a custom constructor reads keys of its own; another scope's
        # wrapper may not be imported yet: both left to MMEngine
        dict(
            constructor='LayerDecayOptimizerConstructor',
            optimizer=SGD,
            layer_decay_rate=0.9),
        dict(type='mmpretrain.SomeOptimWrapper', optimizer=SGD, extra=1),
        dict(type='MyOptimWrapper', _scope_='myproj', optimizer=SGD),
    ],
    ids=[
        'amp_through_kwargs', 'paramwise', 'custom_constructor', 'scope',
        'scope_key'
    ])
def test_legitimate_wrapper_configs_pass(optim_wrapper):
    translate_memory_keys(Config(dict(optim_wrapper=optim_wrapper)))
    # a downstream repo's default scope: its wrappers are its registry's
    translate_memory_keys(
        Config(
            dict(
                default_scope='mmpretrain',
                optim_wrapper=dict(type='MyOptimWrapper', optimizer=SGD))))


def test_plain_wrapper_name_outside_mmdtrs_scope_is_refused():
    # the wrapper was taken for mmdtr's, checked, then MMEngine's builder
    # raised a KeyError in runner.train() (found by an adversarial search)
    wrapper = dict(type='InplaceOptimWrapper', optimizer=SGD)
    with pytest.raises(
            MmdtrError, match="type='InplaceOptimWrapper' is "
            "mmdtr's") as info:
        translate_memory_keys(Config(dict(optim_wrapper=wrapper)))
    assert "type='mmdtr.InplaceOptimWrapper'" in info.value.hint
    translate_memory_keys(
        Config(dict(default_scope='mmdtr', optim_wrapper=wrapper)))
    translate_memory_keys(
        Config(dict(optim_wrapper=dict(wrapper, _scope_='mmdtr'))))
