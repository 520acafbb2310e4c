"""``expert_io=direct``: the pread store's reads bypassing the page cache (``io.uncached``).

The bytes are the pread store's, bit for bit, in place or through a bounce buffer; the pages read
uncached do not enter the page cache (checked with ``mincore``); a truncated file fails clearly.
The model through ``direct`` against stock mlx-lm, and the fallback to cached reads where a file
cannot be read uncached: test_streaming.py. Last, the other side of the page cache: a small pread
call the cache holds (asked with ``RWF_NOWAIT``, against ``mincore``) goes on fewer threads."""

from __future__ import annotations

import errno
import mmap
import os
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks.lib import pagecache
from moeflux_mlx.errors import ExpertReadError
from moeflux_mlx.io import bandwidth, uncached
from moeflux_mlx.io import store as st
from moeflux_mlx.io.uncached import ALIGN, aligned_empty, open_uncached

pytestmark = pytest.mark.skipif(
    not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's (macOS uses F_NOCACHE, not run here)"
)


def _drop(fd):
    os.fsync(fd)  # dirty pages cannot be dropped
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _resident_pages(path) -> np.ndarray:
    """Which of ``path``'s pages are in the page cache (``mincore``)."""
    pages = pagecache.resident_pages(path)
    if pages is None:
        pytest.skip("mincore is unavailable here")
    return pages


