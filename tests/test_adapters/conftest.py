"""Scaffolding shared by the adapter tests, handed out as fixtures.

Test modules cannot import each other (``--import-mode=importlib``), so
what they share lives here: deterministic algorithms where the Runner
trains on CUDA, the single-thread switch, a free TCP port and a
one-rank process group, ``tools/train.py`` as a module, a toy runner config
factory, and the toys registered with MMEngine: a tiny linear model and
dataset, a small conv net of two stages, seeded random images, and (from
``toy_classifier.py``, which subprocesses import by name) a tiny classifier
with its dataset.
"""
import importlib.util
import os
import os.path as osp
import socket
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch
from mmengine.config import Config
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, MODELS
from torch import nn
from torch.utils.data import Dataset

from mmdtr.adapters.cpu_process_group import close_dist

REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TOY_DIR = osp.dirname(osp.abspath(__file__))


@pytest.fixture(autouse=True)
def _deterministic_where_the_runner_trains_on_cuda(deterministic_algorithms):
    """On a GPU machine MMEngine's Runner moves the model to CUDA: the
    bit-for-bit comparisons of training runs need deterministic algorithms
    there (cuDNN's default convolution backward is not). ``warn_only``: an
    op without a deterministic CUDA kernel warns instead of raising. CPU
    runs are left as they are."""
    if not torch.cuda.is_available():
        yield
        return
    with deterministic_algorithms(warn_only=True):
        yield


def _import_toy_classifier():
    """Register ToyClassifier and ToyClassDataset, as ``toy_classifier``."""
    if 'toy_classifier' not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            'toy_classifier', osp.join(TOY_DIR, 'toy_classifier.py'))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules['toy_classifier'] = module


_import_toy_classifier()


