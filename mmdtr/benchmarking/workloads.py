"""Workloads of the benchmark: model, batch, training step, techniques.

A workload is a config of ``configs/`` (a model and a synthetic dataset)
at a batch size. One training step is: forward in ``mode='loss'``, the
losses summed, ``backward()``, then an SGD step (or only ``zero_grad``).
DTR, when used, is active around the forward and the backward only, as
:class:`~mmdtr.adapters.dtr_train_step.DTRTrainStep` does in training.

The alternatives to DTR checkpoint the model's *blocks*: the sequential
chain of residual blocks, units or transformer layers that carry the
activations (:data:`DEFAULT_BLOCKS`).
"""
import math
from contextlib import nullcontext
from typing import Dict, List, Optional, Sequence, Union

import torch
from mmengine.config import Config
from mmengine.dataset import default_collate
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from mmdtr.dtr import DTR
from mmdtr.errors import MmdtrError
from mmdtr.registry import DATASETS, MODELS
from mmdtr.techniques.inplace_update import PerParameterStepper
from mmdtr.techniques.module_selection import resolve_modules
from mmdtr.utils.cfg_options import merge_cfg_options, read_config

#: Model type -> glob of its blocks, in forward order.
DEFAULT_BLOCKS: Dict[str, str] = {
    'ResNetClassifier': 'backbone.layer*.*',
    'ResNet50Classifier': 'backbone.layer*.*',
    'ShuffleNetV2Classifier': 'backbone.stages.*.*',
    'SPOSSupernet': 'backbone.layers.*',
    'GPTDecoder': 'blocks.*',
}
#: What a run may apply to the model.
OPTIMIZERS = ('sgd', 'sgd_in_backward', 'none')
TECHNIQUES = ('baseline', 'dtr', 'dispatch_floor', 'checkpoint_sqrt',
              'mmengine_ac', 'mmdtr_ac')
#: The keys of a config a workload reads (``--cfg-options`` on others are
#: refused).
READ_KEYS = ('model', 'train_dataloader')
#: A threshold no workload reaches: DTR meters but never evicts.
NO_EVICTION = 2**62


def load_config(config: str,
                cfg_options: Optional[dict] = None,
                image_size: Optional[int] = None,
                seq_len: Optional[int] = None) -> Config:
    """Read a workload config and apply the benchmark's overrides.

    Args:
        config (str): Path of the config file.
        cfg_options (dict, optional): ``--cfg-options`` to merge.
        image_size (int, optional): Image side of an image dataset.
        seq_len (int, optional): Sequence length of a token dataset (the
            model's ``max_seq_len`` is raised to it when smaller).

    Returns:
        Config: The config.

    Raises:
        MmdtrError: If the file is missing, ``cfg_options`` set keys
            other than :data:`READ_KEYS` or cannot be merged, the config
            has no ``model`` or no
            ``train_dataloader.dataset`` dict, or an override does not
            apply to the dataset.
    """
    cfg = read_config(config)
    unread = sorted({str(k).split('.')[0]
                     for k in cfg_options or {}} - set(READ_KEYS))
    if unread:
        raise MmdtrError(
            f'--cfg-options on {unread} would be ignored: a workload reads '
            f'only {list(READ_KEYS)} of the config; the techniques, the '
            'optimizer and DTR come from the command and its options.',
            hint='set DTR with --thresholds/--fractions, --policy and '
            '--evictee-minimum-size, the optimizer with --optimizer (see '
            '--help).')
    if cfg_options:
        merge_cfg_options(cfg, cfg_options)
    loader = cfg.get('train_dataloader')
    dataset = loader.get('dataset') if isinstance(loader, dict) else None
    for key, value in (('model', cfg.get('model')),
                       ('train_dataloader.dataset', dataset)):
        if not isinstance(value, dict):
            raise MmdtrError(
                f'config {config} has no {key} dict (got {value!r}); a '
                'workload needs a model and a dataset to build its batch '
                'from.',
                hint='give a config of configs/, e.g. '
                'configs/resnet50_synthetic.py.')
    for key, value in (('image_size', image_size), ('seq_len', seq_len)):
        if value is None:
            continue
        if key not in dataset:
            raise MmdtrError(
                f'--{key.replace("_", "-")} {value} does not apply to '
                f'{config}: its dataset {dataset.get("type")!r} has no '
                f'{key!r}.',
                hint='use --image-size for image datasets and --seq-len '
                'for token datasets.')
        dataset[key] = value
    if seq_len is not None and cfg.model.get('max_seq_len', seq_len) < \
            seq_len:
        cfg.model.max_seq_len = seq_len
    return cfg


