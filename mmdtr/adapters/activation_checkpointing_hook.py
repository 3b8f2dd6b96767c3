"""MMEngine adapter of activation checkpointing: the config key and a hook.

The logic lives in :mod:`mmdtr.techniques.activation_checkpointing`.
"""
from typing import Optional, Sequence, Union

from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper

from mmdtr.errors import MmdtrError
from mmdtr.registry import HOOKS
from mmdtr.techniques.activation_checkpointing import \
    apply_activation_checkpointing
from mmdtr.techniques.module_selection import (as_name_list, called_modules,
                                               resolve_modules)
from mmdtr.techniques.selective_policy import POLICIES, normalize_policy
from .config_translation import memory_key, refuse_runner_key

KEY = 'activation_checkpointing'
_ACCEPTED = ("a module name or glob pattern (str), a list of them, or "
             "dict(modules=<str or list>, policy=<None, a name of "
             f"{sorted(POLICIES)} or a list of aten op names>)")


@memory_key(KEY, hook='ActivationCheckpointingHook')
def translate_activation_checkpointing(value) -> dict:
    """Validate the ``activation_checkpointing`` value and build the hook.

    Args:
        value (str | list[str] | dict): See
            :class:`ActivationCheckpointingHook`.

    Returns:
        dict: The config of :class:`ActivationCheckpointingHook`.

    Raises:
        MmdtrError: If the value has none of the accepted forms, or names an
            unknown policy or op.

    Examples:
        >>> activation_checkpointing = 'backbone.layer*'
        >>> activation_checkpointing = ['backbone.layer3', 'neck']
        >>> activation_checkpointing = dict(
        ...     modules=['backbone.layer*'], policy='save_compute_heavy')
    """
    policy = None
    if isinstance(value, dict):
        unknown = sorted(set(value) - {'modules', 'policy'})
        if unknown or 'modules' not in value:
            raise MmdtrError(
                f'{KEY}={value!r} is not accepted: the dict form takes the '
                "keys 'modules' (required) and 'policy'; got " +
                ', '.join([f'the unknown keys {unknown}'] * bool(unknown) +
                          ['no modules'] * ('modules' not in value)) +
                f'. Accepted: {_ACCEPTED}.',
                hint="e.g. dict(modules='backbone.layer*', "
                "policy='save_compute_heavy').")
        modules, policy = value['modules'], value.get('policy')
    elif isinstance(value, (str, list, tuple)):
        modules = value
    else:
        raise MmdtrError(
            f'{KEY}={value!r} ({type(value).__name__}) is not accepted. '
            f'Accepted: {_ACCEPTED}.',
            hint="e.g. activation_checkpointing = 'backbone.layer*'.")
    modules = as_name_list(
        modules, f'{KEY}.modules' if isinstance(value, dict) else KEY)
    normalize_policy(policy)
    if isinstance(policy, tuple):
        policy = list(policy)
    return dict(
        type='mmdtr.ActivationCheckpointingHook',
        modules=modules,
        policy=policy)


def _selected(model, modules) -> dict:
    """The modules ``modules`` select, by name, with the members of the
    containers among them, which are the ones wrapped (a review: two hooks
    with other policies, one selecting ``'blocks'``, the other
    ``'blocks.0'``, wrapped ``blocks.0`` twice, unrefused)."""
    found = resolve_modules(model, modules, KEY)
    for name in called_modules(model, list(found), KEY):
        found.setdefault(name, model.get_submodule(name))
    return found


@HOOKS.register_module()
class ActivationCheckpointingHook(Hook):
    """Checkpoint the activations of sub-modules before training starts.

    Applied in ``before_train``: after weights are initialized and a
    checkpoint is loaded, before the first iteration. The model is unwrapped
    from DDP (``runner.model.module``) first. Every name is checked before
    any module is wrapped; the wrapped modules are logged.

    Args:
        modules (str | Sequence[str]): Sub-module names or glob patterns on
            ``model.named_modules()`` (``'*'`` within one dotted segment,
            ``'**'`` across segments).
        policy (None | str | Sequence[str]): ``None`` recomputes every op;
            ``'save_compute_heavy'`` keeps matmul, convolution and attention
            outputs and recomputes the rest; ``'save_matmuls'``,
            ``'save_convolutions'``; or a list of aten op names to keep.

    Examples:
        >>> custom_hooks = [
        ...     dict(type='mmdtr.ActivationCheckpointingHook',
        ...          modules=['backbone.layer*'],
        ...          policy='save_compute_heavy')
        ... ]
    """

    priority = 'NORMAL'

    def __init__(self,
                 modules: Union[str, Sequence[str]],
                 policy: Union[None, str, Sequence[str]] = None):
        self.modules = as_name_list(modules, KEY)
        normalize_policy(policy)
        self.policy = policy
        self.wrapped: Optional[list] = None

    def before_run(self, runner) -> None:
        """Check the names before any hook changes the model (in
        ``before_train``): a bad name here then leaves the other mmdtr
        hooks unapplied too. Refused next to MMEngine's own key."""
        refuse_runner_key(runner, KEY, self)
        model = runner.model
        model = model.module if is_model_wrapper(model) else model
        found = _selected(model, self.modules)
        self._refuse_other_policies(runner, model, found)

    def _refuse_other_policies(self, runner, model, found: dict) -> None:
        """Refuse a module that another of these hooks selects with another
        policy: the one applied last won, and both were logged as enabled
        (found by an adversarial search)."""
        for other in runner.hooks:
            if other is self or not isinstance(
                    other, ActivationCheckpointingHook) or normalize_policy(
                        other.policy) == normalize_policy(self.policy):
                continue
            theirs = _selected(model, other.modules)
            ids = {id(module) for module in theirs.values()}
            both = [name for name, m in found.items() if id(m) in ids]
            if both:
                raise MmdtrError(
                    f'{KEY}: {both[0]!r} is selected by two '
                    f'ActivationCheckpointingHooks, with policy='
                    f'{self.policy!r} and policy={other.policy!r}; the one '
                    'applied last would win.',
                    hint='select each module once, or give both hooks the '
                    'same policy.')

    def before_train(self, runner) -> None:
        """Wrap the selected modules of the (unwrapped) model."""
        model = runner.model
        if is_model_wrapper(model):
            model = model.module
        self.wrapped = apply_activation_checkpointing(model, self.modules,
                                                      self.policy)
        runner.logger.info(
            f'Enabling the "{KEY}" feature (mmdtr, non-reentrant, policy='
            f'{self.policy!r}) for {len(self.wrapped)} sub-module'
            f"{'' if len(self.wrapped) == 1 else 's'}: {self.wrapped}")
