"""Validation of the settings of :class:`InplaceOptimWrapper`.

Each public function checks one setting of the ``optim_wrapper`` config and
raises :class:`~mmdtr.errors.MmdtrError` (naming the key, the value and what
is accepted, with a hint) if it is not accepted: the key is ``prefix``
(``'optim_wrapper'`` by default; ``'optim_wrapper.generator'`` for one of a
dict of wrappers). ``clip_grad_settings`` and ``amp_settings`` also return
the form the wrapper applies. Nothing here
changes the optimizer or the model, so the wrapper checks all of its settings
before it applies any.
"""
import difflib
import math
from typing import NamedTuple, Optional, Tuple

import torch

from mmdtr.errors import MmdtrError
from mmdtr.techniques.inplace_update import (NOT_PER_PARAMETER,
                                             foreach_refused,
                                             not_per_parameter_refused)
from mmdtr.utils.value_kinds import is_integer, is_real
from .setting_values import (argument_names, check_keys, check_positive,
                             refuse_non_bool)

KEY = 'optim_wrapper'
#: The arguments of ``InplaceOptimWrapper``.
WRAPPER_KEYS = ('optimizer', 'accumulative_counts', 'clip_grad',
                'step_in_backward', 'amp')
#: Keys of an ``optim_wrapper`` config that MMEngine's builder reads itself.
BUILDER_KEYS = ('type', '_scope_', 'constructor', 'paramwise_cfg')
AMP_KEYS = ('dtype', 'loss_scale')
AMP_DTYPES = ('float16', 'bfloat16')
#: ``clip_grad`` types, as MMEngine's ``OptimWrapper`` accepts them.
CLIP_FUNCS = {
    'norm': torch.nn.utils.clip_grad_norm_,
    'value': torch.nn.utils.clip_grad_value_,
}
_CLIP_FORMS = {
    'norm': 'dict(max_norm=1.0)',
    'value': "dict(type='value', clip_value=1.0)",
}
_CLIP_EXAMPLE = ('e.g. clip_grad={norm} or clip_grad={value}'.format(
    **_CLIP_FORMS))
_AMP_EXAMPLE = "e.g. amp=dict(dtype='float16', loss_scale='dynamic')"
_SCALE_EXAMPLE = ("e.g. loss_scale='dynamic', loss_scale=512.0 (static), "
                  'loss_scale=dict(init_scale=1024.0), or loss_scale=None')


class AmpSettings(NamedTuple):
    """Validated ``amp`` settings.

    Attributes:
        dtype (torch.dtype, optional): The autocast dtype (None: the
            device's default).
        scaler_kwargs (dict, optional): ``torch.amp.GradScaler`` arguments
            (without ``device``); None for no loss scaling.
        static_scale (float, optional): The fixed scale of a static loss
            scale, passed to every ``GradScaler.update``.
    """
    dtype: Optional[torch.dtype]
    scaler_kwargs: Optional[dict]
    static_scale: Optional[float]


def check_step_in_backward(step_in_backward, prefix: str = KEY) -> None:
    """Refuse a ``step_in_backward`` that is not a bool.

    Args:
        step_in_backward: The value given.
        prefix (str): The wrapper's config key, for messages.

    Raises:
        MmdtrError: If it is not True or False.
    """
    refuse_non_bool(step_in_backward, f'{prefix}.step_in_backward')


def check_accumulative_counts(counts,
                              step_in_backward: bool,
                              prefix: str = KEY) -> None:
    """Refuse accumulation counts other than a positive int.

    Args:
        counts: ``accumulative_counts`` as given.
        step_in_backward (bool): Whether parameters step in the backward,
            which needs ``accumulative_counts=1``.
        prefix (str): The wrapper's config key, for messages.

    Raises:
        MmdtrError: If ``counts`` is not a positive int (bools refused), or
            is not 1 with ``step_in_backward``.
    """
    if not is_integer(counts) or counts < 1:
        raise MmdtrError(
            f'{prefix}.accumulative_counts={counts!r} is not accepted; '
            'expected a positive integer (1: no accumulation).',
            hint='e.g. accumulative_counts=4 to step every 4 iterations.')
    if step_in_backward and counts != 1:
        raise MmdtrError(
            f'{prefix}.step_in_backward=True cannot be combined with '
            f'accumulative_counts={counts!r}: accumulation needs the '
            'gradients of several iterations before any step; accepted: '
            'accumulative_counts=1.',
            hint='use step_in_backward=False to accumulate gradients.')