def check_workload(cfg: Config,
                   blocks: Union[bool, str, None] = False) -> None:
    """Build the model and the dataset of ``cfg`` once and drop them, so
    that a bad override (``--cfg-options model.depth=abc``) is refused
    before any run instead of failing every run.

    Args:
        cfg (Config): The workload's config.
        blocks (bool | str | None): ``False``: no blocks are checkpointed.
            Else the ``--blocks`` glob (``None``: the model's default),
            resolved on the model now.

    Raises:
        MmdtrError: If either cannot be built, or the blocks match nothing.
    """
    built = []
    for key, value, registry in (('model', cfg.model, MODELS),
                                 ('train_dataloader.dataset',
                                  cfg.train_dataloader.dataset, DATASETS)):
        try:
            built.append(registry.build(value))
        except MmdtrError:
            raise
        except Exception as e:  # noqa: B902 - any build error, reported
            raise MmdtrError(
                f'{key} of the config cannot be built: '
                f'{type(e).__name__}: {e}',
                hint='check the config and its --cfg-options.') from None
    if blocks is not False:
        block_names(built[0], blocks)


def block_names(model: nn.Module, pattern: Optional[str] = None) -> List[str]:
    """Names of the model's blocks in forward order.

    Args:
        model (nn.Module): The model.
        pattern (str, optional): Glob of the blocks; defaults to
            :data:`DEFAULT_BLOCKS` of the model's type.

    Returns:
        list[str]: Module names.
    """
    if pattern is None:
        pattern = DEFAULT_BLOCKS.get(type(model).__name__)
    if pattern is None:
        raise MmdtrError(
            f'the benchmark does not know the blocks of '
            f'{type(model).__name__}; known: {sorted(DEFAULT_BLOCKS)}.',
            hint="give them with --blocks, e.g. --blocks 'backbone.layer*.*'"
            ' (modules called one after the other, each on one tensor).')
    return list(resolve_modules(model, pattern, key='--blocks'))


def split_even(items: Sequence, parts: int) -> List[list]:
    """Split ``items`` into ``parts`` contiguous groups of near-equal size.

    The first ``len(items) % parts`` groups get one item more.

    Args:
        items (Sequence): The items, in order.
        parts (int): Groups wanted; clamped to between 1 and
            ``len(items)``.

    Returns:
        list[list]: The groups.
    """
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    groups, start = [], 0
    for i in range(parts):
        stop = start + size + (i < extra)
        groups.append(list(items[start:stop]))
        start = stop
    return groups


def _passthrough(x):
    return x


def checkpoint_segments(model: nn.Module,
                        names: Sequence[str],
                        num_segments: Optional[int] = None) -> List[list]:
    """Checkpoint ``names`` in ``num_segments`` segments (sqrt(N) default).

    The blocks must be called one after another, each on the previous one's
    output (true of the blocks of :data:`DEFAULT_BLOCKS`). The first block
    of a segment runs the whole segment under
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``; the others
    then pass their input through. As with any ``torch.utils.checkpoint``,
    batch-norm running statistics are updated again by the recompute.

    Args:
        model (nn.Module): The model; changed in place.
        names (Sequence[str]): Block names in forward order.
        num_segments (int, optional): Defaults to ``round(sqrt(N))``.

    Returns:
        list[list[str]]: The segments.
    """
    if num_segments is None:
        num_segments = max(1, round(math.sqrt(len(names))))
    segments = split_even(list(names), num_segments)
    for segment in segments:
        modules = [model.get_submodule(name) for name in segment]
        forwards = [module.forward for module in modules]

        def run(x, forwards=forwards):
            for forward in forwards:
                x = forward(x)
            return x

        def segment_forward(x, run=run):
            if not torch.is_grad_enabled():
                return run(x)
            return checkpoint(run, x, use_reentrant=False)

        modules[0].forward = segment_forward
        for module in modules[1:]:
            module.forward = _passthrough
    return segments


