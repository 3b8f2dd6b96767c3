"""DTRTrainStep, DTRDistributedDataParallel, and DTR under DDP.

The wrapper and the hook's hand-over run in process on a one-rank gloo
group; then two processes train a workload config through
``tools/dist_train.sh`` with ``--cfg-options dtr.eviction_threshold=...``.
"""
import copy
import os.path as osp
import uuid

import pytest
import torch
import torch.distributed as torch_dist
import torch.nn as nn
import torch.nn.functional as F
from mmengine.config import Config
from mmengine.logging import MessageHub
from mmengine.model import BaseModel
from mmengine.optim import OptimWrapper
from mmengine.registry import DATASETS
from mmengine.registry import MODEL_WRAPPERS as MMENGINE_MODEL_WRAPPERS
from mmengine.registry import MODELS
from torch.utils.data import Dataset

from mmdtr.adapters.checkpoint_loading import WEIGHTS_ONLY_BY_DEFAULT
from mmdtr.adapters.cpu_process_group import init_cpu_dist
from mmdtr.adapters.distributed import MMDTRDistributedDataParallel
from mmdtr.adapters.dtr_hook import DTRHook
from mmdtr.adapters.dtr_model_wrapper import DTRDistributedDataParallel
from mmdtr.adapters.runner import MMDTRRunner
from mmdtr.dtr import engine_active
from mmdtr.errors import MmdtrError
from mmdtr.registry import MODEL_WRAPPERS

REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
DTR_CFG = dict(eviction_threshold='64KB', evictee_minimum_size='4KB')
cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason='tests the CPU-only path')

pytestmark = pytest.mark.usefixtures('single_thread')


