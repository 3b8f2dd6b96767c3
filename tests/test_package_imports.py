"""The engine and the techniques import torch only: never MMEngine or
mmcv (the adapters do), so they work as a plain PyTorch library."""
import ast
import os.path as osp
import subprocess
import sys
import textwrap

import pytest

import mmdtr

PACKAGE = osp.dirname(mmdtr.__file__)
#: what the torch-only parts may import besides the standard library
ALLOWED = ('torch', 'mmdtr.core', 'mmdtr.errors', 'mmdtr.techniques')


def _modules(folder):
    import glob
    return sorted(glob.glob(osp.join(PACKAGE, folder, '*.py')))


def _imports(path, package):
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: within its own package
                yield package + ('.' + node.module if node.module else '')
            else:
                yield node.module


@pytest.mark.parametrize(
    'path',
    _modules('core') + _modules('techniques') +
    [osp.join(PACKAGE, name) for name in ('dtr.py', 'errors.py')],
    ids=osp.basename)
def test_imports_are_torch_and_the_standard_library(path):
    folder = osp.basename(osp.dirname(path))
    package = 'mmdtr' if folder == 'mmdtr' else f'mmdtr.{folder}'
    for name in _imports(path, package):
        top = name.split('.')[0]
        assert top in sys.stdlib_module_names or name.startswith(
            ALLOWED), f'{osp.basename(path)} imports {name}'


def test_the_engine_and_checkpointing_run_without_mmengine():
    blocked = textwrap.dedent('''
        import importlib.abc, sys

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split('.')[0] in ('mmengine', 'mmcv'):
                    raise ModuleNotFoundError(
                        f'No module named {name!r}', name=name)

        sys.meta_path.insert(0, Block())
        import torch
        from torch import nn
        from mmdtr import dtr
        from mmdtr.techniques.activation_checkpointing import \\
            apply_activation_checkpointing
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        apply_activation_checkpointing(model, '1')
        x = torch.randn(4, 8)
        with dtr.DTR(eviction_threshold=1, evictee_minimum_size=1) as e:
            model(x).sum().backward()
        assert e.stats.evictions > 0
        print(sorted(m for m in sys.modules
                     if m.split('.')[0] in ('mmengine', 'mmcv')))
        ''')
    out = subprocess.run([sys.executable, '-c', blocked],
                         capture_output=True,
                         text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == '[]'
