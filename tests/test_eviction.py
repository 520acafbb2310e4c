"""Eviction policies (cache.policy): each keeps output exact, and each evicts what it says."""

import signal

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import moeflux_mlx
from moeflux_mlx.cache.policy import POLICIES, DecayPolicy, LRUPolicy, TransitionPolicy
from moeflux_mlx.cuda.miss_server import within_slots
from moeflux_mlx.format.checkpoint import expert_layout
from moeflux_mlx.options import EVICTIONS, LoadOptions


def _run(policy_class, trace, n_slots, num_experts=8):
    """Replay ``trace`` (one list of experts per call) through ``policy_class``; returns the
    policy and the misses per call."""
    p = policy_class(num_experts, n_slots)
    misses = []
    for tick, experts in enumerate(trace, start=1):
        missing, victims = p.admit(np.array(sorted(experts)), tick)
        p.assign(missing, victims, tick)
        misses.append(missing.tolist())
        resident = set(np.flatnonzero(p.slot_of >= 0).tolist())
        assert set(experts) <= resident and len(resident) <= n_slots
        assert sorted(p.slot_of[p.slot_of >= 0].tolist()) == sorted(set(p.slot_of[p.slot_of >= 0]))
    return p, misses


# the policies that count uses: the two a user may not choose but ``transition`` is built on
LEARNING = {"decay": DecayPolicy, "transition": TransitionPolicy}


def test_the_option_names_every_policy():
    assert set(EVICTIONS) == set(POLICIES) == {"transition", "lru"}
    assert LoadOptions().eviction == "transition"


@pytest.mark.parametrize("policy", [DecayPolicy, TransitionPolicy])
def test_uses_the_gpu_made_count_once_and_never_for_another_occupant(policy):
    """With the device-side table the GPU records a slot's last use (``device_last``) for calls
    the host never sees; an admission counts each such slot once, but not a use the host itself
    saw (same tick) nor a late store of the slot's previous occupant."""
    device_last = np.full(3, -1, np.int64)
    p = policy(8, 3, device_last=device_last)
    missing, victims = p.admit(np.array([0, 1]), 1)
    p.assign(missing, victims, 1)
    device_last[p.slot_of[[0, 1]]] = 1  # the GPU's store for the call the host answered
    device_last[p.slot_of[0]] = 3  # then 0 alone, in a call that needed no help
    before = p.count.copy()
    missing, victims = p.admit(np.array([2]), 4)  # a free slot: nothing evicted
    p.assign(missing, victims, 4)
    assert p.count[1] == before[1] and p.count[0] > before[0]
    assert p.device_seen[p.slot_of[0]] == 3
    missing, victims = p.admit(np.array([3]), 5)  # 1: the fewest uses, the oldest
    p.assign(missing, victims, 5)
    assert p.slot_of[1] < 0 and p.slot_of[0] >= 0 and p.slot_of[3] >= 0
    device_last[p.slot_of[3]] = 2  # a late store of the slot's previous occupant (1)
    count3 = p.count[3]
    p.admit(np.array([0]), 6)
    assert p.count[3] == count3


def test_lru_and_transition_differ_where_frequency_counts():
    # expert 0 is used often early; then 1, 2, 3 arrive: LRU evicts 0, transition's decayed
    # counts keep it
    trace = [[0], [0], [0], [1], [2], [3]]
    lru_policy, lru = _run(LRUPolicy, trace, n_slots=2)
    p, transition = _run(TransitionPolicy, trace, n_slots=2)
    assert lru[-1] == [3] and transition[-1] == [3]
    assert p.slot_of[0] >= 0  # the frequent one stayed
    assert lru_policy.slot_of[0] < 0  # LRU let it go


def test_decay_forgets_with_its_half_life():
    trace = [[0]] * 4 + [[1]] + [[2]] * 40 + [[3]]
    p, _ = _run(DecayPolicy, trace, n_slots=2)
    # by the end 0's count has decayed far below 2's: 3 replaced 0 and 2 stayed
    assert p.slot_of[0] < 0 and p.slot_of[2] >= 0 and p.slot_of[3] >= 0


def test_transition_keeps_what_follows_the_current_call():
    """Experts used as often and as recently: decayed counts evict the oldest (2), but 2 always
    came right after 0, and the call being admitted routes 0: transition keeps 2."""
    trace = [[0], [2], [1], [3]] * 6 + [[0, 5]]
    decay, _ = _run(DecayPolicy, trace, n_slots=4)
    transition, _ = _run(TransitionPolicy, trace, n_slots=4)
    assert decay.slot_of[2] < 0 and decay.slot_of[1] >= 0
    assert transition.slot_of[2] >= 0 and transition.slot_of[1] < 0


