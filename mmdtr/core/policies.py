"""Eviction policies: pure scoring functions of a record and the clock.

A policy changes no state of the engine's; the engine calls :meth:`score`
on candidates and evicts the one with the lowest score (rule R8 of
docs/design.md). (``evicted_neighborhood_cost()`` compresses the union-find
paths it walks: the engine's own cache, the same classes and costs after.)
New policies subclass :class:`EvictionPolicy`; :func:`register_policy`
makes one reachable by name, from ``DTR(policy=...)`` and from the ``dtr``
config key.
"""
import inspect
import math
import numbers
from typing import Dict, Optional, Type

from mmdtr.errors import MmdtrError


class EvictionPolicy:
    """Base class. Lower score = evicted first.

    A record offers: ``nbytes``, ``cost`` (FLOP-equivalents to recompute it
    from its inputs), ``last_access`` (clock of the last use),
    ``remat_count`` (times recomputed) and ``evicted_neighborhood_cost()``
    (cost of the evicted equivalence classes around it, DTR's e*).

    Attributes:
        name (str): The name it is registered under.
        uses_evicted_classes (bool): Whether :meth:`score` reads
            ``evicted_neighborhood_cost()``. The engine keeps DTR's evicted
            equivalence classes only for policies that do (keeping them
            costs time near the memory floor, R8); a subclass that does not
            read them may set it to False.
    """

    name = 'base'
    uses_evicted_classes = True

    def score(self, record, clock: int) -> float:
        """Score one eviction candidate; the lowest is evicted first.

        Called above the threshold on each candidate (or on about sqrt(N)
        of them with ``enable_sqrt_sampling``), while the engine's lock is
        held: read the record, change nothing, raise nothing.

        Args:
            record (StorageRecord): A resident storage at least
                ``evictee_minimum_size`` large (scored before the engine
                checks that nothing else holds it, R3); read its
                ``nbytes``, ``cost``, ``last_access``, ``remat_count`` and
                ``evicted_neighborhood_cost()``.
            clock (int): The engine's clock now (it counts the ops run in
                scope, rebuilds included).

        Returns:
            float: The score; ties go to the candidate scored first, and a
            candidate scored ``inf`` or NaN is never evicted.
        """
        raise NotImplementedError


class DTRPolicy(EvictionPolicy):
    """DTR's heuristic with MegEngine's recompute penalty.

    ``score = (cost + e*) * (1 + penalty * remat_count)
    / (nbytes * staleness)``, with staleness ``clock - last_access + 1``
    and e* from the union-find classes of the evicted neighbourhood.

    Args:
        recompute_penalty (float): Weight of the penalty on tensors already
            recomputed. Defaults to 1.0.
    """

    name = 'dtr'

    def __init__(self, recompute_penalty: float = 1.0):
        if not _finite_at_least_0(recompute_penalty):
            # nan or inf made every score NaN: nothing was evicted (found
            # by an adversarial search)
            raise MmdtrError(
                f'{type(self).__name__}(recompute_penalty='
                f'{recompute_penalty!r}) is not accepted: a finite int or '
                'float, 0 or more.',
                "e.g. 1.0 (the default, MegEngine's); 0 turns "
                'the penalty off.')
        self.recompute_penalty = recompute_penalty

    def score(self, record, clock: int) -> float:
        cost = record.cost + record.evicted_neighborhood_cost()
        cost *= 1.0 + self.recompute_penalty * record.remat_count
        staleness = clock - record.last_access + 1
        return cost / (record.nbytes * staleness)


class LocalDTRPolicy(DTRPolicy):
    """DTR's heuristic without the neighbourhood term (cheaper, local)."""

    name = 'dtr_local'
    uses_evicted_classes = False

    def score(self, record, clock: int) -> float:
        cost = record.cost * (1.0 +
                              self.recompute_penalty * record.remat_count)
        return cost / (record.nbytes * (clock - record.last_access + 1))


class LRUPolicy(EvictionPolicy):
    """Evict the least recently used storage."""

    name = 'lru'
    uses_evicted_classes = False

    def score(self, record, clock: int) -> float:
        return float(record.last_access)


class LargestFirstPolicy(EvictionPolicy):
    """Evict the largest storage."""

    name = 'largest'
    uses_evicted_classes = False

    def score(self, record, clock: int) -> float:
        return -float(record.nbytes)


POLICIES: Dict[str, Type[EvictionPolicy]] = {
    cls.name: cls
    for cls in (DTRPolicy, LocalDTRPolicy, LRUPolicy, LargestFirstPolicy)
}


