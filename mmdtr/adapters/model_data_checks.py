"""Config checks of the model against its data and of its DDP switches.

Each ``@config_check`` runs when the config is translated, before the
runner and its work dir are built. Found by a fuzz of the constructors'
arguments (2026-11-28): ``--cfg-options model.num_classes=10`` over a
dataset of 1000 classes passed ``--check-config`` and failed at the first
iteration (``IndexError: Target 112 is out of bounds``), and
``find_unused_parameters='yes'`` failed in every rank inside PyTorch's
``Reducer``, printing every parameter.
"""
import difflib
import inspect
import numbers

import numpy as np

from mmdtr.errors import MmdtrError
from mmdtr.registry import DATASETS, MODELS
from mmdtr.utils.value_kinds import is_finite_real
from .config_translation import MEMORY_KEY_TRANSLATORS, config_check
from .near_miss_keys import SETTING_SECTIONS, nested_key_error
from .registered_types import of_another_scope, refuse_unregistered

#: DDP switches its C++ side refuses a string for (``'yes'`` failed in
#: every rank); MMEngine's ``detect_anomalous_params`` is read as a truth
#: value, so anything runs there.
WRAPPER_BOOLS = ('find_unused_parameters', 'broadcast_buffers')
#: The dataloaders whose datasets are checked: those training builds (a
#: test dataloader is built by ``runner.test()`` only).
DATALOADERS = ('train_dataloader', 'val_dataloader')


def _mmdtr_class(spec: dict, registry, default_scope, own: bool = True):
    """The class of mmdtr's that ``spec['type']`` names, or ``None``: a
    class of mmdtr's, ``'mmdtr.X'``, or a plain name under mmdtr's scope
    (another scope's name is its own, even if spelt as one of mmdtr's).
    ``own=False``: any class, or one registered in mmdtr's or MMEngine's
    scope, or found there for a name without one (as mmdtr's runner finds
    it)."""
    kind = spec.get('type', None)
    if isinstance(kind, str):
        scope, _, name = kind.rpartition('.')
        scope = scope or spec.get('_scope_', None) or default_scope
        if own:
            if scope != 'mmdtr':
                return None
            kind = registry.module_dict.get(name, None)
        elif not of_another_scope(kind, scope):
            kind = registry.get(name)  # mmdtr's, then MMEngine's
        else:
            return None
    if inspect.isclass(kind) and (not own
                                  or kind.__module__.startswith('mmdtr.')):
        return kind
    return None


def _argument(spec: dict, cls, key: str):
    """``spec[key]``, or the default of the ``key`` argument of ``cls``
    or of the first class in its MRO whose ``__init__`` names it."""
    if key in spec:
        return spec[key]
    for klass in cls.__mro__:
        init = klass.__dict__.get('__init__', None)
        if init is None:
            continue
        param = inspect.signature(init).parameters.get(key, None)
        if param is not None and param.default is not param.empty:
            return param.default
    return None


# (model key, dataset key, how they must compare, what it breaks)
_IMAGE_PAIRS = (('num_classes', 'num_classes', 'at_least', 'labels'),
                ('in_channels', 'num_channels', 'equal', 'images'))
_TOKEN_PAIRS = (('vocab_size', 'vocab_size', 'at_least', 'token ids'),
                ('max_seq_len', 'seq_len', 'at_least', 'sequences'))


def _channels_kept(model: dict) -> bool:
    """Whether the model's images reach it with the dataset's channels: its
    preprocessor is mmdtr's default, which only stacks and moves them."""
    pre = model.get('data_preprocessor', None)
    return pre is None or isinstance(pre, dict) and str(pre.get(
        'type', '')).rpartition('.')[2] == 'TensorBatchPreprocessor'


def _pairs(model_cls, data_cls):
    from mmdtr.datasets.synthetic import (SyntheticImageDataset,
                                          SyntheticTokenDataset)
    from mmdtr.models.base_classifier import BaseImageClassifier
    from mmdtr.models.gpt import GPTDecoder
    if issubclass(model_cls, BaseImageClassifier) and issubclass(
            data_cls, SyntheticImageDataset):
        return _IMAGE_PAIRS
    if issubclass(model_cls, GPTDecoder) and issubclass(
            data_cls, SyntheticTokenDataset):
        return _TOKEN_PAIRS
    return ()


@config_check
def check_model_fits_data(cfg, custom_hooks: list) -> None:
    """Compare the sizes of mmdtr's models with those of mmdtr's synthetic
    datasets: classes, vocabulary and sequence length at least the data's,
    image channels equal. Other models and datasets are left alone.

    Raises:
        MmdtrError: On a size that does not fit, naming both keys.
    """
    model = cfg.get('model', None)
    scope = cfg.get('default_scope', None)
    model_cls = _mmdtr_class(model, MODELS, scope) if isinstance(
        model, dict) else None
    if model_cls is None:
        return
    for loader in DATALOADERS:
        data = (cfg.get(loader, None) or {})
        data = data.get('dataset', None) if isinstance(data, dict) else None
        data_cls = _mmdtr_class(data, DATASETS, scope) if isinstance(
            data, dict) else None
        for mkey, dkey, rule, what in _pairs(model_cls, data_cls) \
                if data_cls else ():
            if rule == 'equal' and not _channels_kept(model):
                continue  # another preprocessor may change them
            have = _argument(model, model_cls, mkey)
            need = _argument(data, data_cls, dkey)
            if not all(
                    isinstance(v, int) and not isinstance(v, bool)
                    for v in (have, need)):
                continue  # the constructors name a bad value
            if have == need or rule == 'at_least' and have > need:
                continue
            relation = 'differs from' if rule == 'equal' else \
                'is smaller than'
            raise MmdtrError(
                f'model.{mkey}={have} {relation} '
                f'{loader}.dataset.{dkey}={need}: the model cannot take '
                f'the dataset\'s {what}.',
                hint=f'set model.{mkey}={need} (or change '
                f'{loader}.dataset.{dkey}).')