def apply_technique(model: nn.Module,
                    technique: str,
                    blocks: Optional[str] = None) -> str:
    """Apply a non-DTR technique to the model; return what was done.

    Args:
        model (nn.Module): The model; changed in place.
        technique (str): One of :data:`TECHNIQUES`.
        blocks (str, optional): Glob of the blocks (see :func:`block_names`).

    Returns:
        str: A short description, e.g. ``'4 segments of 16 blocks'``.
    """
    if technique not in TECHNIQUES:
        raise MmdtrError(
            f'technique {technique!r} is unknown; accepted: '
            f'{list(TECHNIQUES)}.',
            hint="give one of those, e.g. 'baseline' or 'dtr'.")
    if technique in ('baseline', 'dtr', 'dispatch_floor'):
        return ''
    names = block_names(model, blocks)
    if technique == 'checkpoint_sqrt':
        segments = checkpoint_segments(model, names)
        return f'{len(segments)} segments of {len(names)} blocks'
    if technique == 'mmengine_ac':
        from mmengine.runner.activation_checkpointing import \
            turn_on_activation_checkpointing
        turn_on_activation_checkpointing(model, names)
    else:
        from mmdtr.techniques.activation_checkpointing import \
            apply_activation_checkpointing
        apply_activation_checkpointing(model, names)
    return f'each of {len(names)} blocks'


class _ForwardEveryOp(TorchDispatchMode):

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _identity(tensor):
    return tensor


class DispatchFloor:
    """What an engine built as DTR is pays before doing any work: an empty
    ``TorchDispatchMode`` that runs every op as it is, and saved-tensor
    hooks that keep every saved tensor as it is. Used as an engine by
    :meth:`Workload.step` (technique ``'dispatch_floor'``), it separates
    PyTorch's cost of these two extension points from DTR's bookkeeping.
    """

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(
            _identity, _identity)
        self._mode = _ForwardEveryOp()
        self._mode.__enter__()
        try:
            self._hooks.__enter__()
        except BaseException:
            self._mode.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        try:
            self._hooks.__exit__(*exc)
        finally:
            self._mode.__exit__(*exc)
        return False


class Workload:
    """A model, one batch and an optimizer, ready to step.

    Args:
        cfg (Config): A config from :func:`load_config`.
        batch_size (int): Samples in the batch.
        device (str): ``'cpu'`` or ``'cuda'``.
        optimizer (str): ``'sgd'`` (SGD, momentum 0.9, stepped after
            backward), ``'sgd_in_backward'`` (the same SGD stepping each
            parameter from its gradient hook during backward and freeing
            the gradient, as ``InplaceOptimWrapper(step_in_backward=True)``
            does) or ``'none'`` (gradients are only zeroed).
        seed (int): Seeds torch before the model is built.
    """

    def __init__(self,
                 cfg: Config,
                 batch_size: int,
                 device: str = 'cpu',
                 optimizer: str = 'sgd',
                 seed: int = 0):
        if batch_size < 1:
            raise MmdtrError(
                f'batch size {batch_size} is not positive.',
                hint='give a batch size of 1 or more (--batch-size, or '
                'train_dataloader.batch_size of the config).')
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.model = MODELS.build(cfg.model).to(self.device)
        self.model.train()
        dataset = DATASETS.build(cfg.train_dataloader.dataset)
        samples = [dataset[i % len(dataset)] for i in range(batch_size)]
        self.batch = self.model.data_preprocessor(
            default_collate(samples), True)
        self.optimizer = self.stepper = None
        if optimizer in ('sgd', 'sgd_in_backward'):
            self.optimizer = torch.optim.SGD(
                self.model.parameters(),
                lr=1e-3,
                momentum=0.9,
                foreach=False if optimizer == 'sgd_in_backward' else None)
            if optimizer == 'sgd_in_backward':
                self.stepper = PerParameterStepper(self.optimizer)
        elif optimizer != 'none':
            raise MmdtrError(
                f'optimizer {optimizer!r} is not one of {OPTIMIZERS}.',
                hint='give one of those, e.g. --optimizer sgd (the '
                'default).')

    def step(self, engine: Optional[DTR] = None) -> float:
        """One training step; ``engine`` (if any: a :class:`DTR` or a
        :class:`DispatchFloor`) around the forward and the backward.

        Args:
            engine (DTR | DispatchFloor, optional): Entered around the
                forward and the backward.

        Returns:
            float: The loss.
        """
        if self.stepper is not None:
            self.stepper.begin()
        with engine if engine is not None else nullcontext():
            losses = self.model(**self.batch, mode='loss')
            loss = sum(value.sum() for value in losses.values())
            loss.backward()
        if self.stepper is not None:
            self.stepper.end()
        elif self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)
        return float(loss.detach())
