"""The ``dtr`` config key: checked and translated into a DTRHook entry,
also when given through ``--cfg-options``."""
import os.path as osp

import pytest
import torch
from mmengine.config import Config

from mmdtr.adapters.dtr_hook import DTRHook, translate_dtr
from mmdtr.adapters.dtr_train_step import dtr_settings
from mmdtr.core.policies import POLICIES, LRUPolicy
from mmdtr.core.sizes import parse_size
from mmdtr.dtr import DTR
from mmdtr.errors import MmdtrError
from mmdtr.registry import HOOKS

REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason='a threshold is optional on CUDA')


@pytest.mark.parametrize('value, hook_cfg', [
    (dict(eviction_threshold='3GB'), dict(eviction_threshold='3GB')),
    (dict(
        eviction_threshold=2**20,
        evictee_minimum_size='4KB',
        enable_sqrt_sampling=True,
        policy='lru'),
     dict(
         eviction_threshold=2**20,
         evictee_minimum_size='4KB',
         enable_sqrt_sampling=True,
         policy='lru')),
])
def test_translate_accepted(value, hook_cfg):
    cfg = translate_dtr(Config(dict(dtr=value)).dtr)  # a ConfigDict
    assert cfg == dict(type='mmdtr.DTRHook', **hook_cfg)
    hook = HOOKS.build(cfg)
    assert isinstance(hook, DTRHook)
    assert DTR(**hook.settings).eviction_threshold == parse_size(
        hook_cfg['eviction_threshold'])


@pytest.mark.parametrize(
    'value, text',
    [
        ('3GB', "dtr='3GB' (str) is not accepted; expected a dict with the "
         "keys ['eviction_threshold', 'evictee_minimum_size', "
         "'enable_sqrt_sampling', 'policy', 'recording_threshold']"),
        (True, 'dtr=True (bool) is not accepted'),
        (dict(eviction_treshold='3GB'), 'dtr.eviction_treshold is not a DTR '
         "setting; accepted: ['eviction_threshold', 'evictee_minimum_size', "
         "'enable_sqrt_sampling', 'policy', 'recording_threshold'], "
         "closest matches: ['eviction_threshold', 'recording_threshold']"),
        (dict(eviction_threshold='3GB', sqrt_sampling=True),
         "closest matches: ['enable_sqrt_sampling']"),
        (dict(eviction_threshold='3XB'),
         "dtr={'eviction_threshold': '3XB'} is "
         "not accepted: eviction_threshold='3XB' is not a size."),
        (dict(eviction_threshold=-1), 'eviction_threshold=-1 is negative'),
        (dict(eviction_threshold='1GB', evictee_minimum_size=[1]),
         'evictee_minimum_size=[1] is not a size'),
        (dict(eviction_threshold='1GB', enable_sqrt_sampling='yes'),
         "enable_sqrt_sampling='yes' is not a bool"),
        (dict(eviction_threshold='1GB',
              policy='fifo'), "policy='fifo' is not an eviction policy"),
        # the engine's hint offered an EvictionPolicy object, which a config
        # refuses (found by a review)
        (dict(eviction_threshold='1GB', policy='lrux'),
         "dtr.policy='lrux' is not an eviction policy; accepted: ['dtr', "
         "'dtr_local', 'largest', 'lru'], closest match: 'lru'. Hint: a "
         'policy of your own is accepted by the name it was registered'),
        # written to the work dir, which takes names; an object that is no
        # policy got the engine's hint, which offers a policy object
        # (found by a new-user walkthrough)
        (dict(eviction_threshold='1GB', policy=LRUPolicy()),
         "is not accepted in a config: it is written to the work dir, "
         "which takes names (['dtr', 'dtr_local', 'largest', 'lru'] or one "
         'registered), not objects. Hint: register the class'),
        (dict(eviction_threshold='1GB',
              policy=object()), 'is not accepted in a config'),
        # a number got the hint about objects (found by an adversarial
        # search)
        (dict(eviction_threshold='1GB', policy=123),
         "dtr.policy=123 is not accepted: a policy name (['dtr', "
         "'dtr_local', 'largest', 'lru'] or one registered). Hint: e.g. "
         "dtr.policy='lru'."),
        # no closest match for a name in another case (an adversarial
        # search)
        (dict(eviction_threshold='1GB', policy='LRU'),
         "policy='LRU' is not an eviction policy; accepted: ['dtr', "
         "'dtr_local', 'largest', 'lru'], closest match: 'lru'."),
    ])
