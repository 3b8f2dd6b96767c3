"""InplaceOptimWrapper in MMEngine's Runner: registered, built from
configs, and training the repository's workloads bit for bit as
OptimWrapper does."""
import uuid
from pathlib import Path

import pytest
import torch
from mmengine.config import Config
from mmengine.runner import Runner

from mmdtr.adapters.inplace_optim_wrapper import InplaceOptimWrapper
from mmdtr.registry import OPTIM_WRAPPERS

CONFIG_DIR = Path(__file__).parents[2] / 'configs'


def test_registered_under_both_names():
    assert OPTIM_WRAPPERS.get('InplaceOptimWrapper') is InplaceOptimWrapper
    assert (OPTIM_WRAPPERS.get('mmdtr.InplaceOptimWrapper')
            is InplaceOptimWrapper)


# --------------------------------------------------------------- Runner level
WORKLOADS = {
    # GPT: tied embedding/output weights, AdamW, one group per parameter
    # (paramwise_cfg, bypass_duplicate), norm clipping (dropped in backward)
    'gpt_synthetic.py': {
        'model.vocab_size': 64,
        'model.max_seq_len': 16,
        'model.num_layers': 2,
        'model.num_heads': 2,
        'model.embed_dims': 32,
        'train_dataloader.dataset.vocab_size': 64,
        'train_dataloader.dataset.seq_len': 16,
        'train_dataloader.dataset.num_samples': 16,
    },
    # ShuffleNetV2: BatchNorm, SGD with momentum and weight decay
    'shufflenetv2_synthetic.py': {
        'model.widen_factor': 0.5,
        'model.num_classes': 10,
        'train_dataloader.dataset.num_classes': 10,
        'train_dataloader.dataset.image_size': 32,
        'train_dataloader.dataset.num_samples': 16,
    },
}

SMALL_RUN = {
    'train_cfg.max_iters':
    3,
    'train_dataloader.batch_size':
    2,
    'log_level':
    'WARNING',
    # a warm-up: every per-parameter step must see the current lr
    'param_scheduler':
    dict(type='LinearLR', start_factor=0.2, by_epoch=False, end=3),
}


def assert_same_weights(model_a, model_b):
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name, value in state_a.items():  # parameters and buffers
        assert torch.equal(value, state_b[name]), f'{name} differs'


def run_workload(config, tmp_path, **optim_wrapper):
    cfg = Config.fromfile(str(CONFIG_DIR / config))
    cfg.merge_from_dict(WORKLOADS[config])
    cfg.merge_from_dict(SMALL_RUN)
    cfg.merge_from_dict({
        f'optim_wrapper.{k}': v
        for k, v in optim_wrapper.items()
    })
    cfg.work_dir = str(tmp_path)
    cfg.experiment_name = f'inplace_{uuid.uuid4().hex[:8]}'
    runner = Runner.from_cfg(cfg)
    runner.train()
    assert runner.iter == 3
    wrapper_type = optim_wrapper.get('type', 'OptimWrapper')
    assert type(runner.optim_wrapper).__name__ == wrapper_type.split('.')[-1]
    return runner.model


@pytest.mark.parametrize('config', sorted(WORKLOADS))
def test_runner_training_is_bit_identical(config, tmp_path):
    # OptimWrapper's optimizer takes the single-tensor loop, as it does by
    # default on CPU; on CUDA torch defaults to foreach steps, whose last
    # bits may differ (docs/inplace_optim_wrapper.md; AdamW did on an H100)
    loop = {'optimizer.foreach': False}
    ref = run_workload(config, tmp_path, **loop)
    inplace = run_workload(config, tmp_path, type='mmdtr.InplaceOptimWrapper')
    assert_same_weights(ref, inplace)
    # global clipping is refused in the backward: compare without it
    base = Config.fromfile(str(CONFIG_DIR / config))
    if base.optim_wrapper.get('clip_grad'):  # GPT: max_norm=1.0
        ref = run_workload(config, tmp_path, clip_grad=None, **loop)
    in_backward = run_workload(
        config,
        tmp_path,
        type='InplaceOptimWrapper',
        clip_grad=None,
        step_in_backward=True)
    assert_same_weights(ref, in_backward)
    if config.startswith('gpt'):
        tied = in_backward.lm_head.weight
        assert tied is in_backward.token_embedding.weight