def clip_grad_settings(clip_grad,
                       step_in_backward: bool,
                       prefix: str = KEY
                       ) -> Tuple[Optional[dict], Optional[float]]:
    """Check ``clip_grad`` as MMEngine's ``OptimWrapper`` uses it.

    ``None``, or a dict: ``type`` ``'norm'`` (the default; the other keys are
    arguments of :func:`torch.nn.utils.clip_grad_norm_`, ``max_norm``
    required) or ``'value'`` (of :func:`torch.nn.utils.clip_grad_value_`,
    ``clip_value`` required). ``max_norm`` and ``clip_value`` must be
    positive finite numbers (a negative ``clip_value`` would set every
    gradient to it), ``norm_type`` a positive number, ``inf`` or ``'inf'``.

    Args:
        clip_grad (dict, optional): The ``clip_grad`` setting.
        step_in_backward (bool): Whether parameters step in the backward,
            where only clipping by value is possible.
        prefix (str): The wrapper's config key, for messages.

    Returns:
        tuple: A copy of ``clip_grad`` for ``OptimWrapper`` (None for no
        clipping) and, with ``step_in_backward``, the ``clip_value`` of the
        per-parameter clamp (else None).

    Raises:
        MmdtrError: If ``clip_grad`` is not accepted.
    """
    key = f'{prefix}.clip_grad'
    if clip_grad is None:
        return None, None
    if not isinstance(clip_grad, dict) or not clip_grad:
        raise MmdtrError(
            f'{key}={clip_grad!r} is not accepted; expected None or a '
            "non-empty dict of type 'norm' (the default) or 'value' with the "
            'arguments of torch.nn.utils.clip_grad_norm_ or clip_grad_value_.',
            hint=f'{_CLIP_EXAMPLE}; clip_grad=None for no clipping.')
    settings = dict(clip_grad)
    clip_type = settings.get('type', 'norm')
    if not isinstance(clip_type, str) or clip_type not in CLIP_FUNCS:
        raise MmdtrError(
            f'{key}.type={clip_type!r} is not accepted; accepted: '
            "'norm' (the default) or 'value'.",
            hint=f'{_CLIP_EXAMPLE}.')
    func = CLIP_FUNCS[clip_type]
    names = argument_names(func, skip=1)  # after `parameters`
    check_keys((n for n in settings if n != 'type'), ['type'] + names, key,
               f'an argument of torch.nn.utils.{func.__name__}', settings,
               _CLIP_EXAMPLE)
    limit = names[0]  # max_norm or clip_value
    if limit not in settings:
        raise MmdtrError(
            f"{key}={settings!r} is not accepted: type '{clip_type}' needs "
            f'{limit}.',
            hint=f'{_CLIP_EXAMPLE}.')
    check_positive(settings[limit], f'{key}.{limit}',
                   f'e.g. clip_grad={_CLIP_FORMS[clip_type]}.')
    norm_type = settings.get('norm_type', 2.0)
    if not (is_real(norm_type) and norm_type > 0 or norm_type == 'inf'):
        raise MmdtrError(
            f'{key}.norm_type={norm_type!r} is not accepted; expected a '
            "positive number, float('inf') or 'inf'.",
            hint='e.g. norm_type=2.0 (the default) or norm_type=1.0.')
    if 'error_if_nonfinite' in settings:
        refuse_non_bool(settings['error_if_nonfinite'],
                        f'{key}.error_if_nonfinite')
    refuse_non_bool(settings.get('foreach'), f'{key}.foreach', allow_none=True)
    if not step_in_backward:
        return settings, None
    if clip_type != 'value':
        raise MmdtrError(
            f'{prefix}.step_in_backward=True cannot be combined with '
            f'clip_grad={settings!r}: clipping by the global norm needs '
            "every gradient at once; accepted: None or dict(type='value', "
            'clip_value=...).',
            hint='drop clip_grad (clip_grad=None; a base config\'s '
            'optim_wrapper merges in: add _delete_=True to replace it '
            'whole), or use step_in_backward=False.')
    return settings, float(settings['clip_value'])


