"""tools/train.py: end to end in a subprocess, and its argument handling."""
import os.path as osp
import subprocess
import sys

import pytest
import torch
from mmengine.optim import AmpOptimWrapper, OptimWrapper

from mmdtr.adapters import runner_config_checks
from mmdtr.adapters.checkpoint_loading import WEIGHTS_ONLY_BY_DEFAULT
from mmdtr.adapters.inplace_optim_wrapper import InplaceOptimWrapper
from mmdtr.adapters.runner import MMDTRRunner
from mmdtr.errors import MmdtrError

REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TRAIN = osp.join(REPO, 'tools', 'train.py')


@pytest.fixture
def run_train(subprocess_env, tmp_path):
    """``run_train(args)``: tools/train.py in a subprocess in tmp_path."""

    def run(args):
        return subprocess.run(
            [sys.executable, TRAIN] + args,
            cwd=str(tmp_path),
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=300)

    return run


def test_train_and_resume_end_to_end(toy_config, tmp_path, run_train):
    work_dir = tmp_path / 'work'
    common = [
        toy_config, '--work-dir',
        str(work_dir), '--cfg-options',
        'custom_imports.imports=[toy_classifier]'
    ]
    proc = run_train(common + ['train_cfg.max_iters=2'])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (work_dir / 'iter_2.pth').is_file()
    assert not (work_dir / 'iter_3.pth').exists()

    proc = run_train(common + ['train_cfg.max_iters=3', '--resume'])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert 'Auto resumed from the latest checkpoint' in out
    assert 'resumed epoch: 0, iter: 2' in out
    assert (work_dir / 'iter_3.pth').is_file()
    ckpt = torch.load(
        str(work_dir / 'iter_3.pth'), weights_only=WEIGHTS_ONLY_BY_DEFAULT)
    assert ckpt['meta']['iter'] == 3


def test_module_name_typo_fails_in_one_line(toy_config, tmp_path, run_train):
    # checked against the model when training starts, before the first
    # iteration: it ended in a traceback (found by an adversarial search)
    proc = run_train([
        toy_config, '--work-dir', 'wd', '--cfg-options',
        'custom_imports.imports=[toy_classifier]',
        'activation_checkpointing=backbon'
    ])
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert lines[-1].startswith('MmdtrError: mmdtr: activation_checkpointing'
                                ': no sub-module'), proc.stderr[-3000:]
    assert 'Traceback' not in proc.stderr
    # checked before the runner is built: no work dir, no dumped config
    # (found by an adversarial search)
    assert not (tmp_path / 'wd').exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason='needs a CPU-only box')
def test_amp_on_cpu_is_a_clear_error(toy_config, tmp_path, run_train):
    proc = run_train([toy_config, '--amp'])
    assert proc.returncode == 1
    assert 'MmdtrError: mmdtr: optim_wrapper.type=' in proc.stderr
    assert 'Traceback' not in proc.stderr
    assert not (tmp_path / 'work_dirs').exists()  # nothing was started


def build(train_tool, *argv):
    return train_tool.build_cfg(train_tool.parse_args(list(argv)))


@pytest.mark.skipif(torch.cuda.is_available(), reason='needs a CPU-only box')
def test_amp_on_cpu_raises(train_tool, toy_config):
    with pytest.raises(MmdtrError, match='AmpOptimWrapper'):
        build(train_tool, toy_config, '--amp')


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_amp_sets_amp_optim_wrapper(train_tool, toy_config):
    cfg = build(train_tool, toy_config, '--amp')
    assert cfg.optim_wrapper.type == 'AmpOptimWrapper'
    assert cfg.optim_wrapper.loss_scale == 'dynamic'


