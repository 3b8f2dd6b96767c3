"""What the engine needs to know about an operator, read from its schema.

Views are found at run time (an output whose storage is an input's, rule
R2 of docs/design.md), which also covers list returns; writes come from the
schema's alias annotations.

Classification is computed once per ``OpOverload`` and cached, so the hot
path pays a dict lookup per op (rule R1 of docs/design.md).
"""
import platform
from typing import Dict, NamedTuple, Tuple

import torch

aten = torch.ops.aten

# Ops that mutate arguments their schema does not declare as written
# (native_batch_norm updates running stats in training mode), or declare
# them but whose outputs do not depend on those arguments' values. Replay
# passes scratch copies for these arguments (rule R6), which is exact only
# in training mode, where outputs use batch statistics.
_BATCH_NORM_TRAINING_ARG = {
    'native_batch_norm': 'training',
    '_native_batch_norm_legit': 'training',
    'cudnn_batch_norm': 'training',
    'miopen_batch_norm': 'training',
    '_batch_norm_with_update': '',  # always training
    # the statistics kernels (SyncBatchNorm's on CUDA) update the running
    # statistics they are given and return the batch's, which never read
    # them; their schemas declare no write
    'batch_norm_update_stats': '',
    'batch_norm_gather_stats': '',
    'batch_norm_gather_stats_with_counts': '',
}
_RUNNING_STATS = ('running_mean', 'running_var')

# Arguments written by kernels whose schemas in older PyTorch do not mark
# them, by op name: rrelu's ``noise`` is marked ``Tensor(b!)`` in PyTorch
# 2.13, not in 2.4 or 2.5 (the one difference of write annotations
# between the aten schemas of 2.4 and 2.13, compared op by op on
# 2026-11-27). Unmarked, the op was replayable, and a replay wrote the
# noise a backward reads, unseen (R6); a selective policy kept it.
_UNMARKED_WRITES = {
    'rrelu_with_noise': 'noise',
    'rrelu_with_noise_': 'noise',
}

# In-place ops whose result does not depend on the prior content of
# ``self``: once one covers a whole storage, that storage's content is
# fully determined by recorded ops (rule R5).
_FULL_OVERWRITE = frozenset({
    'fill_', 'zero_', 'copy_', 'bernoulli_', 'normal_', 'uniform_', 'random_',
    'exponential_', 'geometric_', 'cauchy_', 'log_normal_'
})

#: Factories of fresh buffers: what custom kernels outside the dispatcher
#: are handed to fill (OpenMMLab's compiled ops allocate their outputs with
#: ``new_zeros`` or ``new_empty``), so their content is trusted only after
#: a full overwrite through the dispatcher (R5).
_FRESH_BUFFER_PREFIXES = ('empty', 'new_empty', '_empty', 'zeros', 'new_zeros',
                          'ones', 'new_ones', 'full', 'new_full')

#: How far an op's kernels on a device are bitwise deterministic (R4):
#: ``ALWAYS``; ``IN_DETERMINISTIC_MODE``, ops whose default kernels may
#: give other bits on each call (atomics, parallel writes to duplicate
#: indices) and which take a deterministic kernel under
#: ``torch.use_deterministic_algorithms(True)``; ``NEVER``, ops without
#: one (that mode raises, or warns with ``warn_only`` and runs the
#: nondeterministic kernel). PyTorch tags no ``aten`` op
#: ``nondeterministic_bitwise``, so the lists follow the documentation of
#: ``use_deterministic_algorithms`` (torch 2.13), except that a forward
#: convolution counts as ``ALWAYS``: cuDNN documents its forward routines
#: as bitwise reproducible, PyTorch's entry is for the backward algorithms
#: (``convolution_backward``) and for benchmark mode's choice, made once
#: per shape; and that ``linalg_lstsq`` counts as ``NEVER`` (its default
#: CPU driver gave other bits on another call; not in that list). Ops
#: whose entry depends on an argument (``scatter_reduce``'s ``reduce``)
#: take the stricter class. Names are base names (in-place and ``out=``
#: forms share them).
ALWAYS = 'always'
IN_DETERMINISTIC_MODE = 'in deterministic mode'
NEVER = 'never'
_INDEX_PUTS = ('index_put', '_index_put_impl', '_unsafe_index_put',
               '_unsafe_masked_index_put_accumulate', 'index_copy')
#: A replay's arguments require no grad (R4), so a CPU convolution's kernel
#: sees ``need_backward`` false. PyTorch then may choose an inference-only
#: depthwise 3x3 Winograd kernel on ARM (NEON) and RISC-V vector builds, or
#: XNNPACK on mobile builds, not the recorded call's kernel: convolution
#: outputs are kept there. XNNPACK built into an x86 wheel (as in PyTorch's
#: official ones) is not used for convolutions outside mobile builds.
_CONVOLUTIONS = ('convolution', '_convolution', 'convolution_overrideable')
#: CPU architectures with such kernels (``platform.machine()`` prefixes).
_OTHER_CONV_KERNEL_MACHINES = ('arm', 'aarch64', 'riscv')