def _scaler_kwargs(loss_scale: dict, prefix: str) -> dict:
    key = f'{prefix}.amp.loss_scale'
    names = [
        n for n in argument_names(torch.amp.GradScaler.__init__, skip=1)
        if n != 'device'  # the parameters' device
    ]
    check_keys(loss_scale, names, key, 'a torch.amp.GradScaler argument',
               loss_scale, 'e.g. loss_scale=dict(init_scale=1024.0)')
    hint = f'{_SCALE_EXAMPLE}.'
    for name, value in loss_scale.items():
        if name == 'init_scale':
            check_positive(value, f'{key}.{name}', hint)
        elif name == 'growth_factor' and not (is_real(value)
                                              and 1 < value < math.inf):
            raise MmdtrError(
                f'{key}.{name}={value!r} is not accepted; expected a finite '
                'number > 1.',
                hint='e.g. growth_factor=2.0 (the default).')
        elif name == 'backoff_factor' and not (is_real(value)
                                               and 0 < value < 1):
            raise MmdtrError(
                f'{key}.{name}={value!r} is not accepted; expected a number '
                'between 0 and 1 (exclusive).',
                hint='e.g. backoff_factor=0.5 (the default).')
        elif name == 'growth_interval' and (not is_integer(value)
                                            or value < 1):
            raise MmdtrError(
                f'{key}.{name}={value!r} is not accepted; expected a '
                'positive integer.',
                hint='e.g. growth_interval=2000 (the default).')
        elif name == 'enabled':
            refuse_non_bool(value, f'{key}.{name}')
    return dict(loss_scale)


def amp_settings(amp,
                 step_in_backward: bool,
                 prefix: str = KEY) -> Optional[AmpSettings]:
    """Check the ``amp`` setting.

    Args:
        amp (dict, optional): ``dict(dtype=..., loss_scale=...)``, or None
            for no AMP.
        step_in_backward (bool): Whether parameters step in the backward,
            which needs ``loss_scale=None``.
        prefix (str): The wrapper's config key, for messages.

    Returns:
        AmpSettings | None: The settings, or None without AMP.

    Raises:
        MmdtrError: If ``amp`` is not accepted.
    """
    key = f'{prefix}.amp'
    if amp is None:
        return None
    if not isinstance(amp, dict):
        raise MmdtrError(
            f'{key}={amp!r} is not accepted: expected a dict with the keys '
            f'{AMP_KEYS}.',
            hint=f'{_AMP_EXAMPLE}; amp=None for fp32.')
    check_keys(amp, AMP_KEYS, key, 'an amp setting', amp, _AMP_EXAMPLE)
    dtype = amp.get('dtype')
    if dtype is not None and (not isinstance(dtype, str)
                              or dtype not in AMP_DTYPES):
        raise MmdtrError(
            f'{key}.dtype={dtype!r} is not accepted; accepted: None, '
            f'{AMP_DTYPES}.',
            hint="e.g. dtype='bfloat16'; leave dtype out (None) for the "
            "device's autocast default.")
    cast_dtype = getattr(torch, dtype) if dtype else None
    loss_scale = amp.get('loss_scale', 'dynamic')
    static_scale = None
    if loss_scale is None:
        return AmpSettings(cast_dtype, None, None)
    if isinstance(loss_scale, str) and loss_scale == 'dynamic':
        kwargs = {}
    elif is_real(loss_scale):
        check_positive(loss_scale, f'{key}.loss_scale', f'{_SCALE_EXAMPLE}.')
        static_scale = float(loss_scale)
        kwargs = dict(init_scale=static_scale)
    elif isinstance(loss_scale, dict):
        kwargs = _scaler_kwargs(loss_scale, prefix)
    else:
        raise MmdtrError(
            f'{key}.loss_scale={loss_scale!r} is not accepted; accepted: '
            "'dynamic', a positive finite number (a static scale), a dict of "
            'torch.amp.GradScaler arguments, or None.',
            hint=f'{_SCALE_EXAMPLE}.')
    if step_in_backward:
        raise MmdtrError(
            f'{prefix}.step_in_backward=True cannot be combined with '
            f'amp.loss_scale={loss_scale!r}: a grad scaler must find inf/NaN '
            'in every gradient before any parameter steps; accepted: '
            'loss_scale=None.',
            hint="use amp=dict(dtype='bfloat16', loss_scale=None), or "
            'step_in_backward=False.')
    return AmpSettings(cast_dtype, kwargs, static_scale)


