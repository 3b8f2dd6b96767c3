"""Replay: rebuilding a storage, exactly, from its recipe.

The replay half of :class:`~mmdtr.core.engine.EngineState` (one state
object per engine; this mixin only groups its methods). Rules R4 and R6 of
docs/design.md.
"""

import torch

from mmdtr.errors import MmdtrError
from .backend_flags import switched_to
from .op_semantics import op_info
from .rebuild_memo import read_once, reads_in_a_rebuild, shrank
from .recipe_refs import HeldRef, RecordRef, ScratchRef, SelfRef
from .recipes import AllocNode
from .records import detached_alias, view_meta, view_of
from .replay_settings import (NON_BLOCKING_COPIES, blocking, outside_vmap,
                              recorded_default_dtype)
from .unseen_writes import (reach, shrunk, shrunk_unseen,
                            stale_after_unseen_write, unseen_write)

Tensor = torch.Tensor

_TAKING_GENERATOR = {}


def _taking_generator(func):
    """``func``, or its overload with the same arguments plus a keyword-only
    ``generator`` (``randn.generator`` for ``randn.default``); ``None`` if
    there is none."""
    if func in _TAKING_GENERATOR:
        return _TAKING_GENERATOR[func]
    found = func if 'generator' in op_info(func).arg_names else None
    wanted = [(a.name, str(a.type)) for a in func._schema.arguments]
    packet = func.overloadpacket
    for name in packet.overloads() if found is None else ():
        other = getattr(packet, name)
        args = other._schema.arguments
        if [(a.name, str(a.type))
                for a in args if a.name != 'generator'] == wanted \
                and any(a.name == 'generator' and a.kwarg_only
                        for a in args):
            found = other
            break
    _TAKING_GENERATOR[func] = found
    return found


