"""Multi-turn chat in the terminal with a streaming model (``moeflux-mlx chat``, examples/chat.py).

The conversation lives in an mlx-lm prompt cache across turns. Each turn renders the whole
conversation with the tokenizer's chat template and feeds the model only the tokens the cache
does not already hold (the longest common prefix with what it holds is kept; a diverging tail, e.g.
a reply the template re-renders differently, is trimmed off). Like ``mlx_lm.chat`` otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import re
from typing import Generator, List, Optional

from mlx_lm import stream_generate
from mlx_lm.generate import GenerationResponse
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ..errors import ExpertReadError
from ..model.lookup_decoding import stream_lookup_generate
from .common import (
    PROG,
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
    prefill_progress,
    print_stream,
    read_prompt,
    say,
    stats_line,
    take_prefill_step,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
PROMPT = ">> "
QUIT = ("/quit", "/exit", "q")
HELP = (
    "Type a message. /reset starts a new conversation; /quit, q or Ctrl-D exits; /help shows "
    "this. To send a message that starts with /, type // (//etc/hosts sends /etc/hosts)."
)
_SLASH_COMMAND = re.compile(r"/[A-Za-z][\w-]*")
DESCRIPTION = "chat in the terminal (multi-turn, streamed)"


class ChatSession:
    """A conversation with ``model`` whose KV cache is kept between turns."""

    def __init__(
        self,
        model,
        tokenizer,
        system_prompt: Optional[str] = None,
        max_kv_size: Optional[int] = None,
    ):
        self.model, self.tokenizer, self.system_prompt = model, tokenizer, system_prompt
        self.max_kv_size = max_kv_size  # mlx-lm's --max-kv-size: a rotating cache
        self.reset()

    def reset(self) -> None:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self.messages = system
        self.cache = make_prompt_cache(self.model, self.max_kv_size)
        self.cached: List[int] = []  # the tokens whose keys and values are in self.cache
        self.new_tokens = self.reused_tokens = 0  # of the last turn's prompt

    def _render(self) -> List[int]:
        if self.tokenizer.has_chat_template:
            return list(
                self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
            )
        # No template: a plain transcript, enough to keep talking to a base model.
        text = "".join(f"{m['role']}: {m['content']}\n" for m in self.messages) + "assistant:"
        return self.tokenizer.encode(text)

    def _uncached(self, tokens: List[int]) -> List[int]:
        """Drop from the cache what ``tokens`` does not continue; return what it lacks."""
        keep = 0
        for a, b in zip(self.cached, tokens):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(tokens) - 1)  # the model must see at least one new token
        extra = len(self.cached) - keep
        if extra and can_trim_prompt_cache(self.cache):
            trim_prompt_cache(self.cache, extra)
        elif extra:
            log.info(
                "the prompt cache cannot be trimmed (recurrent layers): re-reading the conversation"
            )
            self.cache, keep = make_prompt_cache(self.model, self.max_kv_size), 0
        self.cached = tokens[:keep]
        return tokens[keep:]

    def send(
        self, text: str, lookup: Optional[dict] = None, **generate_kwargs
    ) -> Generator[GenerationResponse, None, None]:
        """Add the user's ``text``; stream the reply as mlx-lm ``GenerationResponse``s; with
        ``lookup`` (``stream_lookup_generate``'s keywords), by prompt-lookup speculation, whose
        drafts are also found in the conversation's earlier turns."""
        self.messages.append({"role": "user", "content": text})
        tokens = self._render()
        new = self._uncached(tokens)
        self.new_tokens, self.reused_tokens = len(new), len(tokens) - len(new)
        log.info(
            "prompt: %d tokens, %d of them reused from the prompt cache, %d new",
            len(tokens),
            self.reused_tokens,
            self.new_tokens,
        )
        reply, generated, done = "", [], False
        if lookup is None:
            responses = stream_generate(
                self.model, self.tokenizer, new, prompt_cache=self.cache, **generate_kwargs
            )
        else:
            responses = stream_lookup_generate(
                self.model,
                self.tokenizer,
                new,
                prompt_cache=self.cache,
                context=self.cached,
                **lookup,
                **generate_kwargs,
            )
        try:
            for response in responses:
                reply += response.text
                generated.append(response.token)
                yield response
            done = True
        finally:
            if done:
                # plain decoding fed every token it yielded; speculation all but the last
                self.cached = tokens + (generated if lookup is None else generated[:-1])
                self.messages.append({"role": "assistant", "content": reply})
            else:  # interrupted mid-reply: the cache holds an unknown tail; forget the turn
                self.messages.pop()
                self.cache, self.cached = make_prompt_cache(self.model, self.max_kv_size), []


def reply(session: ChatSession, text: str, args: argparse.Namespace, sampler, group=None) -> None:
    runtime = getattr(session.model, "moeflux", None)
    if runtime is not None:
        runtime.reset_stats()
    # closing(): an interrupted reply runs send()'s cleanup now, not whenever it is collected
    lookup = lookup_kwargs(args)
    turn = session.send(
        text,
        lookup,
        max_tokens=args.max_tokens,
        sampler=sampler,
        prompt_progress_callback=prefill_progress(args.prefill_step_size + 1),
        **kv_kwargs(args),
    )
    with contextlib.closing(turn) as s:
        last = print_stream(s)
    draft = None if lookup is None else lookup["stats"]
    say(stats_line(last, runtime, session.reused_tokens, group, draft))


def chat_loop(
    session: ChatSession, args: argparse.Namespace, sampler, read=input, group=None
) -> None:
    """Read messages and answer them until /quit or end of input. Under mlx.launch every
    process reads the same lines (the launcher hands its input to each) and answers together."""
    say(HELP)
    while True:
        try:
            line = read(PROMPT)
        except EOFError:
            print()
            break
        text = line.strip()
        if not text:
            continue
        if text in QUIT:
            break
        if text == "/reset":
            session.reset()
            say("Conversation reset.")
            continue
        if text in ("/help", "h"):
            say(HELP)
            continue
        if _SLASH_COMMAND.fullmatch(text):  # a typo of a command is not a message to the model
            say(f"Unknown command {text}: not sent to the model (/help lists the commands).")
            continue
        if text.startswith("//"):
            text = text[1:]
        try:
            reply(session, text, args, sampler, group)
        except KeyboardInterrupt:
            say("\n[interrupted: this turn is forgotten]")
        except ExpertReadError as e:  # the model stays usable: the next turn reads again
            say(f"\n{PROG}: error: {e} [this turn is forgotten]")


def run(args: argparse.Namespace) -> int:
    prompt = None if args.prompt is None else read_prompt(args.prompt)
    group = distributed()  # under mlx.launch: this process's share; rank 0 prints
    model, tokenizer = load_model(args, group=group)
    take_prefill_step(args, model)
    try:
        session = ChatSession(model, tokenizer, args.system_prompt, args.max_kv_size)
        sampler = make_sampler(args, tokenizer)
        if prompt is not None:
            reply(session, prompt, args, sampler, group)
            return 0
        try:
            importlib.import_module("readline")  # importing it gives input() editing and history
        except ImportError:
            pass
        chat_loop(session, args, sampler, group=group)
        return 0
    finally:
        model.moeflux.close()


def add_args(parser: argparse.ArgumentParser) -> None:
    add_model_arg(parser)
    parser.add_argument(
        "--prompt",
        "-p",
        default=None,
        help="one-shot: send this message ('-' reads stdin), print the reply and its stats, exit",
    )
    parser.add_argument("--system-prompt", default=None, help="system prompt for the chat template")
    add_tokenizer_args(parser)
    add_sampling_args(parser, DEFAULT_MAX_TOKENS)
    add_kv_args(parser, quantized=False)
    add_lookup_args(parser)
    add_load_args(parser)
    add_distributed_args(parser)


def main(argv: Optional[list] = None) -> int:
    return main_for(command_parser("chat", DESCRIPTION, add_args), run, argv)
