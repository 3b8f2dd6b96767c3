"""CPU process-group setup for distributed training with gloo (or mpi).

MMEngine 0.10.7's ``init_dist`` calls ``torch.cuda.set_device``, which fails
on a CPU-only machine. This module holds what mmdtr's runner
(:mod:`mmdtr.adapters.runner`) uses instead when no accelerator is
available: :func:`check_cpu_dist_cfg` and :func:`dist_cfg_of` check
``env_cfg.dist_cfg``, :func:`init_cpu_dist` starts the default process group
without touching CUDA, and :func:`close_dist` destroys it when training ends
(:func:`close_at_exit`: when the process exits, for a script that does not).
With CUDA, MMEngine's own path (nccl) is kept. The CPU DDP wrappers are in
:mod:`mmdtr.adapters.distributed`.
"""
import atexit
import contextlib
import datetime
import difflib
import gc
import inspect
import os
import subprocess
import sys
import traceback
import urllib.parse
from typing import Optional

import torch.distributed as torch_dist

from mmdtr.errors import MmdtrError

#: launcher -> environment variables giving (rank, world size, local rank)
_LAUNCHER_ENV = {
    'pytorch': ('RANK', 'WORLD_SIZE', 'LOCAL_RANK'),
    'slurm': ('SLURM_PROCID', 'SLURM_NTASKS', 'SLURM_LOCALID'),
    'mpi': ('OMPI_COMM_WORLD_RANK', 'OMPI_COMM_WORLD_SIZE',
            'OMPI_COMM_WORLD_LOCAL_RANK'),
}
_CPU_BACKENDS = ('gloo', 'mpi')

#: The highest TCP port (``MASTER_PORT``, ``dist_cfg.port``).
MAX_PORT = 65535

#: The longest collective timeout: what a ``datetime.timedelta`` holds.
MAX_TIMEOUT_S = datetime.timedelta.max.total_seconds()

#: launcher -> how its processes get their variables, for hints
_STARTED_BY = {
    'pytorch':
    'start the processes with tools/dist_train.sh (torchrun) '
    'for --launcher pytorch.',
    'slurm':
    'start the processes with srun (--launcher slurm).',
    'mpi':
    'start the processes with mpirun (--launcher mpi), and set '
    'MASTER_ADDR.',
}


def _started_by(launcher: str) -> str:
    """The hint of how ``launcher``'s processes get their variables."""
    return _STARTED_BY.get(launcher, _STARTED_BY['pytorch'])


def _env(name: str, launcher: str) -> str:
    if name not in os.environ:
        raise MmdtrError(
            f'launcher {launcher!r} needs the environment variable {name}, '
            'which is not set.',
            hint=_started_by(launcher))
    return os.environ[name]


def _available_backends() -> tuple:
    return tuple(b for b in _CPU_BACKENDS
                 if b != 'mpi' or torch_dist.is_mpi_available())


def check_cpu_dist_cfg(backend: str = 'gloo',
                       init_backend: str = 'torch',
                       timeout: Optional[int] = None,
                       **kwargs) -> tuple:
    """Check ``env_cfg.dist_cfg`` for CPU training, without starting
    anything: ``tools/dist_train.sh`` checks it once, before the ranks
    start (found by an adversarial search: once per rank, then torchrun's
    traceback).

    Args:
        backend (str): ``'gloo'``, or ``'mpi'`` where this PyTorch has it;
            ``'nccl'`` means ``'gloo'``.
        init_backend (str): Only ``'torch'``.
        timeout (int, optional): Seconds, positive.
        **kwargs: Other arguments of
            :func:`torch.distributed.init_process_group`.

    Returns:
        tuple: The backend to use, and the keyword arguments for
        ``init_process_group`` (``timeout`` as a ``timedelta``).

    Raises:
        MmdtrError: On a value CPU training cannot use.
    """
    kwargs = dict(kwargs)
    port = kwargs.pop('port', None)  # init_cpu_dist's own, for slurm
    if port is not None and (isinstance(port, bool)
                             or not isinstance(port, int)
                             or not 1 <= port <= MAX_PORT):
        raise MmdtrError(
            f'env_cfg.dist_cfg.port={port!r} is not a port; accepted: an int '
            f'from 1 to {MAX_PORT}.',
            hint='e.g. env_cfg = dict(dist_cfg=dict(port=29500)).')
    if backend == 'nccl':
        backend = 'gloo'
    if backend not in _available_backends():
        raise MmdtrError(
            f'env_cfg.dist_cfg.backend={backend!r} cannot run on CPU here; '
            f'accepted: {_available_backends()} (or nccl, which means '
            'gloo).',
            hint="e.g. env_cfg = dict(dist_cfg=dict(backend='gloo')).")
    if init_backend != 'torch':
        raise MmdtrError(
            f'env_cfg.dist_cfg.init_backend={init_backend!r} is not '
            "supported on CPU; accepted: 'torch'.",
            hint='leave init_backend out of env_cfg.dist_cfg.')
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(
                timeout, (int, float)) or not 0 < timeout < MAX_TIMEOUT_S:
            # above, a raw OverflowError from timedelta (found by an
            # adversarial search)
            raise MmdtrError(
                f'env_cfg.dist_cfg.timeout={timeout!r} is not accepted; '
                'expected a positive number, below '
                f'{MAX_TIMEOUT_S:.0f} seconds.',
                hint='e.g. env_cfg = dict(dist_cfg=dict(timeout=1800)).')
        kwargs['timeout'] = datetime.timedelta(seconds=timeout)
    accepted = inspect.signature(torch_dist.init_process_group).parameters
    for name in kwargs:
        if name not in accepted or name in ('rank', 'world_size', 'backend'):
            close = difflib.get_close_matches(name, ['timeout', *accepted], 1)
            raise MmdtrError(
                f'env_cfg.dist_cfg.{name}={kwargs[name]!r} is not accepted '
                '(not an argument of torch.distributed.init_process_group '
                'that the config may set)' +
                (f'; closest match: {close[0]!r}.' if close else '.'),
                hint='see init_cpu_dist in '
                'mmdtr/adapters/cpu_process_group.py.')
    return backend, kwargs