def register_policy(cls: Optional[Type[EvictionPolicy]] = None,
                    *,
                    force: bool = False):
    """Register a policy class in :data:`POLICIES` under its ``name``.

    Use it as a class decorator (``@register_policy`` or
    ``@register_policy(force=True)``). The name is then accepted wherever a
    built-in policy's is: ``DTR(policy=name)`` and the ``dtr`` config key,
    in every process that imported the class (a config's
    ``custom_imports``).

    Args:
        cls (type, optional): A subclass of :class:`EvictionPolicy` that
            implements ``score`` and sets a ``name`` of its own.
        force (bool): Replace a policy registered under the same name
            (a built-in one too). Defaults to False.

    Returns:
        type: ``cls``, or a decorator when ``cls`` is not given.

    Raises:
        MmdtrError: If ``cls`` is not such a subclass, or its name is
            taken and ``force`` is False.

    Examples:
        >>> @register_policy
        ... class Newest(EvictionPolicy):
        ...     name = 'newest'
        ...     uses_evicted_classes = False
        ...     def score(self, record, clock):
        ...         return -float(record.last_access)
        >>> # dtr = dict(eviction_threshold='5GB', policy='newest')
    """
    if cls is None:
        return lambda klass: register_policy(klass, force=force)
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise MmdtrError(
            f'register_policy({cls!r}): not a subclass of EvictionPolicy.',
            'Subclass mmdtr.dtr.EvictionPolicy and implement '
            'score(record, clock).')
    name = cls.__dict__.get('name')
    if 'name' not in cls.__dict__:
        raise MmdtrError(
            f'register_policy({cls.__name__}): the class sets no name of '
            f'its own (name={getattr(cls, "name", None)!r} is inherited).',
            f"Give it a class attribute, e.g. name = "
            f"'{cls.__name__.lower()}'.")
    if not isinstance(name, str) or not name:
        raise MmdtrError(
            f'register_policy({cls.__name__}): name={name!r} is not '
            'accepted: a non-empty str.',
            f"e.g. name = '{cls.__name__.lower()}'.")
    if cls.score is EvictionPolicy.score:
        raise MmdtrError(
            f'register_policy({cls.__name__}): it does not implement '
            'score(record, clock).', 'Override score in the class.')
    try:
        inspect.signature(cls).bind()
    except TypeError:
        # a name builds it with no arguments: a raw TypeError came from
        # DTR(policy=name) (found by a review)
        raise MmdtrError(
            f'register_policy({cls.__name__}): it cannot be built without '
            'arguments, as a name builds it.',
            'Give its arguments defaults, or pass an instance to '
            'DTR(policy=...).') from None
    # on an instance, as a name builds it: a callable object, a partial or
    # a property as score are bound there, not on the class (a review)
    _check_score(f'register_policy({cls.__name__})', cls().score)
    if name in POLICIES and POLICIES[name] is not cls and not force:
        raise MmdtrError(
            f'register_policy({cls.__name__}): the name {name!r} is taken '
            f'by {POLICIES[name].__name__}.',
            'Choose another name, or pass force=True to replace it.')
    POLICIES[name] = cls
    return cls


def keeps_evicted_classes(policy) -> bool:
    """Whether the engine keeps DTR's evicted classes for ``policy``: unless
    it says it does not read e* (``uses_evicted_classes = False``) on the
    instance, or on the class that defines its ``score`` or a subclass of
    it. A subclass of ``LocalDTRPolicy`` whose own ``score`` reads e* keeps
    them (R8)."""
    if 'uses_evicted_classes' in vars(policy):
        return bool(policy.uses_evicted_classes)
    for klass in type(policy).__mro__:
        declares = 'uses_evicted_classes' in vars(klass)
        if declares:
            return bool(klass.uses_evicted_classes)
        if 'score' in vars(klass):
            return True  # a score written without saying: it may read e*
    return True


def build_policy(policy) -> EvictionPolicy:
    """Return a policy from a name in :data:`POLICIES` or an instance.

    Args:
        policy (str | EvictionPolicy): A registered name (a new instance
            of its class is built), or an instance (returned as it is).

    Returns:
        EvictionPolicy: The policy the engine scores with.

    Raises:
        MmdtrError: If ``policy`` is neither, or is an instance whose
            ``score`` is the base class's (not implemented).
    """
    if isinstance(policy, EvictionPolicy):
        if getattr(policy.score, '__func__', None) is EvictionPolicy.score:
            name = type(policy).__name__
            raise MmdtrError(
                f'policy={name}() does not implement score(record, clock); '
                'EvictionPolicy is an abstract base class.',
                f'Override score in a subclass, or use one of '
                f'{sorted(POLICIES)}.')
        _check_score(f'policy={type(policy).__name__}()', policy.score)
        return policy
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]()
    raise MmdtrError(
        f'policy={policy!r} is not an eviction policy.',
        f'Use one of {sorted(POLICIES)} (names registered with '
        'register_policy) or an EvictionPolicy instance.')


def _check_score(owner: str, score) -> None:
    """Refuse an instance's ``score`` that cannot be called as
    ``score(record, clock)``; it failed at the first eviction, out of
    whatever op ran (found by an adversarial search)."""
    try:
        inspect.signature(score).bind(None, 0)
    except (TypeError, ValueError):
        raise MmdtrError(
            f'{owner}: score={score!r} cannot be called as '
            'score(record, clock).',
            'Define def score(self, record, clock) -> float in the '
            'class.') from None


def policy_failed(policy, error: Exception) -> MmdtrError:
    """The error for ``policy``'s ``score``, which raised ``error`` or
    returned what does not compare with a float: out of an op's eviction,
    a ``TypeError`` became the op's own (``unsupported operand type(s)
    for @``; found by an adversarial search)."""
    return MmdtrError(
        f'the eviction policy {type(policy).__name__} (name='
        f'{getattr(policy, "name", None)!r}) failed to score a storage: '
        f'{type(error).__name__}: {error}',
        'score(record, clock) must return a float (lower is evicted '
        'first; inf or NaN never) and raise nothing.')


def _finite_at_least_0(value) -> bool:
    """Whether ``value`` is a real number (not a bool) a float can hold,
    finite and not negative."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and value >= 0
    except OverflowError:  # an int beyond any float
        return False
