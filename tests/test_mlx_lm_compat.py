"""Every mlx-lm entry point that takes a model gives, with a streamed model, exactly what it gives
with stock mlx-lm's model of the same checkpoint.

On the CPU through the plain-ops backend, so the comparison is exact: token ids, every
log-probability vector, texts, KV cache contents. At two budgets: every expert resident
(``"all"``), and a quarter of the experts' bytes, so that experts are evicted and read again
while the entry point runs (the fixture checks both after each test: nothing read twice at
``"all"``; more misses than the quarter holds at ``"25% experts"``). The tiny qwen3_moe has 16
experts (top 4) in each of 2 layers: a quarter holds 8 of the 32.

Covered: ``generate`` / ``stream_generate`` (chunked prefill too), ``batch_generate`` and
``BatchGenerator`` (prompts of several lengths, two inserted mid-decode, per-prompt caches
given), draft-model speculation (a stock draft that agrees, and one that does not), prompt
caches (made, saved, loaded and continued, trimmed, rotating, quantized), samplers and logits
processors, ``set_dtype`` and ``copy.deepcopy``. The server's endpoints are test_server*.py's."""

import copy
import json

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator, batch_generate, generate_step, stream_generate
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)
from mlx_lm.sample_utils import make_logits_processors, make_sampler

import moeflux_mlx
from tests.support import synth