def dist_cfg_of(env_cfg) -> dict:
    """``env_cfg.dist_cfg`` as keyword arguments for
    :func:`init_cpu_dist`; ``None`` for either is left out (MMEngine's
    default).

    Raises:
        MmdtrError: If ``env_cfg`` is not a dict with a dict ``dist_cfg``.
    """
    env_cfg = env_cfg or {}
    dist_cfg = env_cfg.get('dist_cfg', None) or {} if isinstance(
        env_cfg, dict) else None
    if not isinstance(dist_cfg, dict):
        raise MmdtrError(
            f'env_cfg={env_cfg!r} is not accepted: MMEngine takes a dict '
            'with a dist_cfg dict.',
            hint="e.g. env_cfg = dict(dist_cfg=dict(backend='gloo')).")
    return dist_cfg


def _env_int(name: str, launcher: str) -> int:
    value = _env(name, launcher)
    try:
        return int(value)
    except ValueError:
        raise MmdtrError(
            f'launcher {launcher!r}: the environment variable {name}='
            f'{value!r} is not an integer.',
            hint=_started_by(launcher)) from None


def _check_port(launcher: str, world_size: int) -> None:
    """``MASTER_PORT``, where set and read (``env://``), is a TCP port: out
    of range it raised a raw ``ValueError`` from the store after the work
    dir was made (found by an adversarial search). 0, any free port, serves
    a world of one process only: the other ranks could not find it."""
    if 'MASTER_PORT' in os.environ:
        port = _env_int('MASTER_PORT', launcher)
        lowest = 0 if world_size == 1 else 1
        if not lowest <= port <= MAX_PORT:
            raise MmdtrError(
                f'launcher {launcher!r}: the environment variable '
                f'MASTER_PORT={port} is not a port; accepted: {lowest} to '
                f'{MAX_PORT}.',
                hint=_started_by(launcher))


def _check_torchrun_init_method(dist_cfg: Optional[dict]) -> None:
    """Under torchrun every rank's store is a client of torchrun's own, at
    ``MASTER_ADDR:MASTER_PORT``: a ``tcp://`` ``init_method`` at another
    port waited for a store nothing serves, silently, for the collective
    timeout (30 minutes; found by an adversarial search)."""
    method = (dist_cfg or {}).get('init_method', None)
    if os.environ.get('TORCHELASTIC_USE_AGENT_STORE') != 'True' or \
            not isinstance(method, str) or not method.startswith('tcp://'):
        return
    master = os.environ.get('MASTER_PORT')
    try:
        port = urllib.parse.urlparse(method).port
    except ValueError:
        port = None
    if port is None or str(port) != master:
        raise MmdtrError(
            f'env_cfg.dist_cfg.init_method={method!r} is not accepted '
            "under torchrun (tools/dist_train.sh): the ranks' stores are "
            "clients of torchrun's, at port MASTER_PORT="
            f'{master}, and would wait for one at another port that '
            'nothing serves.',
            hint='leave init_method out (env://: torchrun\'s address), or '
            'give that port (dist_train.sh: PORT).')