def check_wrapper_keys(settings: dict, prefix: str = KEY) -> None:
    """Refuse a key ``InplaceOptimWrapper`` does not take, with the closest
    name; ``AmpOptimWrapper``'s ``dtype`` and ``loss_scale`` (or names
    close to them) with where they go (the closest name was ``type``;
    found by an adversarial search).

    Args:
        settings (dict): The wrapper's keys and values.
        prefix (str): The wrapper's config key, for messages.

    Raises:
        MmdtrError: If a key is not accepted.
    """
    accepted = WRAPPER_KEYS + BUILDER_KEYS
    amp_keys = [  # misspelt ones too: 'dtyp' was told 'rename to type'
        k for k in settings if k in AMP_KEYS or k not in accepted
        and difflib.get_close_matches(str(k), AMP_KEYS, n=1, cutoff=0.8)
    ]
    if amp_keys:
        raise MmdtrError(
            ', '.join(f'{prefix}.{k}={settings[k]!r}' for k in amp_keys) +
            (' are' if len(amp_keys) > 1 else ' is') + ' not accepted: '
            "AmpOptimWrapper's; InplaceOptimWrapper takes them in "
            'amp=dict(dtype=..., loss_scale=...).',
            hint=f'move them into {prefix}.amp; {_AMP_EXAMPLE}.')
    check_keys(settings, accepted, prefix, 'an InplaceOptimWrapper argument',
               settings)


def check_wrapper_config(wrapper: dict,
                         distributed: bool,
                         prefix: str = KEY) -> None:
    """Check an ``InplaceOptimWrapper`` config before anything is built.

    The same checks as the wrapper's constructor, which MMEngine runs only
    when ``runner.train()`` builds the wrapper, plus the one
    ``optim_context`` would make in the first iteration.

    Args:
        wrapper (dict): The ``optim_wrapper`` config (or one of a dict of
            them, one per optimizer).
        distributed (bool): Whether the run has a launcher: each parameter
            stepping during backward would step before its gradient is
            reduced across ranks.
        prefix (str): The wrapper's config key, for messages.

    Raises:
        MmdtrError: If a setting is not accepted.

    Examples:
        >>> check_wrapper_config(dict(type='InplaceOptimWrapper',
        ...                           optimizer=dict(type='SGD', lr=0.1),
        ...                           step_in_backward=True), False)
    """
    settings = {k: v for k, v in wrapper.items() if k not in BUILDER_KEYS}
    check_wrapper_keys(settings, prefix)
    step_in_backward = settings.get('step_in_backward', False)
    check_step_in_backward(step_in_backward, prefix)
    check_accumulative_counts(
        settings.get('accumulative_counts', 1), step_in_backward, prefix)
    clip_grad_settings(settings.get('clip_grad'), step_in_backward, prefix)
    amp_settings(settings.get('amp'), step_in_backward, prefix)
    optimizer = wrapper.get('optimizer', None)
    if not isinstance(optimizer, dict):
        optimizer = {}
    if optimizer.get('foreach', None) not in (None, False):
        # 1 or 'True' passed the check, and the build refused them as
        # foreach=True (found by an adversarial search)
        raise foreach_refused(str(optimizer.get('type')), optimizer['foreach'])
    optimizer_type = optimizer.get('type', None)
    name = getattr(optimizer_type, '__name__', str(optimizer_type))
    if step_in_backward and name.split('.')[-1] in {
            cls.__name__
            for cls in NOT_PER_PARAMETER
    }:
        # refused when runner.train() built the wrapper, after the work
        # dir was made
        raise not_per_parameter_refused(name)
    if step_in_backward and distributed:
        raise MmdtrError(
            f'{prefix}.step_in_backward=True cannot train with a launcher '
            '(distributed): each parameter would step with its local '
            'gradient before it is reduced across ranks; accepted: '
            "launcher='none'.",
            hint='use step_in_backward=False for distributed training.')
