"""``moeflux-mlx generate``: one reply to one prompt, streamed (like ``mlx_lm.generate``)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from mlx_lm import stream_generate

from ..model.lookup_decoding import stream_lookup_generate
from .common import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_PROMPT,
    add_distributed_args,
    add_load_args,
    add_lookup_args,
    add_model_arg,
    add_sampling_args,
    command_parser,
    distributed,
    load_model,
    lookup_kwargs,
    main_for,
    make_sampler,
    print_stream,
    prompt_tokens,
    read_prompt,
    say,
    stats_line,
)

DESCRIPTION = "generate a reply to one prompt"


def run(args: argparse.Namespace) -> int:
    prompt = read_prompt(args.prompt)  # before loading: an unreadable stdin fails at once
    group = distributed()  # under mlx.launch: this process's share; rank 0 prints
    model, tokenizer = load_model(args, group=group)
    try:
        tokens = prompt_tokens(tokenizer, prompt, args.system_prompt, not args.ignore_chat_template)
        model.moeflux.reset_stats()
        sampler, lookup = make_sampler(args), lookup_kwargs(args)
        if lookup is None:
            responses = stream_generate(
                model, tokenizer, tokens, max_tokens=args.max_tokens, sampler=sampler
            )
        else:
            responses = stream_lookup_generate(
                model, tokenizer, tokens, max_tokens=args.max_tokens, sampler=sampler, **lookup
            )
        last = print_stream(responses)
        draft = None if lookup is None else lookup["stats"]
        say(stats_line(last, model.moeflux, group=group, draft=draft))
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
        "--ignore-chat-template",
        action="store_true",
        help="use the raw prompt without the tokenizer's chat template",
    )
    add_sampling_args(p, max_tokens)
    add_lookup_args(p)
    add_load_args(p)
    add_distributed_args(p)


def main(argv: Optional[list] = None) -> int:
    return main_for(command_parser("generate", DESCRIPTION, add_args), run, argv)


if __name__ == "__main__":
    sys.exit(main())