def check_launcher_env(launcher: str, dist_cfg: Optional[dict] = None) -> None:
    """Check that the variables a launcher's processes get are set:
    ``tools/train.py`` calls it before the runner makes its work dir (a run
    of ``--launcher pytorch`` outside torchrun made the work dir, then
    failed; found by a review), and :func:`init_cpu_dist` before it reads
    them. Another ``init_method`` than ``env://`` needs no address.

    Args:
        launcher (str): ``'pytorch'``, ``'slurm'`` or ``'mpi'``; others
            are left to the runner.
        dist_cfg (dict, optional): ``env_cfg.dist_cfg``.

    Raises:
        MmdtrError: Naming the first variable missing or not an integer,
            a rank outside the world size, a ``MASTER_PORT`` that is no
            port, or under torchrun a ``tcp://`` ``init_method`` at another
            port than its own.
    """
    if launcher not in _LAUNCHER_ENV:
        return
    # the rank and the world size; a local rank has fallbacks (MMEngine's
    # slurm path computes one; found by a review)
    rank_name, size_name = _LAUNCHER_ENV[launcher][:2]
    rank, size = _env_int(rank_name, launcher), _env_int(size_name, launcher)
    if not 0 <= rank < size:  # the other ranks waited for it, silently,
        # for the 30 minutes of torch's timeout (found by a walk through
        # the docs)
        raise MmdtrError(
            f'launcher {launcher!r}: the environment variables {rank_name}='
            f'{rank} and {size_name}={size} are not a rank of the world: '
            f'accepted: 0 <= {rank_name} < {size_name}.',
            hint=_started_by(launcher))
    dist_cfg = dist_cfg or {}
    env_init = dist_cfg.get('init_method', 'env://') == 'env://'
    if env_init and not (launcher == 'slurm'
                         and dist_cfg.get('port') is not None):
        _check_port(launcher, size)  # read by env:// (slurm: unless port)
    if launcher == 'pytorch':
        _check_torchrun_init_method(dist_cfg)
    if launcher == 'slurm':
        if 'MASTER_ADDR' not in os.environ:
            _env('SLURM_NODELIST', launcher)
    elif launcher == 'mpi' or env_init:
        _env('MASTER_ADDR', launcher)
        if launcher == 'pytorch':
            _env_int('MASTER_PORT', launcher)


def init_cpu_dist(launcher: str,
                  backend: str = 'gloo',
                  init_backend: str = 'torch',
                  timeout: Optional[int] = None,
                  port: Optional[int] = None,
                  **kwargs) -> None:
    """Initialise the default process group for CPU training.

    Like :func:`mmengine.dist.init_dist`, but it never touches CUDA.
    MMEngine's default backend ``'nccl'`` is replaced by ``'gloo'``.

    Args:
        launcher (str): ``'pytorch'`` (torchrun), ``'slurm'`` or ``'mpi'``.
        backend (str): ``'gloo'`` or ``'mpi'``; ``'nccl'`` means ``'gloo'``.
            Defaults to ``'gloo'``.
        init_backend (str): Only ``'torch'`` is supported on CPU.
        timeout (int, optional): Timeout of collectives, in seconds.
        port (int, optional): Master port for ``'slurm'`` (otherwise the
            ``MASTER_PORT`` variable, or 29500).
        **kwargs: Passed to :func:`torch.distributed.init_process_group`.

    Examples:
        >>> # in a config, as for MMEngine; on CPU nccl becomes gloo
        >>> env_cfg = dict(dist_cfg=dict(backend='gloo', timeout=1800))
    """
    backend, kwargs = check_cpu_dist_cfg(
        backend, init_backend, timeout, port=port, **kwargs)
    if launcher not in _LAUNCHER_ENV:
        raise MmdtrError(
            f'launcher={launcher!r} is not supported; accepted: '
            f'{tuple(_LAUNCHER_ENV)}.',
            hint='use tools/dist_train.sh, which passes --launcher pytorch.')
    # torchrun sets MASTER_ADDR and MASTER_PORT; env:// raised a raw
    # ValueError without them
    check_launcher_env(launcher, dict(kwargs, port=port))
    rank_var, size_var, local_var = _LAUNCHER_ENV[launcher]
    rank, world_size = int(os.environ[rank_var]), int(os.environ[size_var])
    if launcher == 'slurm':
        if port is not None:
            os.environ['MASTER_PORT'] = str(port)
        os.environ.setdefault('MASTER_PORT', '29500')
        if 'MASTER_ADDR' not in os.environ:
            nodes = os.environ['SLURM_NODELIST']
            os.environ['MASTER_ADDR'] = subprocess.getoutput(
                f'scontrol show hostname {nodes} | head -n1')
    elif launcher == 'mpi':
        os.environ.setdefault('MASTER_PORT', '29500')
    os.environ['RANK'] = str(rank)
    os.environ['WORLD_SIZE'] = str(world_size)
    os.environ['LOCAL_RANK'] = os.environ.get(local_var, '0')
    torch_dist.init_process_group(
        backend=backend, rank=rank, world_size=world_size, **kwargs)


