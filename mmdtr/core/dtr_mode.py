"""The public DTR engine: a context manager over one :class:`EngineState`.

As ``FlopCounterMode`` does, the public façade :class:`DTR` owns the state
and a private, nearly empty ``TorchDispatchMode`` that forwards every op to
it; the saved-tensor hooks are thin closures over the same state.
"""
import dataclasses
from typing import Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mmdtr.errors import MmdtrError
from .engine import EngineState, oom_eviction_needs_cuda
from .policies import build_policy
from .sizes import parse_size

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class _DTRDispatchMode(TorchDispatchMode):

    def __init__(self, state: EngineState):
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t not in _PLAIN for t in types):  # subclasses: kept as is
            return self.state.on_subclass_op(func, args, kwargs or {})
        return self.state.on_op(func, args, kwargs or {})


@dataclasses.dataclass(frozen=True)
class DTRStats:
    """What one engine did.

    Attributes:
        peak_memory (int): Peak of memory in use while active, in bytes (CPU:
            storages allocated in scope; CUDA: ``memory_allocated``).
        evictions (int): Storages evicted.
        recomputations (int): Storages rebuilt by replay.
        remat_seconds (float): Host time spent rebuilding saved tensors.
        eviction_failures (int): Times nothing evictable was left while
            memory was above the threshold.
        ops (int): Ops seen (the engine's clock).
        threshold (int | None): The eviction threshold in bytes.
    """
    peak_memory: int
    evictions: int
    recomputations: int
    remat_seconds: float
    eviction_failures: int
    ops: int
    threshold: Optional[int]


class DTR:
    """Dynamic Tensor Rematerialization for the code in its scope.

    Args:
        eviction_threshold (int | str | None): Evict while memory in use is
            above it (``'5GB'``, ``'512MiB'``, bytes). ``None`` or 0: evict
            only when an allocation fails, which needs CUDA; on CPU a
            threshold is required.
        evictee_minimum_size (int | str): Smaller storages are never
            evicted. Defaults to 1 MiB.
        enable_sqrt_sampling (bool): Score about sqrt(N) sampled candidates
            per eviction instead of all. Defaults to False.
        policy (str | EvictionPolicy): ``'dtr'`` (default), ``'dtr_local'``,
            ``'lru'``, ``'largest'``, or an instance.
        device (str | torch.device, optional): Device whose memory is
            metered. Defaults to the device of the first storage an op
            allocates in scope (a CUDA device: its ``memory_allocated``).

    Examples:
        >>> with DTR(eviction_threshold='2GB') as engine:
        ...     loss = model(x).sum()
        ...     loss.backward()
        >>> engine.stats.evictions
    """

    def __init__(self,
                 eviction_threshold: Union[int, str, None] = None,
                 evictee_minimum_size: Union[int, str] = 2**20,
                 enable_sqrt_sampling: bool = False,
                 policy='dtr',
                 device=None):
        threshold = parse_size(
            eviction_threshold, 'eviction_threshold', allow_none=True)
        self.eviction_threshold = threshold or None
        self.evictee_minimum_size = parse_size(evictee_minimum_size,
                                               'evictee_minimum_size')
        if not isinstance(enable_sqrt_sampling, bool):
            raise MmdtrError(
                f'enable_sqrt_sampling={enable_sqrt_sampling!r} is not a '
                'bool.', 'Use True or False.')
        self.enable_sqrt_sampling = enable_sqrt_sampling
        self.policy = build_policy(policy)
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError):
                raise MmdtrError(f'device={device!r} is not a device.',
                                 "Use 'cpu', 'cuda' or 'cuda:N'.") from None
        self.device = device
        needs_cuda = device.type != 'cuda' if device is not None else \
            not torch.cuda.is_available()
        if self.eviction_threshold is None and needs_cuda:
            where = device.type if device is not None else 'a machine ' \
                'without CUDA'
            raise oom_eviction_needs_cuda(eviction_threshold, where)
        self._state = self._mode = self._hooks = None
        self._stats = None

    def __enter__(self):
        if self._state is not None:
            raise MmdtrError('this DTR engine is already active.',
                             'Create one DTR object per scope.')
        state = EngineState(self.eviction_threshold, self.evictee_minimum_size,
                            self.enable_sqrt_sampling, self.policy,
                            self.device)
        mode = _DTRDispatchMode(state)
        hooks = torch.autograd.graph.saved_tensors_hooks(
            state.pack, state.unpack)
        mode.__enter__()
        try:
            hooks.__enter__()
        except BaseException:
            mode.__exit__(None, None, None)
            raise
        self._state, self._mode, self._hooks = state, mode, hooks
        return self

    def __exit__(self, exc_type, exc, tb):
        state, mode, hooks = self._state, self._mode, self._hooks
        self._state = self._mode = self._hooks = None
        try:
            hooks.__exit__(exc_type, exc, tb)
        finally:
            mode.__exit__(exc_type, exc, tb)
            self._stats = self._snapshot(state)
            state.close()
        return False

    @property
    def active(self) -> bool:
        return self._state is not None

    @property
    def stats(self) -> DTRStats:
        """Statistics: live while active, final after exit."""
        if self._state is not None:
            return self._snapshot(self._state)
        if self._stats is None:
            raise MmdtrError('this DTR engine has not run yet.',
                             'Read stats inside or after a `with` block.')
        return self._stats

    @staticmethod
    def _snapshot(state: EngineState) -> DTRStats:
        return DTRStats(
            peak_memory=state.peak,
            evictions=state.evictions,
            recomputations=state.recomputations,
            remat_seconds=state.remat_seconds,
            eviction_failures=state.eviction_failures,
            ops=state.clock,
            threshold=state.threshold)
