"""Prompt-lookup speculation (model/lookup_decoding.py) gives what plain decoding gives, bit for
bit on the CPU, on a streamed model; the KV cache is rewound after rejected drafts; the CLI flag;
and mlx-lm's own draft-model speculation through a streamed main model.

On a GPU a pass of several tokens rounds unlike as many one-token steps (other matmul shapes):
stock mlx-lm's own draft-model speculation changes its tokens there (seen on an H100). So on a
GPU the streamed model is held to plain decoding's tokens, and where its passes are computed as
stock computes them (every expert resident) to the same speculation through stock mlx-lm's
model, bit for bit; on the CPU to both, log-probs included."""

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

import moeflux_mlx
from moeflux_mlx import cli
from moeflux_mlx.errors import OptionError
from moeflux_mlx.format.checkpoint import expert_layout
from moeflux_mlx.model.lookup_decoding import (
    LookupStats,
    NgramIndex,
    lookup_generate_step,
    stream_lookup_generate,
)
from tests.support import synth

ON_GPU = mx.default_device() == mx.gpu
N = 40
TEXT = "the quick brown fox jumps over the lazy dog " * 3  # repeats: drafts get accepted
EXACT = dict(backend="ops")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two tiny qwen3_moe checkpoints of one shape (so one vocabulary and tokenizer): the main
    model and, with other weights, a draft model for mlx-lm's speculation."""
    root = tmp_path_factory.mktemp("lookup")
    main = synth.build_checkpoint(root / "main", "qwen3_moe", "tiny", seed=1)
    draft = synth.build_checkpoint(root / "draft", "qwen3_moe", "tiny", seed=2)
    return main, draft


def _load(path, budget):
    if budget != "all":  # a fraction of the experts' bytes: experts stream
        budget = int(budget * expert_layout(path).total_expert_bytes)
    return moeflux_mlx.load(path, cache_budget=budget, **EXACT)


def _plain(model, prompt, n=N, cache=None, **kwargs):
    steps = generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache, **kwargs)
    return [(int(t), lp) for t, lp in steps]


def _assert_same(got, want):
    assert [t for t, *_ in got] == [t for t, *_ in want]
    for (_, g, *_), (_, w, *_) in zip(got, want):
        assert mx.array_equal(g, w).item(), float(mx.abs(g - w).max())


def _assert_plain(got, want):
    """``got`` (speculative) is plain decoding's ``want``: bit for bit on the CPU, its tokens on
    a GPU (see the module's text)."""
    if ON_GPU:
        assert [t for t, *_ in got] == [t for t, *_ in want]
    else:
        _assert_same(got, want)


def _as_stock(got, path, prompt, **kwargs):
    """``got`` is bit for bit what the same speculation gives through stock mlx-lm's model."""
    stock, _ = mlx_lm.load(str(path))
    want = list(lookup_generate_step(mx.array(prompt), stock, max_tokens=N, **kwargs))
    _assert_same(got, want)
    assert [d for *_, d in got] == [d for *_, d in want]  # the same drafts accepted


def test_ngram_index_drafts_the_latest_longest_match():
    idx = NgramIndex(1, 3)
    idx.extend([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3])
    assert idx.draft(2) == [7, 5]  # "2 3" last seen followed by 7 (not the earlier 9)
    idx.extend([9])  # "2 3 9" now matches the first occurrence, three tokens long
    assert idx.draft(3) == [1, 2, 3]
    assert idx.draft(0) == []
    idx = NgramIndex(1, 2)
    idx.extend([4, 5, 4, 5])  # a repetition running into the end goes on as itself
    assert idx.draft(5) == [4, 5, 4, 5, 4]
    idx.extend([6])
    assert idx.draft(3) == []  # 6 was never seen before


@pytest.mark.parametrize("budget", [0.25, "all"])
@pytest.mark.parametrize("k", [2, 5])
def test_greedy_is_plain_decoding_bit_for_bit(ckpts, budget, k):
    model, tokenizer = _load(ckpts[0], budget)
    with model.moeflux as rt:
        prompt = tokenizer.encode(TEXT)
        want = _plain(model, prompt)
        rt.reset_stats()
        stats = LookupStats()
        got = list(
            lookup_generate_step(
                mx.array(prompt), model, num_draft_tokens=k, max_tokens=N, stats=stats
            )
        )
        _assert_plain(got, want)  # tokens, and every log-prob (verified in a batch or not)
        if budget == "all" or not ON_GPU:  # at 25% a pass's MoE layers go a token at a time
            _as_stock(got, ckpts[0], prompt, num_draft_tokens=k)
        assert stats.accepted > 0 and stats.accepted == sum(d for *_, d in got)
        assert stats.steps < N  # fewer forward passes than tokens
        assert stats.build_s > 0 and stats.eval_s > 0  # where the passes' time went
        t = rt.stats_dict()["total"]
        if budget != "all":  # the experts really streamed
            assert t["experts_missed"] > 0 and t["bytes_read"] > 0


def test_logits_processors_see_what_plain_decoding_shows_them(ckpts):
    model, tokenizer = _load(ckpts[0], "all")
    with model.moeflux:
        prompt = tokenizer.encode(TEXT)
        procs = make_logits_processors(repetition_penalty=1.3, repetition_context_size=8)
        want = _plain(model, prompt, logits_processors=procs)
        got = list(
            lookup_generate_step(
                mx.array(prompt), model, num_draft_tokens=3, max_tokens=N, logits_processors=procs
            )
        )
        _assert_plain(got, want)
        procs = make_logits_processors(repetition_penalty=1.3, repetition_context_size=8)
        _as_stock(got, ckpts[0], prompt, num_draft_tokens=3, logits_processors=procs)


