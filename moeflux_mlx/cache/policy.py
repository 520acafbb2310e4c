"""Eviction policies: the slot bookkeeping of one partially cached layer (which expert sits in
which slot) and the choice of the slots to free for missing experts. Plain numpy: the miss server
process uses them without MLX.

A policy is a class: ``EvictionPolicy`` keeps the bookkeeping, a subclass says which slots are
used (``touch``) and which to free (``victims``). ``POLICIES`` names them (``LoadOptions
.eviction``): ``lru`` evicts the least recently used; ``lfu`` the least frequently used (use counts
kept across evictions); ``lfuda`` LFU with dynamic aging (an expert's priority is its count plus
the priority of the last one evicted, so old fame fades); ``decay`` the lowest exponentially
decayed use count; ``transition`` (the default) decayed counts raised by how often each expert
followed the experts of the call being admitted (``TransitionPolicy``); ``logistic`` that plus
an online logistic model of the next two calls (``LogisticPolicy``); ``s3fifo`` S3-FIFO,
scan-resistant (``S3FIFOPolicy``). Ties go to the least recently used. ``docs/routing.md`` has
the replayed and live miss counts that chose the default.

``observe`` teaches a policy calls it did not serve (a prefill that read its layers whole,
``LoadOptions.prefill_learns``): what it learns from routing, never which experts are resident.

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

from collections import OrderedDict, deque
from typing import Deque, Optional, Tuple, Union

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


class LFUPolicy(_CountingPolicy):
    """Least frequently used: the fewest uses so far (ties: least recently used)."""

    name = "lfu"

    def score(self, experts: np.ndarray, tick: int) -> np.ndarray:
        return self.count[experts]


class LFUDAPolicy(_CountingPolicy):
    """LFU with dynamic aging: priority = uses + the cache's age, where the age is the priority
    of the last expert evicted; an expert used often long ago ages out."""

    name = "lfuda"

    def setup_scores(self, num_experts: int) -> None:
        self.age = 0.0
        self.priority = np.zeros(num_experts, np.float64)

    def used(self, experts: np.ndarray, tick: Union[int, np.ndarray]) -> None:
        super().used(experts, tick)
        self.priority[experts] = self.count[experts] + self.age

    def score(self, experts: np.ndarray, tick: int) -> np.ndarray:
        return self.priority[experts]

    def victims(self, n: int) -> np.ndarray:
        out = super().victims(n)
        evicted = self.expert_in[out]
        evicted = evicted[evicted >= 0]
        if evicted.size:
            self.age = float(self.priority[evicted].max())
        return out


class DecayPolicy(_CountingPolicy):
    """The lowest use count decayed exponentially with a half-life of ``half_life`` calls."""

    name = "decay"
    half_life = 32.0  # calls; the best compromise over the trained demo's traces (docs/routing.md)

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
    weight = 4.0  # both from the trained demo's replayed traces (docs/routing.md)
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


class LogisticPolicy(TransitionPolicy):
    """``transition``'s score plus ``logistic_weight x half_life x`` (p1 + ``second`` x p2),
    where p1 and p2 are an online logistic model's chances that the layer's next call and the
    one after it route each expert, given this call's experts.

    Each model is a matrix of experts x experts and a bias per expert: a call's logit for ``e``
    is the bias plus the sum of ``W[c, e]`` over the call's experts ``c``. At each admission the
    call's experts are the labels of one stochastic gradient step (learning rate ``lr``) for
    the call before it (next-call model) and the one before that (the call after next). Where
    ``transition`` only counts which experts followed which, the model learns which experts of
    a call matter for what comes next, and looks a call further ahead. ``2 x num_experts ** 2``
    float32 more per layer than ``transition``, O(k x num_experts) per call."""

    name = "logistic"
    lr = 0.05  # these three from the trained demo's replayed traces (docs/routing.md)
    logistic_weight = 4.0
    second = 0.5
    prior_logit = -2.0  # a call routes few of the layer's experts
    observe_rows = 32  # of a prefill's rows (``observe``), the latest this many teach the models

    def setup_scores(self, num_experts: int) -> None:
        super().setup_scores(num_experts)
        shape = (num_experts, num_experts)
        self.w_next, self.w_after = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        self.b_next = np.full(num_experts, self.prior_logit, np.float32)
        self.b_after = np.full(num_experts, self.prior_logit, np.float32)
        self.before_previous: Optional[np.ndarray] = None

    def _learn(self, w: np.ndarray, b: np.ndarray, x: np.ndarray, routed: np.ndarray) -> None:
        step = self.lr * (routed - _sigmoid(w[x].sum(axis=0) + b))
        w[x] += step
        b += step

    def _learn_rows(self, rows: np.ndarray, first_tick: int) -> None:
        # one SGD step a row costs tens of microseconds: only the latest rows, in order, the
        # first following none the policy saw
        rows = rows[-self.observe_rows :]
        self.previous = self.before_previous = None
        for row in rows:
            experts = np.unique(row)
            self._learn_models(experts)
            self.previous = experts

    def _learn_call(self, experts: np.ndarray, tick: int) -> None:
        self._learn_models(experts)
        super()._learn_call(experts, tick)

    def _learn_models(self, experts: np.ndarray) -> None:
        """One SGD step of each model, on ``experts`` (unique) after ``previous`` and
        ``before_previous``; moves ``before_previous`` on (``previous`` is the caller's)."""
        routed = np.zeros(self.b_next.size, np.float32)
        routed[experts] = 1.0
        prev, before = self.previous, self.before_previous
        if prev is not None and prev.size:
            self._learn(self.w_next, self.b_next, prev, routed)
        if before is not None and before.size:
            self._learn(self.w_after, self.b_after, before, routed)
        self.before_previous = prev

    def _follows(self, cur: np.ndarray) -> np.ndarray:
        p_next = _sigmoid(self.w_next[cur].sum(axis=0) + self.b_next)
        p_after = _sigmoid(self.w_after[cur].sum(axis=0) + self.b_after)
        ahead = self.logistic_weight * self.half_life * (p_next + self.second * p_after)
        return super()._follows(cur) + ahead


def _routed(rows: np.ndarray, num_experts: int) -> np.ndarray:
    """``[n, num_experts]`` float32: 1 where row i routed expert e."""
    rows = np.asarray(rows, np.int64).reshape(len(rows), -1)
    out = np.zeros((len(rows), num_experts), np.float32)
    out[np.arange(len(rows))[:, None], rows] = 1.0
    return out


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


class S3FIFOPolicy(LRUPolicy):
    """S3-FIFO (Yang et al., SOSP 2023): a small FIFO queue for newcomers, a main FIFO queue for
    experts used again, and a ghost queue of experts recently dropped from the small one.

    A missed expert enters the small queue ``S`` (a tenth of the slots), or the main queue ``M``
    if it is still in the ghost queue ``G`` (it was dropped from ``S`` recently, so it is coming
    back). A hit only raises the slot's use count (at most 3). To free a slot: while ``S`` holds
    its share, its oldest entry moves to ``M`` if it was used again since it came in, else it
    leaves and its expert joins ``G``; otherwise ``M``'s oldest entry goes around again with its
    count lowered by one if it was used, else it leaves.

    Why S3-FIFO and not ARC: both keep a burst of experts used once (a scan: a prompt's
    prefill, an unusual token) from flushing the experts used again and again, since newcomers
    must prove themselves in a small queue before they can displace the main one. S3-FIFO does it
    with FIFO queues and a 2-bit count per slot that a hit only increments, while ARC moves an
    entry between LRU lists on every hit; the device-side table's GPU could bump such a count the
    way it records last uses now, and the host would keep the queues. It has one fixed setting
    (the small queue's share) where ARC adapts a target size from its ghost hits, which a layer's
    few slots and short bursts would leave noisy. (It keeps LRU's last uses only to know which
    slots the call being admitted uses.)

    Slots used by the call being admitted are never freed: in ``S`` they move to ``M`` (they are
    being used again), in ``M`` they go around without losing their count."""

    name = "s3fifo"
    small_share = 0.1  # of the slots: the small queue's share (the paper's 10%)
    max_count = 3  # a 2-bit use count

    def setup(self, num_experts: int, n_slots: int) -> None:
        self.small: Deque[int] = deque()  # slots, oldest first
        self.main: Deque[int] = deque()
        self.ghost: OrderedDict[int, None] = OrderedDict()  # experts, oldest first
        self.queue = np.zeros(n_slots, np.int8)  # slot -> 0 free, 1 small, 2 main
        self.uses = np.zeros(n_slots, np.int8)  # slot -> uses since it came in, capped
        self.small_size = max(1, int(round(self.small_share * n_slots)))
        self.ghost_size = max(1, n_slots - self.small_size)  # as many as the main queue holds

    def touch(self, slots: np.ndarray, tick: int) -> None:
        super().touch(slots, tick)
        for s in slots.tolist():
            if self.queue[s]:  # a hit
                self.uses[s] = min(self.uses[s] + 1, self.max_count)
                continue
            expert = int(self.expert_in[s])  # just assigned: a newcomer
            self.uses[s] = 0
            if expert in self.ghost:
                del self.ghost[expert]
                self.main.append(s)
                self.queue[s] = 2
            else:
                self.small.append(s)
                self.queue[s] = 1

    def device_used(self, slots: np.ndarray, ticks: np.ndarray) -> None:
        held = slots[self.queue[slots] > 0]
        self.uses[held] = np.minimum(self.uses[held] + 1, self.max_count)

    def victims(self, n: int) -> np.ndarray:
        out = np.flatnonzero(self.queue == 0)[:n].tolist()  # free slots first
        while len(out) < n:
            out.append(self._evict_one())
        return np.array(out, np.int64)

    def _evict_one(self) -> int:
        """Take one slot out of the queues (S3-FIFO's eviction); the caller frees it.

        Raises:
            RuntimeError: every held slot is used by the call being admitted (a caller must
                admit no more than the slots hold)."""
        # A slot of this call is never taken. ``passed`` counts M's slots passed over for that
        # reason since M last held one that is not: once it reaches M's length, every slot in M
        # is the call's, and S gives one up even below its share. Else a call holding all of M
        # (a speculative pass filling the slots) would go around forever.
        passed = 0
        while True:
            main_spent = passed >= len(self.main)
            if self.small and (len(self.small) >= self.small_size or main_spent):
                s = self.small.popleft()
                if self.uses[s] > 0 or self.last_used[s] == self.now:
                    self.main.append(s)  # used again while in S: promoted
                    self.queue[s] = 2
                    if self.last_used[s] != self.now:
                        passed = 0  # M holds a slot it may yet give up
                    continue
                self.ghost[int(self.expert_in[s])] = None
                while len(self.ghost) > self.ghost_size:
                    self.ghost.popitem(last=False)
            elif main_spent:
                raise RuntimeError("s3fifo: the call being admitted holds every slot")
            else:
                s = self.main.popleft()
                if self.last_used[s] == self.now:
                    self.main.append(s)
                    passed += 1
                    continue
                if self.uses[s] > 0:
                    self.uses[s] -= 1
                    self.main.append(s)
                    passed = 0
                    continue
            self.queue[s] = 0
            return s

    def forget(self, slots: np.ndarray) -> None:
        super().forget(slots)
        for s in slots.tolist():
            if self.queue[s] == 1:
                self.small.remove(s)
            elif self.queue[s] == 2:
                self.main.remove(s)
            self.queue[s] = 0
            self.uses[s] = 0


POLICIES = {
    p.name: p
    for p in (
        LRUPolicy,
        LFUPolicy,
        LFUDAPolicy,
        DecayPolicy,
        TransitionPolicy,
        LogisticPolicy,
        S3FIFOPolicy,
    )
}
