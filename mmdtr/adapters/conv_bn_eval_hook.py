"""MMEngine adapter of efficient Conv-BN eval: the config key and a hook.

The fused computation is MMEngine's ``efficient_conv_bn_eval_control``, and
mmcv's ``ConvModule`` keeps its own support
(``ConvModule.turn_on_efficient_conv_bn_eval``); the pair search lives in
:mod:`mmdtr.techniques.efficient_conv_bn_eval`.
"""
import warnings
from typing import Sequence, Union

import torch.nn as nn
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.model.efficient_conv_bn_eval import \
    efficient_conv_bn_eval_control
from torch.nn.modules.batchnorm import _BatchNorm

from mmdtr.registry import HOOKS
from mmdtr.techniques.conv_bn_fusability import fusable_bn, fusable_conv
from mmdtr.techniques.efficient_conv_bn_eval import \
    apply_efficient_conv_bn_eval
from mmdtr.techniques.module_selection import as_name_list, resolve_modules
from .config_translation import memory_key, refuse_runner_key

try:
    from mmcv.cnn import ConvModule
except ImportError:  # pragma: no cover - mmcv is a dependency
    ConvModule = None

KEY = 'efficient_conv_bn_eval'


def mmcv_conv_module_support(module: nn.Module) -> bool:
    """Turn on mmcv ``ConvModule``'s own efficient Conv-BN eval.

    Args:
        module (nn.Module): Any module.

    Returns:
        bool: True if ``module`` is a ``ConvModule`` whose conv is directly
        followed by a BatchNorm with running stats, both as
        :func:`~mmdtr.techniques.conv_bn_fusability.fusable_conv` and
        ``fusable_bn`` require, now using the fused form in eval mode.
    """
    if ConvModule is None or not isinstance(module, ConvModule):
        return False
    order = list(module.order)
    after_conv = order.index('conv') + 1
    if (not module.with_norm or after_conv >= len(order)
            or order[after_conv] != 'norm' or not fusable_conv(module.conv)
            or not fusable_bn(module.norm)):
        return False  # mmcv's fused form would skip ConvWS's own forward
    module.turn_on_efficient_conv_bn_eval(True)
    return module.efficient_conv_bn_eval_forward is not None


@memory_key(KEY, hook='EfficientConvBnEvalHook')
def translate_efficient_conv_bn_eval(value) -> dict:
    """Validate the ``efficient_conv_bn_eval`` value and build the hook.

    Args:
        value (str | list[str]): Module names or glob patterns.

    Returns:
        dict: The config of :class:`EfficientConvBnEvalHook`.

    Raises:
        MmdtrError: If the value is not a name or a non-empty list of names.

    Examples:
        >>> efficient_conv_bn_eval = ['backbone']
    """
    return dict(
        type='mmdtr.EfficientConvBnEvalHook', modules=as_name_list(value, KEY))


@HOOKS.register_module()
class EfficientConvBnEvalHook(Hook):
    """Fuse eval-mode Conv+BN pairs of sub-modules to save memory.

    Applied once, in ``before_train`` (or ``before_val``/``before_test`` of
    a run that does not train), on the model unwrapped from DDP. Its
    priority is ``ABOVE_NORMAL`` so it runs before
    :class:`ActivationCheckpointingHook`, which then checkpoints the fused
    forward. Names that match no module raise ``MmdtrError`` with the
    closest matches; modules left unfused are logged as warnings with the
    reason.

    Args:
        modules (str | Sequence[str]): Sub-module names or glob patterns on
            ``model.named_modules()``.

    Examples:
        >>> custom_hooks = [
        ...     dict(type='mmdtr.EfficientConvBnEvalHook',
        ...          modules=['backbone'])
        ... ]
    """

    priority = 'ABOVE_NORMAL'

    def __init__(self, modules: Union[str, Sequence[str]]):
        self.modules = as_name_list(modules, KEY)
        self.results = None
        self._modes_checked = True  # until before_train

    def _apply(self, runner) -> None:
        if self.results is not None:
            return
        model = _unwrapped(runner.model)
        runner.logger.info(f'Enabling the "{KEY}" feature for these modules '
                           f'{self.modules}')
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            self.results = apply_efficient_conv_bn_eval(
                model, self.modules, efficient_conv_bn_eval_control,
                mmcv_conv_module_support)
        for warning in caught:
            runner.logger.warning(str(warning.message))
        for result in self.results:
            if result.enabled:
                traced = result.traced[:4] + (['...'] if len(result.traced) > 4
                                              else [])
                runner.logger.info(
                    f'{KEY}: {result.name!r}: {result.fused_pairs} Conv+BN '
                    f'pairs fused in {len(result.traced)} torch.fx-traced '
                    f'modules {traced}; {result.native_modules} mmcv '
                    'ConvModules use their own support.')

    def before_run(self, runner) -> None:
        """Check the names before any hook changes the model (in
        ``before_train``): a bad name of another mmdtr hook then leaves
        this one unapplied too. Refused next to MMEngine's own key."""
        refuse_runner_key(runner, KEY, self)
        resolve_modules(_unwrapped(runner.model), self.modules, KEY)

    def before_train(self, runner) -> None:
        """Apply to the model before the first training iteration."""
        self._apply(runner)
        self._modes_checked = False

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        """At the first iteration (the train loop has set the modes): log a
        selected module whose BatchNorms all train, where the fused form
        never runs, so training saves nothing (found by a review: mmseg
        trains its norms, and the log said only how many pairs were
        fused)."""
        if self._modes_checked:
            return
        self._modes_checked = True
        model = _unwrapped(runner.model)
        for result in self.results or ():
            norms = [
                m for m in model.get_submodule(result.name).modules()
                if isinstance(m, _BatchNorm)
            ]
            if result.enabled and norms and all(m.training for m in norms):
                runner.logger.warning(
                    f'{KEY}: every BatchNorm in {result.name!r} is in '
                    'training mode at the first training iteration; the '
                    'fused form runs only where one is in eval mode '
                    '(norm_eval=True, frozen stages, validation and '
                    'testing), so it saves no memory in training here.')

    def before_val(self, runner) -> None:
        """Apply before validation when the run does not train."""
        self._apply(runner)

    def before_test(self, runner) -> None:
        """Apply before testing when the run does not train."""
        self._apply(runner)


def _unwrapped(model: nn.Module) -> nn.Module:
    return model.module if is_model_wrapper(model) else model