@pytest.mark.parametrize('wrapper_type', [
    'OptimWrapper', 'mmengine.OptimWrapper', 'AmpOptimWrapper',
    'mmengine.AmpOptimWrapper'
])
def test_amp_takes_mmengine_wrappers_however_spelt(train_tool, toy_config,
                                                   monkeypatch, wrapper_type):
    # only the bare 'OptimWrapper' was accepted (a scoped name, or the class
    # of a new-style config, was refused)
    monkeypatch.setattr(runner_config_checks, 'is_cuda_available',
                        lambda: True)
    cfg = build(train_tool, toy_config, '--amp', '--cfg-options',
                f'optim_wrapper.type={wrapper_type}')
    assert cfg.optim_wrapper.type == 'AmpOptimWrapper'
    assert runner_config_checks.amp_convertible(OptimWrapper)
    assert runner_config_checks.amp_convertible(AmpOptimWrapper)
    assert not runner_config_checks.amp_convertible(InplaceOptimWrapper)


def test_amp_with_another_wrapper_points_to_its_own_amp(
        train_tool, toy_config):
    # on CPU this said AMP needs CUDA and to use OptimWrapper
    with pytest.raises(MmdtrError, match='--amp needs optim_wrapper.type') \
            as info:
        build(train_tool, toy_config, '--amp', '--cfg-options',
              'optim_wrapper.type=mmdtr.InplaceOptimWrapper')
    assert 'amp=dict' in info.value.hint


@pytest.mark.parametrize(
    'options, match',
    [
        (['train_cfg.max_iters'], 'KEY=VALUE'),
        (['train_cfg.max_iters.x=1'], 'cannot be merged'),
        # the reason was dropped, and no full stop before the hint (found
        # by a new-user walkthrough)
        (['custom_imports.imports=[no_such_module_xyz]'
          ], r'cannot be imported: Failed to import no_such_module_xyz '
         r"\(ModuleNotFoundError: No module named 'no_such_module_xyz'\)\. "
         'Hint:'),
        (['custom_imports=3'], 'custom_imports=3'),
        # MMEngine's DictAction: a RecursionError and an AssertionError
        # (the first, with no word of recursion: it said nothing to a user)
        (['custom_hooks=[dict(type=mmdtr.DTRHook,eviction_threshold=1GB)]'
          ], r"'custom_hooks=\[dict[^ ]*' cannot be parsed\. Accepted"),
        (['train_cfg.max_iters=2', 'x=(1,2'], r"'x=\(1,2' cannot be parsed"),
        # a config's variables are resolved when it is read: a section's
        # setting at the top level reaches nothing (found by an adversarial
        # search: the demo kept its threshold)
        (['eviction_threshold=40MB'], 'mmdtr reads it only as '
         'dtr.eviction_threshold'),
        # sub-keys of several sections: ignored too (found by a review)
        (['policy=lru'], 'mmdtr reads it only as dtr.policy or '
         'activation_checkpointing.policy'),
        (['modules=backbone'], 'only as activation_checkpointing.modules or '
         'efficient_conv_bn_eval.modules'),
        # a dotted option sets the top-level key of its first segment, and
        # recording_threshold is DTR's too: each trained without it (found
        # by an adversarial search)
        (['clip_grad.max_norm=0.001'], r'clip_grad.max_norm=0.001 is a '
         r'top-level key: mmdtr reads it only as optim_wrapper.clip_grad.*'
         r'--cfg-options optim_wrapper.clip_grad.max_norm=\.\.\.'),
        (['amp.dtype=bfloat16'], 'only as optim_wrapper.amp'),
        (['recording_threshold=None'], 'only as dtr.recording_threshold'),
    ])
def test_bad_cfg_options_raise(train_tool, toy_config, options, match):
    with pytest.raises(MmdtrError, match=match):
        build(train_tool, toy_config, '--cfg-options', *options)


def test_dotted_index_into_a_list_of_strings_raises(train_tool, toy_config,
                                                    tmp_path):
    config = tmp_path / 'names.py'
    config.write_text(f"_base_ = ['{toy_config}']\nnames = ['a']\n")
    with pytest.raises(MmdtrError, match='cannot be merged') as info:
        build(train_tool, str(config), '--cfg-options', 'names.0=b')
    # the reason was only "'str' object has no attribute 'copy'" (a review)
    assert 'give the whole list instead, e.g. names=[a,b]' in info.value.hint
    config.write_text(f"_base_ = ['{toy_config}']\nx = dict(names=['a'])\n")
    with pytest.raises(MmdtrError, match='cannot be merged') as info:
        build(train_tool, str(config), '--cfg-options', 'x.names.0=b')
    assert 'e.g. x.names=[a,b]' in info.value.hint