def test_translate_rejects(value, text):
    with pytest.raises(MmdtrError) as info:
        translate_dtr(value)
    message = str(info.value)
    assert message.startswith('mmdtr: dtr')
    assert text in message
    assert 'Hint:' in message


def test_closest_policy_name_in_any_case(monkeypatch):
    # the registered names were compared as they are: 'BF' got no match
    # for 'bf' (a review)
    monkeypatch.setitem(POLICIES, 'BF', LRUPolicy)
    with pytest.raises(MmdtrError, match="closest match: 'BF'"):
        translate_dtr(dict(eviction_threshold='1GB', policy='bf'))


def test_policy_none_is_the_default():
    # it got the message for objects, whose hint was to register a class
    # (found by an adversarial search); activation_checkpointing's
    # policy=None is its default too
    assert translate_dtr(dict(eviction_threshold='1GB', policy=None)) == \
        dict(type='mmdtr.DTRHook', eviction_threshold='1GB')
    hook = DTRHook(eviction_threshold='1GB', policy=None)
    assert 'policy' not in dtr_settings(hook.settings)


@cpu_only
@pytest.mark.parametrize(
    'value',
    [dict(), dict(eviction_threshold=None),
     dict(eviction_threshold=0)])
def test_cpu_needs_a_threshold(value):
    # 0 is read as no threshold; the message says so (a user typed 0)
    with pytest.raises(
            MmdtrError,
            match=r'no threshold \(None or 0\) means evicting on allocation '
            'failure, which needs CUDA.*Hint: On CPU give a threshold'):
        translate_dtr(value)
    with pytest.raises(MmdtrError, match='needs CUDA'):
        DTRHook(**value)


def test_cfg_options_give_a_size_string(train_tool):
    args = train_tool.parse_args([
        osp.join(REPO, 'configs', 'gpt_synthetic.py'), '--cfg-options',
        'dtr.eviction_threshold=3GB', 'dtr.enable_sqrt_sampling=true'
    ])
    assert args.cfg_options['dtr.eviction_threshold'] == '3GB'
    cfg = train_tool.build_cfg(args)
    assert 'dtr' not in cfg
    assert cfg.custom_hooks[-1] == dict(
        type='mmdtr.DTRHook',
        eviction_threshold='3GB',
        enable_sqrt_sampling=True)
    hook = HOOKS.build(cfg.custom_hooks[-1])
    assert parse_size(hook.settings['eviction_threshold']) == 3 * 2**30


def test_cfg_options_turn_on_a_key_the_file_sets_to_none(train_tool, tmp_path):
    config = tmp_path / 'off.py'
    config.write_text(f"_base_ = ['{REPO}/configs/gpt_synthetic.py']\n"
                      'dtr = None\n')
    args = train_tool.parse_args(
        [str(config), '--cfg-options', 'dtr.eviction_threshold=3GB'])
    cfg = train_tool.build_cfg(args)
    assert cfg.custom_hooks[-1] == dict(
        type='mmdtr.DTRHook', eviction_threshold='3GB')


def test_a_registered_policy_is_accepted_by_name():
    from mmdtr.dtr import POLICIES, EvictionPolicy, register_policy

    @register_policy
    class Newest(EvictionPolicy):
        name = 'newest_for_key_tests'
        uses_evicted_classes = False

        def score(self, record, clock):
            return -float(record.last_access)

    try:
        value = dict(eviction_threshold='3GB', policy=Newest.name)
        hook = HOOKS.build(translate_dtr(Config(dict(dtr=value)).dtr))
        assert isinstance(DTR(**hook.settings).policy, Newest)
    finally:
        del POLICIES[Newest.name]
    with pytest.raises(MmdtrError, match="policy='newest_for_key_tests'"):
        translate_dtr(Config(dict(dtr=value)).dtr)