@MODELS.register_module(force=True)
class DTRWrapperToyNet(BaseModel):
    """Conv-BN-ReLU blocks; ``unused`` never gets a gradient."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(*[
            nn.Sequential(
                nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1),
                nn.BatchNorm2d(8), nn.ReLU()) for i in range(3)
        ])
        self.unused = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.dtr_seen = []

    def forward(self, inputs, labels=None, mode='tensor'):
        self.dtr_seen.append((mode, engine_active()))
        logits = self.head(self.body(inputs).mean((2, 3)))
        if mode == 'loss':
            return dict(loss=F.cross_entropy(logits, labels))
        return logits


@DATASETS.register_module(force=True)
class DTRWrapperToyImages(Dataset):

    def __len__(self):
        return 8

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return dict(inputs=torch.randn(3, 12, 12, generator=g), labels=i % 2)


def batch(i):
    data = [DTRWrapperToyImages()[j] for j in range(4 * i, 4 * i + 4)]
    return dict(
        inputs=torch.stack([d['inputs'] for d in data]),
        labels=torch.tensor([d['labels'] for d in data]))


def test_registered_names():
    assert MODEL_WRAPPERS.get(
        'DTRDistributedDataParallel') is DTRDistributedDataParallel
    assert MMENGINE_MODEL_WRAPPERS.get(
        'mmdtr.DTRDistributedDataParallel') is DTRDistributedDataParallel
    assert issubclass(DTRDistributedDataParallel, MMDTRDistributedDataParallel)


def _sgd(model, **kwargs):
    return OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


@cpu_only
@pytest.mark.parametrize(
    'ddp_kwargs', [
        dict(find_unused_parameters=True),
        dict(find_unused_parameters=True, gradient_as_bucket_view=True),
        dict(find_unused_parameters=True, broadcast_buffers=True),
        dict(static_graph=True),
    ],
    ids=['unused', 'bucket_view', 'broadcast_buffers', 'static_graph'])
def test_ddp_gradients_bit_identical(single_rank_env, ddp_kwargs):
    init_cpu_dist('pytorch')
    torch.manual_seed(0)
    model = DTRWrapperToyNet()
    if ddp_kwargs.get('static_graph'):
        model.unused = None  # a static graph with no unused parameters
    plain = MMDTRDistributedDataParallel(copy.deepcopy(model), **ddp_kwargs)
    wrapped = MODEL_WRAPPERS.build(
        dict(
            type='mmdtr.DTRDistributedDataParallel', dtr=DTR_CFG,
            **ddp_kwargs),
        default_args=dict(module=copy.deepcopy(model)))
    hub = MessageHub.get_current_instance()
    grads = {}
    for ddp in (plain, wrapped):
        optim = _sgd(ddp)
        grads[ddp] = []
        optim.optimizer.register_step_pre_hook(
            lambda opt, *a, ddp=ddp: grads[ddp].append([
                p.grad.clone() for p in ddp.parameters() if p.grad is not None
            ]))
        for i in range(2):  # DDP rebuilds its buckets in the second
            ddp.train_step(batch(i), optim)
        ddp.val_step(batch(0))
    assert len(grads[plain]) == len(grads[wrapped]) == 2
    assert wrapped.dtr_step.stats.evictions > 0
    assert hub.get_scalar('train/dtr_evictions').current() > 0
    for a, b in zip(grads[plain], grads[wrapped]):  # the all-reduced ones
        assert len(a) == len(b) and all(map(torch.equal, a, b))
    for (name, p), q in zip(plain.named_parameters(), wrapped.parameters()):
        assert torch.equal(p, q), name
    for (name, b), c in zip(plain.named_buffers(), wrapped.buffers()):
        assert torch.equal(b, c), name
    assert wrapped.module.dtr_seen == [('loss', True)] * 2 + [
        ('predict', False)
    ]


@cpu_only
def test_wrapper_settings_are_validated(single_rank_env):
    init_cpu_dist('pytorch')
    with pytest.raises(
            MmdtrError,
            match=r"model_wrapper_cfg.dtr=\{'eviction_threshold': "
            "'big'} is not accepted"):
        DTRDistributedDataParallel(
            DTRWrapperToyNet(), dtr=dict(eviction_threshold='big'))
    wrapped = DTRDistributedDataParallel(DTRWrapperToyNet())
    assert wrapped.dtr_step is None  # plain DDP
    wrapped.enable_dtr(DTR_CFG)
    with pytest.raises(MmdtrError, match='DTR is configured twice'):
        wrapped.enable_dtr(DTR_CFG)
    wrapped.disable_dtr()
    assert wrapped.dtr_step is None


@pytest.fixture
def runner_cfg(toy_runner_cfg):

    def make(work_dir, **kwargs):
        return toy_runner_cfg(
            work_dir,
            'DTRWrapperToyNet',
            'DTRWrapperToyImages',
            'dtr_wrapper',
            config=False,
            default_hooks=dict(checkpoint=None),
            launcher='pytorch',
            log_level='WARNING',
            **kwargs)

    return make


@cpu_only
def test_hook_hands_its_settings_to_the_wrapper(single_rank_env, tmp_path,
                                                runner_cfg):
    runner = MMDTRRunner.from_cfg(
        runner_cfg(
            tmp_path,
            dtr=DTR_CFG,
            model_wrapper_cfg=dict(
                type='mmdtr.DTRDistributedDataParallel',
                find_unused_parameters=True)))
    model = runner.model
    assert type(model) is DTRDistributedDataParallel
    (hook, ) = [h for h in runner.hooks if isinstance(h, DTRHook)]
    runner.train()
    assert 'train_step' not in vars(model)  # the wrapper ran it
    assert hook.stats is not None and hook.stats.evictions > 0
    assert model.dtr_step is None  # handed back after training
    assert model.module.dtr_seen == [('loss', True)] * 2


@cpu_only
def test_wrapper_alone_and_configured_twice(single_rank_env, tmp_path,
                                            runner_cfg):
    wrapper_cfg = dict(
        type='mmdtr.DTRDistributedDataParallel',
        dtr=DTR_CFG,
        find_unused_parameters=True)
    runner = MMDTRRunner.from_cfg(
        runner_cfg(tmp_path / 'alone', model_wrapper_cfg=wrapper_cfg))
    runner.train()  # no dtr key: the wrapper runs DTR by itself
    assert runner.model.dtr_step.stats.evictions > 0
    evictions = runner.message_hub.get_scalar('train/dtr_evictions')
    assert len(evictions.data[0]) == 2
    torch_dist.destroy_process_group()
    with pytest.raises(MmdtrError, match='DTR is configured twice'):
        # refused before the runner is built
        MMDTRRunner.from_cfg(
            runner_cfg(
                tmp_path / 'twice',
                dtr=DTR_CFG,
                model_wrapper_cfg=copy.deepcopy(wrapper_cfg)))
    assert not (tmp_path / 'twice').exists()
    assert torch._C._len_torch_dispatch_stack() == 0


# --- two processes, through tools/dist_train.sh ----------------------------
DUMP_MODULE = '''
import os.path as osp

import torch
from mmengine.hooks import Hook
from mmengine.registry import HOOKS


@HOOKS.register_module(force=True)
class DumpDTRRankHook(Hook):
    """Save each rank's parameters, buffers and DTR scalars."""

    def after_train(self, runner):
        hub = runner.message_hub
        stats = {
            name: [float(v) for v in buf.data[0]]
            for name, buf in hub.log_scalars.items()
            if name.startswith('train/dtr_')
        }
        module = runner.model.module
        torch.save(
            dict(
                params={k: v.detach() for k, v in module.named_parameters()},
                buffers=dict(module.named_buffers()),
                stats=stats,
                wrapper=type(runner.model).__name__),
            osp.join(runner.work_dir, f'rank{runner.rank}.pth'))
