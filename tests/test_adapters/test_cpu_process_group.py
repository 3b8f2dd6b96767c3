"""The CPU process group (``cpu_process_group.py``): its settings, the
launcher's environment, and the checks of both before the runner."""
import os

import pytest
import torch.distributed as torch_dist

from mmdtr.adapters.cpu_process_group import check_launcher_env, init_cpu_dist
from mmdtr.errors import MmdtrError
from .test_distributed import cpu_only


def test_init_cpu_dist_errors(monkeypatch):
    with pytest.raises(MmdtrError, match="backend='ucc'"):
        init_cpu_dist('pytorch', backend='ucc')
    with pytest.raises(MmdtrError, match="launcher='k8s'"):
        init_cpu_dist('k8s')
    monkeypatch.delenv('RANK', raising=False)
    with pytest.raises(MmdtrError, match='RANK'):
        init_cpu_dist('pytorch')
    assert not torch_dist.is_initialized()


@pytest.mark.parametrize('dist_cfg, match', [
    (dict(tiemout=30), "dist_cfg.tiemout=30.*closest match: 'timeout'"),
    (dict(timeout='30'), "timeout='30' is not accepted"),
    (dict(timeout=-1), 'timeout=-1 is not accepted'),
    (dict(timeout=1e15), r'timeout=1000000000000000.0 is not accepted.* below '
     '86400000000000 seconds'),
    (dict(rank=3), 'dist_cfg.rank=3 is not accepted'),
    pytest.param(
        dict(backend='mpi'),
        "backend='mpi' cannot run on CPU here",
        marks=pytest.mark.skipif(
            torch_dist.is_mpi_available(), reason='this torch has MPI')),
])
def test_init_cpu_dist_refuses_bad_dist_cfg(single_rank_env, dist_cfg, match):
    with pytest.raises(MmdtrError, match=match):
        init_cpu_dist('pytorch', **dist_cfg)
    assert not torch_dist.is_initialized()


@pytest.mark.parametrize(
    'name, value, match',
    [
        ('MASTER_ADDR', None, 'needs the environment variable MASTER_ADDR'),
        ('RANK', 'abc', "RANK='abc' is not an integer"),
        # a raw ValueError from the store (found by an adversarial search)
        ('MASTER_PORT', '99999', 'MASTER_PORT=99999 is not a port'),
        ('MASTER_PORT', '-5', 'MASTER_PORT=-5 is not a port'),
        ('MASTER_PORT', '65536',
         'MASTER_PORT=65536 is not a port; accepted: 0 '
         'to 65535'),
    ])
def test_init_cpu_dist_refuses_a_bad_environment(single_rank_env, monkeypatch,
                                                 name, value, match):
    # raw ValueErrors of int() and of torch's env:// (found by an
    # adversarial search)
    if value is None:
        monkeypatch.delenv(name)
    else:
        monkeypatch.setenv(name, value)
    with pytest.raises(MmdtrError, match=match):
        init_cpu_dist('pytorch')
    assert not torch_dist.is_initialized()


def test_init_cpu_dist_with_an_init_method_needs_no_master_address(
        single_rank_env, monkeypatch):
    # the check of MASTER_ADDR refused an explicit init_method (a review)
    port = os.environ['MASTER_PORT']
    monkeypatch.delenv('MASTER_ADDR')
    monkeypatch.delenv('MASTER_PORT')
    init_cpu_dist('pytorch', init_method=f'tcp://127.0.0.1:{port}')
    assert torch_dist.get_world_size() == 1


@pytest.mark.parametrize('launcher, unset, match', [
    ('pytorch', 'WORLD_SIZE', 'needs the environment variable WORLD_SIZE'),
    ('pytorch', 'MASTER_PORT', 'needs the environment variable MASTER_PORT'),
    ('slurm', None, 'needs the environment variable SLURM_PROCID'),
    ('mpi', None, 'needs the environment variable OMPI_COMM_WORLD_RANK'),
])
def test_launcher_variables_are_checked_before_the_runner(
        single_rank_env, monkeypatch, tmp_path, train_tool, toy_config,
        launcher, unset, match):
    # the runner made its work dir, then failed (found by a review)
    if unset is not None:
        monkeypatch.delenv(unset)
    with pytest.raises(MmdtrError, match=match):
        check_launcher_env(launcher)
    work_dir = tmp_path / 'work'
    with pytest.raises(SystemExit):
        train_tool.main(
            [toy_config, '--launcher', launcher, '--work-dir',
             str(work_dir)])
    assert not work_dir.exists()
    # --check-config runs outside the launcher (tools/dist_train.sh)
    train_tool.main([toy_config, '--launcher', launcher, '--check-config'])


@pytest.mark.parametrize('rank, size', [('5', '2'), ('-1', '2'), ('0', '0')])
def test_a_rank_outside_the_world_is_refused(single_rank_env, monkeypatch,
                                             rank, size):
    # RANK=5 WORLD_SIZE=2 waited silently for torch's 30-minute timeout
    # (found by a walk through the docs)
    monkeypatch.setenv('RANK', rank)
    monkeypatch.setenv('WORLD_SIZE', size)
    with pytest.raises(
            MmdtrError,
            match=f'RANK={rank} and WORLD_SIZE={size} are not a rank of'):
        check_launcher_env('pytorch')


