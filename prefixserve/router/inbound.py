"""What the router reads from a client's request before placing it: a checked JSON body and its prompt.

The router only needs a body's prompt (to compute block keys) and a rough size of
its work (to balance load). Everything else is the replica's to validate, so an
odd field is forwarded untouched and answered by the replica with a precise 4xx.
What the router cannot forward it answers itself: a body that is not JSON, not an
object, or not sent as JSON.

Reading runs in a worker thread (`asyncio.to_thread`): parsing a body of megabytes
and tokenizing a long prompt would otherwise stall every other request and the
health checks. A prompt that cannot fit the replicas' context (more characters than
max_model_len times the most characters one token stands for) is not tokenized at
all (the replica will refuse it); it is routed by load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..anthropic_chat import chat_of
from ..chat_tools import render_chat, template_reads_tools
from ..http import split_model
from ..http_body import parse_json_body
from ..prompts import is_token_ids, split_prompts

MAX_SANE_TOKENS = 1 << 31
MESSAGES_PATH = "/v1/messages"


class BadRequest(Exception):
    """A request the router answers itself (the replica would never see a readable body)."""

    def __init__(self, status: int, message: str, code: str = "invalid_request", param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


@dataclass
class ClientRequest:
    path: str  # /v1/completions, /v1/chat/completions or /v1/messages (Anthropic's)
    body: dict
    streaming: bool
    n: int  # samples per prompt (1 when unclear)
    num_choices: int  # choices the response will carry (n times the prompts of a batch)
    max_tokens: Optional[int]  # the client's limit when it is a sane integer, else None (the replica decides)
    wants_token_ids: bool  # the client itself asked for vLLM's return_token_ids
    token_ids: list[int] = field(default_factory=list)  # the prompt as the replica will see it; [] when unknown
    salt: Optional[str] = None  # tenant and cache_salt composed as the replicas compose them
    model_version: Optional[str] = None  # 'name@fp_...': the model fingerprint's leading hex digits it asked for
    cache_key: Optional[str] = None  # OpenAI's prompt_cache_key: keep requests sharing it on one replica

    @property
    def model_name(self) -> Optional[str]:
        """The model it names without a version pin (a LoRA adapter's name keys it in that adapter's scope)."""
        model = self.body.get("model")
        if not isinstance(model, str):
            return None
        try:
            return split_model(model)[0]
        except ValueError:
            return None

    @property
    def is_chat(self) -> bool:
        return self.path.endswith("/chat/completions")

    @property
    def is_messages(self) -> bool:
        """Anthropic's Messages API: its stream carries no token ids, so it is replayed, never continued."""
        return self.path == MESSAGES_PATH


def check_content_type(content_type: Optional[str]) -> None:
    """JSON, or no declared type (some clients omit it); anything else is a client error (415)."""
    if not content_type:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise BadRequest(
            415,
            f"the request body must be JSON sent as 'Content-Type: application/json', not {media!r}",
            "unsupported_media_type",
        )


def read_request(raw: bytes, path: str, tokenizer, max_prompt_tokens: int, max_prompt_chars: int) -> ClientRequest:
    """Parse and inspect a body (call it off the event loop). Raises BadRequest when it cannot be forwarded."""
    try:
        body = parse_json_body(raw)
    except ValueError as error:
        raise BadRequest(400, f'{error}; send a JSON object such as {{"prompt": "..."}}', code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest(400, f"the request body must be a JSON object, not {type(body).__name__}", code="invalid_json")
    n = _sane_int(body.get("n", 1)) or 1
    model_version = None
    if isinstance(body.get("model"), str):
        try:
            model_version = split_model(body["model"])[1]
        except ValueError as error:
            raise BadRequest(400, str(error), code="invalid_value", param="model") from None
    request = ClientRequest(
        path=path,
        body=body,
        streaming=body.get("stream") is True,
        n=n,
        num_choices=n * _num_prompts(path, body),
        max_tokens=_max_tokens(path, body),
        wants_token_ids=body.get("return_token_ids") is True,
        model_version=model_version,
        cache_key=None if path == MESSAGES_PATH else _cache_key(body.get("prompt_cache_key")),
    )
    try:
        request.token_ids = _prompt_tokens(request, tokenizer, max_prompt_tokens, max_prompt_chars)
    except Exception:  # a template may reject a conversation; the replica will say why
        request.token_ids = []
    return request


def _cache_key(value) -> Optional[str]:
    """A prompt_cache_key the replica would accept (1-256 characters), else None: the replica refuses it."""
    return value if isinstance(value, str) and 0 < len(value) <= 256 else None


def _sane_int(value) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < MAX_SANE_TOKENS else None


def _max_tokens(path: str, body: dict) -> Optional[int]:
    if path.endswith("/chat/completions") and body.get("max_completion_tokens") is not None:
        return _sane_int(body["max_completion_tokens"])
    return _sane_int(body.get("max_tokens"))


def _prompts(body: dict) -> list:
    """The completion prompts as the replica splits them ([] when they are not prompts at all)."""
    try:
        return split_prompts(body.get("prompt"))
    except (ValueError, TypeError):
        return []


def _num_prompts(path: str, body: dict) -> int:
    return 1 if path.endswith("/chat/completions") or path == MESSAGES_PATH else max(len(_prompts(body)), 1)


def _prompt_tokens(request: ClientRequest, tokenizer, max_prompt_tokens: int, max_prompt_chars: int) -> list[int]:
    """The token ids the replica will see (the first prompt of a batch decides its placement)."""
    body = request.body
    if request.is_chat:
        return _chat_tokens(body.get("messages"), body.get("tools"), tokenizer, max_prompt_chars)
    if request.is_messages:  # Anthropic's body, as the replica turns it into a chat (anthropic_chat.py)
        try:
            messages, tools = chat_of(body)
        except (ValueError, KeyError, TypeError, AttributeError):  # the replica will refuse it
            return []
        return _chat_tokens(messages, tools, tokenizer, max_prompt_chars)
    prompts = _prompts(body)
    prompt = prompts[0] if prompts else None
    if isinstance(prompt, str):
        return tokenizer.encode(prompt) if len(prompt) <= max_prompt_chars else []
    if is_token_ids(prompt) and len(prompt) <= max_prompt_tokens:
        return list(prompt)
    return []


def _chat_tokens(messages, tools, tokenizer, max_prompt_chars: int) -> list[int]:
    """A chat's tokens as the replica renders them, tools and tool calls included (chat_tools.py)."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    ):
        return []
    if not isinstance(tools, list) or not tools:
        tools = None
    try:
        rendered, template_tools = render_chat(messages, tools, template_reads_tools(tokenizer.chat_template))
    except (ValueError, KeyError, TypeError, AttributeError):  # the replica will refuse it
        return []
    if sum(len(m["content"]) for m in rendered) + len(str(template_tools or "")) > max_prompt_chars:
        return []
    return tokenizer.encode_chat(rendered, True, template_tools)
