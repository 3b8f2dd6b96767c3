"""Run each measured run in a process of its own, with a progress bar.

Two launchers, same result (:func:`mmdtr.benchmarking.worker.run_spec`):

- ``'forkserver'`` (default on CPU where available): a server process
  imports torch, MMEngine and mmdtr once, runs no torch op, and forks a
  fresh child per run. Nothing a run allocates outlives its child, and a
  run starts in milliseconds instead of re-importing torch.
- ``'subprocess'`` (default on CUDA): a fresh interpreter per run
  (``python -m mmdtr.benchmarking.worker SPEC RESULT``). Importing those
  modules on a machine with a GPU may initialize CUDA (seen with torch
  2.11), and a forked child then cannot use it.

A child's stdout and stderr go to a log file per run. A run killed by
SIGKILL (the kernel's OOM killer, systemd-oomd) or SIGTERM (earlyoom's
first signal) gets status ``'killed'``, one that dies otherwise without a
result (a segfault, an abort, an exit) ``'crashed'``,
and one that passes ``timeout`` seconds ``'timeout'`` (a forked run that
hands in its result within a grace period after the timeout keeps that
result). The largest-batch search reads ``'killed'`` as "does not fit" and
stops at any other failure.
"""
import json
import multiprocessing
import os
import os.path as osp
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

from mmdtr.errors import MmdtrError

_WORKER = 'mmdtr.benchmarking.worker'
_REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
LAUNCHERS = ('forkserver', 'subprocess')
#: Seconds a forked run gets after its timeout to hand in a finished result
#: (and after sending it, or dying, to exit).
_GRACE_S = 5


def default_launcher(device: str = 'cpu') -> str:
    """``'forkserver'`` for CPU runs where the platform has it, else
    ``'subprocess'``.

    Args:
        device (str): The runs' device. Defaults to ``'cpu'``.

    Returns:
        str: One of :data:`LAUNCHERS`.
    """
    methods = multiprocessing.get_all_start_methods()
    if str(device).startswith('cuda') or 'forkserver' not in methods:
        return 'subprocess'
    return 'forkserver'


class Progress:
    """A progress bar on stderr: tqdm if installed, else a plain one.

    Args:
        total (int | None): Runs expected, or None when unknown.
        desc (str): Label in front of the bar.
        enabled (bool): False prints nothing.
    """

    def __init__(self, total: Optional[int], desc: str, enabled: bool = True):
        self.total, self.desc, self.enabled = total, desc, enabled
        self.done, self.start = 0, time.monotonic()
        self.tty = sys.stderr.isatty()
        self._tqdm = None
        if enabled:
            try:
                from tqdm import tqdm
                self._tqdm = tqdm(total=total, desc=desc, unit='run')
            except ImportError:
                self._draw('')

    def _draw(self, label: str, final: bool = False) -> None:
        elapsed = time.monotonic() - self.start
        if self.total:
            filled = int(20 * self.done / self.total)
            bar = f'[{"#" * filled}{"." * (20 - filled)}] ' \
                f'{self.done}/{self.total}'
        else:
            bar = f'{self.done} runs'
        line = f'{self.desc}: {bar} {elapsed:6.0f}s {label}'
        if self.tty:
            sys.stderr.write('\r' + line[:100].ljust(100) +
                             ('\n' if final else ''))
        elif label or final:
            sys.stderr.write(line + '\n')
        sys.stderr.flush()

    def set_label(self, label: str) -> None:
        """Show what runs now.

        Args:
            label (str): The run's name.
        """
        if self._tqdm is not None:
            self._tqdm.set_postfix_str(label)
        elif self.enabled:
            self._draw(f'running {label}')

    def update(self, label: str = '') -> None:
        """Count one finished run.

        Args:
            label (str): What to show with it, e.g. ``'name: status'``.
                Defaults to ``''``.
        """
        self.done += 1
        if self._tqdm is not None:
            self._tqdm.update(1)
        elif self.enabled:
            self._draw(f'done {label}')

    def close(self) -> None:
        """End the bar."""
        if self._tqdm is not None:
            self._tqdm.close()
        elif self.enabled:
            self._draw('', final=True)


def _child(spec: dict, log_path: str, conn) -> None:
    """Body of a forked run: stdout/stderr to the log, result to ``conn``."""
    with open(log_path, 'w') as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    from mmdtr.benchmarking.worker import log_result, run_spec
    result = run_spec(spec)
    log_result(result)
    conn.send(result)
    conn.close()