def test_transition_counts_pairs_with_their_half_life():
    """A row of pair counts decays by half over ``pair_half_life`` calls, applied when the row
    is counted again; the ratio read is unchanged by decay."""
    p = TransitionPolicy(8, 4)
    for tick, experts in ((1, [0]), (2, [1]), (3, [0])):
        p.assign(*p.admit(np.array(experts), tick), tick)
    assert p.pairs[0, 1] == 1 and p.calls[0] == 1 and p.pairs[1, 0] == 1
    late = 2 + int(TransitionPolicy.pair_half_life)  # row 0 was last counted at tick 2
    p.assign(*p.admit(np.array([1]), late), late)
    assert p.calls[0] == pytest.approx(1.5) and p.pairs[0, 1] == pytest.approx(1.5)
    assert p.pairs_at[0] == late and p.pairs_at[1] == 3


@pytest.mark.parametrize("eviction", sorted(POLICIES))
def test_every_policy_keeps_decode_exact(tiny_checkpoints, eviction):
    src, packed = tiny_checkpoints["qwen3_moe"]
    stock, tokenizer = mlx_lm.load(str(src))
    prompt = mx.array(tokenizer.encode("one two three four five six seven eight"))

    def greedy(model, n=16):
        return [int(t) for (t, _), _ in zip(generate_step(prompt, model, max_tokens=n), range(n))]

    want = greedy(stock)
    total = expert_layout(packed).total_expert_bytes
    model, _ = moeflux_mlx.load(packed, cache_budget=int(0.3 * total), eviction=eviction)
    with model.moeflux as rt:
        assert rt.cache.slots.policy is POLICIES[eviction]
        assert greedy(model) == want
        assert 0 < rt.stats.hit_rate < 1


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_call_never_evicts_its_own_hits(policy):
    # 0 is frequent and old; 5 was just admitted (count 1); a call needing 5 and a new expert
    # must evict 0, never 5, whatever the policy's score says about 5
    trace = [[0]] * 6 + [[5]] + [[5, 6]]
    p, misses = _run(POLICIES[policy], trace, n_slots=2)
    assert misses[-1] == [6] and p.slot_of[5] >= 0 and p.slot_of[6] >= 0


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("n_slots,k", [(4, 4), (5, 4), (8, 2), (16, 8)])
def test_no_policy_evicts_what_the_call_needs_on_random_traces(policy, n_slots, k):
    # _run checks after every call that all its experts are resident in distinct slots, within
    # the budget; a hit freed for a miss of the same call would fail it
    rng = np.random.default_rng(n_slots * 31 + k)
    hot = rng.choice(32, 12, replace=False)
    trace = [
        sorted(rng.choice(hot if rng.random() < 0.6 else 32, k, replace=False).tolist())
        for _ in range(300)
    ]
    p, misses = _run(POLICIES[policy], trace, n_slots=n_slots, num_experts=32)
    assert 0 < sum(map(len, misses)) < 300 * k


@pytest.fixture
def no_hang():
    """Turn an eviction that goes around forever into a failure after 20 s."""

    def hung(*_):
        raise TimeoutError("the eviction did not end")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_passes_that_fill_the_slots_end_and_keep_what_they_use(policy, no_hang):
    # speculative passes served as one call: within_slots admits the resident experts then the
    # earliest absent ones, as many as the slots hold, so a call often leaves no slot it does not
    # use, or exactly as many as it misses
    rng = np.random.default_rng(7)
    n_slots, num_experts, top_k = 20, 48, 8
    p = POLICIES[policy](num_experts, n_slots)
    hot = rng.choice(num_experts, 24, replace=False)
    for tick in range(1, 400):
        tokens = int(rng.integers(1, 6))
        # the pass's tokens route mostly among the hot experts, now and then anywhere
        request = np.concatenate(
            [
                rng.choice(hot if rng.random() < 0.7 else num_experts, top_k, replace=False)
                for _ in range(tokens)
            ]
        )
        experts, _ = within_slots(request, p.slot_of, n_slots)
        missing, victims = p.admit(experts, tick)
        p.assign(missing, victims, tick)
        assert (p.slot_of[experts] >= 0).all()
        assert (p.slot_of >= 0).sum() <= n_slots


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_keep_holds_a_pass_s_later_experts_while_others_can_go(policy):
    # slots hold 0, 1, 2, 3; 0 is the oldest and least used, so every policy would free it for
    # 9, unless the call says the pass's next token routes to 0 (keep)
    p2, _ = _run(POLICIES[policy], [[0]] + [[1, 2, 3]] * 3, n_slots=4, num_experts=16)
    missing, victims = p2.admit(np.array([9]), 5, keep=np.array([0, 7]))  # 7: not resident
    assert missing.tolist() == [9]
    p2.assign(missing, victims, 5)
    assert p2.slot_of[0] >= 0 and (p2.slot_of[[1, 2, 3]] >= 0).sum() == 2
    # no room: the call's misses take kept slots too (and every policy's eviction ends)
    p3, _ = _run(POLICIES[policy], [[0, 1, 2, 3]], n_slots=4)
    missing, victims = p3.admit(np.array([4, 5, 6]), 2, keep=np.array([0, 1, 2, 3]))
    assert len(set(victims.tolist())) == 3
    p3.assign(missing, victims, 2)
    assert (p3.slot_of[[4, 5, 6]] >= 0).all() and (p3.slot_of[:4] >= 0).sum() == 1


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_keep_short_of_room_keeps_the_soonest_needed(policy):
    # slots hold 0-3; a call misses 8, 9 and 10, which leaves room to keep one slot: keep names
    # 3 then 0 (3 needed first), so 3 stays, though 0 may sit in a lower slot
    p, _ = _run(POLICIES[policy], [[0], [1], [2], [3]], n_slots=4, num_experts=16)
    missing, victims = p.admit(np.array([8, 9, 10]), 5, keep=np.array([3, 0]))
    p.assign(missing, victims, 5)
    assert p.slot_of[3] >= 0 and p.slot_of[0] < 0


