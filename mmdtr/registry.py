"""mmdtr's registries: children of MMEngine's, as OpenMMLab repos do.

Components registered here are reachable from a config either through
``custom_imports=dict(imports=['mmdtr'])`` and their plain name, or through
the scoped name ``'mmdtr.Name'``.
"""
from mmengine.registry import DATASETS as MMENGINE_DATASETS
from mmengine.registry import HOOKS as MMENGINE_HOOKS
from mmengine.registry import MODEL_WRAPPERS as MMENGINE_MODEL_WRAPPERS
from mmengine.registry import MODELS as MMENGINE_MODELS
from mmengine.registry import OPTIM_WRAPPERS as MMENGINE_OPTIM_WRAPPERS
from mmengine.registry import RUNNERS as MMENGINE_RUNNERS
from mmengine.registry import Registry

HOOKS = Registry(
    'hook', parent=MMENGINE_HOOKS, locations=['mmdtr.adapters'])
MODEL_WRAPPERS = Registry(
    'model_wrapper',
    parent=MMENGINE_MODEL_WRAPPERS,
    locations=['mmdtr.adapters'])
OPTIM_WRAPPERS = Registry(
    'optim_wrapper',
    parent=MMENGINE_OPTIM_WRAPPERS,
    locations=['mmdtr.adapters'])
RUNNERS = Registry(
    'runner', parent=MMENGINE_RUNNERS, locations=['mmdtr.adapters'])
MODELS = Registry('model', parent=MMENGINE_MODELS, locations=['mmdtr.models'])
DATASETS = Registry(
    'dataset', parent=MMENGINE_DATASETS, locations=['mmdtr.datasets'])
