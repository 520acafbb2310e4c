"""The miss server: a helper process that answers the device-side table's requests.

Why a process and not a thread: while the GPU waits for a missed expert, the model's own thread
may be blocked inside MLX (``mx.async_eval`` waiting on the GPU, ``mx.clear_cache``) holding
Python's GIL, and a Python thread of that process could not run to answer: the GPU then waited
until its timeout (a server thread, when tried, made no poll at all for the whole wait). This
process has its own interpreter and never imports MLX.

It maps the control block and the staging buffers (shared memory, see control_block.py), opens
the expert files itself, owns the eviction policy of every table layer, and loops: answer host
requests (admit or release experts for the model process's synced calls), answer GPU requests (read
the missing experts into the staging, pick victims, update the table and the copy list), release
experts whose read failed once the GPU is past them, and start reading the absent experts of each
hint into buffers of its own, which the layer's requests take instead of reading them again
(set-based: order does not matter). A hint names the experts of the layer's next calls: for a
speculative pass looked up a token at a time, the experts of all its tokens, so the pass's union is
read at once, a token's request admits the next tokens' experts too as far as the slots and the
staging allow (those tokens then need no request), and the pass's other resident experts are kept
(``EvictionPolicy.admit``'s ``keep``) until its last token. What the hint's calls did not take is
dropped after the last of them. A pass served as one call may name more experts than the slots: the
request's answer admits what they hold and leaves the rest where the GPU reads it
(``within_slots``). It exits when told to stop or when the model process goes away (its socket
closes).

Started by ``miss_client.MissServer``: ``python -m moeflux_mlx.cuda.miss_server`` with a JSON
spec on stdin.
"""

from __future__ import annotations

import json
import select
import socket
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..cache.policy import POLICIES
from ..errors import DeviceWaitError
from ..io.store import store_from_spec
from ..io.uncached import aligned_empty
from .control_block import (
    HOST_ADMIT,
    HOST_OBSERVE,
    HOST_RELEASE,
    MAX_SELECTIONS,
    S_BYTES,
    S_IO_NS,
    S_MISSED,
    S_PF_HITS,
    S_PF_ISSUED,
    S_READ,
    ControlBlock,
)
from .shared_memory import SharedMapping

IDLE_WAIT_S = 1e-3  # between polls while no table call is in flight
STALL_S = 1.0  # in flight this long without progress: treated as idle (a graph never evaluated)
# The poll interval while table calls are in flight (``LoadOptions.server_poll_us``). A miss
# costs milliseconds of reading, so a few tens of microseconds of latency are cheap, and a
# spinning poller may share a physical core with the model process's Python thread, which builds
# the next token's graph. 0: spin (yield only). With no request for a while (every expert
# resident, so no misses) the interval grows by POLL_GROWTH per empty poll up to a cap
# (``server_poll_max_us``): a busy poller cost the table model up to 22% of its host time per
# token on an H100 VM, and a slow one nothing. A request resets it, so a miss waits at most
# ~(POLL_GROWTH - 1) x the time since the previous request, or the first interval.
POLL_GROWTH = 1.25


def next_poll_interval(interval: float, cap: float) -> float:
    """The interval after an empty poll: grown, but no longer than ``cap``."""
    return min(interval * POLL_GROWTH, cap)