def _markov_rows(n, num_experts=16, k=3, seed=0):
    """``n`` calls of ``k`` distinct experts each, each call's drawn mostly after the one
    before it (so that what follows what can be learnt)."""
    rng = np.random.default_rng(seed)
    nxt = rng.permutation(num_experts)
    rows, cur = [], rng.choice(num_experts, k, replace=False)
    for _ in range(n):
        rows.append(np.sort(cur))
        cur = np.unique(np.concatenate([nxt[cur[:2]], rng.choice(num_experts, k, replace=False)]))[
            :k
        ]
        while cur.size < k:
            cur = np.unique(np.append(cur, rng.integers(num_experts)))
    return np.array(rows)


_SLOT_STATE = ("slot_of", "expert_in", "last_used", "device_seen", "device_last", "clock", "now")


@pytest.mark.parametrize("policy", sorted(LEARNING))
def test_observe_learns_what_serving_the_calls_would_have_taught(policy):
    """``observe`` (a prefill's rows, never served) leaves a policy knowing what admitting those
    calls would have taught it, but the slots empty: from there both make the same choices on
    the calls that follow (the transition pairs and decay counts are summed at once, not row by
    row, so this checks the sums)."""
    rows = _markov_rows(120)
    taught, served = LEARNING[policy](16, 5), LEARNING[policy](16, 5)
    taught.observe(rows[:80], 1)
    assert (taught.slot_of < 0).all()  # nothing admitted
    for tick, row in enumerate(rows[:80], start=1):
        served.assign(*served.admit(row, tick), tick)
    fresh = LEARNING[policy](16, 5)
    for name, value in vars(served).items():  # what it learnt, its slots left empty
        if name not in _SLOT_STATE:
            setattr(fresh, name, value)
    for tick, row in enumerate(rows[80:], start=81):
        got, want = taught.admit(row, tick), fresh.admit(row, tick)
        assert [a.tolist() for a in got] == [a.tolist() for a in want], (policy, tick)
        taught.assign(*got, tick)
        fresh.assign(*want, tick)


@pytest.mark.parametrize("policy", sorted(LEARNING))
def test_observe_after_served_calls_decays_what_came_before(policy):
    """A policy that has served calls, then observes more: it learns what serving them would
    have taught (what it knew decayed to the observed ticks; the first observed call following
    none it saw), its slots left as the served calls left them."""
    import copy

    rows = _markov_rows(160, seed=1)
    base = LEARNING[policy](16, 5)
    for tick, row in enumerate(rows[:40], start=1):
        base.assign(*base.admit(row, tick), tick)
    taught, served = copy.deepcopy(base), copy.deepcopy(base)
    taught.observe(rows[40:100], 41)
    if hasattr(served, "previous"):
        served.previous = None  # the observed rows follow no call the policy saw
    for tick, row in enumerate(rows[40:100], start=41):
        served.assign(*served.admit(row, tick), tick)
    for name, value in vars(taught).items():  # the served one's learning, the taught one's slots
        if name in _SLOT_STATE + ("current", "follows"):  # (and no call being admitted)
            setattr(served, name, copy.deepcopy(value))
    everyone = np.arange(16)
    np.testing.assert_allclose(taught.score(everyone, 100), served.score(everyone, 100), 1e-5)
    if hasattr(taught, "pairs"):  # what is read of them: each row over its calls
        for p in (taught, served):
            assert p.previous.tolist() == rows[99].tolist()
        ratio = [p.pairs / np.maximum(p.calls, 1e-6)[:, None] for p in (taught, served)]
        np.testing.assert_allclose(*ratio, rtol=1e-5, atol=1e-6)
    for tick, row in enumerate(rows[100:], start=101):
        got, want = taught.admit(row, tick), served.admit(row, tick)
        assert [a.tolist() for a in got] == [a.tolist() for a in want], (policy, tick)
        taught.assign(*got, tick)
        served.assign(*want, tick)


def test_observe_teaches_lru_nothing():
    rows = _markov_rows(100)
    lru = LRUPolicy(16, 5)
    before = {k: np.array(v, copy=True) for k, v in vars(lru).items() if isinstance(v, np.ndarray)}
    lru.observe(rows, 1)
    assert all(np.array_equal(before[k], getattr(lru, k)) for k in before)