BUDGETS = ["all", "25% experts"]
MAX_TOKENS = 12
TEXT = "the quick brown fox jumps over the lazy dog"
LONG = " ".join([TEXT] * 3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat")
    src = synth.build_checkpoint(root / "main", "qwen3_moe", "tiny", seed=3)
    # a smaller stock model of other weights (1 layer) for speculation: mostly disagrees
    draft = synth.build_checkpoint(
        root / "draft", "qwen3_moe", "tiny", seed=4, overrides={"num_hidden_layers": 1}
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the draft shares the tokenizer
        assert (src / name).read_bytes() == (draft / name).read_bytes()
    config = json.loads((src / "config.json").read_text())
    return {
        "src": src,
        "draft": draft,
        "experts": config["num_experts"] * config["num_hidden_layers"],
    }


@pytest.fixture(scope="module")
def stock(ckpt):
    """Stock mlx-lm's model and tokenizer; no test changes the model (dtype tests load their own)."""
    return mlx_lm.load(str(ckpt["src"]))


@pytest.fixture(scope="module")
def stock_once():
    """Stock's result of each case, computed once for both budgets."""
    memo = {}

    def once(key, fn):
        if key not in memo:
            memo[key] = fn()
        return memo[key]

    return once


@pytest.fixture(params=BUDGETS, ids=["all", "quarter"])
def streamed(request, ckpt):
    """The streamed model and its tokenizer at one budget; after the test, proof the budget was
    what it says: at ``all`` no expert was read twice, at a quarter experts were missed more
    often than the quarter holds (so some were evicted and read again)."""
    model, tokenizer = moeflux_mlx.load(ckpt["src"], backend="ops", cache_budget=request.param)
    yield model, tokenizer
    total = moeflux_mlx.stats(model)["total"]
    model.moeflux.close()
    assert total["experts_read"] > 0
    if request.param == "all":
        assert total["experts_read"] <= ckpt["experts"], total
    else:
        assert total["experts_missed"] > 0
        assert total["experts_missed"] > ckpt["experts"] // 4, total


# --------------------------------------------------------------------------- helpers


def _tokens(tokenizer, text=LONG):
    return tokenizer.encode(text)


def _stream(model, tokenizer, prompt, **kwargs):
    """Every response of ``stream_generate``: token, logprobs vector, text, draft flag, reason."""
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    out = []
    for r in stream_generate(model, tokenizer, prompt, **kwargs):
        mx.eval(r.logprobs)
        out.append((r.token, r.logprobs, r.text, r.from_draft, r.finish_reason))
    return out


def _assert_same_stream(got, want):
    assert [r[0] for r in got] == [r[0] for r in want]  # tokens
    assert [r[2:] for r in got] == [r[2:] for r in want]  # texts, draft flags, finish reasons
    for i, (g, w) in enumerate(zip(got, want)):
        assert g[1].dtype == w[1].dtype
        assert mx.array_equal(g[1], w[1]).item(), (i, float(mx.abs(g[1] - w[1]).max()))
    # the case ran as long as asked (no early end-of-sequence made it trivially short)
    assert len(want) == MAX_TOKENS


def _states(cache):
    """Every array and scalar a prompt cache holds, flattened, with its class."""
    out = []
    for c in cache:
        out.append(("class", type(c).__name__))
        out.extend(tree_flatten(c.state))  # arrays, offsets, sizes
    return out


def _assert_same_states(got, want):
    g, w = _states(got), _states(want)
    assert len(g) == len(w)
    for a, b in zip(g, w):
        if isinstance(b[1], mx.array):
            assert a[0] == b[0] and a[1].dtype == b[1].dtype and a[1].shape == b[1].shape
            assert mx.array_equal(a[1], b[1]).item(), a[0]
        else:
            assert a == b


def _prefill(model, prompt, cache):
    """Run the prompt into ``cache`` as ``mlx_lm.cache_prompt`` does (no token decoded)."""
    for _ in generate_step(mx.array(prompt), model, max_tokens=0, prompt_cache=cache):
        pass
    mx.eval([c.state for c in cache])


# --------------------------------------------------------------------------- generate


@pytest.mark.parametrize("prompt", [TEXT, LONG], ids=["short", "long"])
def test_generate_text(stock, stock_once, streamed, prompt):
    model, tokenizer = streamed
    want = stock_once(
        ("generate", prompt),
        lambda: mlx_lm.generate(*stock, prompt, max_tokens=MAX_TOKENS),
    )
    assert want  # something was generated
    assert mlx_lm.generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS) == want


@pytest.mark.parametrize(
    "case, kwargs",
    [("one token", {}), ("long", {}), ("long, prefill in steps of 5", dict(prefill_step_size=5))],
    ids=["one-token", "long", "prefill-steps-of-5"],
)
def test_stream_generate_tokens_and_logprobs(stock, stock_once, streamed, case, kwargs):
    model, tokenizer = streamed
    prompt = _tokens(tokenizer)[:1] if case == "one token" else _tokens(tokenizer)
    want = stock_once(("stream", case), lambda: _stream(*stock, prompt, **kwargs))
    _assert_same_stream(_stream(model, tokenizer, prompt, **kwargs), want)


# --------------------------------------------------------------------------- batches


def _batch_prompts(tokenizer):
    long = _tokens(tokenizer)
    return [long[:1], long[:6], long, long[3:17]]


def test_batch_generate(stock, stock_once, streamed):
    model, tokenizer = streamed
    prompts = _batch_prompts(tokenizer)
    assert len({len(p) for p in prompts}) == len(prompts)
    kwargs = dict(
        max_tokens=[MAX_TOKENS, 5, 9, MAX_TOKENS],
        return_token_ids=True,
        return_logprobs=True,
        return_prompt_caches=True,
        prefill_batch_size=3,
        prefill_step_size=8,
    )
    want = stock_once("batch_generate", lambda: batch_generate(*stock, prompts, **kwargs))
    got = batch_generate(model, tokenizer, prompts, **kwargs)
    assert [len(t) for t in want.token_ids] == kwargs["max_tokens"]
    assert got.token_ids == want.token_ids
    assert got.texts == want.texts
    assert got.logprobs == want.logprobs  # python floats, exactly
    for g, w in zip(got.caches, want.caches):
        _assert_same_states(g, w)


def _from_caches(model, tokenizer, prompts):
    """``batch_generate`` continuing from per-prompt caches (each prompt's start prefilled)."""
    caches = []
    for p in prompts:
        caches.append(make_prompt_cache(model))
        _prefill(model, p[:-3], caches[-1])
    rest = [p[-3:] for p in prompts]
    return batch_generate(
        model, tokenizer, rest, prompt_caches=caches, max_tokens=8, return_logprobs=True
    )


def test_batch_generate_from_prompt_caches(stock, stock_once, streamed):
    model, tokenizer = streamed
    prompts = _batch_prompts(tokenizer)[1:]
    want = stock_once("batch from caches", lambda: _from_caches(*stock, prompts))
    got = _from_caches(model, tokenizer, prompts)
    assert [len(t) for t in want.logprobs] == [8] * len(prompts)
    assert got.texts == want.texts and got.logprobs == want.logprobs


def _batch_generator(model, prompts, eos):
    """Continuous batching: two prompts, two more inserted three steps into their decode, each
    with its own sampler and logits processors; every response's token and logprobs."""
    gen = BatchGenerator(
        model,
        max_tokens=MAX_TOKENS,
        stop_tokens=[[eos]],
        prefill_batch_size=2,
        completion_batch_size=3,
        prefill_step_size=4,
    )
    mx.random.seed(5)
    uids = gen.insert(prompts[:2])
    out = {}
    steps = 0
    while True:
        if steps == 3:
            uids += gen.insert(
                prompts[2:],
                max_tokens=[7, 10],
                samplers=[make_sampler(temp=0.8, top_k=12), None],
                logits_processors=[[], make_logits_processors(repetition_penalty=1.4)],
            )
        responses = gen.next_generated()
        steps += 1
        if not responses and steps > 3:
            break
        for r in responses:
            mx.eval(r.logprobs)
            out.setdefault(r.uid, []).append((r.token, r.logprobs, r.finish_reason))
            if r.finish_reason is not None:
                out[r.uid].append(r.prompt_cache)
    gen.close()
    return uids, out


def test_batch_generator(stock, stock_once, streamed):
    model, tokenizer = streamed
    prompts = _batch_prompts(tokenizer)
    eos = tokenizer.eos_token_id
    want_uids, want = stock_once("BatchGenerator", lambda: _batch_generator(stock[0], prompts, eos))
    uids, got = _batch_generator(model, prompts, eos)
    assert uids == want_uids and sorted(got) == sorted(want) == sorted(uids)
    for uid in uids:
        *g_steps, g_cache = got[uid]
        *w_steps, w_cache = want[uid]
        assert [(t, r) for t, _, r in g_steps] == [(t, r) for t, _, r in w_steps]
        for (_, g, _), (_, w, _) in zip(g_steps, w_steps):
            assert mx.array_equal(g, w).item()
        _assert_same_states(g_cache, w_cache)
    assert [len(want[u]) - 1 for u in uids] == [MAX_TOKENS, MAX_TOKENS, 7, 10]


# --------------------------------------------------------------------------- speculation


@pytest.fixture(scope="module")
def drafts(ckpt):
    return {
        "agreeing": mlx_lm.load(str(ckpt["src"]))[0],  # stock's own weights: accepts all
        "disagreeing": mlx_lm.load(str(ckpt["draft"]))[0],
    }


@pytest.mark.parametrize("draft", ["agreeing", "disagreeing"])
@pytest.mark.parametrize("processed", [False, True], ids=["greedy", "repetition-penalty"])
def test_draft_model_speculation(stock, stock_once, streamed, drafts, draft, processed):
    model, tokenizer = streamed
    prompt = _tokens(tokenizer)
    kwargs = dict(draft_model=drafts[draft], num_draft_tokens=3)
    if processed:
        kwargs["logits_processors"] = make_logits_processors(repetition_penalty=1.3)
    want = stock_once(("draft", draft, processed), lambda: _stream(*stock, prompt, **kwargs))
    _assert_same_stream(_stream(model, tokenizer, prompt, **kwargs), want)
    # speculation's paths ran: the model's own tokens, and (agreeing) accepted draft tokens
    flags = [r[3] for r in want]
    assert False in flags and (True in flags or draft == "disagreeing")


# --------------------------------------------------------------------------- prompt caches


def _saved_and_continued(model, tokenizer, path):
    tokens = _tokens(tokenizer)
    cache = make_prompt_cache(model)
    _prefill(model, tokens[:20], cache)
    save_prompt_cache(str(path), cache, metadata={"model": "tiny", "tokens": "20"})
    loaded, metadata = load_prompt_cache(str(path), return_metadata=True)
    out = _stream(model, tokenizer, tokens[20:], prompt_cache=loaded)
    return cache, metadata, out, loaded


def test_prompt_cache_save_load_and_continue(ckpt, stock, stock_once, streamed, tmp_path):
    model, tokenizer = streamed
    stock_file = ckpt["src"].parent / "stock-cache.safetensors"  # made once, for both budgets
    want = stock_once("saved", lambda: _saved_and_continued(*stock, stock_file))
    got = _saved_and_continued(model, tokenizer, tmp_path / "ours.safetensors")
    assert [type(c) for c in got[0]] == [type(c) for c in want[0]] == [KVCache] * 2
    assert got[0][0].offset == want[0][0].offset == 20
    _assert_same_states(got[0], want[0])  # the cache as saved
    ours = mx.load(str(tmp_path / "ours.safetensors"))
    theirs = mx.load(str(stock_file))
    assert sorted(ours) == sorted(theirs)
    assert all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)  # the file's arrays
    assert got[1] == want[1] == {"model": "tiny", "tokens": "20"}
    _assert_same_stream(got[2], want[2])  # continuing from the loaded cache
    _assert_same_states(got[3], want[3])  # and where that left the cache
    # the cache carried the prompt's start: without it the reply differs
    alone = stock_once("saved, alone", lambda: _stream(*stock, _tokens(stock[1])[20:]))
    assert [r[0] for r in alone] != [r[0] for r in want[2]]


