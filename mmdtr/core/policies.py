"""Eviction policies: pure scoring functions of a record and the clock.

A policy never mutates anything; the engine calls :meth:`score` on
candidates and evicts the one with the lowest score (rule R8 of
docs/design.md). New policies subclass :class:`EvictionPolicy` and are
registered in :data:`POLICIES` under a name.
"""
from typing import Dict, Type

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
        return policy
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]()
    raise MmdtrError(
        f'policy={policy!r} is not an eviction policy.',
        f'Use one of {sorted(POLICIES)} or an EvictionPolicy instance.')
