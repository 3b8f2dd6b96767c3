"""mmdtr's Runner: MMEngine's Runner that honours mmdtr's config keys.

It adds three things to :class:`mmengine.runner.Runner`:

- :meth:`MMDTRRunner.from_cfg` translates mmdtr's memory keys
  (:func:`~mmdtr.adapters.config_translation.translate_memory_keys`), so a
  downstream repo's own ``tools/train.py`` honours the same keys as mmdtr's;
- distributed training on a CPU-only machine: the process group is
  initialised with gloo (and destroyed when the process exits) and the
  model is wrapped by
  :class:`~mmdtr.adapters.distributed.MMDTRDistributedDataParallel`
  (with CUDA, MMEngine's nccl and ``MMDistributedDataParallel`` are kept);
- checkpoints load with ``torch.load(weights_only=True)`` (see
  :mod:`mmdtr.adapters.checkpoint_loading`).

MMEngine builds a runner either with ``Runner.from_cfg(cfg)`` or, when the
config has ``runner_type``, with ``RUNNERS.build(cfg)``, which calls
``runner_cls.from_cfg(cfg)``. Both routes go through
:meth:`MMDTRRunner.from_cfg`; translation is idempotent, so a config that
``tools/train.py`` already translated is not translated again.
"""
import os.path as osp
from typing import Dict, Optional, Union

from mmengine.config import Config, ConfigDict
from mmengine.device import get_device
from mmengine.dist import is_distributed, is_main_process
from mmengine.model import is_model_wrapper
from mmengine.registry import RUNNERS as MMENGINE_RUNNERS
from mmengine.runner import Runner
from torch import distributed as torch_dist
from torch import nn

from mmdtr.registry import MODEL_WRAPPERS, RUNNERS
from mmdtr.utils.module_names import CHECKED_ATTR, check_module_names
from .checkpoint_loading import register_checkpoint_safe_globals
from .config_translation import SOURCE_ATTR, translate_memory_keys
from .cpu_process_group import (check_launcher_env, close_at_exit, dist_cfg_of,
                                init_cpu_dist, noting_outcome)
from .registered_types import mmdtr_only
from .runner_config_checks import check_amp_available
from .writable_config import refuse_unwritable