class Launcher:
    """Starts runs, one at a time, each in a new process.

    Args:
        kind (str): One of :data:`LAUNCHERS`.
        log_dir (str): Where the logs of the runs go.
        timeout (float, optional): Seconds a run may take.
    """

    def __init__(self,
                 kind: Optional[str] = None,
                 log_dir: str = '.',
                 timeout: Optional[float] = None):
        self.kind = kind or default_launcher()
        if self.kind not in LAUNCHERS:
            raise MmdtrError(
                f'launcher {self.kind!r} is not one of {list(LAUNCHERS)}.',
                hint="give 'forkserver' or 'subprocess', or None for "
                "default_launcher()'s choice.")
        self.log_dir, self.timeout = log_dir, timeout
        self._context = None
        os.makedirs(log_dir, exist_ok=True)
        # numbered on from an earlier invocation's logs, which its section
        # of results.json names (found by an adversarial search: a second
        # command overwrote 001_baseline.log)
        numbers = (name.split('_', 1)[0] for name in os.listdir(log_dir))
        self.count = max((int(n) for n in numbers if n.isdigit()), default=0)

    def run(self, spec: dict, name: str = 'run') -> dict:
        """Run ``spec`` in a new process and return its result.

        Args:
            spec (dict): From :func:`~mmdtr.benchmarking.worker.make_spec`.
            name (str): Names the log file.

        Returns:
            dict: The result of :func:`~.worker.run_spec`, plus ``log``.
        """
        self.count += 1
        safe = ''.join(c if c.isalnum() or c in '-_.' else '_' for c in name)
        log_path = osp.join(self.log_dir, f'{self.count:03d}_{safe}.log')
        if self.kind == 'forkserver':
            result = self._run_forked(spec, log_path)
        else:
            result = self._run_subprocess(spec, log_path)
        result['log'] = log_path
        return result

    def _failed(self, status: str, why: str) -> dict:
        return dict(
            status=status,
            error=why,
            median_step_s=None,
            step_times_s=[],
            peak_engine=None,
            peak_independent=None)

    def _died(self, code) -> dict:
        """A child that exited with ``code`` without a result: the signals
        of out-of-memory killers (SIGKILL, SIGTERM) are ``'killed'``,
        anything else ``'crashed'``: a segfault read as "does not fit" let
        the largest batch search go on and report a smaller batch (a
        review)."""
        for sig in (signal.SIGKILL, signal.SIGTERM):
            if code == -sig:
                return self._failed('killed', f'exit code {code} ({sig.name})')
        return self._failed('crashed', f'exit code {code}')

    def _run_forked(self, spec: dict, log_path: str) -> dict:
        if self._context is None:
            self._context = multiprocessing.get_context('forkserver')
            self._context.set_forkserver_preload([_WORKER])
        receive, send = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=_child, args=(spec, log_path, send), daemon=True)
        process.start()
        send.close()
        timed_out = not receive.poll(self.timeout)
        # a child finishing as the timeout passes still gets its result in
        ready = not timed_out or receive.poll(_GRACE_S)
        result = None
        if ready:
            try:
                result = receive.recv()
            except EOFError:  # the child died before sending
                pass
        process.join(_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join()
        if result is not None:
            return result
        if timed_out:
            return self._failed('timeout', f'over {self.timeout} s')
        return self._died(process.exitcode)

    def _run_subprocess(self, spec: dict, log_path: str) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            spec_path = osp.join(tmp, 'spec.json')
            result_path = osp.join(tmp, 'result.json')
            with open(spec_path, 'w') as f:
                json.dump(spec, f)
            env = dict(os.environ)
            env['PYTHONPATH'] = os.pathsep.join(
                p for p in (_REPO, env.get('PYTHONPATH')) if p)
            with open(log_path, 'w') as log:
                try:
                    code = subprocess.run([
                        sys.executable, '-m', _WORKER, spec_path, result_path
                    ],
                                          stdout=log,
                                          stderr=subprocess.STDOUT,
                                          env=env,
                                          timeout=self.timeout).returncode
                except subprocess.TimeoutExpired:
                    return self._failed('timeout', f'over {self.timeout} s')
            if not osp.exists(result_path):
                return self._died(code)
            with open(result_path) as f:
                return json.load(f)
