"""tools/demo.py: bad input is refused in one line before anything trains."""
import os
import os.path as osp
import subprocess
import sys

import pytest

REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TOOL = osp.join(REPO, 'tools', 'demo.py')
RESNET = osp.join(REPO, 'configs', 'resnet50_synthetic.py')


@pytest.mark.parametrize(
    'argv, match',
    [
        (['/nonexistent.py'], "config file '/nonexistent.py' does not exist"),
        (['--cfg-options', 'dtr'], 'KEY=VALUE'),
        (['--cfg-options', 'train_cfg.max_iters.x=1'], 'cannot be merged'),
        (['--cfg-options', 'train_cfg.max_iters=None'], 'positive int max_i'),
        # a traceback, and a silent 3 iterations (an adversarial search)
        (['--cfg-options', 'train_cfg.type=EpochBasedTrainLoop'
          ], 'is not an IterBasedTrainLoop'),
        (['--cfg-options', 'train_cfg.max_iters=-5'
          ], 'positive int max_iters'),
        (['--cfg-options', 'dtr.eviction_threshold=3XB'
          ], "'3XB' is not a size"),
        (['--cfg-options', 'dtr.evict=1'], 'dtr.evict is not a DTR setting'),
        ([RESNET], 'none of the memory keys'),
        (['--cfg-options', 'activation_checkpointing=bakbone'], "'bakbone'"),
        (['--cfg-options', 'efficient_conv_bn_eval=[bakbone]'], "'bakbone'"),
        # 35 lines of the baseline's build (a walk through the docs)
        (['--cfg-options', 'model.typo_arg=1'], "argument 'typo_arg'"),
    ])
def test_bad_input_fails_before_training(demo, monkeypatch, capsys, argv,
                                         match):
    # a bad memory key (a module name too, checked on the model) was found
    # only after the baseline had trained; a config without memory keys
    # trained twice and printed a row "with"
    def train(*args):
        raise AssertionError('trained before the input was checked')

    monkeypatch.setattr(demo, 'train', train)
    monkeypatch.setattr(sys, 'argv', [TOOL] + argv)
    with pytest.raises(SystemExit) as exit_info:
        demo.main()
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith('MmdtrError: mmdtr: ')
    assert len(err.splitlines()) == 1, err
    assert match in err


def test_epoch_based_loop_without_a_type_is_refused(demo, monkeypatch, capsys,
                                                    tmp_path):
    # MMEngine builds an EpochBasedTrainLoop from by_epoch=True, which
    # failed on max_iters in a traceback (found by a review)
    config = tmp_path / 'by_epoch.py'
    config.write_text(f"_base_ = ['{REPO}/configs/demo_dtr.py']\n"
                      'train_cfg = dict(_delete_=True, by_epoch=True, '
                      'max_iters=4)\n')
    monkeypatch.setattr(demo, 'train', None)  # never reached
    monkeypatch.setattr(sys, 'argv', [TOOL, str(config)])
    with pytest.raises(SystemExit):
        demo.main()
    assert 'is not an IterBasedTrainLoop' in capsys.readouterr().err


@pytest.mark.fails_before_torch(
    (2, 6),
    reason='PyTorch 2.4 and 2.5 print a DeprecationWarning of their '
    'own (mmengine imports torch.distributed.optim) before the error line')
def test_missing_config_is_one_line_without_traceback(tmp_path):
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join([REPO, env.get('PYTHONPATH', '')])
    proc = subprocess.run([sys.executable, TOOL, '/nonexistent.py'],
                          cwd=str(tmp_path),
                          env=env,
                          capture_output=True,
                          text=True,
                          timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.startswith('MmdtrError: mmdtr: config file')
    assert 'Traceback' not in proc.stderr
