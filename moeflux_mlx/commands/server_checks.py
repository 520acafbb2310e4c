"""What ``moeflux-mlx server`` checks of a request before any work, against the served model.

Every field mlx_lm.server's handler reads (``APIHandler.do_POST``) is checked here for its type
and range, as the OpenAI API defines them, and against the model: token ids within its
vocabulary, sizes within its context. A bad field raises ``RequestError`` (a ``ValueError``)
whose message is written for the client and names the field (``param``); the server answers it
as OpenAI does (``{"error": {"message", "type", "param", "code"}}``).

``check_logit_bias`` and ``check_generation_args`` are the same checks for callers of the Python
API (mlx-lm's ``GenerationArguments``, a logits processor's bias): an id past the vocabulary, or a
context size past what an array can index, crashes the process inside MLX (a segmentation
fault), so it is refused here instead.
"""

from __future__ import annotations

import hmac
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional

# OpenAI's ranges (https://platform.openai.com/docs/api-reference/chat/create)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
TEMPERATURE_RANGE = (0.0, 2.0)
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty, frequency_penalty
MAX_TOP_LOGPROBS = 11  # mlx_lm.server's own limit (OpenAI's is 20)
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_NUM_DRAFT_TOKENS = 64
MAX_SEED = 2**64 - 1  # mx.random.seed takes an unsigned 64-bit integer
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# keys of apply_chat_template that the server sets itself
RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "messages",
    "tools",
    "tokenize",
    "add_generation_prompt",
    "return_dict",
    "return_tensors",
    "padding",
    "truncation",
    "max_length",
    "continue_final_message",
    "documents",
    "chat_template",
}
_TOKEN_ID = re.compile(r"[0-9]{1,12}")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


