"""Prompt-lookup decoding: speculation without a draft model, built for streamed experts.

Each step looks for the most recent earlier occurrence of the text's last n tokens (n from
``ngram_max`` down to ``ngram_min``) in the prompt and the reply so far, proposes the tokens that
followed it, and verifies them in one forward pass of the model. With experts read from disk,
that pass reads the union of the drafted tokens' experts once, where separate decode steps would
each read their own misses. Accepted tokens cost nothing more; a rejected tail is trimmed from
the KV cache.

Structure and sampling semantics mirror ``mlx_lm.generate.speculative_generate_step``: the model
samples a token at every drafted position and a draft token is accepted while it equals the
model's own sample. For a deterministic draft (one proposal per position, as here) that exact-match
rule is the standard speculative acceptance rule: a draft token is kept with probability p(d), and
after a mismatch the model's sample comes from p restricted to tokens other than d, renormalized,
so the output is distributed exactly as without speculation. Greedy output is the same tokens.

Works with any mlx-lm model whose prompt cache can be trimmed (streamed or stock).
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence, Tuple, Union, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import (
    DEFAULT_QUANTIZED_KV_START,
    GenerationResponse,
    generation_stream,
    maybe_quantize_kv_cache,
    wired_limit,
)
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..errors import OptionError

DEFAULT_NUM_DRAFT_TOKENS = 4
DEFAULT_NGRAM_MAX = 3
DEFAULT_NGRAM_MIN = 1


@dataclass
class LookupStats:
    """What the drafting did, for a stats line: updated in place while generating."""

    steps: int = 0  # forward passes after the prompt (one per verification or plain step)
    proposed: int = 0  # draft tokens sent to verification
    accepted: int = 0  # of those, equal to the model's own token (and yielded)
    # where the passes' time went: building their graphs (host), then waiting for their
    # evaluation (the device's computation and, streamed, its waits for experts)
    build_s: float = 0.0
    eval_s: float = 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def summary(self) -> str:
        """``draft tokens: 40 proposed, 25 accepted (62.5%)`` for a stats line."""
        return (
            f"draft tokens: {self.proposed} proposed, {self.accepted} accepted "
            f"({100 * self.acceptance:.1f}%)"
        )


class NgramIndex:
    """Where each n-gram of a token sequence last occurred with a token after it.

    ``index[n][gram]`` is the position just after the most recent occurrence of ``gram`` that
    is followed by at least one token; kept up to date as tokens are appended, so a lookup
    costs O(ngram_max) instead of a scan of the whole text.
    """

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.tokens: List[int] = []
        self.index: Dict[int, Dict[Tuple[int, ...], int]] = {
            n: {} for n in range(ngram_min, ngram_max + 1)
        }

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens``; the n-grams they complete the continuation of are indexed."""
        seq = self.tokens
        for t in tokens:
            p = len(seq)  # t's position: every n-gram ending at p - 1 now has a follower
            for n, grams in self.index.items():
                if p >= n:
                    grams[tuple(seq[p - n : p])] = p
            seq.append(int(t))

    def draft(self, k: int) -> List[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        matching suffix (``ngram_max`` down to ``ngram_min`` tokens); ``[]`` when none matches.

        A continuation that runs into the end of the text goes on as a copy of itself (the
        repetition it found continues), so a repeated phrase drafts ``k`` tokens, not fewer.
        """
        seq = self.tokens
        if k <= 0:
            return []
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if len(seq) < n:
                continue
            start = self.index[n].get(tuple(seq[-n:]))
            if start is None:
                continue
            out: List[int] = []
            for j in range(k):
                i = start + j
                out.append(seq[i] if i < len(seq) else out[i - len(seq)])
            return out
        return []


def _ids(a: mx.array) -> List[int]:
    """A 1-D array of token ids as Python ints."""
    return [int(t) for t in cast(List[int], a.tolist())]


def lookup_generate_step(
    prompt: mx.array,
    model: nn.Module,
    stream: Any = generation_stream,
    *,
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    ngram_max: int = DEFAULT_NGRAM_MAX,
    ngram_min: int = DEFAULT_NGRAM_MIN,
    context: Optional[Sequence[int]] = None,
    max_tokens: int = 256,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    logits_processors: Optional[List[Callable[[mx.array, mx.array], mx.array]]] = None,
    prompt_cache: Optional[Any] = None,
    prefill_step_size: int = 2048,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    stats: Optional[LookupStats] = None,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    cache_last_token: bool = False,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Generate tokens with prompt-lookup speculation; yields as
    ``mlx_lm.generate.speculative_generate_step`` does.

    Args:
        prompt: The prompt's token ids (1-D), not yet in ``prompt_cache``.
        model: Any mlx-lm model (streamed or stock).
        stream: The stream to run on (mlx-lm's generation stream by default).
        num_draft_tokens: Draft up to this many tokens a step; 0 decodes one token a step.
        ngram_max: The longest suffix (in tokens) matched against earlier text.
        ngram_min: The shortest; below it nothing is drafted.
        context: Tokens already in ``prompt_cache`` before ``prompt`` (a chat's earlier
            turns): searched for drafts, not fed to the model.
        max_tokens: The most tokens to yield; -1 for no limit.
        sampler: mlx-lm sampler on log-probabilities (default: greedy argmax).
        logits_processors: mlx-lm logits processors, given the tokens before each position.
        prompt_cache: An mlx-lm prompt cache, updated in place; must be trimmable.
        prefill_step_size: Prompt tokens per forward pass while prefilling.
        kv_bits: Bits of a quantized KV cache (None: not quantized).
        kv_group_size: Group size of the quantized KV cache.
        quantized_kv_start: Cache length from which the KV cache is quantized.
        stats: Updated in place with the draft tokens proposed and accepted.
        prompt_progress_callback: Called with (prompt tokens processed, prompt tokens) as the
            prompt is prefilled, as ``generate_step`` calls it.
        cache_last_token: When the generator ends or is closed, also feed the last yielded
            token to the model (one more forward pass, of one token), so that the cache holds
            every yielded token, as ``generate_step``'s does: mlx-lm's server saves the cache
            under the prompt and every token of the reply.

    Returns:
        A generator of ``(token, logprobs, from_draft)``: the token id, the model's
        log-probabilities for that position (1-D, over the vocabulary), and whether the token
        was a draft the model accepted. When the generator ends or is closed, the cache holds
        ``context``, ``prompt`` and every yielded token but the last (as after
        ``speculative_generate_step``); with ``cache_last_token``, the last as well (not
        after an error).

    Raises:
        OptionError: a negative ``num_draft_tokens``, bad n-gram bounds, an empty prompt, or a
            prompt cache that cannot be trimmed (recurrent layers, a full rotating cache).
    """
    if num_draft_tokens < 0:
        raise OptionError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
    if not 1 <= ngram_min <= ngram_max:
        raise OptionError(
            f"n-gram lengths must satisfy 1 <= ngram_min <= ngram_max, got {ngram_min} and "
            f"{ngram_max}"
        )
    if prompt.size == 0:
        raise OptionError("the prompt is empty: the model needs at least one token to start from")
    if prompt_cache is None:
        prompt_cache = make_prompt_cache(model)
    if not can_trim_prompt_cache(prompt_cache):
        kinds = sorted({type(c).__name__ for c in prompt_cache if not c.is_trimmable()})
        raise OptionError(
            f"prompt lookup needs a prompt cache that can be trimmed (got {', '.join(kinds)})"
        )
    sampler = sampler or greedy_sampler
    stats = stats if stats is not None else LookupStats()
    progress = prompt_progress_callback or (lambda *_: None)
    quantize_cache_fn = functools.partial(
        maybe_quantize_kv_cache,
        quantized_kv_start=quantized_kv_start,
        kv_group_size=kv_group_size,
        kv_bits=kv_bits,
    )

    prompt_ids = _ids(prompt)
    earlier = [int(t) for t in context or ()]
    known = NgramIndex(ngram_min, ngram_max)  # context + prompt + every token yielded
    known.extend(earlier + prompt_ids)

    runtime = getattr(model, "moeflux", None)  # a streamed model's

    def verify(inputs: List[int]) -> Tuple[List[int], mx.array]:
        """One forward pass over ``inputs``: the model's token and log-probs after each."""
        t0 = time.perf_counter()
        with runtime.verifying_drafts() if runtime is not None else contextlib.nullcontext():
            logits = model(mx.array(inputs, mx.uint32)[None], cache=prompt_cache)[0]
        quantize_cache_fn(prompt_cache)
        if logits_processors:
            # each position sees the tokens before it from the prompt on (not the context),
            # as generate_step's processors do one step at a time
            before = known.tokens[len(earlier) : len(known.tokens) - 1]
            rows = []
            for i in range(len(inputs)):
                history = mx.array(before + inputs[: i + 1], mx.uint32)
                row = logits[i : i + 1]
                for processor in logits_processors:
                    row = processor(history, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tokens = sampler(logprobs)
        t1 = time.perf_counter()
        mx.eval(tokens, logprobs)
        stats.build_s += t1 - t0
        stats.eval_s += time.perf_counter() - t1
        if runtime is not None:  # streamed: a read that failed in this pass raises before any
            runtime.cache.check()  # of its tokens is yielded (not at the next pass)
        return _ids(tokens), logprobs

    in_cache = len(known.tokens) - len(prompt_ids)  # tokens of ``known`` the cache holds
    yielded = 0
    ended = False  # finished or closed by the caller, not stopped by an error
    total = len(prompt_ids)
    with mx.stream(stream):
        try:
            # the prompt but its last token, in chunks as generate_step feeds it
            progress(0, total)
            rest = prompt_ids
            while len(rest) > 1:
                n = min(prefill_step_size, len(rest) - 1)
                model(mx.array(rest[:n], mx.uint32)[None], cache=prompt_cache)
                quantize_cache_fn(prompt_cache)
                mx.eval([c.state for c in prompt_cache])
                in_cache += n
                rest = rest[n:]
                progress(total - len(rest), total)
                mx.clear_cache()

            while max_tokens < 0 or yielded < max_tokens:
                # the last known token is not in the cache yet: it leads the verified inputs
                left = max_tokens - yielded if max_tokens >= 0 else num_draft_tokens + 1
                draft = known.draft(min(num_draft_tokens, left - 1))
                tokens, logprobs = verify(known.tokens[-1:] + draft)
                in_cache += 1 + len(draft)
                if yielded == 0:  # the first pass ended the prompt
                    progress(total, total)
                stats.steps += 1
                stats.proposed += len(draft)
                n = 0
                while n < len(draft) and tokens[n] == draft[n]:
                    n += 1
                # drop the rejected drafts' keys and values before yielding anything, so the
                # cache is right whenever the caller stops
                trim_prompt_cache(prompt_cache, len(draft) - n)
                in_cache -= len(draft) - n
                for i in range(n + 1):
                    known.extend(tokens[i : i + 1])
                    yielded += 1
                    stats.accepted += i < n
                    yield tokens[i], logprobs[i], i < n
                if stats.steps % 256 == 0:
                    mx.clear_cache()
            ended = True
        except GeneratorExit:
            ended = True
            raise
        finally:
            # whatever the caller saw: the cache holds every yielded token but the last
            extra = in_cache - (len(known.tokens) - 1)
            if extra > 0:
                trim_prompt_cache(prompt_cache, extra)
            if cache_last_token and ended and yielded:
                model(mx.array(known.tokens[-1:], mx.uint32)[None], cache=prompt_cache)
                quantize_cache_fn(prompt_cache)
                mx.eval([c.state for c in prompt_cache])


def stream_lookup_generate(
    model: nn.Module,
    tokenizer: Any,
    prompt: Union[str, mx.array, List[int]],
    max_tokens: int = 256,
    stream: Any = generation_stream,
    **kwargs: Any,
) -> Generator[GenerationResponse, None, None]:
    """``mlx_lm.stream_generate`` with prompt-lookup speculation (it takes no custom step).

    Args:
        model: Any mlx-lm model (streamed or stock).
        tokenizer: Its tokenizer (a ``TokenizerWrapper`` or a Hugging Face tokenizer).
        prompt: The prompt: text or token ids.
        max_tokens: The most tokens to generate; -1 for no limit.
        stream: The stream to run on.
        **kwargs: ``lookup_generate_step``'s keywords (``num_draft_tokens``, ``ngram_max``,
            ``sampler``, ``prompt_cache``, ``stats``, ...).

    Returns:
        A generator of mlx-lm ``GenerationResponse``s, as ``stream_generate`` yields them
        (``from_draft`` marks accepted draft tokens; the last has a ``finish_reason``).

    Raises:
        OptionError: see ``lookup_generate_step``.
        ValueError: ``max_tokens`` is 0 (as ``stream_generate``).
    """
    if max_tokens == 0:
        raise ValueError("Maximum number of tokens must be non-zero (use -1 for no limit).")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if isinstance(prompt, str):
        special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        ids = mx.array(tokenizer.encode(prompt, add_special_tokens=special))
    else:
        ids = prompt if isinstance(prompt, mx.array) else mx.array(prompt)
    detokenizer = tokenizer.detokenizer
    steps = lookup_generate_step(ids, model, stream, max_tokens=max_tokens, **kwargs)
    # the same loop as stream_generate, so the responses (and where it stops) are the same
    tic = time.perf_counter()
    prompt_tps = 0.0
    n, token, logprobs, from_draft = 0, 0, mx.array([]), False

    def response(token, logprobs, from_draft, n, finish_reason) -> GenerationResponse:
        return GenerationResponse(
            text=detokenizer.last_segment,
            token=token,
            logprobs=logprobs,
            from_draft=from_draft,
            prompt_tokens=ids.size,
            prompt_tps=prompt_tps,
            generation_tokens=n + 1,
            generation_tps=(n + 1) / (time.perf_counter() - tic),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish_reason,
        )

    with wired_limit(model, [stream]):
        try:
            for n, (token, logprobs, from_draft) in enumerate(steps):
                if n == 0:
                    prompt_tps = ids.size / (time.perf_counter() - tic)
                    tic = time.perf_counter()
                if token in tokenizer.eos_token_ids:
                    break
                detokenizer.add_token(token)
                if (n + 1) == max_tokens:
                    break
                yield response(token, logprobs, from_draft, n, None)
        finally:
            steps.close()  # trims the cache now, not when the generator is collected
        detokenizer.finalize()
        finish = "stop" if token in tokenizer.eos_token_ids else "length"
        yield response(token, logprobs, from_draft, n, finish)
