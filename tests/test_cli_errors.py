"""Every command fails cleanly: each bad input a careless new user tried, run as the real command
(a subprocess), gets the right exit status and one line saying what is wrong, never a traceback
(docs/errors.md, "The commands")."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moeflux_mlx.format.checkpoint import PACKED_DIR
from moeflux_mlx.format.convert import convert
from moeflux_mlx.options import (
    ENVIRONMENT,
    LoadOptions,
    OptionError,
    Tuning,
    from_environment,
    parse_budget,
    share_of_experts,
)
from tests.support import synth

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 180
# the last line of a one-line error: a command's own, or argparse's for a bad flag
ERROR_LINE = re.compile(r"^moeflux-mlx(?: [a-z]+)?: error: ")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A plain tiny qwen3_moe checkpoint, its conversion, a truncated copy of the conversion, a
    dense (not MoE) checkpoint and a mixtral conversion (other experts)."""
    root = tmp_path_factory.mktemp("cli-errors")
    src = synth.build_checkpoint(root / "qwen3_moe", "qwen3_moe", "tiny")
    packed = convert(src, root / "qwen3_moe-packed", progress=False)
    truncated = root / "truncated"
    shutil.copytree(packed, truncated)
    layer0 = truncated / PACKED_DIR / "layer_00.bin"
    os.truncate(layer0, layer0.stat().st_size // 2)
    other = synth.build_checkpoint(root / "mixtral", "mixtral", "tiny")
    other_packed = convert(other, root / "mixtral-packed", progress=False)
    return dict(
        src=src,
        packed=packed,
        truncated=truncated,
        dense=_dense_checkpoint(root / "dense"),
        other_packed=other_packed,
    )


def _dense_checkpoint(path: Path) -> Path:
    from mlx_lm.utils import _get_classes, save_config, save_model

    cfg = dict(synth.model_config("qwen3_moe", "tiny"), model_type="qwen3")
    for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        cfg.pop(k, None)
    model_class, args_class = _get_classes(cfg)
    save_model(path, model_class(args_class.from_dict(cfg)))
    save_config(cfg, path / "config.json")
    return path


def _env(tmp_path=None, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOEFLUX_")}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if tmp_path is not None:
        env["XDG_CACHE_HOME"] = str(tmp_path / "xdg-cache")
    env.update(extra)
    return env


def _ctrl_c_as_in_a_terminal() -> None:
    """A child's SIGINT as a terminal gives it, even when the test runner ignores SIGINT (a
    shell's background job does; Python then never turns it into KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cli(*args, env=None, stdin=None, cwd=None, timeout=TIMEOUT) -> subprocess.CompletedProcess:
    """``moeflux-mlx ARGS`` as a user runs it (``python -m moeflux_mlx.cli``)."""
    return subprocess.run(
        [sys.executable, "-m", "moeflux_mlx.cli", *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        env=env or _env(),
        cwd=cwd,
        timeout=timeout,
    )


def one_line_error(r: subprocess.CompletedProcess, status: int = 2) -> str:
    """The error line of a failed command: exit ``status``, no traceback, the message last."""
    everything = r.stdout + r.stderr
    assert "Traceback" not in everything, everything
    assert r.returncode == status, everything
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines and ERROR_LINE.match(lines[-1]), r.stderr
    return lines[-1]


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert r.returncode == 0, r.stdout + r.stderr
    return r


# --------------------------------------------------------------------------- 1. compare


@pytest.mark.parametrize("case", ["missing", "empty", "corrupt-config"])
def test_compare_bad_model_is_one_line(case, tmp_path):
    path = tmp_path / "model"
    if case != "missing":
        path.mkdir()
    if case == "corrupt-config":
        (path / "config.json").write_text("{not json")
    line = one_line_error(run_cli("compare", path))
    expected = {
        "missing": "no such directory",
        "empty": "no config.json",
        "corrupt-config": "config.json: unreadable",
    }[case]
    assert expected in line, line


def test_compare_checks_a_dense_model_before_running_stock(models):
    r = run_cli("compare", models["dense"])
    assert "not an MoE checkpoint" in one_line_error(r)
    assert "stock mlx-lm: loading" not in r.stderr  # refused before stock mlx-lm ran


def test_compare_converted_of_another_model_is_one_line(models):
    r = run_cli("compare", models["src"], "--converted", models["other_packed"])
    line = one_line_error(r)
    assert "--converted must be a conversion of MODEL" in line, line
    assert "stock mlx-lm: loading" not in r.stderr
    line = one_line_error(run_cli("compare", models["src"], "--converted", models["truncated"]))
    assert "truncated?" in line, line


# --------------------------------------------------------------------------- 2, 3. server


def test_server_refuses_a_damaged_model_before_listening(models):
    r = run_cli("server", "--model", models["truncated"], "--port", "0", timeout=60)
    assert "truncated?" in one_line_error(r)
    assert "Serving" not in r.stderr


def test_server_on_a_port_in_use_is_one_line(models):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = run_cli("server", "--model", models["packed"], "--port", port, timeout=60)
    assert f"127.0.0.1:{port} is already in use" in one_line_error(r)
    assert time.monotonic() - t0 < 60 and "Serving" not in r.stderr


# --------------------------------------------------------------------------- 4. sampling flags


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_max_tokens_zero_is_a_usage_error(command, models):
    r = run_cli(command, "--model", models["packed"], "--max-tokens", "0", "-p", "hi")
    assert "--max-tokens" in one_line_error(r) and ">= 1" in r.stderr


# --------------------------------------------------------------------------- 5. variables


@pytest.mark.parametrize(
    "var,value,command,expected",
    [
        ("MOEFLUX_BACKEND", "banana", "generate", "expected one of auto, ops, metal, cuda"),
        ("MOEFLUX_EXPERT_IO", "banana", "info", "expected one of auto, mmap, pread, direct"),
        ("MOEFLUX_EXPERT_IO", "banana", "generate", "expected one of auto, mmap, pread, direct"),
        ("MOEFLUX_EVICTION", "fifo", "info", "expected one of transition, lru"),
        ("MOEFLUX_PIN_EXPERTS", "maybe", "generate", "expected auto or one of 1, on, true"),
    ],
)
def test_bad_variable_is_one_line(models, var, value, command, expected):
    args = [command, models["packed"]] if command == "info" else [command, "--model"]
    args += [models["packed"], "-m", "2"] if command != "info" else []
    r = run_cli(*args, env=_env(**{var: value}))
    line = one_line_error(r)
    assert line == f"moeflux-mlx: error: {var}={value}: {expected}" or (
        line.startswith(f"moeflux-mlx: error: {var}={value}: {expected}")
    ), line
    assert "WARNING" not in r.stderr  # refused, not warned about and carried on


def test_variables_are_read_case_insensitively(models):
    r = ok(run_cli("info", models["packed"], env=_env(MOEFLUX_EXPERT_IO="PREAD")))
    assert re.search(r"^expert I/O\s+pread \(requested: MOEFLUX_EXPERT_IO=PREAD\)", r.stdout, re.M)
    r = ok(run_cli("info", models["packed"], env=_env(MOEFLUX_BACKEND="Ops")))
    assert re.search(r"^backend\s+ops \(ops,", r.stdout, re.M), r.stdout
    # and flags too
    r = ok(run_cli("info", models["packed"], "--expert-io", "MMAP"))
    assert re.search(r"^expert I/O\s+mmap \(requested: --expert-io mmap\)", r.stdout, re.M)


def test_options_are_read_in_one_place(monkeypatch):
    """LoadOptions.resolve is strict; select_expert_io's lenient reading still warns (io/store)."""
    monkeypatch.setenv("MOEFLUX_EXPERT_IO", "Pread")
    monkeypatch.setenv("MOEFLUX_EVICTION", "LRU")
    opts = LoadOptions.resolve()
    assert opts.expert_io == "pread" and opts.eviction == "lru"
    monkeypatch.setenv("MOEFLUX_EXPERT_IO", "bogus")
    with pytest.raises(OptionError, match="MOEFLUX_EXPERT_IO=bogus: expected one of"):
        LoadOptions.resolve()
    assert from_environment()["expert_io"] == "bogus"  # lenient: for select_expert_io to warn
    with pytest.raises(TypeError, match="threads"):  # the machine's choice, not an option
        LoadOptions.resolve(threads=0, expert_io="mmap")
    with pytest.raises(OptionError, match="threads must be >= 1"):
        Tuning(threads=0)
    with pytest.raises(OptionError, match="slot_writes='gpu': expected one of host, device"):
        Tuning(slot_writes="gpu")
    tuned = Tuning(threads=3, warm_read_threads=0)  # 0: every thread, always
    assert LoadOptions.resolve(expert_io="mmap", tuning=tuned).tuning == tuned
    with pytest.raises(OptionError, match="tuning="):
        LoadOptions.resolve(expert_io="mmap", tuning={"threads": 3})
    assert LoadOptions.resolve(expert_io="MMAP").expert_io == "mmap"
    assert LoadOptions.resolve(expert_io="mmap").pin_experts is None  # the machine decides
    monkeypatch.setenv("MOEFLUX_PIN_EXPERTS", "On")
    assert LoadOptions.resolve(expert_io="mmap").pin_experts is True
    # the argument wins over the variable
    assert LoadOptions.resolve(expert_io="mmap", pin_experts=False).pin_experts is False
    monkeypatch.setenv("MOEFLUX_PIN_EXPERTS", "AUTO")
    assert LoadOptions.resolve(expert_io="mmap").pin_experts is None
    monkeypatch.setenv("MOEFLUX_PIN_EXPERTS", "maybe")
    with pytest.raises(OptionError, match="MOEFLUX_PIN_EXPERTS=maybe: expected auto or one of"):
        LoadOptions.resolve(expert_io="mmap")


def test_the_machine_s_choices_are_no_variables(monkeypatch):
    """What the machine decides (``Tuning``) is read from no variable: the variables that once
    set it are not options, so a value they hold, good or bad, changes nothing and stops
    nothing."""
    removed = {
        "MOEFLUX_THREADS": "0",
        "MOEFLUX_WARM_READ_THREADS": "-1",
        "MOEFLUX_DEVICE_TABLE": "maybe",
        "MOEFLUX_SLOT_WRITES": "gpu",
        "MOEFLUX_WAIT_TIMEOUT_S": "soon",
        "MOEFLUX_PREFETCH": "on",
        "MOEFLUX_PREFILL_WHOLE_LAYER": "0",
    }
    for var, value in removed.items():
        monkeypatch.setenv(var, value)
    assert not set(removed) & {var for var, _ in ENVIRONMENT.values()}
    assert LoadOptions.resolve() == LoadOptions()
    assert from_environment(strict=True) == {}


# --------------------------------------------------------------------------- 6. ~ in load()


def test_readme_python_example_expands_home(models, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(models["packed"], home / "models" / "m")
    code = textwrap.dedent("""
        import moeflux_mlx
        from mlx_lm import generate
        model, tokenizer = moeflux_mlx.load("~/models/m", cache_budget="8MB")
        print(repr(generate(model, tokenizer, "Hello", max_tokens=4)))
        print(moeflux_mlx.stats(model)["total"]["calls"] > 0)
        model.moeflux.close()
    """)
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_env(HOME=str(home)),
        timeout=TIMEOUT,
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.splitlines()[-1] == "True"


# --------------------------------------------------------------------------- 7. info


def test_info_reports_a_truncated_model(models):
    line = one_line_error(run_cli("info", models["truncated"]))
    assert "layer_00.bin" in line and "truncated?" in line, line


@pytest.mark.parametrize("command", ["info", "generate", "chat", "server", "compare"])
def test_a_file_for_a_model_directory_is_one_line(command, models):
    config = models["packed"] / "config.json"
    args = [command, config] if command in ("info", "compare") else [command, "--model", config]
    assert "not a directory" in one_line_error(run_cli(*args, timeout=60))


# --------------------------------------------------------------------------- 8. budgets


@pytest.mark.parametrize(
    "budget,expected",
    [
        ("0.25", "write '25% experts' (of the experts' bytes), '25% RAM' (of physical RAM)"),
        ("1.5", "a number alone names no base"),
        ("1000", "a number alone names no base: write '25% experts'"),
        ("-5GB", "is negative"),  # as two words: argparse alone says "expected one argument"
        ("-0.5", "is negative"),
        ("8G", "unit 'G' is ambiguous: write 8GB (x 1000^n bytes) or 8GiB"),
        ("lots", "expected a size with a unit"),
        ("8 parsecs", "expected a size with a unit"),
    ],
)
def test_bad_budget_is_one_line(models, budget, expected):
    line = one_line_error(run_cli("info", models["packed"], "--cache-budget", budget))
    assert "--cache-budget" in line and expected in line, line


def test_budget_is_shown_in_the_units_typed(models):
    # (the tiny model holds 0.84 MiB of experts: a larger budget is shown as what it holds)
    for typed, shown, given in [
        ("512KiB", "512 KiB", "512 KiB"),
        ("0.5MB", "0.5 MB", "0.5 MB"),
        ("8MiB", "0.84 MiB", "8 MiB"),
        ("0", "0 B", "0 B"),
    ]:
        r = ok(run_cli("info", models["packed"], "--cache-budget", typed))
        row = re.search(r"^expert cache\s+(.*)$", r.stdout, re.M)[1]
        assert row.startswith(f"{shown} of MLX memory"), row
        assert row.endswith(f"; --cache-budget {given})"), row
    r = ok(run_cli("generate", "--model", models["packed"], "-m", "2", "--cache-budget", "1MiB"))
    assert "budget 1 MiB" in r.stderr, r.stderr


def test_parse_budget_units():
    ram = __import__("psutil").virtual_memory().total
    assert parse_budget("8MB", 1) == 8 * 1000**2 and parse_budget("8mb", 1) == 8 * 1000**2
    assert parse_budget("8MiB", 1) == 8 * 1024**2 and parse_budget("2 GiB", 1) == 2 * 1024**3
    assert parse_budget("1000B", 1) == 1000 and parse_budget(1000, 1) == 1000
    assert parse_budget("25% experts", 1000) == 250 and parse_budget("25 % of Experts", 8) == 2
    assert parse_budget("25% RAM", 1) == int(0.25 * ram)
    assert parse_budget(share_of_experts(0.25), 1000) == 250
    assert parse_budget("all", 7) == 7 and parse_budget("0", 7) == 0 and parse_budget(0.0, 7) == 0
    # a share names its base: a bare number is refused, the message naming both forms
    for bare in ("0.25", 0.25, "1"):
        with pytest.raises(OptionError, match="names no base") as e:
            parse_budget(bare, 1)
        assert "% experts" in str(e.value) and "% RAM" in str(e.value)
    for bad in ("1.5", 1.5, "1000", "8G", "-1GB", -1, True, "nan", float("inf"), "150% RAM"):
        with pytest.raises(OptionError, match="cache budget"):
            parse_budget(bad, 1)


# --------------------------------------------------------------------------- 9. convert

THROTTLED_CONVERT = textwrap.dedent("""
    import sys, time
    import moeflux_mlx.format.convert as cv
    real = cv.read_exact
    def slow(*a, **kw):
        time.sleep(0.02)
        return real(*a, **kw)
    cv.read_exact = slow
    from moeflux_mlx.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_convert_ctrl_c_says_where_the_partial_is_and_a_rerun_resumes(models, tmp_path):
    dst = tmp_path / "out"
    partial = tmp_path / "out.partial"
    proc = subprocess.Popen(
        [sys.executable, "-c", THROTTLED_CONVERT, "convert", models["src"], dst, "-q"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        preexec_fn=_ctrl_c_as_in_a_terminal,
    )
    deadline = time.monotonic() + 60
    while not list((partial / PACKED_DIR).glob("layer_*.bin")):  # one layer done, then Ctrl-C
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in out + err
    assert f"the completed part is kept in {partial}" in err and "resumes" in err, err
    assert not dst.exists() and partial.is_dir()

    r = ok(run_cli("convert", models["src"], dst, "-q"))
    assert f"Resuming the interrupted conversion in {partial}" in r.stderr, r.stderr
    assert "Converted" in r.stdout and dst.is_dir() and not partial.exists()


def test_convert_rerun_of_a_finished_conversion_is_nothing_to_do(models):
    r = ok(run_cli("convert", models["src"], models["packed"], "-q"))
    assert "Nothing to do" in r.stderr and str(models["packed"]) in r.stderr
    r = ok(run_cli("convert", models["src"], models["packed"], "-q", "--verify"))
    assert "verified byte for byte" in r.stdout


def test_convert_into_an_empty_directory(models, tmp_path):
    dst = tmp_path / "empty"
    dst.mkdir()
    r = ok(run_cli("convert", models["src"], dst, "-q"))
    assert "Converted" in r.stdout and (dst / PACKED_DIR / "layout.json").is_file()
    assert not (tmp_path / "empty.partial").exists()


def test_convert_to_an_unwritable_destination_keeps_nothing(models, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = one_line_error(run_cli("convert", models["src"], blocker / "out", "-q"))
    assert "nothing was written" in line and "kept" not in line, line
    assert not (tmp_path / "out.partial").exists()
    if os.geteuid() != 0:  # root writes anywhere; a read-only directory then proves nothing
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        try:
            line = one_line_error(run_cli("convert", models["src"], ro / "out", "-q"))
        finally:
            ro.chmod(0o755)
        assert "nothing was written" in line and "kept" not in line, line


@pytest.mark.parametrize("case", ["other", "itself", "converted-src"])
def test_convert_refusals_are_one_line(models, tmp_path, case):
    if case == "other":
        dst = tmp_path / "busy"
        dst.mkdir()
        (dst / "notes.txt").write_text("mine")
        line = one_line_error(run_cli("convert", models["src"], dst, "-q"))
        assert "already exists" in line and (dst / "notes.txt").read_text() == "mine"
    elif case == "itself":
        line = one_line_error(run_cli("convert", models["src"], models["src"], "-q"))
        assert "is SRC itself" in line, line
    else:
        line = one_line_error(run_cli("convert", models["packed"], tmp_path / "x", "-q"))
        assert "already a converted moeflux directory" in line


# --------------------------------------------------------------------------- 11. bench

BLOCK_MATPLOTLIB = "raise ImportError('No module named matplotlib (blocked by the test)')\n"


def test_bench_default_output_folder_no_overwrite_and_no_plot_said(models, tmp_path):
    r = ok(run_cli("bench", "--help"))
    assert "moeflux-bench-results" in " ".join(r.stdout.split())
    blocked = tmp_path / "blocked"
    (blocked / "matplotlib").mkdir(parents=True)
    (blocked / "matplotlib" / "__init__.py").write_text(BLOCK_MATPLOTLIB)
    env = _env(tmp_path, PYTHONPATH=f"{blocked}{os.pathsep}{REPO}")
    cwd = tmp_path / "work"
    cwd.mkdir()
    args = ["bench", models["packed"], "--no-stock", "--budgets", "1", "--expert-io", "mmap"]
    args += ["--prompt-tokens", "4", "--decode-tokens", "2"]
    first = ok(run_cli(*args, env=env, cwd=cwd))
    second = ok(run_cli(*args, env=env, cwd=cwd))
    assert sorted(p.name for p in cwd.iterdir()) == ["moeflux-bench-results"]  # nothing else
    files = sorted(p.name for p in (cwd / "moeflux-bench-results").iterdir())
    assert len(files) == 4 and not any(f.endswith(".png") for f in files), files
    stems = {f.rsplit(".", 1)[0] for f in files}
    assert len(stems) == 2 and any(s.endswith("-decode-2") for s in stems), files
    for r in (first, second):
        assert "no plot: matplotlib is not installed" in r.stdout, r.stdout


@pytest.mark.parametrize(
    "flags,expected",
    [
        (["--budgets", "1,2"], "--budgets: 2 is not a fraction in [0, 1]"),
        (["--budgets", "half"], "--budgets: 'half' is not a number"),
        (["--prompt-tokens", "0"], "--prompt-tokens: expected a whole number >= 1"),
        (["--decode-tokens", "0"], "--decode-tokens: expected a whole number >= 1"),
        (["/no/such/model"], "/no/such/model: no such directory"),
    ],
)
def test_bench_bad_flags_are_one_line(flags, expected, tmp_path):
    r = run_cli("bench", *flags, env=_env(tmp_path), cwd=tmp_path)
    assert expected in one_line_error(r)


# --------------------------------------------------------------------------- 13. small things


def test_chat_unknown_command_is_not_sent_to_the_model(models):
    r = ok(run_cli("chat", "--model", models["packed"], "-m", "3", stdin="/frobnicate\n/quit\n"))
    assert "Unknown command /frobnicate" in r.stderr
    assert "[prompt:" not in r.stderr  # nothing was generated


def test_prompt_from_stdin_drops_the_trailing_newline(models):
    def prompt_tokens(r):
        return int(re.search(r"\[prompt: (\d+) tokens", r.stderr)[1])

    args = ["generate", "--model", models["packed"], "-m", "2", "--ignore-chat-template"]
    typed = ok(run_cli(*args, "--prompt", "hello there"))
    piped = ok(run_cli(*args, "--prompt", "-", stdin="hello there\n"))
    assert prompt_tokens(piped) == prompt_tokens(typed)


def test_every_expert_resident_is_not_a_zero_hit_rate(models):
    r = ok(run_cli("generate", "--model", models["packed"], "-m", "8", "--cache-budget", "all"))
    stats = re.search(r"experts: (.*)\]$", r.stderr, re.M)[1]
    # the first call of each layer fills it (a miss, by necessity); every later call finds
    # all its experts resident, and each of its selections counts as a hit
    m = re.fullmatch(
        r".* read, hit rate ([\d.]+)%, (\d+) of (\d+) layer calls all resident \(mmap\)", stats
    )
    assert m and 50 < float(m[1]) < 100 and 0 < int(m[2]) < int(m[3]), stats


# --------------------------------------------------------------------------- beyond the list


@pytest.mark.parametrize(
    "args,expected",
    [
        (["generate", "--threads", "3"], "unrecognized arguments: --threads"),
        (["generate", "--max-tokens", "-1"], "--max-tokens/-m: expected a whole number >= 1"),
        (["generate", "--temp", "-1"], "--temp: expected a number >= 0"),
        (["generate", "--top-p", "1.5"], "--top-p: expected a number >= 0 and <= 1"),
        (["generate", "--seed", "x"], "--seed: expected a whole number, got 'x'"),
        (["generate", "--seed", "-1"], "--seed: expected a whole number from 0"),
        (["generate", "--expert-io", "disk"], "--expert-io: invalid choice: 'disk'"),
        (["chat", "--temp", "nan"], "--temp: expected a number >= 0"),
        (["compare", "--max-tokens", "0"], "--max-tokens/-m: expected a whole number >= 1"),
        (["server", "--port", "70000"], "--port: expected a whole number from 0 to 65535"),
        (["server", "--max-tokens-limit", "0"], "--max-tokens-limit: expected a whole number"),
        (["server", "--decode-concurrency", "0"], "--decode-concurrency: expected a whole"),
        (["demo", "--max-tokens", "0"], "--max-tokens/-m: expected a whole number >= 1"),
        (["info", "--device-table"], "unrecognized arguments: --device-table"),
        (["generate", "--prefetch"], "unrecognized arguments: --prefetch"),
        (["server", "--prompt-cache-bytes", "lots"], "--prompt-cache-bytes: expected a size"),
        (["server", "--top-k", "-1"], "--top-k: expected a whole number >= 0"),
    ],
)
def test_bad_flag_values_are_usage_errors(args, expected, models):
    r = run_cli(*args, timeout=60)
    line = one_line_error(r)
    assert expected in line, line


def test_generate_bad_prompts_are_one_line(models):
    args = ["generate", "--model", models["packed"], "-m", "2"]
    line = one_line_error(run_cli(*args, "--ignore-chat-template", "--prompt", ""))
    assert "the prompt is empty" in line
    r = subprocess.run(
        [sys.executable, "-m", "moeflux_mlx.cli", *map(str, args), "--prompt", "-"],
        input=b"\xff\xfe\xfa not text\n",
        capture_output=True,
        env=_env(),
        timeout=TIMEOUT,
    )
    err = r.stderr.decode()
    assert r.returncode == 2 and "Traceback" not in err, err
    assert "standard input is not text" in err.splitlines()[-1]


def test_generate_missing_model_and_server_bad_host_are_one_line(tmp_path, models):
    line = one_line_error(run_cli("generate", "--model", tmp_path / "nope", "-m", "2"))
    assert "no such directory" in line
    r = run_cli("server", "--model", models["packed"], "--host", "no.such.host.invalid", timeout=60)
    assert "--host no.such.host.invalid: not an address to listen on" in one_line_error(r)
    r = run_cli(
        "server", "--model", models["packed"], "--max-tokens", "600", "--max-tokens-limit", "500"
    )
    assert "--max-tokens 600 is more than --max-tokens-limit 500" in one_line_error(r)


def test_closed_stdout_ends_quietly(models):
    """``moeflux-mlx info X | head -1``: no BrokenPipeError traceback."""
    cmd = f"{sys.executable} -m moeflux_mlx.cli info {models['packed']} | head -1"
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True, env=_env(), timeout=60)
    assert r.stdout.startswith("model") and "Traceback" not in r.stderr, r.stderr


def test_layout_json_written_by_convert_is_json(models):
    json.loads((models["packed"] / PACKED_DIR / "layout.json").read_text())


def test_flag_values_that_start_with_a_dash():
    from moeflux_mlx import cli
    from moeflux_mlx.commands.common import join_dash_values

    parser = cli.build_parser()
    argv = ["generate", "--cache-budget", "-5GB", "-p", "-x", "-m", "-1", "--prompt", "-"]
    assert join_dash_values(parser, argv) == [
        "generate",
        "--cache-budget=-5GB",
        "-p=-x",
        "-m=-1",
        "--prompt",
        "-",
    ]
    # a flag after a flag stays a flag (argparse then says the first one lacks its value)
    assert join_dash_values(parser, ["generate", "-p", "--model", "m"]) == [
        "generate",
        "-p",
        "--model",
        "m",
    ]
    args = parser.parse_args(join_dash_values(parser, ["generate", "--prompt", "-hello"]))
    assert args.prompt == "-hello"


def test_ctrl_c_is_one_line_and_exit_130(models):
    proc = subprocess.Popen(
        [sys.executable, "-m", "moeflux_mlx.cli", "generate", "--model", str(models["packed"])]
        + ["-m", "100000", "--ignore-chat-template"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        preexec_fn=_ctrl_c_as_in_a_terminal,
    )
    time.sleep(0.5)
    deadline = time.monotonic() + 60
    lines = []
    while not any(line.startswith("Loaded in") for line in lines):
        lines.append(proc.stderr.readline())
        assert proc.poll() is None and time.monotonic() < deadline, lines
    time.sleep(1.0)  # generating now
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "Interrupted.", err


def test_server_missing_draft_model_is_one_line(models, tmp_path):
    r = run_cli("server", "--model", models["packed"], "--draft-model", tmp_path / "nope")
    assert f"{tmp_path / 'nope'}: no such directory" in one_line_error(r)


@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_backend_that_cannot_run_here_is_reported_as_what_ran(models, tmp_path, backend):
    """``--backend metal`` / ``cuda`` where that dialect cannot run: one warning, and the status
    lines name the backend that actually computed the experts, not the one asked for."""
    import mlx.core as mx

    if mx.default_device() == mx.gpu and (mx.metal.is_available() or mx.cuda.is_available()):
        pytest.skip("a GPU backend is present: the requested kernels may well run here")
    r = ok(
        run_cli(
            "generate",
            "--model",
            models["packed"],
            "-p",
            "hi",
            "-m",
            "3",
            "--backend",
            backend,
            env=_env(tmp_path),
        )
    )
    warnings = [line for line in r.stderr.splitlines() if f"backend '{backend}' requested" in line]
    assert len(warnings) == 1, r.stderr
    loaded = next(line for line in r.stderr.splitlines() if line.startswith("Loaded in"))
    assert "backend: ops (fallback:" in loaded and f"backend: {backend})" not in loaded, loaded