class RequestError(ValueError):
    """A request the server refuses, with what the client is told.

    Attributes:
        message: for the client; never an internal exception's text.
        param: the field at fault (``"logit_bias"``, ``"messages[0].role"``), or None.
        code: a short machine-readable reason, or None.
        status: the HTTP status (400 unless said).
        kind: OpenAI's error ``type`` (``invalid_request_error`` unless said).
    """

    def __init__(
        self,
        message: str,
        param: Optional[str] = None,
        code: Optional[str] = None,
        status: int = 400,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = (
            message,
            param,
            code,
            status,
            kind,
        )

    def body(self) -> dict:
        """Returns: the OpenAI error object, ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True)
class ModelLimits:
    """What a request may ask of one model.

    Attributes:
        vocab_size: rows of the model's logits (``vocab_size`` of config.json): token ids are
            below it.
        context_length: the model's context (``max_position_embeddings``).
        max_prompt_tokens: the longest prompt accepted (at most ``context_length``).
        max_tokens: the most tokens a request may ask for (``--max-tokens-limit``).
    """

    vocab_size: int
    context_length: int
    max_prompt_tokens: int
    max_tokens: int


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(
        value
    )


def _int(value: Any, name: str, low: int, high: int) -> int:
    if not _is_int(value):
        raise RequestError(f"{name} must be an integer, not {_kind(value)}", name, "invalid_type")
    if not low <= value <= high:
        bound = f"at least {low}" if value < low else f"at most {high}"
        raise RequestError(f"{name} must be {bound}, got {value}", name, "out_of_range")
    return value


def _number(value: Any, name: str, low: float, high: Optional[float]) -> float:
    if not _is_number(value):
        why = "a finite number" if isinstance(value, float) else f"a number, not {_kind(value)}"
        raise RequestError(f"{name} must be {why}", name, "invalid_type")
    if value < low or (high is not None and value > high):
        bound = f"at least {low:g}" if value < low else f"at most {high:g}"
        raise RequestError(f"{name} must be {bound}, got {value}", name, "out_of_range")
    return float(value)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise RequestError(
            f"{name} must be true or false, not {_kind(value)}", name, "invalid_type"
        )
    return value


def _kind(value: Any) -> str:
    names = {
        type(None): "null",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }
    return names.get(type(value), type(value).__name__)


def check_logit_bias(
    logit_bias: Any, vocab_size: int, name: str = "logit_bias"
) -> Dict[int, float]:
    """A logit bias as OpenAI defines it, its token ids within the model's vocabulary.

    Args:
        logit_bias: ``{token id: bias}``; ids as JSON gives them (decimal strings) or ints.
        vocab_size: rows of the model's logits.
        name: the field named in errors.

    Returns:
        ``{int id: float bias}``.

    Raises:
        RequestError: not an object, more than ``MAX_LOGIT_BIAS_ENTRIES`` entries, an id that is
            not a non-negative integer below ``vocab_size``, or a bias that is not a finite number
            in [-100, 100].
    """
    if not isinstance(logit_bias, dict):
        raise RequestError(
            f"{name} must be an object of token ids to biases, not {_kind(logit_bias)}", name
        )
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise RequestError(
            f"{name} has {len(logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are accepted",
            name,
        )
    out = {}
    for key, value in logit_bias.items():
        if _is_int(key):
            token = key
        elif isinstance(key, str) and _TOKEN_ID.fullmatch(key):
            token = int(key)
        else:
            raise RequestError(
                f"{name}: {str(key)[:40]!r} is not a token id (a non-negative integer)",
                name,
                "invalid_token_id",
            )
        if not 0 <= token < vocab_size:
            raise RequestError(
                f"{name}: token id {token} is outside this model's vocabulary (0 to "
                f"{vocab_size - 1})",
                name,
                "invalid_token_id",
            )
        low, high = LOGIT_BIAS_RANGE
        if not _is_number(value) or not low <= value <= high:
            raise RequestError(
                f"{name}: the bias of token {token} must be a number between {low:g} and {high:g}",
                name,
                "out_of_range",
            )
        out[token] = float(value)
    return out


def check_generation_args(args: Any, limits: ModelLimits) -> None:
    """mlx-lm's ``GenerationArguments`` checked against the model, for any caller of
    ``ResponseGenerator.generate`` (the HTTP handler checks the same fields earlier).

    Args:
        args: an ``mlx_lm.server.GenerationArguments``.
        limits: the model's.

    Raises:
        RequestError: a token id outside the vocabulary, a context size, top-k or
            ``max_tokens`` beyond the model, a non-finite or out-of-range sampling value.
    """
    logits, sampling = args.logits, args.sampling
    if logits.logit_bias:
        check_logit_bias(logits.logit_bias, limits.vocab_size)
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        _int(getattr(logits, name), name, 0, limits.context_length)
    _number(logits.repetition_penalty or 0, "repetition_penalty", 0.0, None)
    _number(logits.presence_penalty or 0, "presence_penalty", -math.inf, None)
    _number(logits.frequency_penalty or 0, "frequency_penalty", -math.inf, None)
    _number(sampling.temperature, "temperature", 0.0, None)
    _number(sampling.top_p, "top_p", 0.0, 1.0)
    _number(sampling.min_p, "min_p", 0.0, 1.0)
    _int(sampling.top_k, "top_k", 0, limits.vocab_size - 1)
    _number(sampling.xtc_probability, "xtc_probability", 0.0, 1.0)
    _number(sampling.xtc_threshold, "xtc_threshold", 0.0, 1.0)
    _int(args.max_tokens, "max_tokens", 1, limits.max_tokens)
    _int(args.top_logprobs, "top_logprobs", -1, min(MAX_TOP_LOGPROBS, limits.vocab_size))
    if args.seed is not None:
        _int(args.seed, "seed", 0, MAX_SEED)


def check_prompt_length(n_tokens: int, limits: ModelLimits, param: str = "messages") -> None:
    """Raises ``RequestError`` (code ``context_length_exceeded``) when a prompt of ``n_tokens``
    is longer than the server takes, or is empty.

    Args:
        n_tokens: the prompt's tokens.
        limits: the model's.
        param: the field named (``messages`` or ``prompt``).

    Raises:
        RequestError: as said.
    """
    if n_tokens == 0:
        raise RequestError("the prompt is empty (no tokens)", param, "empty_prompt")
    if n_tokens > limits.max_prompt_tokens:
        which = (
            "the model's context length"
            if limits.max_prompt_tokens >= limits.context_length
            else "this server's --max-prompt-tokens"
        )
        raise RequestError(
            f"the prompt is {n_tokens} tokens, more than this server accepts "
            f"({limits.max_prompt_tokens}, {which})",
            param,
            "context_length_exceeded",
        )


def _check_content(content: Any, where: str, images: bool) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise RequestError(
            f"{where} must be a string or an array of content parts, not {_kind(content)}", where
        )
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise RequestError(f"{at} must be an object with a type", at)
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                raise RequestError(f"{at}.text must be a string", at)
        elif part["type"] in ("image_url", "input_image", "image"):
            if not images:
                raise RequestError(
                    f"{at}: this model takes text only (content parts of type text)", at
                )
            url = part.get("image_url", part.get("image"))
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url.startswith("data:"):
                raise RequestError(
                    f"{at}: images must be sent inline as data: URLs (this server fetches nothing)",
                    at,
                )
        else:
            raise RequestError(
                f"{at}: content parts of type {part['type'][:40]!r} are not supported (text only)",
                at,
            )


def check_messages(messages: Any, images: bool = False) -> None:
    """A chat request's ``messages``: a non-empty array of objects, each with a known ``role``
    and a ``content`` that is a string, null, or an array of content parts.

    Args:
        messages: the field as sent.
        images: whether the model takes images (``image_url`` parts, as data: URLs only).

    Raises:
        RequestError: naming the message and field at fault.
    """
    if not isinstance(messages, list):
        raise RequestError(
            f"messages must be an array of message objects, not {_kind(messages)}", "messages"
        )
    if not messages:
        raise RequestError("messages must not be empty", "messages")
    for i, message in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{at} must be an object with a role and content", at)
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(
                f"{at}.role must be one of {', '.join(ROLES)}, got {str(role)[:40]!r}",
                f"{at}.role",
            )
        _check_content(message.get("content"), f"{at}.content", images)
        calls = message.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function", {}), dict) for c in calls
            ):
                raise RequestError(f"{at}.tool_calls must be an array of objects", at)
            for c in calls:
                arguments = c.get("function", {}).get("arguments")
                if isinstance(arguments, str):
                    try:
                        json.loads(arguments)
                    except ValueError:
                        raise RequestError(
                            f"{at}.tool_calls: function arguments must be JSON", at
                        ) from None


def _optional(body: dict, name: str) -> bool:
    return body.get(name) is not None


def check_object(body: Any) -> dict:
    """``body`` if it is a JSON object.

    Raises:
        RequestError: it is not.
    """
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, not {_kind(body)}")
    return body


def check_request(
    body: Any,
    endpoint: str,
    limits: ModelLimits,
    default_max_tokens: int,
    images: bool = False,
) -> dict:
    """Every field of a completion request that mlx_lm.server reads, checked; unsupported values
    of the OpenAI API refused.

    Args:
        body: the parsed JSON body.
        endpoint: ``"chat"`` or ``"text"``.
        limits: the model's.
        default_max_tokens: the server's ``--max-tokens`` (what a request that does not say gets).
        images: whether the model takes images.

    Returns:
        The body, normalized for mlx-lm's handler: numbers its validator wants as floats made
        floats, ``logit_bias`` keys made decimal strings, ``stream_options`` complete, a prompt
        given as a one-element array made a string.

    Raises:
        RequestError: the first field at fault.
    """
    body = dict(check_object(body))
    if endpoint == "chat":
        if "messages" not in body:
            raise RequestError("messages is required", "messages", "missing_required_parameter")
        check_messages(body["messages"], images)
        if _optional(body, "tools"):
            tools = body["tools"]
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise RequestError("tools must be an array of objects", "tools")
        if _optional(body, "role_mapping"):
            mapping = body["role_mapping"]
            if not isinstance(mapping, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()
            ):
                raise RequestError("role_mapping must be an object of strings", "role_mapping")
    else:
        if "prompt" not in body:
            raise RequestError("prompt is required", "prompt", "missing_required_parameter")
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            body["prompt"] = prompt = prompt[0]
        if isinstance(prompt, list):
            raise RequestError(
                "prompt: only one prompt, as a string, is supported (not several prompts or "
                "token ids)",
                "prompt",
                "unsupported_value",
            )
        if not isinstance(prompt, str):
            raise RequestError(f"prompt must be a string, not {_kind(prompt)}", "prompt")
        for name in ("echo",):
            if body.get(name) not in (None, False):
                raise RequestError(f"{name} is not supported", name, "unsupported_value")
        if body.get("suffix") not in (None, ""):
            raise RequestError("suffix is not supported", "suffix", "unsupported_value")
        if body.get("best_of") not in (None, 1):
            raise RequestError("best_of: only 1 is supported", "best_of", "unsupported_value")
    if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):
        raise RequestError(
            f"n: only one choice per request is supported (n = 1), got {str(body.get('n'))[:20]}",
            "n",
            "unsupported_value",
        )
    response_format = body.get("response_format")
    if response_format is not None and (
        not isinstance(response_format, dict) or response_format.get("type") != "text"
    ):
        raise RequestError(
            'response_format: only {"type": "text"} is supported',
            "response_format",
            "unsupported_value",
        )
    if "stream" in body:
        _bool(body["stream"], "stream")
    if _optional(body, "stream_options"):
        options = body["stream_options"]
        if not isinstance(options, dict):
            raise RequestError("stream_options must be an object", "stream_options")
        body["stream_options"] = {
            **options,
            "include_usage": _bool(options.get("include_usage", False), "stream_options"),
        }
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"model must be a string, not {_kind(model)}", "model")
    for name in ("draft_model", "adapters"):
        if _optional(body, name) and not isinstance(body[name], str):
            raise RequestError(f"{name} must be a string", name)
    max_tokens = body.get("max_completion_tokens")
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = body.get("max_tokens"), "max_tokens"
    if max_tokens is not None:
        _int(max_tokens, name, 1, 2**63)
        if max_tokens > limits.max_tokens:
            raise RequestError(
                f"{name} {max_tokens} is more than this server allows ({limits.max_tokens}, "
                "its --max-tokens-limit: by default the model's context length)",
                name,
                "out_of_range",
            )
    elif default_max_tokens > limits.max_tokens:
        raise RequestError(
            f"max_tokens must be given: this server's default ({default_max_tokens}) is more "
            f"than this model allows ({limits.max_tokens})",
            "max_tokens",
        )
    for name, low, high in (
        ("temperature", *TEMPERATURE_RANGE),
        ("top_p", 0.0, 1.0),
        ("min_p", 0.0, 1.0),
        ("presence_penalty", *PENALTY_RANGE),
        ("frequency_penalty", *PENALTY_RANGE),
        ("repetition_penalty", 0.0, None),
        ("xtc_probability", 0.0, 1.0),
        ("xtc_threshold", 0.0, 1.0),
    ):
        if _optional(body, name):
            body[name] = _number(body[name], name, low, high)  # a float, as mlx-lm wants
    if _optional(body, "top_k"):
        _int(body["top_k"], "top_k", 0, limits.vocab_size - 1)
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        if _optional(body, name):
            _int(body[name], name, 0, limits.context_length)
    if _optional(body, "num_draft_tokens"):
        _int(body["num_draft_tokens"], "num_draft_tokens", 0, MAX_NUM_DRAFT_TOKENS)
    if _optional(body, "logprobs"):
        _bool(body["logprobs"], "logprobs")
    if _optional(body, "top_logprobs"):
        _int(body["top_logprobs"], "top_logprobs", 0, min(MAX_TOP_LOGPROBS, limits.vocab_size))
    if _optional(body, "seed"):
        _int(body["seed"], "seed", 0, MAX_SEED)
    if _optional(body, "logit_bias"):
        bias = check_logit_bias(body["logit_bias"], limits.vocab_size)
        body["logit_bias"] = {str(k): v for k, v in bias.items()}
    if _optional(body, "stop"):
        stop = body["stop"]
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise RequestError("stop must be a string or an array of strings", "stop")
        if len(stop) > MAX_STOP_STRINGS:
            raise RequestError(
                f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are accepted", "stop"
            )
        if any(not s or len(s) > MAX_STOP_CHARS for s in stop):
            raise RequestError(
                f"stop strings must be 1 to {MAX_STOP_CHARS} characters long", "stop"
            )
    if _optional(body, "chat_template_kwargs"):
        kwargs = body["chat_template_kwargs"]
        if not isinstance(kwargs, dict):
            raise RequestError("chat_template_kwargs must be an object", "chat_template_kwargs")
        for key in kwargs:
            if not _IDENTIFIER.fullmatch(key) or key in RESERVED_TEMPLATE_KWARGS:
                raise RequestError(
                    f"chat_template_kwargs: {key[:40]!r} cannot be set by a request",
                    "chat_template_kwargs",
                )
    return body


def model_allowed(requested: Optional[str], allowed: Iterable[str]) -> bool:
    """Whether a request's ``model`` names a model this server may load (no disk access).

    Args:
        requested: the request's ``model`` (None or ``"default_model"``: the served one).
        allowed: the names and paths the server accepts; ``"*"`` among them: any.

    Returns:
        True where it may be loaded.
    """
    allowed = set(allowed)
    return requested in (None, "default_model") or requested in allowed or "*" in allowed


def bearer_matches(header: Optional[str], key: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <key>``, compared in constant time.

    Args:
        header: the header's value, or None.
        key: the server's key.

    Returns:
        True when it matches.
    """
    if not header:
        return False
    scheme, _, given = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), key.encode())