@pytest.fixture
def blob_file(tmp_path):
    path = tmp_path / "experts.bin"
    # not whole pages: a read may end at a partial last page of the file
    data = np.random.default_rng(0).integers(0, 256, (3 << 20) + 100, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    reader, why = open_uncached(path, fd)
    if reader is None:
        os.close(fd)
        pytest.skip(f"{tmp_path}: {why}")
    yield path, data, fd, reader
    reader.close()
    os.close(fd)


# (file offset, length, where the range starts in the buffer): in place, pages only; in place
# with partial first and last pages; a buffer at another offset within a page than the file
# (bounced), longer than one bounce step; a range inside one page
RANGES = {
    "in place": (2 * ALIGN, 5 * ALIGN, 0),
    "partial pages": (ALIGN + 100, 9 * ALIGN + 7, 100),
    "bounced": (3 * ALIGN + 64, (1 << 20) + 3 * ALIGN + 5, 0),
    "one page": (123, 500, 123),
    "to the end of the file": ((3 << 20) - 2 * ALIGN + 64, 2 * ALIGN + 36, 64),
    "bounced to the end": ((3 << 20) - 2 * ALIGN + 64, 2 * ALIGN + 36, 0),
}


@pytest.mark.parametrize("case", list(RANGES))
def test_uncached_reads_are_exact_and_bypass_the_page_cache(blob_file, case):
    path, data, fd, reader = blob_file
    start, n, at = RANGES[case]
    _drop(fd)
    buf = aligned_empty(n + 2 * ALIGN)
    buf[:] = 0xA5
    reader.read(start, buf[at : at + n], "test")
    assert np.array_equal(buf[at : at + n], data[start : start + n])
    assert (buf[:at] == 0xA5).all() and (buf[at + n :] == 0xA5).all()  # nothing else written
    resident = _resident_pages(path)
    body = resident[-(-start // ALIGN) : (start + n) // ALIGN]  # whole pages of the range
    if case != "one page":
        assert body.size and not body.any(), f"{int(body.sum())} of {body.size} pages cached"
    # at most the partial first and last pages went through the cache
    assert resident.sum() <= 2


def test_memory_the_kernel_refuses_is_read_through_the_bounce_buffer(blob_file, monkeypatch):
    """O_DIRECT into memory it cannot pin (CUDA managed memory) fails with EFAULT: bounced."""
    path, data, fd, reader = blob_file
    real, calls = uncached._read_direct, []

    def refuse_in_place(fd_, into, offset, need, what):
        calls.append(into.ctypes.data)
        if len(calls) == 1:
            raise OSError(errno.EFAULT, "Bad address")
        return real(fd_, into, offset, need, what)

    monkeypatch.setattr(uncached, "_read_direct", refuse_in_place)
    buf = aligned_empty(8 * ALIGN)
    reader.read(ALIGN, buf, "test")
    assert np.array_equal(buf, data[ALIGN : 9 * ALIGN]) and len(calls) >= 2


def test_a_truncated_file_fails_clearly(blob_file):
    path, data, fd, reader = blob_file
    os.truncate(path, 2 * ALIGN + 10)
    for start, n, at in ((ALIGN, 4 * ALIGN, 0), (3 * ALIGN, ALIGN, 0), (ALIGN, 4 * ALIGN, 8)):
        buf = aligned_empty(n + at)[at:]  # in place, and through the bounce buffer
        with pytest.raises(ExpertReadError, match=r"experts\.bin \(expert 3\).*short read") as e:
            reader.read(start, buf, f"{path} (expert 3)")
        assert str(e.value).count("experts.bin") == 1  # named once, not wrapped twice


def test_store_reads_equal_pread(tiny_checkpoints):
    """Every expert of every layer, one at a time and in batches, into staging and into a buffer
    at an odd address: the same bytes as the pread store."""
    src, packed = tiny_checkpoints["qwen3_moe"]
    for path in (packed, src):
        direct, layout = st.open_store(path, "direct", threads=3)
        pread, _ = st.open_store(path, "pread", threads=1)
        with direct, pread:
            assert direct._uncached  # read uncached, not fallen back to the page cache
            for i, lay in layout.layers.items():
                every = np.arange(lay.num_experts)
                want = pread.read(i, every).copy()
                assert np.array_equal(direct.read(i, every), want)
                assert np.array_equal(direct.read(i, every[:1]), want[:1])
                odd = np.empty(lay.num_experts * lay.blob_size + 1, np.uint8)[1:]
                out = odd.reshape(lay.num_experts, lay.blob_size)
                direct.read(i, every, out)
                assert np.array_equal(out, want)


def test_direct_is_chosen_only_for_experts_far_beyond_ram(monkeypatch):
    """The RAM gate reads uncached only where the page cache could hold few of the experts
    (``DIRECT_RAM_RATIO`` x RAM, Linux); asked for, ``direct`` is used at any size."""
    monkeypatch.delenv("MOEFLUX_EXPERT_IO", raising=False)
    monkeypatch.setattr(st.sys, "platform", "linux")
    ram = st.psutil.virtual_memory().total
    assert st.select_expert_io(1 << 62) == "direct"
    assert st.select_expert_io(int(st.DIRECT_RAM_RATIO * ram)) == "pread"
    monkeypatch.setenv("MOEFLUX_EXPERT_IO", "direct")
    assert st.select_expert_io(10) == "direct"


def test_the_bound_of_a_direct_run_reads_uncached(tiny_checkpoints):
    """``read_bandwidth(io_mode="direct")`` reads as the direct store does: only the partial
    pages at the ends of ranges read in place (experts of 6.75 pages: a row of the staging lies
    at the same offset within a page as its expert in the file for one pair in four) go through
    the cache; the pread store's reads cache every page."""
    from moeflux_mlx.io.bandwidth import expert_files, read_bandwidth

    _, packed = tiny_checkpoints["qwen3_moe"]
    files = expert_files(packed)
    pages = sum(-(-os.path.getsize(p) // ALIGN) for p in files)

    def resident_after(**kw):
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            _drop(fd)
            os.close(fd)
        cold, _ = read_bandwidth(packed, reads=1 << 20, threads=3, **kw)
        assert cold > 0
        return sum(int(_resident_pages(p).sum()) for p in files)

    assert 0 < resident_after(io_mode="direct") < pages // 4
    assert resident_after() == pages


def test_background_reads_go_uncached_too(tiny_checkpoints, monkeypatch):
    """The CUDA miss server's reads (and its read ahead of a speculative pass's experts) go
    through ``store.read_one`` in a thread of their own: uncached in ``direct`` mode, the same
    bytes as the pread store."""
    from concurrent.futures import ThreadPoolExecutor

    from moeflux_mlx.errors import ModelClosedError

    _, packed = tiny_checkpoints["qwen3_moe"]
    calls = []
    real = uncached.UncachedFile.read
    monkeypatch.setattr(
        uncached.UncachedFile, "read", lambda self, *a: (calls.append(a[0]), real(self, *a))[1]
    )
    direct, layout = st.open_store(packed, "direct", threads=2)
    pread, _ = st.open_store(packed, "pread", threads=1)
    layer = min(layout.layers)
    experts = np.array([1, 5, 6])
    with direct, pread:
        got = aligned_empty(len(experts) * layout.layers[layer].blob_size).reshape(len(experts), -1)
        with ThreadPoolExecutor(2) as background:
            for f in [
                background.submit(direct.read_one, layer, int(e), got[i])
                for i, e in enumerate(experts)
            ]:
                f.result()
        assert len(calls) >= len(experts)  # each expert was read uncached
        assert np.array_equal(got, pread.read(layer, experts))
        fd = next(iter(direct.layers[layer].file_descriptors().values()))
    with pytest.raises(ModelClosedError):
        direct.read_range(fd, 0, aligned_empty(8), "closed")


# -- small reads from the page cache: fewer threads (``store.page_cache_holds``) ---------------


@pytest.mark.skipif(st._RWF_NOWAIT is None, reason="RWF_NOWAIT is Linux's")
def test_page_cache_holds_answers_as_mincore(blob_file):
    """The probe says True for a file read whole, False once its pages are dropped, and False
    when only its first half is read back (the probe looks at each range's middle and last
    page too); ``mincore`` agrees each time, and the probe reads at most one page in."""
    path, data, fd, _ = blob_file
    n = len(data)
    reads = [
        (fd, 0, np.empty(n // 3, np.uint8), "a"),
        (fd, n // 3, np.empty(n - n // 3, np.uint8), "b"),
    ]
    probed = [
        (start + at) // mmap.PAGESIZE
        for _, start, into, _ in reads
        for at in (0, len(into) // 2, len(into) - 1)
    ]
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # as the store's files: no readahead
    os.pread(fd, n, 0)
    assert _resident_pages(path).all()
    assert st.page_cache_holds(reads) is True
    # a drop is advice: under a busy machine some pages may stay a while; the probe must then
    # find the pages it looks at gone, so drop until they are
    for _ in range(10):
        _drop(fd)
        if not _resident_pages(path)[probed].any():
            break
        time.sleep(0.05)
    if _resident_pages(path).all():
        pytest.skip(f"{path.parent}: this file system keeps every page (tmpfs)")
    if _resident_pages(path)[probed].any():
        pytest.skip("the page cache kept the pages the probe looks at through ten drops")
    assert st.page_cache_holds(reads) is False
    # it stops at the first page missing, which the kernel may start reading (the call reads it
    # next anyway), and reads nothing else in
    assert _resident_pages(path).sum() <= 1
    os.pread(fd, n // 2, 0)
    assert st.page_cache_holds(reads[:1]) is True  # the first third only
    assert st.page_cache_holds(reads) is False


def test_a_small_call_from_the_page_cache_reads_on_fewer_threads(tiny_checkpoints, monkeypatch):
    """A call of a few experts the page cache holds is dealt to ``warm_threads`` shares (4 by
    default), the same call after a drop to every thread, as is a call over
    ``WARM_PROBE_MAX_BYTES``, one read uncached, or any with ``warm_threads=0``; a probe that
    meets a failing page means "not cached", and where the probe is refused the store stops
    probing. The bytes are the one-thread store's every time."""
    _, packed = tiny_checkpoints["qwen3_moe"]
    dealt = []
    real = st.balanced_shares
    monkeypatch.setattr(st, "balanced_shares", lambda r, t: (dealt.append(t), real(r, t))[1])
    monkeypatch.setattr(st, "MIN_SHARE_BYTES", 4096)  # tiny experts: still several shares
    store, layout = st.open_store(packed, "pread", threads=8)
    one, _ = st.open_store(packed, "pread", threads=1)
    direct, _ = st.open_store(packed, "direct", threads=8)
    never, _ = st.open_store(packed, "pread", threads=8, warm_threads=0)
    layer = min(layout.layers)
    experts = np.array([0, 3, 5, 6])
    files = {Path(p) for p in store.layers[layer].file_descriptors()}
    with store, one, direct, never:
        want = one.read(layer, experts).copy()

        def threads_of(s):
            dealt.clear()
            assert np.array_equal(s.read(layer, experts), want)
            return dealt[-1]

        if st._RWF_NOWAIT is not None:
            assert store.warm_threads == 4 and threads_of(store) == 4
            assert threads_of(never) == 8
        bandwidth.drop_page_cache(sorted(files))
        if not any(_resident_pages(p).all() for p in files):  # a file system that drops pages
            assert threads_of(store) == 8
        assert threads_of(direct) == 8
        monkeypatch.setattr(st, "WARM_PROBE_MAX_BYTES", 1)
        assert threads_of(store) == 8
        monkeypatch.setattr(st, "WARM_PROBE_MAX_BYTES", 32 << 20)

        preadv = os.preadv

        def probes_fail(code):
            def probe_or_read(fd, buffers, offset, *flags):  # the probes fail, not the reads
                if flags:
                    raise OSError(code, os.strerror(code))
                return preadv(fd, buffers, offset)

            monkeypatch.setattr(st.os, "preadv", probe_or_read)

        probes_fail(errno.EIO)  # a failing page: not cached, and the store keeps asking
        assert threads_of(store) == 8 and store._probe_cache
        probes_fail(errno.EOPNOTSUPP)  # refused: never asked again
        assert threads_of(store) == 8 and not store._probe_cache
        monkeypatch.setattr(st, "page_cache_holds", lambda r: pytest.fail("probed again"))
        assert threads_of(store) == 8
