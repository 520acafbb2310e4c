"""``moeflux-mlx generate``: one reply to one prompt, streamed (like ``mlx_lm.generate``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from mlx_lm import load as mlx_load
from mlx_lm import stream_generate
from mlx_lm.models.cache import QuantizedKVCache, load_prompt_cache, make_prompt_cache

from ..model.lookup_decoding import stream_lookup_generate
from .common import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_PROMPT,
    UsageError,
    add_distributed_args,
    add_kv_args,
    add_load_args,
    add_lookup_args,
    add_model_arg,
    add_sampling_args,
    add_tokenizer_args,
    command_parser,
    distributed,
    kv_kwargs,
    load_model,
    lookup_kwargs,
    main_for,
    make_sampler,
    positive_int,
    prefill_progress,
    print_stream,
    prompt_tokens,
    read_prompt,
    say,
    stats_line,
    take_prefill_step,
)

DESCRIPTION = "generate a reply to one prompt"


def _prompt_cache(args: argparse.Namespace):
    """``--prompt-cache-file``: mlx-lm's saved KV cache and its metadata, checked against the
    flags as ``mlx_lm.generate`` checks them; (None, {}) without it."""
    if args.prompt_cache_file is None:
        return None, {}
    try:
        cache, metadata = load_prompt_cache(args.prompt_cache_file, return_metadata=True)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--prompt-cache-file {args.prompt_cache_file}: not readable ({e})") from e
    if isinstance(cache[0], QuantizedKVCache):
        if args.kv_bits is not None and args.kv_bits != cache[0].bits:
            raise UsageError("--kv-bits does not match the KV cache of --prompt-cache-file")
        if args.kv_group_size != cache[0].group_size:
            raise UsageError("--kv-group-size does not match the KV cache of --prompt-cache-file")
    model = metadata.get("model")
    if args.model is None:
        args.model = model
    elif model is not None and args.model != model:
        raise UsageError(
            f"--model {args.model} is not the model the prompt cache was made with ({model})"
        )
    return cache, metadata


def _tokens(args: argparse.Namespace, tokenizer, prompt: str, cached: bool) -> list:
    """The prompt's tokens, as ``mlx_lm.generate`` makes them: through the chat template
    (``--chat-template-config``'s keywords, ``--prefill-response`` continued), and with a
    prompt cache only the part after what the cache holds."""
    use_template = not args.ignore_chat_template and tokenizer.has_chat_template
    if not use_template:
        return prompt_tokens(tokenizer, prompt, use_chat_template=False)
    try:
        template_kwargs = json.loads(args.chat_template_config or "{}")
    except ValueError as e:
        raise UsageError(f"--chat-template-config: not JSON ({e})") from None
    if not isinstance(template_kwargs, dict):
        raise UsageError("--chat-template-config: expected a JSON object")
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    messages.append({"role": "user", "content": prompt})
    prefill = args.prefill_response is not None
    if prefill:
        messages.append({"role": "assistant", "content": args.prefill_response})
    kwargs = dict(continue_final_message=prefill, add_generation_prompt=not prefill)
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs, **template_kwargs)
    if cached:  # the cache holds the template's prefix: keep from the message on
        messages[-1]["content"] = "<query>"
        probe = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        text = text[probe.index("<query>") :]
    tokens = list(tokenizer.encode(text, add_special_tokens=False))
    if not tokens:
        raise UsageError("the prompt is empty: the model needs at least one token to start from")
    return tokens


def _draft_model(args: argparse.Namespace, tokenizer):
    """``--draft-model`` loaded by mlx-lm (a small dense model, wholly in memory), or None."""
    if args.draft_model is None:
        return None
    if args.prompt_lookup:
        raise UsageError("--draft-model and --prompt-lookup: choose one way of drafting")
    try:
        loaded = mlx_load(args.draft_model)
        draft, draft_tokenizer = loaded[0], loaded[1]
    except Exception as e:  # mlx-lm raises many types; all mean "cannot load it"
        raise UsageError(f"--draft-model {args.draft_model}: {type(e).__name__}: {e}") from e
    if draft_tokenizer.vocab_size != tokenizer.vocab_size:
        raise UsageError("--draft-model: its tokenizer does not match the model's")
    return draft


def run(args: argparse.Namespace) -> int:
    prompt = read_prompt(args.prompt)  # before loading: an unreadable stdin fails at once
    cache, metadata = _prompt_cache(args)
    group = distributed()  # under mlx.launch: this process's share; rank 0 prints
    tokenizer_config = json.loads(metadata["tokenizer_config"]) if metadata else None
    model, tokenizer = load_model(args, group=group, tokenizer_config=tokenizer_config)
    take_prefill_step(args, model)
    try:
        for token in args.extra_eos_token:
            try:
                tokenizer.add_eos_token(token)
            except ValueError as e:  # not one token of this tokenizer
                raise UsageError(f"--extra-eos-token: {e}") from None
        tokens = _tokens(args, tokenizer, prompt, cache is not None)
        draft = _draft_model(args, tokenizer)
        model.moeflux.reset_stats()
        sampler, lookup = make_sampler(args, tokenizer), lookup_kwargs(args)
        kwargs = dict(
            max_tokens=args.max_tokens,
            sampler=sampler,
            prompt_cache=cache,
            prompt_progress_callback=prefill_progress(args.prefill_step_size + 1),
            **kv_kwargs(args),
        )
        if lookup is None:
            responses = stream_generate(
                model,
                tokenizer,
                tokens,
                draft_model=draft,
                num_draft_tokens=args.num_draft_tokens,
                max_kv_size=args.max_kv_size,
                **kwargs,
            )
        else:
            if args.max_kv_size is not None and cache is None:
                kwargs["prompt_cache"] = make_prompt_cache(model, args.max_kv_size)
            responses = stream_lookup_generate(model, tokenizer, tokens, **kwargs, **lookup)
        last = print_stream(responses)
        stats = None if lookup is None else lookup["stats"]
        say(stats_line(last, model.moeflux, group=group, draft=stats))
    finally:
        model.moeflux.close()
    return 0


def add_args(
    p: argparse.ArgumentParser, prompt: str = DEFAULT_PROMPT, max_tokens: int = DEFAULT_MAX_TOKENS
) -> None:
    add_model_arg(p)
    p.add_argument(
        "--prompt", "-p", default=prompt, help=f"the message ('-' reads stdin; default: {prompt!r})"
    )
    p.add_argument("--system-prompt", default=None, help="system prompt for the chat template")
    p.add_argument(
        "--prefill-response",
        default=None,
        help="the start of the reply: the chat template continues it",
    )
    p.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="use the raw prompt without the tokenizer's chat template",
    )
    p.add_argument(
        "--chat-template-config",
        default=None,
        metavar="JSON",
        help="keywords for the chat template (apply_chat_template), a JSON object",
    )
    p.add_argument(
        "--extra-eos-token",
        type=str,
        default=(),
        nargs="+",
        help="more tokens that end the reply",
    )
    add_tokenizer_args(p)
    add_sampling_args(p, max_tokens)
    add_kv_args(p)
    p.add_argument(
        "--prompt-cache-file",
        default=None,
        help="a KV cache saved by mlx_lm.cache_prompt: the prompt continues it",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="a small model (loaded by mlx-lm, in memory) for speculative decoding",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=positive_int,
        default=3,
        help="with --draft-model: tokens drafted a step (default: 3)",
    )
    add_lookup_args(p)
    add_load_args(p)
    add_distributed_args(p)


def main(argv: Optional[list] = None) -> int:
    return main_for(command_parser("generate", DESCRIPTION, add_args), run, argv)


if __name__ == "__main__":
    sys.exit(main())