def _cpu_classes(keep_convolutions: bool) -> dict:
    """The CPU classes that differ from ``ALWAYS``."""
    classes = dict.fromkeys(_INDEX_PUTS, IN_DETERMINISTIC_MODE)
    # linalg_lstsq: its default CPU driver (gelsy) gave up to 9 results in
    # 25 calls on the same inputs (found by an adversarial search)
    classes.update(
        dict.fromkeys(('put', 'max_unpool2d', 'max_unpool3d', 'linalg_lstsq'),
                      NEVER))
    if keep_convolutions:
        classes.update(dict.fromkeys(_CONVOLUTIONS, NEVER))
    return classes


def replayed_conv_may_change_kernel(machine: str) -> bool:
    """Whether a CPU convolution replayed without ``need_backward`` may run
    on another kernel on a CPU of this architecture (``platform.machine()``).
    """
    return machine.lower().startswith(_OTHER_CONV_KERNEL_MACHINES)


_CPU_CLASSES = _cpu_classes(
    replayed_conv_may_change_kernel(platform.machine()))
_CUDA_CLASSES = dict.fromkeys(
    _INDEX_PUTS +
    ('index_add', 'scatter', 'scatter_add', 'embedding_dense_backward',
     'convolution_backward', 'replication_pad1d_backward',
     'replication_pad2d_backward', 'replication_pad3d_backward',
     'max_pool3d_with_indices_backward'), IN_DETERMINISTIC_MODE)
_CUDA_CLASSES.update(
    dict.fromkeys(
        ('index_reduce', 'scatter_reduce', 'histc', 'bincount', 'kthvalue',
         'median', 'nanmedian', 'cumsum', 'put', 'nll_loss2d_forward',
         'nll_loss2d_backward', '_embedding_bag_backward',
         '_embedding_bag_dense_backward', '_ctc_loss_backward', 'max_unpool2d',
         'max_unpool3d', 'avg_pool3d_backward',
         '_adaptive_avg_pool2d_backward', 'adaptive_avg_pool3d_backward',
         '_adaptive_avg_pool3d_backward', 'adaptive_max_pool2d_backward',
         'adaptive_max_pool3d_backward', 'fractional_max_pool2d_backward',
         'fractional_max_pool3d_backward', 'upsample_linear1d_backward',
         'upsample_bilinear2d_backward', '_upsample_bilinear2d_aa_backward',
         'upsample_bicubic2d_backward', '_upsample_bicubic2d_aa_backward',
         'upsample_trilinear3d_backward', 'reflection_pad1d_backward',
         'reflection_pad2d_backward', 'reflection_pad3d_backward',
         'grid_sampler_2d_backward', 'grid_sampler_3d_backward',
         'linalg_lstsq'), NEVER))  # lstsq: as on CPU, unsure (not tested)
#: ``scatter`` with a ``reduce`` argument has no deterministic CUDA kernel
_CUDA_NEVER_OVERLOADS = frozenset({('scatter', 'reduce'),
                                   ('scatter', 'value_reduce'),
                                   ('scatter', 'reduce_out'),
                                   ('scatter', 'value_reduce_out')})


def _determinism(name: str, overload: str) -> Tuple[str, str]:
    """``(on CPU, on CUDA)``: when the op's kernels are deterministic."""
    base = name[:-1] if name.endswith('_') else name  # in-place forms
    cuda = _CUDA_CLASSES.get(base, ALWAYS)
    if (base, overload) in _CUDA_NEVER_OVERLOADS:
        cuda = NEVER
    return _CPU_CLASSES.get(base, ALWAYS), cuda


class OpInfo(NamedTuple):
    """Static facts about one operator overload.

    Attributes:
        arg_names (tuple): Schema argument names, in order.
        written_args (tuple): Indices of arguments written in place and
            returned (in-place and ``out=`` ops).
        side_effect_args (tuple): Indices of arguments written but not
            returned (running statistics of batch norm).
        batch_norm_training_arg (str | None): For batch norm ops, the name
            of the ``training`` flag, or ``''`` when always training.
        replayable (bool): The op can be replayed exactly: an ``aten`` op,
            random ops included (their RNG state is replayed), and no
            undeclared side effects other than those handled above.
        random (bool): Whether the op draws from a random generator.
        fresh_buffer (bool): Whether outputs are fresh buffers (``empty``,
            ``zeros``, ``ones``, ``full`` and their ``_like`` and ``new_``
            forms), recomputable only once overwritten whole.
        full_overwrite (bool): Whether it overwrites ``self`` regardless of
            its prior content.
        cpu_determinism (str): ``ALWAYS``, ``IN_DETERMINISTIC_MODE`` or
            ``NEVER``: when its CPU kernels are bitwise deterministic.
        cuda_determinism (str): The same for its CUDA kernels.
        fresh_returns (bool): Whether no return is alias-annotated, so an
            output whose storage has no other user is a new allocation.
        swaps_storage (bool): Whether the op points ``self`` at another
            storage (``set_``).
        versions_lists (bool): Whether eager autograd bumps the version
            counters of the lists the op writes (in-place ``_foreach_``
            ops); below a dispatch mode their kernels do not.
        lifts_fresh (bool): Whether the op returns its argument, a tensor
            just made outside the dispatcher (``lift_fresh``: ``torch.tensor``
            of a list), whose storage is new when it is resizable (not
            NumPy's memory, R11).
    """
    arg_names: Tuple[str, ...]
    written_args: Tuple[int, ...]
    side_effect_args: Tuple[int, ...]
    batch_norm_training_arg: object
    replayable: bool
    random: bool
    fresh_buffer: bool
    full_overwrite: bool
    cpu_determinism: str
    cuda_determinism: str
    fresh_returns: bool
    swaps_storage: bool
    versions_lists: bool
    lifts_fresh: bool