def _trimmed(model, tokenizer):
    tokens = _tokens(tokenizer)
    cache = make_prompt_cache(model)
    _prefill(model, tokens[:24], cache)
    trimmed = trim_prompt_cache(cache, 9)
    offset = cache[0].offset
    # continue from the first 15 tokens with another ending than the one trimmed away
    return trimmed, offset, _stream(model, tokenizer, tokens[30:36], prompt_cache=cache), cache


def test_trim_prompt_cache(stock, stock_once, streamed):
    model, tokenizer = streamed
    want = stock_once("trim", lambda: _trimmed(*stock))
    got = _trimmed(model, tokenizer)
    assert got[:2] == want[:2] == (9, 15)
    _assert_same_stream(got[2], want[2])
    _assert_same_states(got[3], want[3])


def _rotating(model, tokenizer):
    cache = make_prompt_cache(model, max_kv_size=10)
    out = _stream(model, tokenizer, _tokens(tokenizer)[:14], prompt_cache=cache)
    return cache, out, _stream(model, tokenizer, _tokens(tokenizer)[:14], max_kv_size=10)


def test_rotating_kv_cache(stock, stock_once, streamed):
    model, tokenizer = streamed
    want = stock_once("rotating", lambda: _rotating(*stock))
    got = _rotating(model, tokenizer)
    assert [type(c) for c in got[0]] == [type(c) for c in want[0]] == [RotatingKVCache] * 2
    assert want[0][0].offset == 14 + MAX_TOKENS > 10  # the cache rotated (one step ahead)
    _assert_same_states(got[0], want[0])
    _assert_same_stream(got[1], want[1])
    _assert_same_stream(got[2], want[2])  # max_kv_size=, the cache made by generate_step
    # the limit changed the reply (it would not if the cache kept everything)
    full = stock_once("rotating, full", lambda: _stream(*stock, _tokens(stock[1])[:14]))
    assert [r[0] for r in full] != [r[0] for r in want[1]]