'''
# the runner's default CPU wrapper, MMDTRDistributedDataParallel: DTRHook
# runs one engine per rank around its train_step
GPT_SMALL = dict(
    model=dict(num_layers=2, embed_dims=128, vocab_size=1024, max_seq_len=64),
    train_dataloader=dict(
        batch_size=2, dataset=dict(vocab_size=1024, seq_len=64)),
    train_cfg=dict(max_iters=3))
DIST_CONFIG = f'''
_base_ = ['{REPO}/configs/gpt_synthetic.py']
custom_imports = dict(
    imports=['mmdtr', 'dtr_dump'], allow_failed_imports=False)
custom_hooks = [dict(type='DumpDTRRankHook')]
model = {GPT_SMALL['model']!r}
train_dataloader = {GPT_SMALL['train_dataloader']!r}
train_cfg = {GPT_SMALL['train_cfg']!r}
'''


def baseline_peak_kib(work_dir):
    """One iteration of a rank's work under DTR that never evicts."""
    cfg = Config.fromfile(osp.join(REPO, 'configs', 'gpt_synthetic.py'))
    cfg.merge_from_dict(GPT_SMALL)
    cfg.merge_from_dict({
        'train_cfg.max_iters':
        1,
        'dtr':
        dict(eviction_threshold=2**60, evictee_minimum_size='16KB')
    })
    cfg.work_dir = str(work_dir)
    cfg.experiment_name = f'dtr_probe_{uuid.uuid4().hex}'
    runner = MMDTRRunner.from_cfg(cfg)
    runner.train()
    return runner.message_hub.get_scalar(
        'train/dtr_peak_memory_mb').current() * 1024


def rank_dumps(work_dir):
    return [
        torch.load(
            str(work_dir / f'rank{r}.pth'),
            weights_only=WEIGHTS_ONLY_BY_DEFAULT) for r in (0, 1)
    ]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason='tests the gloo CPU path')
def test_two_process_run_bit_identical(tmp_path, dist_train):
    (tmp_path / 'dtr_dump.py').write_text(DUMP_MODULE)
    config = tmp_path / 'gpt_dist.py'
    config.write_text(DIST_CONFIG)
    threshold = f'{int(0.4 * baseline_peak_kib(tmp_path / "probe"))}KB'
    dist_train(config, tmp_path / 'plain')
    plain = rank_dumps(tmp_path / 'plain')
    out = dist_train(config, tmp_path / 'dtr',
                     f'dtr.eviction_threshold={threshold}',
                     'dtr.evictee_minimum_size=16KB')
    ranks = rank_dumps(tmp_path / 'dtr')
    assert 'backend gloo, world size 2' in out
    assert 'Enabling the "dtr" feature (mmdtr)' in out
    assert f"'eviction_threshold': '{threshold}'" in out  # a string
    for rank in (0, 1):
        assert plain[rank]['stats'] == {}
        assert ranks[rank]['wrapper'] == 'MMDTRDistributedDataParallel'
        stats = ranks[rank]['stats']  # each rank ran its own engine
        assert len(stats['train/dtr_evictions']) == 3
        assert min(stats['train/dtr_evictions']) > 0
        assert min(stats['train/dtr_recomputations']) > 0
        for kind in ('params', 'buffers'):
            for key, value in plain[rank][kind].items():
                assert torch.equal(value, ranks[rank][kind][key]), key
    for key, value in ranks[0]['params'].items():  # all-reduced alike
        assert torch.equal(value, ranks[1]['params'][key]), key
