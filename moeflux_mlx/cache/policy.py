"""Eviction policies: the slot bookkeeping of one partially cached layer (which expert sits in
which slot) and the choice of the slots to free for missing experts. Plain numpy: the miss server
process uses them without MLX.

A policy is a class: ``EvictionPolicy`` keeps the bookkeeping, a subclass says which slots are
used (``touch``) and which to free (``victims``). ``POLICIES`` names the two a user
may choose (``LoadOptions.eviction``): ``transition`` (the default), the lowest exponentially
decayed use count (``DecayPolicy``) raised by how often each expert followed the experts of the
call being admitted; and ``lru``, the least recently used, the classic baseline it is measured
against. Ties go to the least recently used. Frequency counts (LFU, LFU with aging), an online
logistic model of the next calls and S3-FIFO were measured too and never beat ``transition``
by more than the noise live; the git history keeps them.

``observe`` teaches a policy calls it did not serve (a prefill that read its layers whole):
what it learns from routing, never which experts are resident.

Every policy frees only slots the call being admitted does not use: ``admit`` marks the call's
hits used at its tick (``now``) before it asks for victims, and no policy picks a slot used at
``now``. ``admit``'s ``keep`` (the experts a speculative pass's later tokens route to, served one
token at a time by the device-side table) holds resident slots the same way, as far as the
call's misses leave room.

With the device-side table, ``slot_of`` is a view into the shared control block
(``cuda.control_block``), read by the GPU, and ``device_last`` another, where the GPU records
each slot's last use by calls that needed no help (the miss server sees every other call). The
GPU's stores to host memory may land late, so the GPU and the host never write the same words: a
slot's last use is the later of the two. Policies that count uses learn of the GPU's at each
admission (``device_used``): a slot whose ``device_last`` moved since it was last looked at, past
the host's own last touch, was used at least once in between. Between two admissions of a layer a
slot's GPU uses count once: at a small budget nearly every call has a miss, so little is lost.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import numpy as np


class EvictionPolicy:
    """Which expert is in which slot of one layer, and which slots to free for missing ones.

    Subclasses implement ``touch`` (slots used at ``tick``), ``victims`` (the ``n`` slots to free:
    free slots first) and ``forget`` (slots freed)."""

    name = "?"

    def __init__(self, num_experts: int, n_slots: int, slot_of: Optional[np.ndarray] = None):
        self.slot_of = slot_of if slot_of is not None else np.full(num_experts, -1, np.int64)
        self.expert_in = np.full(n_slots, -1, np.int64)  # slot -> expert (only the host needs it)
        self.clock = np.zeros(1, np.int64)  # one tick per call (the table's is in the block)
        self.now = 0  # the tick of the call being admitted (set by admit)

    def admit(
        self, experts: np.ndarray, tick: int, keep: Optional[np.ndarray] = None
    ) -> Tuple[np.ndarray, np.ndarray]:
        """Mark the resident ones used; pick and free a victim slot for each missing one.
        Returns (missing, victims).

        ``keep``: experts the next calls are known to route to (the later tokens of a
        speculative pass): those resident are not freed while other slots can be.

        Victims are freed before their new bytes are written: an interrupted write must not
        leave a slot that claims an expert whose bytes never arrived."""
        slots = self.slot_of[experts]
        hit = slots >= 0
        self.now = tick  # the call being admitted: its hits must not be victims
        self.touch(slots[hit], tick)
        missing = experts[~hit]
        if not missing.size:
            return missing, slots[:0]
        if keep is not None:
            self.hold(self._keepable(keep, int(hit.sum()), missing.size), tick)
        victims = self.victims(missing.size)
        old = self.expert_in[victims]
        self.slot_of[old[old >= 0]] = -1
        self.expert_in[victims] = -1
        self.forget(victims)
        return missing, victims

    def _keepable(self, keep: np.ndarray, hits: int, n_missing: int) -> np.ndarray:
        """The slots of ``keep``'s resident experts (``keep``: soonest needed first), the first
        of them, as many as leave ``n_missing`` slots free to take besides the call's
        ``hits``."""
        slots = self.slot_of[keep]
        slots = slots[slots >= 0]
        _, first = np.unique(slots, return_index=True)
        room = self.expert_in.size - hits - n_missing
        return slots[np.sort(first)][: max(room, 0)]

    def hold(self, slots: np.ndarray, tick: int) -> None:
        """Keep ``slots`` from being victims of the call at ``tick``: they look used then (by
        recency; S3-FIFO moves such a slot from its small queue to its main one), but no use is
        counted."""
        raise NotImplementedError

    def assign(self, missing: np.ndarray, victims: np.ndarray, tick: int) -> None:
        """The bytes of ``missing`` are in ``victims`` now."""
        self.slot_of[missing] = victims
        self.expert_in[victims] = missing
        self.touch(victims, tick)

    def release(self, experts: np.ndarray) -> None:
        """Free the slots of ``experts`` (their bytes are not to be trusted)."""
        slots = self.slot_of[experts]
        slots = slots[slots >= 0]
        self.slot_of[experts] = -1
        self.expert_in[slots] = -1
        self.forget(slots)

    def observe(self, rows: np.ndarray, first_tick: int) -> None:
        """Learn from calls that routed without going through the slots: ``rows`` ``[n, k]``,
        the experts of n calls at ticks ``first_tick``, ``first_tick + 1``, ... (a prefill that
        read its layer whole). What a policy learns from routing (use counts, what follows
        what) and nothing about residency: the slots stay as they are. The first row is taken
        to follow no call the policy saw (a prefill's latest rows, not its first). LRU and
        S3-FIFO learn nothing from calls they did not serve."""

    def touch(self, slots: np.ndarray, tick: int) -> None:
        raise NotImplementedError

    def victims(self, n: int) -> np.ndarray:
        raise NotImplementedError

    def forget(self, slots: np.ndarray) -> None:
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently used: free slots first, then the slots whose last use is oldest."""

    name = "lru"

    def __init__(
        self,
        num_experts: int,
        n_slots: int,
        slot_of: Optional[np.ndarray] = None,
        device_last: Optional[np.ndarray] = None,
    ):
        super().__init__(num_experts, n_slots, slot_of)
        self.last_used = np.full(n_slots, -1, np.int64)  # slot -> clock of its last use, -1: free
        self.device_last = device_last
        self.device_seen = np.full(n_slots, -1, np.int64)  # the GPU's last uses counted so far
        self.setup(num_experts, n_slots)

    def setup(self, num_experts: int, n_slots: int) -> None:
        """A subclass's own state, made after LRU's (so subclasses need no constructor)."""

    def touch(self, slots: np.ndarray, tick: int) -> None:
        self.last_used[slots] = tick

    def hold(self, slots: np.ndarray, tick: int) -> None:
        # every policy here skips slots last used at ``now`` (the call's own hits)
        self.last_used[slots] = tick

    def admit(
        self, experts: np.ndarray, tick: int, keep: Optional[np.ndarray] = None
    ) -> Tuple[np.ndarray, np.ndarray]:
        if self.device_last is not None:
            self._fold_device_uses()
        return super().admit(experts, tick, keep)

    def _fold_device_uses(self) -> None:
        assert self.device_last is not None
        seen = np.array(self.device_last)  # one snapshot: the GPU may store into it meanwhile
        # a GPU use no later than the host's last touch is one the host saw (the calls it
        # answered, its occupant's arrival), or the previous occupant's
        fresh = (seen > np.maximum(self.device_seen, self.last_used)) & (self.last_used >= 0)
        slots = np.flatnonzero(fresh)
        self.device_seen[slots] = seen[slots]
        if slots.size:
            self.device_used(slots, seen[slots])

    def device_used(self, slots: np.ndarray, ticks: np.ndarray) -> None:
        """The GPU used ``slots`` (their occupants) at least once, last at ``ticks``, in calls the
        host never saw. LRU needs nothing: ``victims`` reads ``device_last`` itself."""

    def last_uses(self) -> np.ndarray:
        """Each slot's last use, the host's or the GPU's (-1: free)."""
        last = self.last_used
        if self.device_last is not None:
            last = np.maximum(last, self.device_last)
            last[self.last_used < 0] = -1  # freed by the host since: free whatever the GPU saw
        return last

    def victims(self, n: int) -> np.ndarray:
        return np.argpartition(self.last_uses(), n - 1)[:n]

    def forget(self, slots: np.ndarray) -> None:
        self.last_used[slots] = -1


class _CountingPolicy(LRUPolicy):
    """LRU's bookkeeping plus a score per expert; the victims are the lowest scores (free slots
    first, ties by last use)."""

    def setup(self, num_experts: int, n_slots: int) -> None:
        self.count = np.zeros(num_experts, np.float64)  # uses per expert, kept across evictions
        self.setup_scores(num_experts)

    def setup_scores(self, num_experts: int) -> None:
        """A subclass's own per-expert state."""

    def score(self, experts: np.ndarray, tick: int) -> np.ndarray:
        raise NotImplementedError

    def touch(self, slots: np.ndarray, tick: int) -> None:
        super().touch(slots, tick)
        experts = self.expert_in[slots]
        self.used(experts[experts >= 0], tick)

    def used(self, experts: np.ndarray, tick: Union[int, np.ndarray]) -> None:
        """One more use of each of ``experts`` (distinct) at ``tick``, one for all or one each
        (hits, arrivals, the GPU's uses)."""
        self.count[experts] += 1

    def device_used(self, slots: np.ndarray, ticks: np.ndarray) -> None:
        self.used(self.expert_in[slots], ticks)

    def observe(self, rows: np.ndarray, first_tick: int) -> None:
        for i, row in enumerate(rows):  # each call's experts used once, as admit counts them
            self.used(np.unique(row), first_tick + i)

    def victims(self, n: int) -> np.ndarray:
        used = self.expert_in >= 0
        score = np.full(self.expert_in.size, -np.inf)  # free slots first
        score[used] = self.score(self.expert_in[used], self.now)
        score[self.last_used == self.now] = np.inf  # this call's hits stay (admit touched them)
        order = np.lexsort((self.last_uses(), score))  # by score, then oldest use
        return order[:n]


class DecayPolicy(_CountingPolicy):
    """The lowest use count decayed exponentially with a half-life of ``half_life`` calls."""

    name = "decay"
    half_life = 32.0  # calls; the best compromise over the trained demo's replayed routing

    def setup_scores(self, num_experts: int) -> None:
        self.at = np.zeros(num_experts, np.int64)  # the call each count was last brought up to

    def used(self, experts: np.ndarray, tick: Union[int, np.ndarray]) -> None:
        gap = tick - self.at[experts]
        if np.ndim(tick) == 0 and not (gap < 0).any():  # the host's own uses: in order
            self.count[experts] = self.count[experts] * np.exp2(-gap / self.half_life) + 1.0
            self.at[experts] = tick
            return
        # a late-counted GPU use (tick before ``at``) adds its weight at that tick
        late = gap < 0
        self.count[experts] *= np.where(late, 1.0, 0.5 ** (np.maximum(gap, 0) / self.half_life))
        self.count[experts] += np.where(late, 0.5 ** (-gap / self.half_life), 1.0)
        self.at[experts] = np.maximum(self.at[experts], tick)

    def score(self, experts: np.ndarray, tick: int) -> np.ndarray:
        return self.count[experts] * 0.5 ** ((tick - self.at[experts]) / self.half_life)

    def observe(self, rows: np.ndarray, first_tick: int) -> None:
        # what ``used`` once a row would leave, at once: every count brought to the last tick,
        # each use weighted by its age then, then back to each expert's own last use
        if not len(rows):
            return
        routed = _routed(rows, self.count.size)
        last = first_tick + len(rows) - 1
        ages = np.arange(len(rows) - 1, -1, -1)
        uses = np.exp2(-ages / self.half_life) @ routed
        last_use = last - np.argmax(routed[::-1], axis=0)  # each expert's last row
        e = np.flatnonzero(routed.any(axis=0))
        now = self.count[e] * np.exp2((self.at[e] - last) / self.half_life) + uses[e]
        self.count[e] = now * np.exp2((last - last_use[e]) / self.half_life)
        self.at[e] = last_use[e]


class TransitionPolicy(DecayPolicy):
    """Decayed counts plus what tends to follow the call being admitted: an expert's score is
    its decayed count plus ``weight x half_life x`` the estimated chance that the layer's next
    call routes it, given this call's experts.

    The estimate is the mean, over this call's experts ``c``, of how often ``e`` was routed by
    the call right after one that routed ``c`` (``pairs[c, e] / calls[c]``), counted with a
    half-life of ``pair_half_life`` calls. Decayed counts alone say which experts a layer uses
    often; the pairs add which of them the current context calls next. Each row is decayed only
    when it is counted again (both of its terms by the same factor, so the ratio needs no decay
    when read): ``num_experts ** 2`` float32 per layer, O(k x num_experts) per call."""

    name = "transition"
    weight = 4.0  # both the best over the trained demo's replayed routing
    pair_half_life = 512.0

    def setup_scores(self, num_experts: int) -> None:
        super().setup_scores(num_experts)
        self.pairs = np.zeros((num_experts, num_experts), np.float32)
        self.calls = np.zeros(num_experts, np.float32)
        self.pairs_at = np.zeros(num_experts, np.int64)  # the call each row was decayed to
        self.previous: Optional[np.ndarray] = None  # the experts of the last call admitted
        self.follows: Optional[np.ndarray] = None  # [num_experts] for the call being admitted
        self.current = np.zeros(0, np.int64)  # the experts of the call being admitted

    def admit(
        self, experts: np.ndarray, tick: int, keep: Optional[np.ndarray] = None
    ) -> Tuple[np.ndarray, np.ndarray]:
        self._learn_call(experts, tick)
        self.current, self.follows = experts, None  # worked out if a victim is asked for
        try:
            return super().admit(experts, tick, keep)
        finally:
            self.previous = np.array(experts)

    def observe(self, rows: np.ndarray, first_tick: int) -> None:
        super().observe(rows, first_tick)
        if not len(rows):
            return
        # what ``_learn_call`` once a row would leave, at once: each row of ``pairs`` that gains
        # is brought to the last tick (pairs and calls by the same factor: their ratio is what
        # is read), each pair weighted by its age then. The first row leads no pair.
        routed = _routed(rows, self.calls.size)
        ages = np.arange(len(rows) - 2, -1, -1)  # of rows 1.., each led by the row before it
        lead = routed[:-1] * np.exp2(-ages / self.pair_half_life).astype(np.float32)[:, None]
        c = np.flatnonzero(lead.any(axis=0))
        last = first_tick + len(rows) - 1
        share = np.exp2((self.pairs_at[c] - last) / self.pair_half_life).astype(np.float32)
        self.pairs[c] = self.pairs[c] * share[:, None] + lead[:, c].T @ routed[1:]
        self.calls[c] = self.calls[c] * share + lead[:, c].sum(axis=0)
        self.pairs_at[c] = last
        self._learn_rows(rows, first_tick)
        self.previous = np.unique(rows[-1])
        self.current, self.follows = np.zeros(0, np.int64), None

    def _learn_rows(self, rows: np.ndarray, first_tick: int) -> None:
        """A subclass's own learning from observed rows (the first following no call it
        saw)."""

    def _learn_call(self, experts: np.ndarray, tick: int) -> None:
        """A call routed ``experts`` (unique) at ``tick``, after ``previous``'s call: count what
        followed what."""
        prev = self.previous
        if prev is not None and prev.size:
            share = np.exp2((self.pairs_at[prev] - tick) / self.pair_half_life).astype(np.float32)
            rows = self.pairs[prev] * share[:, None]
            rows[:, experts] += 1.0
            self.pairs[prev] = rows
            self.calls[prev] = self.calls[prev] * share + 1.0
            self.pairs_at[prev] = tick

    def score(self, experts: np.ndarray, tick: int) -> np.ndarray:
        base = super().score(experts, tick)
        if not self.current.size:
            return base
        if self.follows is None:
            self.follows = self._follows(self.current)
        return base + self.follows[experts]

    def _follows(self, cur: np.ndarray) -> np.ndarray:
        """What each expert's score gains from ``cur``, the call being admitted (once a call)."""
        rows = self.pairs[cur] / np.maximum(self.calls[cur], 1e-6)[:, None]
        return (self.weight * self.half_life / cur.size) * rows.sum(axis=0)


def _routed(rows: np.ndarray, num_experts: int) -> np.ndarray:
    """``[n, num_experts]`` float32: 1 where row i routed expert e."""
    rows = np.asarray(rows, np.int64).reshape(len(rows), -1)
    out = np.zeros((len(rows), num_experts), np.float32)
    out[np.arange(len(rows))[:, None], rows] = 1.0
    return out


# the choices of ``LoadOptions.eviction``; ``DecayPolicy`` is the base of ``transition``
POLICIES = {p.name: p for p in (TransitionPolicy, LRUPolicy)}