def close_dist(wait: bool = True,
               wait_at_most: Optional[float] = None) -> None:
    """Destroy the default process group, after every rank got here.

    ``tools/train.py`` calls it when training ends. A process that exits
    with its gloo group alive can abort while the interpreter shuts down
    (gloo's worker threads still hold tensors: "terminate called without an
    active exception", SIGABRT), which fails the whole torchrun job after
    training succeeded. Nothing happens without a process group.

    Args:
        wait (bool): Wait for every rank first (a barrier). ``False`` when
            this rank failed: the others may never get here, and they fail
            fast on the closed connection instead of waiting out the
            collective timeout. Defaults to True.
        wait_at_most (float, optional): Wait this many seconds at most
            (gloo's ``monitored_barrier``; other backends wait as long as
            their collective timeout). Defaults to None: as long as that.

    Raises:
        RuntimeError: If the barrier failed or ran out of time (a rank is
            gone); the group is destroyed all the same.
    """
    if torch_dist.is_available() and torch_dist.is_initialized():
        # DDP wrappers nothing refers to any more go first, while the group
        # still holds its own reference: a reducer dropping the last one
        # destroys the gloo group from a finalizer that holds the GIL while
        # gloo's thread may wait for it (a deadlock seen in torch 2.13)
        gc.collect()
        try:
            if wait and wait_at_most is not None and \
                    torch_dist.get_backend() == 'gloo':
                torch_dist.monitored_barrier(
                    timeout=datetime.timedelta(seconds=wait_at_most))
            elif wait:
                torch_dist.barrier()
        finally:
            torch_dist.destroy_process_group()


#: Seconds the exit of a rank whose run succeeded waits for the others.
EXIT_WAIT_S = 60.0

#: [whether close_at_exit registered its handler, how the latest run of an
#: MMDTRRunner ended: None (none ended), True (returned), False (raised)]
_AT_EXIT = [False, None]


def close_at_exit() -> None:
    """Destroy the default process group when the interpreter exits.

    For the group :class:`~mmdtr.adapters.runner.MMDTRRunner` starts on
    CPU: a downstream repo's ``tools/train.py`` calls ``runner.train()``
    and exits with the group alive, which can abort the process at exit
    (see :func:`close_dist`; found by a review, about one run in 40 with 2
    ranks under mmpretrain's ``dist_train.sh``). The handler waits for the
    other ranks (:data:`EXIT_WAIT_S` at most) only if the latest run noted
    by :func:`noting_outcome` returned and the interpreter is not exiting
    on an uncaught exception: a rank that failed anywhere else leaves at
    once, while the others may be waiting in a collective of their run.
    The frames of that exception's traceback are cleared first: a runner
    they hold keeps its DDP wrapper, which keeps the group's threads alive
    into the interpreter's shutdown. A runner kept in a module global does
    the same (delete it, or keep it in a function, as OpenMMLab's
    ``tools/train.py`` scripts do). Registered once per process.
    """
    if not _AT_EXIT[0]:
        _AT_EXIT[0] = True
        atexit.register(_close_at_exit)


@contextlib.contextmanager
def noting_outcome():
    """Note for :func:`close_at_exit` whether a run returned or raised."""
    _AT_EXIT[1] = None
    try:
        yield
    except BaseException:
        _AT_EXIT[1] = False
        raise
    _AT_EXIT[1] = True


def _close_at_exit() -> None:
    tb = getattr(sys, 'last_traceback', None)
    if tb is not None:  # an uncaught exception's frames hold their locals
        traceback.clear_frames(tb)
    wait = _AT_EXIT[1] is True and getattr(sys, 'last_value', None) is None
    try:
        close_dist(wait=wait, wait_at_most=EXIT_WAIT_S)
    except Exception:  # noqa: B902 - another rank is gone: destroyed
        pass
