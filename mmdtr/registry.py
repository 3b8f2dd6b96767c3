"""mmdtr's registries: children of MMEngine's, as OpenMMLab repos do.

Components registered here are reachable from a config by their plain
name when its ``default_scope`` is ``'mmdtr'``, and from any config through
the scoped name ``'mmdtr.Name'`` (with
``custom_imports=dict(imports=['mmdtr'])``); a plain name of mmdtr's in
another scope is refused when the config is read. Every MMEngine root
registry has a child
here, so a config with ``default_scope='mmdtr'`` finds MMEngine's own
components (loops, optimizers, visualizers, ...) without warnings.
"""
from mmengine import registry as mmengine_registry
from mmengine.registry import Registry


def _child(name: str, location: str = None) -> Registry:
    parent = getattr(mmengine_registry, name)
    return Registry(
        parent.name, parent=parent, locations=[location] if location else [])


HOOKS = _child('HOOKS', 'mmdtr.adapters')
MODEL_WRAPPERS = _child('MODEL_WRAPPERS', 'mmdtr.adapters')
OPTIM_WRAPPERS = _child('OPTIM_WRAPPERS', 'mmdtr.adapters')
RUNNERS = _child('RUNNERS', 'mmdtr.adapters')
MODELS = _child('MODELS', 'mmdtr.models')
DATASETS = _child('DATASETS', 'mmdtr.datasets')

DATA_SAMPLERS = _child('DATA_SAMPLERS')
EVALUATOR = _child('EVALUATOR')
FUNCTIONS = _child('FUNCTIONS')
INFERENCERS = _child('INFERENCERS')
LOG_PROCESSORS = _child('LOG_PROCESSORS')
LOOPS = _child('LOOPS')
METRICS = _child('METRICS')
OPTIMIZERS = _child('OPTIMIZERS')
OPTIM_WRAPPER_CONSTRUCTORS = _child('OPTIM_WRAPPER_CONSTRUCTORS')
PARAM_SCHEDULERS = _child('PARAM_SCHEDULERS')
RUNNER_CONSTRUCTORS = _child('RUNNER_CONSTRUCTORS')
TASK_UTILS = _child('TASK_UTILS')
TRANSFORMS = _child('TRANSFORMS')
VISBACKENDS = _child('VISBACKENDS')
VISUALIZERS = _child('VISUALIZERS')
WEIGHT_INITIALIZERS = _child('WEIGHT_INITIALIZERS')