class Replayer:
    """Rebuilds storages by replaying recipes; mixed into ``EngineState``.

    Uses the state's accounting (``_register``, ``_meter_replay_outputs``),
    eviction (``evict_until``) and ``_run``.
    """

    @staticmethod
    def _capture_rng(args, kwargs):
        gen = kwargs.get('generator')
        if gen is None:  # positional in some schemas (poisson, _fused_dropout)
            gen = next((a for a in args if isinstance(a, torch.Generator)),
                       None)
        if gen is not None:
            return gen, gen.get_state()
        # the device the op draws on: its device= keyword if given (the
        # first tensor's was taken over it: randint_like(cpu_t,
        # device='cuda') drew on CUDA and replayed from the CPU's state;
        # found by a review), and an unindexed 'cuda' as it is now
        device = kwargs.get('device')
        if device is None:
            device = next((a.device for a in args if isinstance(a, Tensor)),
                          None)
        if device is not None and torch.device(device).type == 'cuda':
            device = torch.device(device)
            if device.index is None:
                device = torch.device('cuda', torch.cuda.current_device())
            return ('cuda', device), torch.cuda.get_rng_state(device)
        return None, torch.get_rng_state()

    def materialize(self, rec, version):
        """Return ``rec``'s storage at ``version``, recomputing if needed
        (also if it is resident but shrank below the dispatcher, R13).

        A rebuild rebuilds the evicted inputs it reads first, theirs before
        them, in the order a recursion would; but each rebuild is a
        generator that asks for its inputs (``yield``) and this loop keeps
        them on a stack of its own, so no chain is too long for Python's
        stack or a thread's C stack (a recursion overflowed them at 4000
        ops, and a 256 KiB C stack at 600, R6).
        """
        storage, stale = self._at_hand(rec, version, False)
        if storage is not None:
            return storage
        # one frame per rebuild in progress (_rebuild_frame). The storage
        # asked for is appended to the request, which the steps pop: this
        # loop holds none while a rebuild runs, so an eviction frees what
        # it evicts
        stack = [self._rebuild_frame(rec, version, stale)]
        error = frame = wanted = None
        try:
            while True:
                frame = stack[-1]
                try:
                    if error is None:
                        wanted = frame[0].send(None)
                    else:
                        wanted = frame[0].throw(error)
                except StopIteration as done:
                    stack.pop()
                    if not stack:
                        return done.value
                    stack[-1][1].append(done.value)
                    continue
                except BaseException as e:  # raised by the steps: they are
                    stack.pop()  # done; to the rebuild that asked (R6)
                    if not stack:
                        raise
                    error = e
                    continue
                error, frame[1] = None, wanted
                try:
                    storage, wanted[2] = self._at_hand(*wanted)
                except BaseException as e:  # to the steps that asked
                    error = e
                    continue
                if storage is None:
                    stack.append(self._rebuild_frame(*wanted))
                else:
                    wanted.append(storage)
                    storage = None
        finally:
            # an exception escaping this loop (KeyboardInterrupt between
            # two sends) closes the rebuilds left, innermost first, as the
            # recursion unwound; nor do its locals hold the error, whose
            # traceback holds them (a cycle), or a storage
            error = frame = wanted = storage = None
            while stack:
                stack.pop()[0].close()

    def _rebuild_frame(self, rec, version, stale):
        """A frame of :meth:`materialize`'s stack: ``[the rebuild's steps,
        the request they yielded last, the record's storage now]`` (at
        another version, or stale: held while it is rebuilt, as the
        recursion held it)."""
        return [self._rebuild_steps(rec, version, stale), None, rec.storage()]

    def _at_hand(self, rec, version, stale):
        """``(storage, stale)``: ``rec``'s storage at ``version`` if it
        needs no rebuild (resident, or rebuilt earlier in this rebuild),
        else ``None``; ``stale`` also when it shrank."""
        storage = rec.storage()
        if shrank(rec, storage):  # below the dispatcher: rebuilt for this
            # use, as a storage written after the scope is (R13)
            if not rec.recomputable(version):
                raise shrunk_unseen(f'a storage of {rec.nbytes} bytes',
                                    storage.nbytes(), rec.nbytes)
            stale = True
        memo = self.rebuilt
        if storage is not None and rec.version == version and not stale:
            rec.last_access = self.clock
            if memo:  # a read of what this rebuild keeps, if it does (R4)
                read_once(memo, (rec, version))
            return storage, stale
        if memo is not None and not stale:
            kept = read_once(memo, (rec, version))
            if kept is not None:
                return kept, stale  # rebuilt earlier in this rebuild (R4)
        return None, stale

    def _rebuild_steps(self, rec, version, stale):
        """Rebuild ``rec`` at ``version``: a generator that yields a list
        ``[record, version, stale]`` for each storage it reads, finds that
        storage appended to it when resumed, and returns the rebuilt one
        (see :meth:`materialize`)."""
        memo, key = self.rebuilt, (rec, version)
        if not rec.recomputable(version):
            raise MmdtrError(
                f'cannot rebuild a storage of {rec.nbytes} bytes at version '
                f'{version} (recomputable: {rec.lo}..{rec.hi}).',
                'This is an engine bug (rule R7 should have kept it); '
                'please report it with the model.')
        try:
            if memo is None:  # the outermost rebuild keeps what it rebuilds
                self.rebuilt, self.rebuilding = {}, set()
            elif not stale and not self.thrashing:
                # a storage rebuilt twice in one rebuild: it thrashes (R4)
                self.thrashing = key in self.rebuilding
                self.rebuilding.add(key)
            with outside_vmap():
                storage = yield from self._replay_recipe(rec, version)
        finally:
            if memo is None:
                self.rebuilt = self.rebuilding = None
                self.thrashing = False
        if memo is not None and not stale:
            # kept for the reads still to come: one read each recipe
            # argument that reads it (the one that asked has it); a link
            # read once is let go after that read (R4)
            reads = reads_in_a_rebuild(rec) - 1
            if reads > 0:
                memo[key] = [storage, reads]
        rec.last_access = self.clock  # just rebuilt: fresh, not stale
        if version == rec.version and not rec.resident:
            self._register(storage, storage._cdata, rec)
            rec.leave_evicted_class()
            rec.remat_count += 1
            self.recomputations += 1
            if rec.handles:  # the engine's alias of the whole storage,
                # keyed apart from the saved views' metas (R10)
                whole = (torch.uint8, (rec.nbytes, ), (1, ), 0)
                rec.views[None] = view_of(storage, whole, rec.device)
                self._add_candidate(rec)
        return storage

    def _replay_recipe(self, rec, version):
        """Replay ``rec``'s creator and its writes up to ``version`` into a
        new storage; steps as :meth:`_rebuild_steps`'s."""
        creator = rec.creator
        if isinstance(creator, AllocNode):
            with torch._C._DisableTorchDispatch():
                out = torch.empty(
                    creator.nbytes, dtype=torch.uint8, device=creator.device)
            self._meter_replay_outputs(torch.ops.aten.empty.memory_format, out)
            storage = out.untyped_storage()
        else:
            out = yield from self._replay(creator, None)
            outs = out if isinstance(out, (tuple, list)) else (out, )
            storage = outs[rec.out_index].untyped_storage()
        if storage.nbytes() != rec.recipe_nbytes:
            raise MmdtrError(
                f'replaying {creator.func} gave {storage.nbytes()} bytes, '
                f'not {rec.recipe_nbytes}.',
                'Please report it with the model.')
        for node in rec.mutations[:version - rec.base]:
            yield from self._replay(node, storage)
        return storage

    def _replay(self, node, self_storage):
        resolve = self._resolve
        args = []
        for a in node.args:
            args.append((yield from resolve(a, self_storage)))
        args = tuple(args)
        kwargs = {}
        for k, v in node.kwargs.items():
            kwargs[k] = yield from resolve(v, self_storage)
        if node.func in NON_BLOCKING_COPIES:
            args, kwargs = blocking(node.func, args, kwargs)
        # as recorded: below the dispatch mode, after autocast (the recorded
        # op is the cast one), and in grad mode (some ops return other
        # outputs without it: mkldnn_rnn_layer's workspace); no argument
        # requires grad, so no graph is built; under the default dtype and
        # the backend switches of the call (R4)
        with torch.enable_grad(), torch._C._DisableTorchDispatch(), \
                torch._C._DisableAutocast(), \
                recorded_default_dtype(node.default_dtype), \
                switched_to(node.switches):
            if node.rng is None:
                out = self._run(node.func, args, kwargs)
            else:
                out = self._run_with_rng(node, args, kwargs)
        self.clock += 1
        self._meter_replay_outputs(node.func, out)
        memory = self.memory_after_op()
        if memory is not None and self.limit is not None \
                and memory > self.limit:
            del args, kwargs  # inputs we no longer need may go
            self.evict_until()
        return out

    def _resolve(self, a, self_storage):
        """An argument of a replayed call, from its reference: a generator
        that yields ``[record, version, stale]`` for a storage it needs
        (see :meth:`_rebuild_steps`)."""
        if isinstance(a, RecordRef):
            rec = a.record
            stale = rec.version == a.version and stale_after_unseen_write(
                rec, rebuildable=True)
            wanted = [rec, a.version, stale]
            yield wanted  # materialize appends the storage
            return view_of(wanted.pop(), a.meta, rec.device)
        if isinstance(a, HeldRef):
            if a.record is not None:
                stale_after_unseen_write(a.record, rebuildable=False)
            if a.tracked is not None:
                stale_after_unseen_write(a.tracked, rebuildable=False)
            if a.current_version() != a.version:
                raise unseen_write(a.tensor.shape, a.version,
                                   a.current_version())
            t = a.tensor
            if a.cdata is not None and t.untyped_storage()._cdata != a.cdata:
                raise MmdtrError(
                    f'a tensor of shape {tuple(t.shape)} that DTR may still '
                    'need to recompute from got another storage '
                    '(tensor.data = ...) during the step.',
                    'write into it in place (tensor.data.copy_(...)), or '
                    'swap it outside the DTR scope.')
            if shrunk(t):  # freed below the dispatcher (R13)
                raise shrunk_unseen(f'a tensor of shape {tuple(t.shape)}',
                                    t.untyped_storage().nbytes(),
                                    reach(view_meta(t)))
            return detached_alias(t) if t.requires_grad else t
        if isinstance(a, SelfRef):
            return view_of(self_storage, a.meta, self_storage.device)
        if isinstance(a, ScratchRef):
            with torch._C._DisableTorchDispatch():
                return a.tensor.clone()
        if isinstance(a, (list, tuple)):
            items = []
            for b in a:
                items.append((yield from self._resolve(b, self_storage)))
            return type(a)(items)
        return a

    def _run_with_rng(self, node, args, kwargs):
        gen, state = node.rng
        func = _taking_generator(node.func) if gen is None else None
        if func is not None:
            # it drew from the default CPU generator: the replay draws from
            # a private copy of that state (through the overload that takes
            # a generator: randn.generator for randn.default), so neither
            # the default stream nor another thread drawing from it
            # meanwhile is touched (R6)
            private = torch.Generator()
            private.set_state(state)
            index = op_info(func).arg_names.index('generator')
            if index < len(args):
                args = (*args[:index], private, *args[index + 1:])
            else:
                kwargs = dict(kwargs, generator=private)
            return self._run(func, args, kwargs, (private, state))
        saved = self._set_rng(node.rng)
        try:
            return self._run(node.func, args, kwargs, node.rng)
        finally:  # the global stream never shifts (R6)
            self._set_rng(saved)

    @staticmethod
    def _set_rng(rng):
        """Set a generator to a state from :meth:`_capture_rng`; return its
        state before, in the same form."""
        gen, state = rng
        if gen is None:
            saved = torch.get_rng_state()
            torch.set_rng_state(state)
        elif isinstance(gen, tuple):
            saved = torch.cuda.get_rng_state(gen[1])
            torch.cuda.set_rng_state(state, gen[1])
        else:
            saved = gen.get_state()
            gen.set_state(state)
        return gen, saved
