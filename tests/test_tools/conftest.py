"""Shared by the tools' tests."""
import importlib.util
import os
import os.path as osp
import subprocess
import sys

import pytest

REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TOOL = osp.join(REPO, 'tools', 'benchmark.py')
RESNET = osp.join(REPO, 'configs', 'resnet50_synthetic.py')


def run_tool(*argv):
    """tools/benchmark.py on the ResNet-50 config, in a subprocess."""
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join([REPO, env.get('PYTHONPATH', '')])
    cmd = [sys.executable, TOOL, RESNET, *argv]
    return subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope='session')
def benchmark_cli():
    """:func:`run_tool`: tools/benchmark.py in a subprocess."""
    return run_tool


class CannedLauncher:
    """Answers every run with the next of a list of step times; ``answer``
    overrides keys of the result."""

    def __init__(self, **answer):
        self.calls, self.step, self.answer = [], 0.0, answer

    def run(self, spec, name='run'):
        self.calls.append(name)
        self.step += 1.0
        return dict(
            dict(
                status='ok',
                error=None,
                step_times_s=[self.step],
                median_step_s=self.step,
                peak_engine=1000,
                peak_independent=1000), **self.answer)


@pytest.fixture
def canned_launcher():
    """The class :class:`CannedLauncher`."""
    return CannedLauncher


def _load_tool(name):
    """The module of ``tools/<name>.py`` (the tools are scripts, not in a
    package)."""
    spec = importlib.util.spec_from_file_location(
        f'mmdtr_{name}_tool', osp.join(REPO, 'tools', f'{name}.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope='module')
def tool():
    """The module of tools/benchmark.py."""
    return _load_tool('benchmark')


@pytest.fixture(scope='module')
def demo():
    """The module of tools/demo.py."""
    return _load_tool('demo')