@RUNNERS.register_module()
class MMDTRRunner(Runner):
    """MMEngine's Runner with mmdtr's config keys and CPU-distributed support.

    Accepts the same arguments as :class:`mmengine.runner.Runner`. Build it
    with :meth:`from_cfg` (or through ``runner_type``) so that mmdtr's memory
    keys are translated into hooks; building it with ``__init__`` directly
    takes ``custom_hooks`` as given.

    Examples:
        >>> # in a downstream repo's config, used by its own tools/train.py
        >>> custom_imports = dict(imports=['mmdtr'],
        ...                       allow_failed_imports=False)
        >>> runner_type = 'MMDTRRunner'  # or 'mmdtr.MMDTRRunner'
        >>> activation_checkpointing = ['backbone.layer1']
    """

    #: model wrapper used by default when distributed on CPU.
    cpu_model_wrapper: str = 'mmdtr.MMDTRDistributedDataParallel'

    def __init__(self, *args, **kwargs):
        register_checkpoint_safe_globals()
        super().__init__(*args, **kwargs)
        if self.distributed and get_device() == 'cpu':
            self.logger.info(
                f'mmdtr: distributed on CPU, backend '
                f'{torch_dist.get_backend()}, world size {self.world_size}, '
                f'model wrapper {type(self.model).__name__}.')

    @classmethod
    def from_cfg(cls, cfg: Union[Config, ConfigDict, dict]) -> 'MMDTRRunner':
        """Build a runner from a config, translating mmdtr's memory keys.

        Args:
            cfg (Config or dict): The config; see
                :meth:`mmengine.runner.Runner.__init__` for its keys.

        Returns:
            MMDTRRunner: The runner.

        Raises:
            MmdtrError: If a value cannot be written to the work dir (an
                object: MMEngine writes the config as Python source), a
                memory key has a bad value, AMP is asked for
                on a CPU-only machine, a launcher's environment variables
                are missing, or, without a launcher, a module
                name selects nothing or the two selecting keys cannot
                apply together (checked on a model built for it, before
                the work dir is made).
        """
        checked = getattr(cfg, CHECKED_ATTR, False)  # by tools/train.py
        if not isinstance(cfg, Config):
            cfg = Config(dict(cfg))
        translated = translate_memory_keys(cfg)
        # after mmdtr's own checks, which say more of what they refuse; the
        # keys as written (MMEngine writes it after making the work dir)
        refuse_unwritable(cfg)
        cfg = translated
        check_amp_available(cfg.get('optim_wrapper'))
        launcher = cfg.get('launcher', 'none')
        if launcher == 'none':
            if not checked:
                # before the work dir is made and before any hook changes
                # the model, as tools/train.py does: a downstream script's
                # bad name or conflict came after both (found by a review);
                # under a launcher each rank checks in before_run
                check_module_names(cfg)
        elif not is_distributed():
            # before the work dir too, on any device: outside torchrun,
            # MMEngine's init_dist raised KeyError: 'RANK' on a GPU machine
            check_launcher_env(launcher, dist_cfg_of(cfg.get('env_cfg')))
        return super().from_cfg(cfg)

    def dump_config(self) -> None:
        """Dump the config as written, with mmdtr's keys, to ``work_dir``
        (see :func:`dump_config_as_written`)."""
        if not dump_config_as_written(self):
            super().dump_config()

    def setup_env(self, env_cfg: Dict) -> None:
        """Set up the environment; on CPU, initialise gloo first.

        MMEngine's ``init_dist`` calls ``torch.cuda.set_device``. Without an
        accelerator the process group is initialised here with
        :func:`~mmdtr.adapters.cpu_process_group.init_cpu_dist`; MMEngine's
        ``setup_env`` then skips ``init_dist`` since the group exists.

        Args:
            env_cfg (dict): The ``env_cfg`` of the config.
        """
        if (self.distributed and not is_distributed()
                and get_device() == 'cpu'):
            init_cpu_dist(self.launcher, **dist_cfg_of(env_cfg))
            close_at_exit()  # a downstream script does not close it
        super().setup_env(env_cfg)

    def train(self) -> nn.Module:
        """Train as MMEngine's Runner does; how it ended is noted: the
        process group this runner started on CPU is closed at exit, waiting
        for the other ranks only after a run that returned
        (:func:`~mmdtr.adapters.cpu_process_group.close_at_exit`)."""
        with noting_outcome():
            return super().train()

    def val(self) -> dict:
        """Validate as MMEngine's Runner does; see :meth:`train`."""
        with noting_outcome():
            return super().val()

    def test(self) -> dict:
        """Test as MMEngine's Runner does; see :meth:`train`."""
        with noting_outcome():
            return super().test()

    def wrap_model(self, model_wrapper_cfg: Optional[Dict],
                   model: nn.Module) -> nn.Module:
        """Wrap the model; on CPU, with :attr:`cpu_model_wrapper` by default.

        Args:
            model_wrapper_cfg (dict, optional): The config's
                ``model_wrapper_cfg``; when set it is used as is.
            model (nn.Module): The model to wrap.

        Returns:
            nn.Module: The wrapped model (or the model when not distributed).
        """
        on_cpu = self.distributed and not is_model_wrapper(model) and \
            get_device() == 'cpu'
        if model_wrapper_cfg is None and on_cpu:
            model_wrapper_cfg = dict(
                type=self.cpu_model_wrapper,
                broadcast_buffers=False,
                find_unused_parameters=self.cfg.get('find_unused_parameters',
                                                    False))
        elif isinstance(model_wrapper_cfg, dict):
            model_wrapper_cfg = self._resolvable_wrapper(
                model_wrapper_cfg, on_cpu)
        return super().wrap_model(model_wrapper_cfg, model)

    def _resolvable_wrapper(self, cfg: Dict, on_cpu: bool) -> Dict:
        """``model_wrapper_cfg`` as MMEngine's ``wrap_model`` can build it
        (found by an adversarial search; each failed in every rank):
        MMEngine looks the type up in its root registry, so a plain name
        of mmdtr's gets its scope; on CPU, MMEngine's own DDP wrapper (also
        the default when no type is given) passes CUDA ``device_ids``, so
        :attr:`cpu_model_wrapper`, its subclass without them, is used."""
        cfg = dict(cfg)
        name = cfg.get('type', 'MMDistributedDataParallel')
        if isinstance(name, type):  # MMEngine's wrap_model takes names
            name = cfg['type'] = name.__name__  # scoped below if mmdtr's
        if name in ('MMDistributedDataParallel',
                    'mmengine.MMDistributedDataParallel') and on_cpu:
            cfg['type'] = self.cpu_model_wrapper
        elif name in ('MMSeparateDistributedDataParallel',
                      'mmengine.MMSeparateDistributedDataParallel') \
                and on_cpu:  # the same, for each sub-module (GANs)
            cfg['type'] = 'mmdtr.MMDTRSeparateDistributedDataParallel'
        elif isinstance(name, str) and mmdtr_only(MODEL_WRAPPERS, name):
            cfg['type'] = f'mmdtr.{name}'
        return cfg


def dump_config_as_written(runner: Runner) -> bool:
    """Dump the config as written, with mmdtr's keys, to the work dir.

    A runner trains with the translated config (the keys turned into
    hooks); dumping that would make a restart from the dumped file refuse
    ``--cfg-options`` on the keys as configured twice. The file is the one
    MMEngine's ``Runner.dump_config`` writes, so this replaces its dump.

    Args:
        runner (Runner): A runner whose config
            :func:`~mmdtr.adapters.config_translation.translate_memory_keys`
            made.

    Returns:
        bool: Whether there was a config as written (``False`` for a
        config that was not translated); only the main process writes it.
    """
    source = getattr(runner.cfg, SOURCE_ATTR, None)
    if source is None:
        return False
    if not is_main_process():
        return True
    filename = osp.basename(source.filename) if source.filename \
        is not None else f'{runner.timestamp}.py'
    source.dump(osp.join(runner.work_dir, filename))
    return True


# ``runner_type='MMDTRRunner'`` must resolve under any default scope (e.g. a
# downstream repo's 'mmdet'), so the runner is reachable from MMEngine's root
# registry too; ``'mmdtr.MMDTRRunner'`` resolves to the same class.
if MMENGINE_RUNNERS.get('MMDTRRunner') is None:
    MMENGINE_RUNNERS.register_module(module=MMDTRRunner)
