"""``convert`` killed with SIGKILL at random points, then rerun: the rerun always ends with a
verified conversion, DST never exists half-written, and the source is never modified.

The kills happen in a separate process: a small "fork server" child imports moeflux once, then
forks one grandchild per conversion attempt and SIGKILLs it. Two kinds of kill points:

* random: after a seeded random delay, while the grandchild converts with its source reads
  throttled to a simulated 50 MB/s disk (so the ~57 MB checkpoint takes over a second and the
  kill can land anywhere: inside a copy, an fsync, a rename, the side files, ...); some trials
  kill the resumed run a second time before the final rerun;
* deterministic: just before and just after each of the conversion's commit points (every
  ``os.replace`` / ``os.rename`` it makes), so each step of the protocol is hit at least once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support import synth

ROOT = Path(__file__).resolve().parents[1]
SEED = 20261122
RANDOM_KILLS = 12

SERVER = r"""
import hashlib, importlib, json, os, random, shutil, signal, sys, threading, time
from pathlib import Path
C = importlib.import_module("moeflux_mlx.format.convert")
import mlx_lm.utils  # convert imports it on first use: import it once here, not in every attempt
src, work, seed, n_random = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
assert threading.active_count() == 1  # safe to fork

def tree_sha(p):
    return {str(f.relative_to(p)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(p.rglob("*")) if f.is_file()}

def listing(p):
    return sorted(str(f.relative_to(p)) for f in p.rglob("*")) if p.exists() else None

def grandchild(dst, throttle, commit=None, after=False):
    # runs in the forked process; never returns
    try:
        if throttle:
            C.CHUNK_BYTES = 1 << 20
            real_read = C.read_exact
            def slow_read(fd, start, into, what):
                real_read(fd, start, into, what)
                time.sleep(len(into) / 50e6)  # a 50 MB/s disk
            C.read_exact = slow_read
        count = [0]
        for name in ("replace", "rename"):
            real = getattr(os, name)
            def hook(*a, _real=real, **kw):
                count[0] += 1
                if commit is not None and count[0] == commit and not after:
                    os.kill(os.getpid(), signal.SIGKILL)
                r = _real(*a, **kw)
                if commit is not None and count[0] == commit and after:
                    os.kill(os.getpid(), signal.SIGKILL)
                return r
            setattr(os, name, hook)
        C.convert(src, dst, progress=False)
        os.write(3, json.dumps(count[0]).encode())
        os._exit(0)
    except BaseException as e:
        os.write(2, repr(e).encode())
        os._exit(3)

def attempt(dst, throttle, delay=None, commit=None, after=False):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.dup2(w, 3)
        grandchild(dst, throttle, commit, after)
    os.close(w)
    t0 = time.perf_counter()
    if delay is not None:
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)  # harmless if it already finished
    _, status = os.waitpid(pid, 0)
    out = os.read(r, 100)
    os.close(r)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    if not killed:
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    return killed, time.perf_counter() - t0, (json.loads(out) if out else None)

def after_kill(dst):
    # the state a kill leaves, then the rerun that must finish it
    partial = dst.with_name(dst.name + ".partial")
    state = {"dst_exists": dst.exists(), "partial": listing(partial)}
    if dst.exists():  # the kill came after the final rename: DST must be complete already
        C.verify_conversion(src, dst, progress=False)
        state["dst_verified_before_rerun"] = True
        # and the rerun says there is nothing to do, without touching it
        sha, said = tree_sha(dst), []
        assert C.convert(src, dst, verify=True, progress=False, notify=said.append) == dst
        assert said and said[0].startswith("Nothing to do"), said
        assert tree_sha(dst) == sha
    else:
        C.convert(src, dst, verify=True, progress=False)
    C.verify_conversion(src, dst, progress=False)
    state["rerun_verified"] = True
    state["partial_after"] = partial.exists()
    state["stray"] = [n for n in listing(dst) if n.endswith(".tmp") or n.startswith(".moeflux")]
    shutil.rmtree(dst)
    return state

before = tree_sha(src)
report = {"random": [], "commit": []}

# how long an unkilled throttled conversion takes, and how many commit points it has
killed, duration, commits = attempt(work / "probe", True)
assert not killed
C.verify_conversion(src, work / "probe", progress=False)
shutil.rmtree(work / "probe")
report["duration_s"] = duration
report["commits"] = commits

rng = random.Random(seed)
for i in range(n_random):
    dst = work / f"random{i}"
    kills = []
    for k in range(rng.choice([1, 1, 2])):
        delay = rng.uniform(0.0, duration * 1.05)
        killed, _, _ = attempt(dst, True, delay=delay)
        kills.append([round(delay, 3), killed])
        if not killed:  # it finished before the kill: there is no run left to resume
            break
    report["random"].append({"kills": kills, **after_kill(dst)})

for k in range(1, commits + 1):
    for after in (False, True):
        dst = work / f"commit{k}{'a' if after else 'b'}"
        killed, _, _ = attempt(dst, False, commit=k, after=after)
        report["commit"].append({"commit": k, "after": after, "killed": killed, **after_kill(dst)})

report["source_unchanged"] = tree_sha(src) == before
report["sources"] = len(before)
print(json.dumps(report))
"""


def test_convert_survives_sigkill(tmp_path):
    src = synth.build_checkpoint(
        tmp_path / "src", "qwen3_moe", "small", overrides={"num_hidden_layers": 8}
    )
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(SERVER),
            str(src),
            str(work),
            str(SEED),
            str(RANDOM_KILLS),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        json.dumps({k: v for k, v in report.items() if k in ("duration_s", "commits", "sources")})
    )

    assert report["duration_s"] > 1.0, "conversion too fast for random kill points to spread"
    assert report["commits"] >= 12  # state, shard, index, 8 layers, layout, config, rename
    random_kills = [k for t in report["random"] for k in t["kills"]]
    landed = [k for k in random_kills if k[1]]
    assert len(landed) >= 10, f"only {len(landed)} of the random kills landed mid-conversion"
    for t in report["random"] + report["commit"]:
        assert t["rerun_verified"] and not t["partial_after"] and not t["stray"], t
        if t["dst_exists"]:  # only after the final rename, and then DST is complete
            assert t.get("dst_verified_before_rerun"), t
    assert all(t["killed"] for t in report["commit"])
    # every kill before the final rename leaves no DST
    final = report["commits"]
    for t in report["commit"]:
        if t["commit"] < final or not t["after"]:
            assert not t["dst_exists"], t
    assert report["source_unchanged"]
    for t in report["random"]:
        p = t["partial"] or []
        print(
            "kills",
            t["kills"],
            "-> DST" if t["dst_exists"] else "-> no DST",
            f"partial: {sum(n.endswith('.bin') for n in p)} layer files, "
            f"{sum(n.endswith('.tmp') for n in p)} .tmp"
            if t["partial"] is not None
            else "no partial",
        )
    print(
        f"{len(landed)} random kills landed (of {len(random_kills)}), "
        f"{len(report['commit'])} commit-point kills, source files: {report['sources']}"
    )