def test_cache_is_rewound_after_rejections(ckpts):
    """Two turns on one cache, the first speculative with rejections; stopped early as well."""
    model, tokenizer = _load(ckpts[0], 0.25)
    with model.moeflux:
        prompt = tokenizer.encode(TEXT)
        more = tokenizer.encode(" over the lazy dog")
        # reference: plain decoding, its cache then holding every token but the last reply token
        ref_cache = make_prompt_cache(model)
        first = _plain(model, prompt, cache=ref_cache)
        trim_prompt_cache(ref_cache, 1)
        second = _plain(model, [first[-1][0]] + more, cache=ref_cache)

        cache, stats = make_prompt_cache(model), LookupStats()
        got1 = list(
            lookup_generate_step(
                mx.array(prompt), model, max_tokens=N, prompt_cache=cache, stats=stats
            )
        )
        assert stats.proposed > stats.accepted > 0  # drafts were rejected, and accepted
        assert cache[0].offset == len(prompt) + N - 1
        context = prompt + [t for t, *_ in got1[:-1]]
        got2 = list(
            lookup_generate_step(
                mx.array([got1[-1][0]] + more),
                model,
                max_tokens=N,
                prompt_cache=cache,
                context=context,
            )
        )
        _assert_plain(got1, first)
        _assert_plain(got2, second)

        # closed after 7 tokens, whatever it had verified: 6 of them in the cache
        cache = make_prompt_cache(model)
        steps = lookup_generate_step(mx.array(prompt), model, max_tokens=N, prompt_cache=cache)
        for _, _ in zip(range(7), steps):  # range first: zip takes no 8th token
            pass
        steps.close()
        assert cache[0].offset == len(prompt) + 6


def test_sampling_is_seeded_and_uses_the_model_distribution(ckpts):
    """With a sampler each run is reproducible; a sampler with almost all mass on the argmax
    (temp tiny) gives the greedy tokens (the acceptance rule is the model's own sample)."""
    model, tokenizer = _load(ckpts[0], "all")
    with model.moeflux:
        prompt = mx.array(tokenizer.encode(TEXT))
        runs = []
        for seed in (3, 3):
            mx.random.seed(seed)
            steps = lookup_generate_step(prompt, model, max_tokens=N, sampler=make_sampler(1.0))
            runs.append([t for t, *_ in steps])
        assert runs[0] == runs[1]
        cold = lookup_generate_step(prompt, model, max_tokens=N, sampler=make_sampler(1e-4))
        assert [t for t, *_ in cold] == [t for t, _ in _plain(model, prompt.tolist())]


def test_stream_matches_mlx_lm_stream_generate(ckpts):
    model, tokenizer = _load(ckpts[0], "all")
    with model.moeflux:
        want = list(mlx_lm.stream_generate(model, tokenizer, TEXT, max_tokens=N))
        stats = LookupStats()
        got = list(stream_lookup_generate(model, tokenizer, TEXT, max_tokens=N, stats=stats))
        assert [(r.text, r.token, r.finish_reason) for r in got] == [
            (r.text, r.token, r.finish_reason) for r in want
        ]
        assert any(r.from_draft for r in got) and stats.accepted > 0


def test_bad_arguments_are_option_errors(ckpts):
    model, tokenizer = _load(ckpts[0], "all")
    with model.moeflux:
        prompt = mx.array(tokenizer.encode("hi"))
        for kwargs in (dict(num_draft_tokens=-1), dict(ngram_min=3, ngram_max=2)):
            with pytest.raises(OptionError):
                next(lookup_generate_step(prompt, model, **kwargs))


def test_cli_generate_and_chat_print_the_same_text(ckpts, capsys):
    base = ["--model", str(ckpts[0]), "-p", TEXT, "-m", str(N), "--cache-budget", "100kB"]
    outs = {}
    for command in ("generate", "chat"):
        for flags in ([], ["--prompt-lookup", "4", "--ngram", "2"]):
            assert cli.main([command] + base + flags) == 0
            out, err = capsys.readouterr()
            outs[command, bool(flags)] = out
            if flags:
                line = err.strip().splitlines()[-1]
                assert "draft tokens: " in line and " proposed, " in line and " accepted (" in line
    assert outs["generate", True] == outs["generate", False] != ""
    assert outs["chat", True] == outs["chat", False] != ""
    with pytest.raises(SystemExit) as e:
        cli.main(["generate"] + base + ["--prompt-lookup", "-1"])
    assert e.value.code == 2 and "--prompt-lookup" in capsys.readouterr().err


def test_mlx_lm_draft_model_through_a_streamed_model(ckpts):
    """mlx-lm's speculative decoding with a streamed main model and a stock draft model: the
    tokens of stock mlx-lm with the same draft, and (on the CPU) of no speculation at all."""
    main, draft_path = ckpts
    draft, _ = mlx_lm.load(str(draft_path))
    stock, tokenizer = mlx_lm.load(str(main))
    plain = mlx_lm.generate(stock, tokenizer, TEXT, max_tokens=N)
    want = mlx_lm.generate(
        stock, tokenizer, TEXT, max_tokens=N, draft_model=draft, num_draft_tokens=3
    )
    if not ON_GPU:
        assert want == plain
    model, tokenizer = _load(main, 0.25)
    with model.moeflux:
        got = mlx_lm.generate(
            model, tokenizer, TEXT, max_tokens=N, draft_model=draft, num_draft_tokens=3
        )
        assert got == want
        assert mlx_lm.generate(model, tokenizer, TEXT, max_tokens=N) == plain