def _check_arguments(where: str, cls, spec: dict) -> None:
    """Build a synthetic dataset of mmdtr's from ``spec`` (cheap: samples
    are made when read), so that its own checks run now, after a check of
    the argument names; the errors name ``where``."""
    kwargs = {k: v for k, v in spec.items() if k not in ('type', '_scope_')}
    params = inspect.signature(cls.__init__).parameters
    accepted = [name for name in params if name != 'self']
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for key in () if takes_any else kwargs:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            raise MmdtrError(
                f'{where}.{key}={kwargs[key]!r} is not accepted: not an '
                f'argument of {cls.__name__}.',
                hint=(f'closest match: {close[0]!r}; ' if close else '') +
                f'its arguments: {accepted}.')
    try:
        cls(**kwargs)
    except MmdtrError as e:
        raise MmdtrError(f'{where}: {e.message}', hint=e.hint) from None


@config_check
def check_datasets(cfg, custom_hooks: list) -> None:
    """Check each dataloader's ``dataset``: its ``type`` as ``model.type``
    is checked (a name of mmdtr's or MMEngine's scope that is not
    registered failed when ``runner.train()`` built the dataloader, in a
    traceback), and the arguments of mmdtr's synthetic datasets, which
    failed there too.

    Raises:
        MmdtrError: On such a name, with the closest registered one, or an
            argument a synthetic dataset refuses or does not take.
    """
    for loader in DATALOADERS:
        data = cfg.get(loader, None)
        data = data.get('dataset', None) if isinstance(data, dict) else None
        if not isinstance(data, dict):
            continue
        scope = data.get('_scope_', None) or cfg.get('default_scope', None)
        if isinstance(data.get('type', None), str):
            refuse_unregistered(
                f'{loader}.dataset.type',
                data['type'],
                DATASETS,
                scope,
                list_parent=False)
        data_cls = _mmdtr_class(data, DATASETS, scope)
        if data_cls is not None:
            _check_arguments(f'{loader}.dataset', data_cls, data)


def _takes(cls, key: str) -> bool:
    """Whether ``cls(**{key: ...})`` may be accepted: its signature names
    ``key`` or takes ``**kwargs`` (or cannot be read)."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return True
    return key in params or any(p.kind is p.VAR_KEYWORD
                                for p in params.values())


@config_check
def check_memory_keys_in_model(cfg, custom_hooks: list) -> None:
    """mmdtr's memory keys and optimizer-wrapper settings inside ``model``
    (``model.activation_checkpointing``, ``model.accumulative_counts``)
    where the model's class is known (registered in mmdtr's or MMEngine's
    scope, or given as a class in a new-style config) and does not take
    them: MMEngine passed them to it, a raw ``TypeError`` after the work
    dir was made (found by an adversarial search). DTR's own are refused
    whatever the model (:mod:`~mmdtr.adapters.near_miss_keys`); another
    model may take these names as arguments of its own.

    Raises:
        MmdtrError: On the first such key, naming where it belongs.
    """
    model = cfg.get('model', None)
    if not isinstance(model, dict):
        return
    cls = _mmdtr_class(
        model, MODELS, cfg.get('default_scope', None), own=False)
    if cls is None:
        return
    for key in (*MEMORY_KEY_TRANSLATORS, *SETTING_SECTIONS):
        if key in model and not _takes(cls, key):
            raise nested_key_error('model', key, model[key])


def _switch(value) -> bool:
    """Whether DDP's ``Reducer`` takes ``value`` as a switch: a bool
    (NumPy's too), an int or ``None``; a string it refuses."""
    return value is None or isinstance(value, (np.bool_, numbers.Integral))


@config_check
def check_wrapper_switches(cfg, custom_hooks: list) -> None:
    """``find_unused_parameters`` (top level, which MMEngine's and mmdtr's
    runners pass to DDP) and the DDP switches of a ``model_wrapper_cfg`` of
    mmdtr's or MMEngine's scope must be what DDP takes (a bool, an int or
    ``None``), and its ``bucket_cap_mb`` a finite number (DDP runs with 0
    or less too) or ``None``.

    Raises:
        MmdtrError: On another value (``'yes'``), naming its key.
    """
    switches = [('find_unused_parameters',
                 cfg.get('find_unused_parameters', False))]
    wrapper = cfg.get('model_wrapper_cfg', None)
    kind = wrapper.get('type', None) if isinstance(wrapper, dict) else None
    if isinstance(wrapper,
                  dict) and not (isinstance(kind, str) and of_another_scope(
                      kind, cfg.get('default_scope', None))):
        switches += [(f'model_wrapper_cfg.{key}', wrapper[key])
                     for key in WRAPPER_BOOLS if key in wrapper]
        cap = wrapper.get('bucket_cap_mb', None)
        if cap is not None and not is_finite_real(cap):
            raise MmdtrError(
                f'model_wrapper_cfg.bucket_cap_mb={cap!r} is not accepted: '
                'a number of MiB.',
                hint='e.g. model_wrapper_cfg.bucket_cap_mb=25 (DDP\'s '
                'default), or leave it out.')
    for key, value in switches:
        if not _switch(value):
            raise MmdtrError(
                f'{key}={value!r} is not accepted: True or False (or 0, 1, '
                'None, as DDP takes them).',
                hint=f'e.g. --cfg-options {key}=True.')