@pytest.mark.parametrize("bits, start", [(8, 0), (4, 10)])
def test_quantized_kv_cache(stock, stock_once, streamed, bits, start):
    model, tokenizer = streamed

    def run(model, tokenizer):
        cache = make_prompt_cache(model)
        kwargs = dict(kv_bits=bits, kv_group_size=32, quantized_kv_start=start)
        return cache, _stream(
            model, tokenizer, _tokens(tokenizer)[:16], prompt_cache=cache, **kwargs
        )

    want = stock_once(("kv_bits", bits, start), lambda: run(*stock))
    got = run(model, tokenizer)
    assert [type(c) for c in got[0]] == [type(c) for c in want[0]] == [QuantizedKVCache] * 2
    _assert_same_states(got[0], want[0])
    _assert_same_stream(got[1], want[1])


# --------------------------------------------------------------------------- sampling


SAMPLERS = {
    "temp": dict(temp=1.0),
    "top_k": dict(temp=0.8, top_k=10),
    "min_p": dict(temp=1.2, min_p=0.1),
    "top_p+top_k+min_p": dict(temp=0.9, top_p=0.9, top_k=20, min_p=0.02),
}


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_samplers_with_a_fixed_seed(stock, stock_once, streamed, name):
    model, tokenizer = streamed
    prompt = _tokens(tokenizer)

    def run(model, tokenizer):
        mx.random.seed(1234)
        return _stream(model, tokenizer, prompt, sampler=make_sampler(**SAMPLERS[name]))

    want = stock_once(("sampler", name), lambda: run(*stock))
    _assert_same_stream(run(model, tokenizer), want)
    greedy = stock_once(("stream", "long"), lambda: _stream(*stock, prompt))
    assert [r[0] for r in want] != [r[0] for r in greedy]  # it sampled