def test_args_are_applied(train_tool, toy_config, tmp_path):
    cfg = build(train_tool, toy_config)
    assert cfg.work_dir == osp.join('./work_dirs', 'toy_cfg')
    assert cfg.launcher == 'none'
    assert not cfg.get('resume', False)

    cfg = build(train_tool, toy_config, '--resume', '--work-dir', 'wd',
                '--cfg-options', 'train_cfg.max_iters=7')
    assert (cfg.resume, cfg.load_from) == (True, None)
    assert cfg.work_dir == 'wd'
    assert cfg.train_cfg.max_iters == 7

    checkpoint = tmp_path / 'iter_3.pth'
    checkpoint.write_bytes(b'')
    cfg = build(train_tool, toy_config, '--resume', str(checkpoint))
    assert (cfg.resume, cfg.load_from) == (True, str(checkpoint))


def test_work_dir_under_a_file_is_refused(train_tool, toy_config, tmp_path):
    a_file = tmp_path / 'a_file'
    a_file.write_text('')
    with pytest.raises(MmdtrError, match='is under the file'):
        build(train_tool, toy_config, '--work-dir', str(a_file / 'x'))
    with pytest.raises(MmdtrError, match='--work-dir .* is the file'):
        build(train_tool, toy_config, '--work-dir', str(a_file))
    config = tmp_path / 'wd_in_file.py'
    config.write_text(f"_base_ = ['{toy_config}']\nwork_dir = '{a_file}/x'\n")
    with pytest.raises(MmdtrError, match='^mmdtr: work_dir .* is under'):
        build(train_tool, str(config))


def test_resume_of_a_missing_file_is_refused(train_tool, toy_config, tmp_path):
    with pytest.raises(MmdtrError, match='no such checkpoint file'):
        build(train_tool, toy_config, '--resume', str(tmp_path / 'no.pth'))
    with pytest.raises(MmdtrError, match='no such checkpoint file'):
        build(train_tool, toy_config, '--resume', str(tmp_path))  # a dir
    cfg = build(train_tool, toy_config, '--resume', 'https://x.org/a.pth')
    assert cfg.load_from == 'https://x.org/a.pth'


@pytest.mark.fails_before_torch(
    (2, 6),
    reason='PyTorch 2.4 and 2.5 print a DeprecationWarning of their '
    'own (mmengine imports torch.distributed.optim) before the error line')
def test_bad_work_dir_and_resume_fail_in_one_line(toy_config, tmp_path,
                                                  run_train):
    # both ended in a traceback once the runner had been built
    (tmp_path / 'a_file').write_text('')
    for args in (['--work-dir', str(tmp_path / 'a_file' / 'x')],
                 ['--work-dir', 'wd', '--resume', 'missing.pth']):
        proc = run_train([toy_config] + args)
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert proc.stderr.startswith('MmdtrError: mmdtr: --'), proc.stderr
        assert len(proc.stderr.splitlines()) == 1, proc.stderr
        assert not (tmp_path / 'wd').exists()


def test_builds_mmdtr_runner_or_runner_type(train_tool, toy_config, tmp_path):
    cfg = build(train_tool, toy_config, '--work-dir', str(tmp_path),
                '--cfg-options', 'custom_imports.imports=[toy_classifier]',
                'log_level=WARNING')
    runner = train_tool.build_runner(cfg.copy())
    assert type(runner) is MMDTRRunner
    cfg.experiment_name = 'train_tool_runner_type'
    cfg.runner_type = 'Runner'
    runner = train_tool.build_runner(cfg)
    assert type(runner).__name__ == 'Runner'


