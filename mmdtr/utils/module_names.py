"""Module names in a translated config, checked on its model before training.

The hooks that select modules by name (``activation_checkpointing``,
``efficient_conv_bn_eval``) check the names against the model in
``before_run``, once the runner has made its work dir and, under
``tools/dist_train.sh``, once in every rank. ``tools/train.py`` and
``tools/demo.py`` run the same checks here first, on a model built for it.
"""
import copy
import types

from mmengine.registry import MODELS, DefaultScope
from torch import nn

from mmdtr.adapters.config_translation import MEMORY_KEY_HOOKS, hook_name
from mmdtr.registry import HOOKS

#: the memory keys whose hooks select modules by name
SELECTING_KEYS = ('activation_checkpointing', 'efficient_conv_bn_eval')


def check_module_names(cfg) -> None:
    """Run the module-name checks of the config's selecting hooks.

    Only mmdtr's own hooks are checked (others may be another scope's). The
    model is built as MMEngine's Runner builds it (its registry, the
    config's default scope, from a copy of ``cfg.model`` given the config's
    ``data_preprocessor``); one that cannot be built here is left to the
    runner, which says why.

    Args:
        cfg (Config): A config translated by
            :func:`~mmdtr.adapters.config_translation.translate_memory_keys`.

    Raises:
        MmdtrError: If a selecting hook names no module of the model
            (``activation_checkpointing=backbone.layr2``).
    """
    names = [MEMORY_KEY_HOOKS[key] for key in SELECTING_KEYS]
    selecting = [
        HOOKS.build(copy.deepcopy(h)) for h in cfg.get('custom_hooks') or ()
        if isinstance(h, dict) and hook_name(h) in names
    ]
    if not selecting:
        return
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
            except Exception:  # noqa: B902 - the runner will say why
                return
    for hook in selecting:
        hook.before_run(
            types.SimpleNamespace(model=model, cfg=cfg, hooks=selecting))
