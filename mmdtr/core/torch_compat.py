"""What the engine and the techniques read that PyTorch 2.4 lacks.

mmdtr runs on PyTorch >= 2.4. A few things it reads were added later; each
is read here, with what stands in for it on an older release. Two version
gates of behaviour stay beside the code they guard:
``WEIGHTS_ONLY_BY_DEFAULT`` (:mod:`mmdtr.adapters.checkpoint_loading`) and
``_COMPILED_STATS_ONCE`` (:mod:`mmdtr.techniques.activation_checkpointing`).
"""
from typing import Optional

import torch
import torch.utils.checkpoint as _checkpoint

#: ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` and
#: ``CheckpointPolicy`` (PyTorch >= 2.5; 2.4 has a private, compile-only
#: predecessor), or ``None``: selective policies are then refused.
create_selective_checkpoint_contexts = getattr(
    _checkpoint, 'create_selective_checkpoint_contexts', None)
CheckpointPolicy = getattr(_checkpoint, 'CheckpointPolicy', None)


def _storage_object_uses() -> int:
    """What a storage's own Python object adds to its use count while no
    Python name references the object (R3). On PyTorch 2.13 the object
    holds the storage: 1. On 2.4 the storage owns its object then, which
    holds it only while Python references it: 0."""
    t = torch.empty(1)
    t.untyped_storage()  # its Python object made, then unreferenced
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1


#: Uses of a storage its Python object adds while unreferenced (R3).
STORAGE_OBJECT_USES = _storage_object_uses()

_top_hooks = getattr(torch._C._autograd, '_top_saved_tensors_default_hooks',
                     None)


def can_read_saved_tensor_hooks() -> bool:
    """Whether this PyTorch reads the saved-tensor hooks in force without
    running them (2.8 and later: ``_top_saved_tensors_default_hooks``)."""
    return _top_hooks is not None


def hooks_on_top(pack_hook) -> Optional[bool]:
    """Whether ``pack_hook`` is the pack hook of the saved-tensor hooks in
    force on this thread; ``None`` where PyTorch does not tell (before
    2.8)."""
    if _top_hooks is None:
        return None
    top = _top_hooks(False)
    return top is not None and top[0] is pack_hook


def outer_saved_tensor_hooks() -> Optional[str]:
    """Whether a ``saved_tensors_hooks`` context is active on this thread.

    PyTorch 2.8 and later tell (``_top_saved_tensors_default_hooks``).
    PyTorch 2.4 to 2.7 do not, so a tensor is saved for
    backward by a tiny op, and its saved value is asked to take hooks:
    autograd refuses a second pair when the context's were set at the save.
    That runs the context's pack hook once on a one-element tensor.

    Returns:
        str | None: ``None`` when no such context is active; else the name
        of its pack hook (``'unknown'`` on PyTorch 2.4 to 2.7).
    """
    if _top_hooks is not None:
        top = _top_hooks(False)
        if top is None:
            return None
        return getattr(top[0], '__qualname__', repr(top[0]))
    return 'unknown' if _hooks_set_at_save() else None


def _hooks_set_at_save() -> bool:
    """PyTorch 2.4 to 2.7: whether a tensor saved now gets default hooks."""
    with torch._C._DisableTorchDispatch(), torch.enable_grad(), \
            torch.inference_mode(False):
        x = torch.ones(1, requires_grad=True)
        y = x * x
    try:
        y.grad_fn._raw_saved_self.register_hooks(_same, _same)
    except RuntimeError as e:
        if 'already been set' in str(e):
            return True
        raise
    return False


def _same(value):
    return value
