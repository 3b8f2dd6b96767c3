"""Module names in a translated config, checked on its model before training.

The hooks that select modules by name (``activation_checkpointing``,
``efficient_conv_bn_eval``) check the names against the model in
``before_run``, once the runner has made its work dir and, under
``tools/dist_train.sh``, once in every rank. ``tools/train.py``,
``tools/demo.py`` and, without a launcher,
:meth:`~mmdtr.adapters.runner.MMDTRRunner.from_cfg` run the same checks
here first, on a model built for it.
"""
import copy
import logging
import types
from typing import Optional

from mmengine.hooks import Hook
from mmengine.registry import MODELS, DefaultScope
from mmengine.runner import get_priority
from torch import nn

from mmdtr.adapters.config_translation import MEMORY_KEY_HOOKS, hook_name
from mmdtr.errors import MmdtrError
from mmdtr.registry import HOOKS

#: the memory keys whose hooks select modules by name
SELECTING_KEYS = ('activation_checkpointing', 'efficient_conv_bn_eval')
#: set on a config whose names :func:`check_module_names` checked
CHECKED_ATTR = '_mmdtr_module_names_checked'

_SILENT = logging.getLogger('mmdtr.module_names')  # the runner logs it all
_SILENT.addHandler(logging.NullHandler())
_SILENT.propagate = False


def selecting_hooks(cfg) -> list:
    """mmdtr's hooks in ``cfg.custom_hooks`` that select modules by name
    (those of :data:`SELECTING_KEYS`): configs, or hook objects (a
    config built in Python; they were skipped, found by a review)."""
    names = [MEMORY_KEY_HOOKS[key] for key in SELECTING_KEYS]
    return [
        h for h in cfg.get('custom_hooks') or ()
        if isinstance(h, (dict, Hook)) and hook_name(h) in names
    ]


def check_module_names(cfg,
                       strict: bool = False,
                       build_model: bool = False) -> Optional[str]:
    """Run the module-name checks of the config's selecting hooks.

    Only mmdtr's own hooks are checked (others may be another scope's). The
    model is built as MMEngine's Runner builds it (its registry, the
    config's default scope, from a copy of ``cfg.model`` given the config's
    ``data_preprocessor``). An :class:`MmdtrError` from that build (one of
    mmdtr's models refusing an argument) is raised; a model that cannot be
    built here for another reason is left to the runner, which says why,
    unless ``strict``; the reason is returned.

    When both keys are set, the two hooks are also applied to that model,
    as the runner applies them, so that a module checkpointed inside one
    ``efficient_conv_bn_eval`` replaces by a torch.fx trace is refused here.

    Args:
        cfg (Config): A config translated by
            :func:`~mmdtr.adapters.config_translation.translate_memory_keys`.
        strict (bool): Refuse a model that cannot be built here, naming the
            error (``--check-config`` without a launcher: the names would go
            unchecked while the check said they were accepted; found by a
            review). Under a launcher a model may need the process group
            to be built: the ranks check the names in ``before_run``.
        build_model (bool): Build the model even when no hook selects
            modules, so that its own arguments are checked
            (``--check-config``: ``model.depth=51`` and a misplaced
            argument passed it, then failed after the work dir was made;
            found by an adversarial search).

    Returns:
        str | None: Why the names were not checked (the model could not
        be built here, not ``strict``), or None.

    Raises:
        MmdtrError: If a selecting hook names no module of the model
            (``activation_checkpointing=backbone.layr2``), the two cannot
            apply together, or the model cannot be built (see above).
    """
    selecting = [
        copy.deepcopy(h) if isinstance(h, Hook) else HOOKS.build(
            copy.deepcopy(h)) for h in selecting_hooks(cfg)
    ]
    if not selecting and not build_model:
        return None
    model = cfg.get('model')
    if not isinstance(model, nn.Module):  # built as the runner builds it,
        # from a copy (a model's __init__ may pop from its config; found by
        # a review)
        model = copy.deepcopy(model)
        if isinstance(model, dict) and \
                cfg.get('data_preprocessor') is not None:
            model.setdefault('data_preprocessor', cfg.data_preprocessor)
        scope = cfg.get('default_scope', 'mmengine')
        with DefaultScope.overwrite_default_scope(scope):
            try:
                model = MODELS.build(model)
            except MmdtrError:
                raise  # the runner would raise it, once its work dir exists
            except Exception as e:  # noqa: B902 - the runner will say why
                if not strict:
                    return ('the model could not be built here '
                            f'({type(e).__name__}: {e})')
                purpose = ' to check the module names of ' + str(
                    [hook_name(h) for h in selecting]) if selecting else ''
                raise MmdtrError(
                    f'the model could not be built{purpose}: '
                    f'{type(e).__name__}: {e}',
                    hint='fix the model config; the runner would fail to '
                    'build it too.') from e
    built = model is not cfg.get('model')  # a model of its own: changed
    runner = types.SimpleNamespace(
        model=model, cfg=cfg, hooks=selecting, logger=_SILENT)
    for hook in selecting:
        hook.before_run(runner)
    if built and len(selecting) > 1:
        # applied together, as the runner will (by priority): a module
        # checkpointed inside one efficient_conv_bn_eval replaced by a
        # trace is refused only when applied, in before_train, once the
        # work dir was made and the model changed (found by a review)
        for hook in sorted(selecting, key=lambda h: get_priority(h.priority)):
            hook.before_train(runner)
    object.__setattr__(cfg, CHECKED_ATTR, True)  # not a config key
    return None