def test_logits_processors(stock, stock_once, streamed):
    model, tokenizer = streamed
    prompt = _tokens(tokenizer)
    greedy = stock_once(("stream", "long"), lambda: _stream(*stock, prompt))
    biased = greedy[3][0]  # a token greedy decoding chose: pushed up here
    kwargs = dict(
        logit_bias={biased: 2.0, 7: -1.5},
        repetition_penalty=1.5,
        repetition_context_size=6,
        presence_penalty=0.5,
        frequency_penalty=0.3,
    )

    def run(model, tokenizer):
        return _stream(model, tokenizer, prompt, logits_processors=make_logits_processors(**kwargs))

    want = stock_once("processors", lambda: run(*stock))
    _assert_same_stream(run(model, tokenizer), want)
    assert [r[0] for r in want] != [r[0] for r in greedy]  # the processors changed the reply


# --------------------------------------------------------------------------- model operations


def test_set_dtype_float16(ckpt, streamed):
    model, tokenizer = streamed
    stock16, _ = mlx_lm.load(str(ckpt["src"]))
    prompt = _tokens(tokenizer)
    before = model(mx.array([prompt]))
    for m in (stock16, model):
        m.set_dtype(mx.float16)
    want, got = stock16(mx.array([prompt])), model(mx.array([prompt]))
    assert before.dtype == mx.bfloat16 and got.dtype == want.dtype == mx.float16
    assert mx.array_equal(got, want).item(), float(mx.abs(got - want).max())
    _assert_same_stream(_stream(model, tokenizer, prompt), _stream(stock16, tokenizer, prompt))


def test_deepcopy(ckpt, stock, stock_once, streamed):
    model, tokenizer = streamed
    prompt = _tokens(tokenizer)
    want = stock_once(("stream", "long"), lambda: _stream(*stock, prompt))
    twin = copy.deepcopy(model)
    _assert_same_stream(_stream(twin, tokenizer, prompt), want)
    # a copy cast to float16 computes as stock's cast copy; the original stays as it was
    stock16 = copy.deepcopy(mlx_lm.load(str(ckpt["src"]))[0])
    for m in (stock16, twin):
        m.set_dtype(mx.float16)
    _assert_same_stream(_stream(twin, tokenizer, prompt), _stream(stock16, tokenizer, prompt))
    _assert_same_stream(_stream(model, tokenizer, prompt), want)