_CACHE: Dict[object, OpInfo] = {}


def op_info(func) -> OpInfo:
    """Return the cached :class:`OpInfo` of ``func`` (an ``OpOverload``)."""
    info = _CACHE.get(func)
    if info is None:
        info = _CACHE[func] = _classify(func)
    return info


def _alias_sets(alias_info):
    if alias_info is None:
        return frozenset()
    return frozenset(alias_info.before_set)


def _classify(func) -> OpInfo:
    schema = func._schema
    name = schema.name.split('::')[-1]
    args = schema.arguments
    arg_names = tuple(a.name for a in args)
    returned_sets = set()
    for ret in schema.returns:
        returned_sets |= _alias_sets(ret.alias_info)
    written, side_effects = [], []
    unmarked = _UNMARKED_WRITES.get(name)
    for i, arg in enumerate(args):
        if arg.alias_info is not None and arg.alias_info.is_write:
            if _alias_sets(arg.alias_info) & returned_sets:
                written.append(i)
            else:
                side_effects.append(i)
        elif arg.name == unmarked:
            side_effects.append(i)
    bn_arg = _BATCH_NORM_TRAINING_ARG.get(name, False)
    if bn_arg is not False:
        side_effects = [  # none in _native_batch_norm_legit.no_stats
            arg_names.index(n) for n in _RUNNING_STATS if n in arg_names
        ]
    tags = func.tags
    namespace = getattr(func, 'namespace', schema.name.split('::')[0])
    replayable = (
        namespace == 'aten' and (not side_effects or bn_arg is not False))
    if name in ('set_', 'resize_', 'resize_as_', '_resize_output_',
                'record_stream', 'as_strided_', '_local_scalar_dense',
                'lift_fresh'):  # its argument is made outside (R4)
        replayable = False
    if name == 'from_file':  # reads a file by name, which may change (R4)
        replayable = False
    cpu, cuda = _determinism(name, func._overloadname)
    return OpInfo(
        arg_names=arg_names,
        written_args=tuple(written),
        side_effect_args=tuple(side_effects),
        batch_norm_training_arg=bn_arg if bn_arg is not False else None,
        replayable=replayable,
        random=torch.Tag.nondeterministic_seeded in tags,
        fresh_buffer=name.startswith(_FRESH_BUFFER_PREFIXES),
        full_overwrite=name in _FULL_OVERWRITE,
        cpu_determinism=cpu,
        cuda_determinism=cuda,
        fresh_returns=all(r.alias_info is None for r in schema.returns),
        swaps_storage=name == 'set_',
        versions_lists=name.startswith('_foreach_') and bool(side_effects),
        lifts_fresh=name == 'lift_fresh')


def same_bits_on_replay(info: OpInfo, device_types) -> bool:
    """Whether a call of the op gives the same bits when replayed, judged by
    the kernels of each device type it ran on (R4): those of its new outputs
    and written tensors, whatever device the engine meters.

    Args:
        info (OpInfo): The op's facts.
        device_types (Iterable[str]): ``torch.device.type`` of each tensor
            the call allocated or wrote.

    Returns:
        bool: True if every device's kernels replay the same bits now (so
        True for none: the caller builds no recipe then); a device other
        than CPU or CUDA counts as unknown, so not (R4).
    """
    for device_type in device_types:
        if device_type == 'cuda':
            determinism = info.cuda_determinism
        elif device_type == 'cpu':
            determinism = info.cpu_determinism
        else:
            return False
        if determinism != ALWAYS and (
                determinism != IN_DETERMINISTIC_MODE
                or not torch.are_deterministic_algorithms_enabled()):
            return False
    return True


def get_arg(info: OpInfo, args, kwargs, index: int):
    """Return argument ``index`` of a call, positional or keyword."""
    if index < len(args):
        return args[index]
    return kwargs.get(info.arg_names[index])


def batch_norm_in_training(info: OpInfo, args, kwargs) -> bool:
    """Whether a batch norm call updates running stats (training mode)."""
    flag = info.batch_norm_training_arg
    if flag == '':
        return True
    return bool(get_arg(info, args, kwargs, info.arg_names.index(flag)))
