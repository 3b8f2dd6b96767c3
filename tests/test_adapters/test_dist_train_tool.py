"""tools/dist_train.sh: its own argument checks, and the config checked
once before torchrun starts the ranks."""
import os
import os.path as osp
import subprocess

import pytest
import torch

from .conftest import REPO


def run_dist_train(cwd, *args, env=None, timeout=60):
    """tools/dist_train.sh ARGS in ``cwd``; ``env`` overrides variables."""
    return subprocess.run(
        ['bash', osp.join(REPO, 'tools', 'dist_train.sh'), *args],
        cwd=str(cwd),
        env=dict(os.environ, **(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout)


@pytest.mark.parametrize('nproc', ['0', 'abc', '-1', '1.5', '01'])
def test_dist_train_refuses_a_bad_nproc(toy_config, nproc, tmp_path):
    # torchrun was started with it and ended in a traceback
    proc = run_dist_train(
        tmp_path, toy_config, nproc, env=dict(PYTHON='false'))  # no start
    assert proc.returncode == 1
    assert proc.stderr.startswith(
        f"MmdtrError: mmdtr: NPROC '{nproc}' is not accepted")
    assert proc.stderr.count('\n') == 1  # one line


@pytest.mark.parametrize('nproc', ['2', 'auto', 'cpu'])
def test_dist_train_passes_what_torchrun_takes(toy_config, nproc, tmp_path):
    # auto and cpu (one process per core) were refused
    proc = run_dist_train(  # prints the commands instead
        tmp_path,
        toy_config,
        nproc,
        env=dict(PYTHON='echo'))
    assert proc.returncode == 0, proc.stderr
    assert f'--nproc_per_node={nproc}' in proc.stdout


@pytest.mark.parametrize('name, value', [('NNODES', '0'), ('NNODES', 'x'),
                                         ('NODE_RANK', '-1'), ('PORT', 'abc'),
                                         ('PORT', '99999'), ('PORT', '0'),
                                         ('NODE_RANK', '1')])
def test_dist_train_refuses_bad_settings(toy_config, name, value, tmp_path):
    # torchrun ended in a traceback; PORT 0 and a NODE_RANK of no node hung
    # in the rendezvous (found by adversarial searches)
    proc = run_dist_train(
        tmp_path, toy_config, '1', env={
            'PYTHON': 'false',
            name: value
        })
    assert proc.returncode == 1
    assert proc.stderr.startswith(
        f"MmdtrError: mmdtr: {name} '{value}' is not accepted")
    assert proc.stderr.count('\n') == 1


@pytest.mark.parametrize('flag', ['--launcher', '--launch', '--la'])
def test_dist_train_refuses_a_launcher_argument(toy_config, tmp_path, flag):
    # '--launcher none' (or a prefix argparse takes) overrode the script's:
    # independent runs, exit 0 (found by an adversarial search, a review)
    proc = run_dist_train(
        tmp_path, toy_config, '1', flag, 'none', env={'PYTHON': 'false'})
    assert proc.returncode == 1
    assert proc.stderr.startswith(
        f"MmdtrError: mmdtr: '{flag}' is not accepted here")


@pytest.mark.skipif(torch.cuda.is_available(), reason='needs a CPU-only box')
def test_dist_train_refuses_gpu_without_one(toy_config, tmp_path):
    proc = run_dist_train(tmp_path, toy_config, 'gpu', timeout=120)
    assert proc.returncode == 1
    assert proc.stderr == ("MmdtrError: mmdtr: NPROC 'gpu': no GPU is "
                           'available here. Hint: give a number of '
                           'processes, or cpu.\n')


@pytest.mark.parametrize('options, error', [
    (['dtr.eviction_threshold=3XB'], 'dtr='),
    ([
        'custom_imports.imports=[toy_classifier]',
        'activation_checkpointing=[layer9]'
    ], 'activation_checkpointing: no sub-module'),
])
def test_dist_train_checks_the_config_once(toy_config, tmp_path,
                                           subprocess_env, options, error):
    # each rank refused it, then torchrun ended in its traceback; module
    # names were checked in each rank's before_run, after the work dir was
    # made (found by an adversarial search)
    proc = run_dist_train(
        tmp_path,
        toy_config,
        '2',
        '--cfg-options',
        *options,
        env=subprocess_env(),
        timeout=300)
    assert proc.returncode == 1
    # once, and no torchrun traceback (on PyTorch 2.4 a warning of its own
    # comes first, raised as MMEngine imports torch.distributed.optim)
    errors = [
        line for line in proc.stderr.splitlines()
        if line.startswith('MmdtrError')
    ]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith('MmdtrError: mmdtr: ' + error), proc.stderr
    assert 'Traceback' not in proc.stderr, proc.stderr
    assert not (tmp_path / 'work_dirs').exists()


def test_dist_train_refuses_a_missing_config(tmp_path):
    proc = run_dist_train(tmp_path, 'no.py', '1', env=dict(PYTHON='false'))
    assert proc.returncode == 1
    assert proc.stderr == ("MmdtrError: mmdtr: config file 'no.py' does not "
                           'exist. Hint: give the path of a config file, '
                           "e.g. configs/demo_dtr.py.\n")