def test_slurm_needs_no_local_rank(monkeypatch):
    # MMEngine's slurm path computes one when SLURM_LOCALID is unset (a
    # review of the check's first form)
    monkeypatch.setenv('SLURM_PROCID', '0')
    monkeypatch.setenv('SLURM_NTASKS', '1')
    monkeypatch.delenv('SLURM_LOCALID', raising=False)
    monkeypatch.setenv('MASTER_ADDR', '127.0.0.1')
    check_launcher_env('slurm')
    monkeypatch.delenv('SLURM_NTASKS')
    with pytest.raises(MmdtrError, match='SLURM_NTASKS') as info:
        check_launcher_env('slurm')
    assert 'srun' in info.value.hint


def test_launcher_variables_with_an_init_method(single_rank_env, monkeypatch):
    check_launcher_env('pytorch')
    check_launcher_env('none')
    monkeypatch.delenv('MASTER_ADDR')
    check_launcher_env('pytorch', dict(init_method='tcp://127.0.0.1:1'))
    with pytest.raises(MmdtrError, match='MASTER_ADDR'):
        check_launcher_env('pytorch')


def test_master_port_is_checked_where_it_is_read(single_rank_env, monkeypatch):
    # the first form of the check refused a leftover MASTER_PORT that
    # another init_method or slurm's port never reads, and 0, which a world
    # of one process takes (a review)
    monkeypatch.setenv('MASTER_PORT', '99999')
    check_launcher_env('pytorch', dict(init_method='file:///tmp/store'))
    check_launcher_env('pytorch', dict(init_method='tcp://127.0.0.1:29500'))
    for name, value in (('SLURM_PROCID', '0'), ('SLURM_NTASKS', '1')):
        monkeypatch.setenv(name, value)
    check_launcher_env('slurm', dict(port=29500))
    with pytest.raises(MmdtrError, match='MASTER_PORT=99999 is not a port'):
        check_launcher_env('slurm')
    monkeypatch.setenv('MASTER_PORT', '0')
    check_launcher_env('pytorch')  # a world of one
    monkeypatch.setenv('WORLD_SIZE', '2')
    with pytest.raises(
            MmdtrError,
            match='MASTER_PORT=0 is not a port; '
            'accepted: 1 to 65535'):
        check_launcher_env('pytorch')


@pytest.mark.parametrize('port', [0, 70000, '29500', True])
def test_slurm_port_is_checked(single_rank_env, port):
    with pytest.raises(
            MmdtrError, match=f'env_cfg.dist_cfg.port={port!r} is not a port'):
        init_cpu_dist('pytorch', port=port)
    assert not torch_dist.is_initialized()


@pytest.mark.parametrize('init_method, accepted', [
    ('tcp://127.0.0.1:{port}', True),
    ('tcp://localhost:{port}', True),
    ('tcp://127.0.0.1:1', False),
    ('tcp://127.0.0.1', False),
    ('tcp://127.0.0.1:port', False),
    ('env://', True),
    ('file:///tmp/store', True),
])
def test_init_method_under_torchrun_is_at_its_port(single_rank_env,
                                                   monkeypatch, init_method,
                                                   accepted):
    # under torchrun every rank's store is a client of torchrun's: a tcp://
    # init_method at another port hung until the collective timeout (found
    # by an adversarial search); outside torchrun rank 0 serves it
    dist_cfg = dict(
        init_method=init_method.format(port=os.environ['MASTER_PORT']))
    check_launcher_env('pytorch', dist_cfg)
    monkeypatch.setenv('TORCHELASTIC_USE_AGENT_STORE', 'True')
    if accepted:
        check_launcher_env('pytorch', dist_cfg)
        return
    with pytest.raises(MmdtrError, match='is not accepted under torchrun'):
        check_launcher_env('pytorch', dist_cfg)
    with pytest.raises(MmdtrError, match='is not accepted under torchrun'):
        init_cpu_dist('pytorch', **dist_cfg)
    assert not torch_dist.is_initialized()


@cpu_only
@pytest.mark.parametrize('keys, match', [
    (dict(sync_bn='torch'), "sync_bn='torch' cannot run on CPU"),
    (dict(env_cfg=dict(dist_cfg=dict(backend='ucc'))),
     "backend='ucc' cannot run on CPU"),
    (dict(env_cfg=dict(dist_cfg=dict(timeout=0))), 'timeout=0 is not'),
])
def test_cpu_distributed_settings_are_checked_with_the_config(keys, match):
    # each failed once per rank, then in torchrun's traceback (found by an
    # adversarial search); dist_train.sh checks the config once
    from mmengine.config import Config

    from mmdtr.adapters.config_translation import translate_memory_keys
    with pytest.raises(MmdtrError, match=match):
        translate_memory_keys(Config(dict(launcher='pytorch', **keys)))
    translate_memory_keys(Config(keys))  # without a launcher: not used