@dataclass
class Hint:
    """A table layer's latest hint: the layer's GPU calls done when the GPU published it
    (``tick``), and the experts (``words``, as published: a router call's top-k after another,
    the first for the next call)."""

    tick: int
    words: np.ndarray

    def last_call(self, n_request: int) -> int:
        """The last of the layer's GPU calls the hint covers: a call per ``n_request`` words."""
        return self.tick + max(1, -(-self.words.size // max(n_request, 1)))

    def _rows(self, n_request: int) -> Optional[np.ndarray]:
        """The words as one row per call, or None if they do not split so."""
        if n_request <= 0 or self.words.size % n_request:
            return None
        return self.words.reshape(-1, n_request)

    def upcoming(self, call: int, n_request: int, num_experts: int) -> np.ndarray:
        """The experts of the calls after ``call`` that the hint names, each once, in the order
        they will be needed."""
        rows = self._rows(n_request)
        if rows is None:
            return np.zeros(0, np.int64)
        w = rows[call - self.tick :].reshape(-1)  # row call - tick - 1 is this call's
        w = w[(w >= 0) & (w < num_experts)]
        _, first = np.unique(w, return_index=True)
        return w[np.sort(first)]

    def admit_with(
        self,
        experts: np.ndarray,
        call: int,
        n_request: int,
        slot_of: np.ndarray,
        n_slots: int,
        max_missing: int,
    ) -> np.ndarray:
        """``experts`` (call ``call``'s) and those of the calls after it that the hint names, a
        call's at a time while the union fits the slots and its absent experts the staging: the
        pass's later tokens then find them resident instead of waiting for the server again."""
        rows = self._rows(n_request)
        if rows is None:
            return experts
        union = experts
        for row in rows[call - self.tick :]:  # row call - tick - 1 is this call's
            row = row[(row >= 0) & (row < slot_of.size)]
            more = np.union1d(union, row)
            if more.size > n_slots or int((slot_of[more] < 0).sum()) > max_missing:
                break
            union = more
        return union


def within_slots(
    request: np.ndarray, slot_of: np.ndarray, n_slots: int
) -> Tuple[np.ndarray, np.ndarray]:
    """For a request naming more experts than the layer has slots (a speculative pass served as
    one call): the experts that take the slots, every resident one and then the absent ones in
    the order the request names them (the earliest tokens', the likeliest accepted, first),
    sorted; and the rest, which the GPU reads where they lie (the pinned files, or the staging
    after the call's misses)."""
    request = np.asarray(request, np.int64)
    _, first = np.unique(request, return_index=True)
    ordered = request[np.sort(first)]
    here = slot_of[ordered] >= 0
    resident, absent = ordered[here], ordered[~here]
    room = max(n_slots - resident.size, 0)
    return np.sort(np.concatenate([resident, absent[:room]])), absent[room:]


class Server:
    def __init__(self, spec: dict):
        self.control = ControlBlock(
            {int(k): v for k, v in spec["layers"].items()}, fd=spec["control_fd"]
        )
        self.store = store_from_spec(spec["store"])
        self.sock = socket.socket(fileno=spec["socket_fd"])
        self.sock.setblocking(False)
        # poll, not select: the descriptors it inherits keep the model process's numbers, which
        # may pass select's limit of 1024 in a process with many files open
        self._idle = select.poll()
        self._idle.register(self.sock, select.POLLIN)
        self.poll_s = float(spec["poll_us"]) * 1e-6
        self.max_poll_s = max(self.poll_s, float(spec["poll_max_us"]) * 1e-6)
        # table layers whose misses the GPU copies out of pinned files itself (pinned_files):
        # the copy list names experts, and nothing is read here
        self.in_place = {int(k) for k in spec.get("in_place", ())}
        policy = POLICIES[spec["eviction"]]
        self.policies = {
            layer: policy(t.num_experts, t.n_slots, t.slot_of, t.last_used)
            for layer, t in self.control.layers.items()
        }
        self.staging: Dict[int, np.ndarray] = {}  # blob size -> [rows, blob size]
        self._mappings: List[SharedMapping] = []
        self.releases: List[Tuple[int, int, np.ndarray]] = []  # (index, GPU call, experts)
        # per table layer, the GPU call the server last answered: until it ends, it may still
        # read the slots its answer gave it
        self.answered = np.zeros(len(self.control.order), np.int64)
        self.alive = True
        # whole-expert reads of hinted experts, beside the store's demand reads (threads start
        # on the first hint)
        self.prefetcher = ThreadPoolExecutor(self.store.threads, thread_name_prefix="read-ahead")
        self.hints_seen = self.control.hints.copy()
        self.prefetched: Dict[int, Dict[int, Future]] = {}  # table index -> expert -> its read
        self.hinted: Dict[int, Hint] = {}  # table index -> its latest hint

    # -- messages from the model process: staging buffers, wake-ups; EOF when it is gone ----

    def _receive(self, block: bool) -> None:
        self.sock.setblocking(block)
        try:
            while True:
                msg, fds, _, _ = socket.recv_fds(self.sock, 4096, 4)
                if not msg:
                    self.alive = False
                    return
                if msg.startswith(b"{"):  # a staging buffer (anything else only wakes us)
                    d = json.loads(msg)
                    m = SharedMapping(d["nbytes"], fd=fds[0])
                    self._mappings.append(m)
                    self.staging[d["blob_size"]] = m.array.reshape(-1, d["blob_size"])
                if block:
                    return
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.alive = False
        finally:
            self.sock.setblocking(False)

    def _staging(self, blob_size: int) -> np.ndarray:
        while blob_size not in self.staging:  # sent before the GPU call that needs it
            if not self.alive:
                raise DeviceWaitError(
                    f"no staging buffer for {blob_size}-byte experts (the model process went away)"
                )
            self._receive(block=True)
        return self.staging[blob_size]

    # -- requests --------------------------------------------------------------------------

    def _layer(self, i: int):
        layer = self.control.order[i]
        return layer, self.control.layers[layer], self.policies[layer]

    def take_hints(self) -> None:
        """Start reading the absent experts of every new hint, in the hint's order (a pass's
        first token first)."""
        c = self.control
        for i in np.flatnonzero(c.hints != self.hints_seen).tolist():
            self.hints_seen[i] = c.hints[i]
            layer, t, _ = self._layer(i)
            n = min(int(t.header["hint_n"]), t.hint.size)
            hint = t.hint[:n].astype(np.int64)
            hint = hint[(hint >= 0) & (hint < t.num_experts)]
            experts, first = np.unique(hint, return_index=True)
            self.hinted[i] = Hint(int(t.header["hint_tick"]), t.hint[:n].astype(np.int64))
            pending = self.prefetched.setdefault(i, {})
            keep = set(experts.tolist())
            for e in [e for e in pending if e not in keep]:
                pending.pop(e).cancel()  # only the latest hint counts
            if layer in self.in_place:
                continue  # nothing to read: the hint only keeps a pass's experts together
            for e in hint[np.sort(first)].tolist():
                if t.slot_of[e] < 0 and e not in pending:
                    pending[e] = self.prefetcher.submit(self._read_one, layer, e)
                    t.stats[S_PF_ISSUED] += 1

    def _drop_hint(self, i: int) -> None:
        self.hinted.pop(i, None)
        for f in self.prefetched.pop(i, {}).values():
            f.cancel()  # hinted, never routed

    def _read_one(self, layer: int, e: int) -> np.ndarray:
        buf = aligned_empty(self.store.layout(layer).blob_size)
        self.store.read_one(layer, e, buf)
        return buf

    def _read_missing(
        self, i: int, layer: int, missing: np.ndarray, staging: np.ndarray
    ) -> np.ndarray:
        """Read ``missing`` into the staging's first rows, the prefetched ones from their
        buffers; returns the order the rows hold them in (read first, prefetched after)."""
        pending = self.prefetched.get(i, {})
        bufs = {}
        for e in missing.tolist():
            f = pending.pop(e, None)
            if f is not None:
                try:
                    bufs[e] = f.result()
                except Exception:  # noqa: BLE001 - a prefetch is a hint: read it again below
                    pass
        rest = np.array([e for e in missing.tolist() if e not in bufs], np.int64)
        if rest.size:
            self.store.read(layer, rest, staging[: rest.size])
        for k, e in enumerate(bufs, start=rest.size):
            staging[k] = bufs[e]
        self.control.layers[layer].stats[S_PF_HITS] += len(bufs)
        return np.concatenate([rest, np.array(list(bufs), np.int64)])

    def answer_gpu(self, i: int) -> None:
        c = self.control
        layer, t, policy = self._layer(i)
        self.release_failed(i)
        seq = int(c.requests[i])
        n_request = int(t.header["nreq"])
        experts = np.unique(t.request[:n_request])
        tick = c.clock(i) + 1  # the waiting call's tick; the GPU counts the call when done
        call = int(c.ticks[i]) + 1  # the waiting call: the layer's GPU calls end in order
        self.answered[i] = call
        hint = self.hinted.get(i)
        last = -1 if hint is None else hint.last_call(n_request)
        if call > last:
            self._drop_hint(i)  # a stale hint's reads are not this call's
            hint = None
        own, keep = experts, None
        in_place = layer in self.in_place
        if hint is not None and call < last:  # a pass's token, more to come
            blob = self.store.layout(layer).blob_size
            rows = self.staging[blob].shape[0] if blob in self.staging else n_request
            rows = MAX_SELECTIONS if in_place else rows  # the copy list's length
            experts = hint.admit_with(own, call, n_request, t.slot_of, t.n_slots, rows)
            # the later tokens' other resident experts stay through the misses, the soonest
            # needed first
            keep = hint.upcoming(call, n_request, t.num_experts)
            keep = keep[~np.isin(keep, experts)]
        outside = experts[:0]  # what the GPU reads where it lies (a pass larger than the slots)
        if experts.size > t.n_slots:  # a speculative pass served whole (TableCache._fits_whole)
            experts, outside = within_slots(t.request[:n_request], t.slot_of, t.n_slots)
            outside = np.sort(outside)  # in the staging: rows after the misses, by id
            keep = None
        missing, victims = policy.admit(experts, tick, keep)
        n = missing.size
        early = missing[:0]  # later tokens' experts whose read failed: freed at once
        t.header["err"] = 0
        try:
            layout = self.store.layout(layer)
            if in_place:  # the GPU copies them from the pinned files
                if n > MAX_SELECTIONS:
                    raise DeviceWaitError(
                        f"layer {layer}: {n} missed experts in one call, the copy list "
                        f"holds {MAX_SELECTIONS}"
                    )
                # those read in place cross the bus too, every time
                t.stats[S_READ] += n + outside.size
                t.stats[S_BYTES] += (n + outside.size) * layout.blob_size
                t.stats[S_MISSED] += n + outside.size
                return
            staging = self._staging(layout.blob_size)
            if n + outside.size > staging.shape[0]:
                raise DeviceWaitError(
                    f"layer {layer}: {n + outside.size} missed experts in one call, the "
                    f"staging holds {staging.shape[0]}"
                )
            t0 = time.perf_counter_ns()
            if self.prefetched.get(i):
                order = self._read_missing(i, layer, missing, staging)
                victims = victims[np.searchsorted(missing, order)]  # missing is sorted
                missing = order
            else:
                self.store.read(layer, missing, staging[:n])
            if outside.size:  # the expert kernels read them there (resolve_cuda.cuh's rows)
                self.store.read(layer, outside, staging[n : n + outside.size])
            t.stats[S_IO_NS] += time.perf_counter_ns() - t0
            t.stats[S_READ] += n + outside.size
            t.stats[S_BYTES] += (n + outside.size) * layout.blob_size
            t.stats[S_MISSED] += n + outside.size
        except BaseException as e:  # noqa: BLE001 - the fill writes NaN bytes; released once the GPU is past
            t.header["err"] = 1
            c.set_message(
                f"{e}"
                if str(e).startswith(("layer", "/"))
                else f"layer {layer}: reading experts {missing.tolist()} failed: {e}"
            )
            # the call's own experts are released once the GPU is past it (it reads their
            # poisoned slots); those admitted for a pass's later tokens at once, so that those
            # tokens ask again instead of finding poisoned slots (nothing reads them before)
            mine = np.isin(missing, own)
            early = missing[~mine]
            if mine.any():
                c.globals["pending_release"] += 1
                self.releases.append((i, int(c.ticks[i]) + 1, missing[mine]))
            # counted last: the model process, seeing it, waits for the release counted above
            c.globals["errors"] += 1
        finally:
            policy.assign(missing, victims, tick)
            if early.size:
                policy.release(early)
            t.copy_src[:n] = missing if in_place else np.arange(n)  # an expert, a staging row
            t.copy_dst[:n] = victims
            t.header["ncopy"] = n
            c.answers[i] = seq  # last: the GPU reads everything above once it sees this
            if call >= last >= 0:
                self._drop_hint(i)  # the hint's last call: what it did not take goes

    def answer_host(self, i: int) -> None:
        c = self.control
        _, t, policy = self._layer(i)
        seq = int(c.host_requests[i])
        if t.header["host_kind"] != HOST_OBSERVE:
            # synced (no call of the layer in flight): a failed read's slots go before the
            # request could count them resident
            self.release_failed(i)
        experts = np.array(t.host_request[: int(t.header["host_n"])], np.int64)
        missing = experts[:0]
        if t.header["host_kind"] == HOST_ADMIT:
            tick = c.clock(i) + 1
            missing, victims = policy.admit(np.unique(experts), tick)
            policy.assign(missing, victims, tick)
            t.header["host_ticks"] += 1
            t.host_missing[: missing.size] = missing
            t.host_victims[: missing.size] = victims
        elif t.header["host_kind"] == HOST_RELEASE:
            policy.release(experts)
        elif t.header["host_kind"] == HOST_OBSERVE:  # calls the policy did not serve
            rows = experts.reshape(-1, max(int(t.header["host_k"]), 1))
            policy.observe(rows, c.clock(i) + 1)
            t.header["host_ticks"] += len(rows)
        t.header["host_nmiss"] = missing.size
        c.host_answers[i] = seq

    def release_failed(self, answering: int = -1) -> None:
        """Free the slots of failed reads once the GPU has finished the call that got them, and
        only while no answered call of their layer is still reading its slots: a slot freed
        between a call's answer and its reading the table reads as absent. In the answer to the
        layer's next request (``answering``: a GPU request, or a synced host admit or release)
        they go first: the GPU waits there and asks for every expert of its call, so it is
        given again what it found poisoned. A call that asked nothing may find one freed since
        it looked (the kernel takes slot 0; the read's error is raised for that pass)."""
        if not self.releases:
            return
        ticks = self.control.ticks
        keep = []
        for i, call, experts in self.releases:
            quiet = i == answering or ticks[i] >= self.answered[i]
            if quiet and int(ticks[i]) >= call:
                self.policies[self.control.order[i]].release(experts)
                self.control.globals["pending_release"] -= 1
            else:
                keep.append((i, call, experts))
        self.releases = keep

    def run(self) -> None:
        c = self.control
        c.globals["ready"] = 1
        last_ticks, last_change = c.ticks.copy(), time.monotonic()
        poll_s = self.poll_s
        while self.alive and not c.globals["stop"]:
            worked = False
            # the requests first, then the hints: a hint written before a request seen here is
            # taken before that request is answered, with the later tokens' experts it names
            gpu_pending = c.pending()
            if (c.hints != self.hints_seen).any():
                self.take_hints()
                worked = True
            self.release_failed()
            for i in c.host_pending():
                self.answer_host(int(i))
                worked = True
            for i in gpu_pending:
                self.answer_gpu(int(i))
                worked = True
            if worked:
                poll_s = self.poll_s
                continue
            if (c.ticks != last_ticks).any():
                last_ticks, last_change = c.ticks.copy(), time.monotonic()
            if (c.in_flight() or self.releases) and time.monotonic() - last_change < STALL_S:
                time.sleep(poll_s)  # the GPU may ask any moment
                poll_s = next_poll_interval(poll_s, self.max_poll_s)
            else:
                poll_s = self.poll_s
                if self._idle.poll(IDLE_WAIT_S * 1e3):
                    self._receive(block=False)

    def close(self) -> None:
        self.prefetcher.shutdown(wait=True, cancel_futures=True)
        self.store.close()
        for m in self._mappings:
            m.close()
        self.control.close()


def main() -> int:
    try:
        server = Server(json.loads(sys.stdin.read()))
        try:
            server.run()
        finally:
            server.close()
    except Exception as e:  # noqa: BLE001 - one line for the model process's message (its "last words")
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