@pytest.fixture(scope='module')
def single_thread():
    """Two OpenMP threads spin against other processes on a shared box.

    Modules opt in with ``pytestmark = pytest.mark.usefixtures(...)``.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


@pytest.fixture(scope='session')
def free_port():
    """``free_port()`` -> a TCP port on 127.0.0.1 free right now."""
    return _free_port


@pytest.fixture
def single_rank_env(monkeypatch):
    """torchrun's variables for a one-process job; the group is torn down."""
    saved = dict(os.environ)
    for key, value in dict(
            RANK='0',
            WORLD_SIZE='1',
            LOCAL_RANK='0',
            MASTER_ADDR='127.0.0.1',
            MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(key, value)
    yield
    close_dist()
    os.environ.clear()
    os.environ.update(saved)


def _load_train_tool():
    spec = importlib.util.spec_from_file_location(
        'mmdtr_train_tool', osp.join(REPO, 'tools', 'train.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope='session')
def load_train_tool():
    """``load_train_tool()`` -> a fresh import of ``tools/train.py``."""
    return _load_train_tool


@pytest.fixture(scope='module')
def train_tool():
    """``tools/train.py`` imported once per test module."""
    return _load_train_tool()


@pytest.fixture(scope='session')
def subprocess_env():
    """``subprocess_env(*paths)`` -> os.environ with ``PYTHONPATH`` led by
    the repository, this folder (``toy_classifier``) and ``paths``, and one
    OpenMP thread per process."""

    def make(*paths):
        env = dict(os.environ, OMP_NUM_THREADS='1')
        env['PYTHONPATH'] = os.pathsep.join(
            [REPO, TOY_DIR, *map(str, paths),
             env.get('PYTHONPATH', '')])
        return env

    return make


@pytest.fixture
def dist_train(tmp_path, free_port, subprocess_env):
    """``dist_train(config, work_dir, *cfg_options)`` -> the output of
    ``tools/dist_train.sh`` with two ranks, run in ``tmp_path`` (which is
    on ``PYTHONPATH``); fails the test if the run fails."""

    def run(config, work_dir, *options):
        args = ['--cfg-options', *options] if options else []
        proc = subprocess.run([
            'bash',
            osp.join(REPO, 'tools', 'dist_train.sh'),
            str(config), '2', '--work-dir',
            str(work_dir), *args
        ],
                              cwd=str(tmp_path),
                              env=dict(
                                  subprocess_env(tmp_path),
                                  PORT=str(free_port())),
                              capture_output=True,
                              text=True,
                              timeout=400)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        return out

    return run


def _toy_runner_cfg(work_dir,
                    model,
                    dataset,
                    name,
                    *,
                    batch_size=4,
                    shuffle=False,
                    max_iters=2,
                    optimizer=None,
                    config=True,
                    **keys):
    """A small iteration-based training config for a registered toy model.

    ``model`` and ``dataset`` are registered type names, or config dicts
    with arguments; ``name`` prefixes a unique experiment name.
    ``optimizer`` defaults to SGD with lr=0.1. Every other key
    (``default_hooks``, ``randomness``, ``log_level``...) is set as given,
    after the common ones. ``config=False`` returns the plain dict instead
    of a ``Config``.
    """
    cfg = dict(
        model=model if isinstance(model, dict) else dict(type=model),
        work_dir=str(work_dir),
        experiment_name=f'{name}_{uuid.uuid4().hex}',
        train_dataloader=dict(
            dataset=dataset if isinstance(dataset, dict) else dict(
                type=dataset),
            sampler=dict(type='DefaultSampler', shuffle=shuffle),
            batch_size=batch_size,
            num_workers=0,
            collate_fn=dict(type='default_collate')),
        train_cfg=dict(by_epoch=False, max_iters=max_iters),
        optim_wrapper=dict(
            optimizer=dict(type='SGD', lr=0.1) if optimizer is
            None else optimizer))
    cfg.update(keys)
    return Config(cfg) if config else cfg


@pytest.fixture(scope='session')
def toy_runner_cfg():
    """The factory :func:`_toy_runner_cfg`."""
    return _toy_runner_cfg


@MODELS.register_module(force=True)
class LinearToyModel(BaseModel):
    """One ``Linear(3, 2)``; inputs of shape (N, 3)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, inputs, labels=None, mode='tensor'):
        out = self.fc(inputs)
        if mode == 'loss':
            return dict(loss=nn.functional.cross_entropy(out, labels))
        return out


@DATASETS.register_module(force=True)
class RangeToyDataset(Dataset):
    """8 samples: ``inputs`` is (i, i, i), ``labels`` is i % 2."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return dict(inputs=torch.full((3, ), float(i)), labels=i % 2)


@pytest.fixture(scope='session')
def linear_toy_model():
    """The class registered as ``LinearToyModel``."""
    return LinearToyModel


class ConvStage(nn.Module):
    """Conv-BN-ReLU blocks; the forward takes a keyword-only argument."""

    def __init__(self, width=8, depth=2, inplace_relu=False):
        super().__init__()
        self.blocks = nn.Sequential(*[
            nn.Sequential(
                nn.Conv2d(width, width, 3, padding=1, bias=False),
                nn.BatchNorm2d(width), nn.ReLU(inplace_relu))
            for _ in range(depth)
        ])

    def forward(self, x, *, scale=None):
        x = self.blocks(x)
        return x if scale is None else x * scale


@MODELS.register_module(force=True)
class ConvToyNet(BaseModel):
    """A stem and two :class:`ConvStage` s (``backbone.layer1/2``), a head.

    Args:
        norm_eval (bool): Keep every BatchNorm in eval mode while training.
        scales (tuple): The ``scale`` passed to layer1 and layer2.
        running_var (float, optional): Fills the BatchNorms' running
            variances ("pretrained" statistics).
        inplace_relu (bool): ``ReLU(inplace=True)`` in the stages, as
            ResNets have.
    """

    def __init__(self,
                 norm_eval=False,
                 scales=(None, None),
                 running_var=None,
                 inplace_relu=False):
        super().__init__()
        self.norm_eval, self.scales = norm_eval, tuple(scales)
        self.backbone = nn.Module()
        self.backbone.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.backbone.layer1 = ConvStage(inplace_relu=inplace_relu)
        self.backbone.layer2 = ConvStage(inplace_relu=inplace_relu)
        self.head = nn.Linear(8, 2)
        if running_var is not None:
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_var.fill_(running_var)

    def train(self, mode=True):
        super().train(mode)
        if mode and self.norm_eval:
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
        return self

    def forward(self, inputs, labels=None, mode='tensor'):
        x = self.backbone.stem(inputs)
        x = self.backbone.layer1(x, scale=self.scales[0])
        x = self.backbone.layer2(x, scale=self.scales[1])
        logits = self.head(x.mean((2, 3)))
        if mode == 'loss':
            return dict(loss=nn.functional.cross_entropy(logits, labels))
        return logits


@DATASETS.register_module(force=True)
class SeededToyImages(Dataset):
    """``length`` images of 3 x ``size`` x ``size``, each from its own
    seeded generator (never the global RNG); labels ``i % 2``."""
    metainfo = dict(classes=('a', 'b'))

    def __init__(self, length=8, size=8):
        self.length, self.size = length, size

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return dict(
            inputs=torch.randn(3, self.size, self.size, generator=g),
            labels=i % 2)


@pytest.fixture(scope='session')
def seeded_toy_images():
    """The class registered as ``SeededToyImages``."""
    return SeededToyImages


# No custom_imports here: the tests give it through --cfg-options.
TOY_CONFIG = '''
model = dict(type='ToyClassifier')
train_dataloader = dict(
    dataset=dict(type='ToyClassDataset', size=16),
    sampler=dict(type='DefaultSampler', shuffle=True),
    batch_size=4,
    num_workers=0,
    collate_fn=dict(type='default_collate'))
train_cfg = dict(by_epoch=False, max_iters=100)
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))
default_hooks = dict(
    checkpoint=dict(type='CheckpointHook', interval=1, by_epoch=False))
randomness = dict(seed=0)
'''


@pytest.fixture
def toy_config(tmp_path):
    """A config file of ToyClassifier for 100 iterations, in ``tmp_path``."""
    config = tmp_path / 'toy_cfg.py'
    config.write_text(textwrap.dedent(TOY_CONFIG))
    return str(config)