def test_dumped_config_keeps_the_keys_as_written(train_tool, toy_config,
                                                 tmp_path):
    # the runner trains with the keys turned into hooks but dumps the config
    # as written: a restart from the dump honours --cfg-options on the keys
    work_dir = tmp_path / 'wd'
    cfg = build(train_tool, toy_config, '--work-dir', str(work_dir),
                '--cfg-options', 'custom_imports.imports=[toy_classifier]',
                'log_level=WARNING', 'dtr.eviction_threshold=64KB')
    assert cfg.custom_hooks[-1].type == 'mmdtr.DTRHook'
    train_tool.build_runner(cfg)
    dumped = work_dir / 'toy_cfg.py'
    text = dumped.read_text()
    assert "eviction_threshold='64KB'" in text and 'DTRHook' not in text
    cfg = build(train_tool, str(dumped), '--cfg-options',
                'dtr.eviction_threshold=3GB')
    assert cfg.custom_hooks == [
        dict(type='mmdtr.DTRHook', eviction_threshold='3GB')
    ]
    with pytest.raises(MmdtrError, match="'3XB' is not a size"):
        build(train_tool, str(dumped), '--cfg-options',
              'dtr.eviction_threshold=3XB')


def test_dump_of_another_runner_type_keeps_the_keys_as_written(
        train_tool, toy_config, tmp_path):
    # MMEngine's Runner dumped the translated config: a restart from it
    # with --cfg-options on the key was refused as configured twice (found
    # by an adversarial search)
    work_dir = tmp_path / 'wd'
    cfg = build(train_tool, toy_config, '--work-dir', str(work_dir),
                '--cfg-options', 'custom_imports.imports=[toy_classifier]',
                'log_level=WARNING', 'dtr.eviction_threshold=64KB',
                'runner_type=Runner')
    runner = train_tool.build_runner(cfg)
    assert type(runner).__name__ == 'Runner'
    text = (work_dir / 'toy_cfg.py').read_text()
    assert "eviction_threshold='64KB'" in text and 'DTRHook' not in text
    cfg = build(train_tool, str(work_dir / 'toy_cfg.py'), '--cfg-options',
                'dtr.eviction_threshold=3GB')
    assert cfg.custom_hooks == [
        dict(type='mmdtr.DTRHook', eviction_threshold='3GB')
    ]


def test_check_config_checks_and_starts_nothing(train_tool, toy_config,
                                                tmp_path, capsys):
    # it printed nothing when the config passed (found by a new-user
    # walkthrough), and no test ran it
    work_dir = tmp_path / 'work'
    common = [toy_config, '--work-dir', str(work_dir), '--check-config']
    options = ['--cfg-options', 'custom_imports.imports=[toy_classifier]']
    assert train_tool.main(common + options) is None
    # it said the module names were accepted where none were given
    assert 'the arguments and the model are accepted; no module names to ' \
        'check.' in capsys.readouterr().out
    assert train_tool.main(common + options +
                           ['activation_checkpointing=conv']) is None
    assert 'the arguments, the model and the module names are accepted.' in \
        capsys.readouterr().out
    with pytest.raises(SystemExit) as info:  # a module name, on the model
        train_tool.main(common + options + ['activation_checkpointing=nope'])
    assert info.value.code == 1
    assert 'activation_checkpointing' in capsys.readouterr().err
    assert not work_dir.exists()


def test_check_config_with_a_model_it_cannot_build(train_tool, toy_config,
                                                   capsys):
    # it said the module names were accepted, unchecked (a review); under a
    # launcher a model may need the process group, so the ranks check them
    # (a type that is not registered is refused before, by its name)
    options = [
        '--cfg-options', 'model.no_such_argument=1',
        'activation_checkpointing=x'
    ]
    with pytest.raises(SystemExit):
        train_tool.main([toy_config, '--check-config', *options])
    assert 'the model could not be built' in capsys.readouterr().err
    train_tool.main(
        [toy_config, '--check-config', '--launcher', 'pytorch', *options])
    out = capsys.readouterr().out
    assert 'the module names are checked when training starts' in out
    assert 'no_such_argument' in out
    # without module names to check, the model was not built at all: a bad
    # model argument passed, then failed after the work dir was made (found
    # by an adversarial search)
    options = ['--cfg-options', 'model.no_such_argument=1']
    with pytest.raises(SystemExit):
        train_tool.main([toy_config, '--check-config', *options])
    assert 'the model could not be built: TypeError' in \
        capsys.readouterr().err
    train_tool.main(
        [toy_config, '--check-config', '--launcher', 'pytorch', *options])
    assert 'the model is checked when training starts' in \
        capsys.readouterr().out
