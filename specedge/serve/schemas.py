"""Request bodies of /v1/chat/completions and /v1/completions (pydantic), and their translation
into the pipeline's generation arguments.

Fields clients commonly send but this server does not implement are refused when they ask for
something (n > 1, logprobs, penalties, tools) instead of being silently ignored; unknown fields
are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from ..contract import MAX_SPEC_TOKENS, SEED_MAX

MAX_STOP = 4
MAX_TASK_LEN = 64
ROLES = ("system", "user", "assistant", "developer", "tool")

Text = Annotated[str, Field(max_length=1_000_000)]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: Text | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class SpecedgeOptions(BaseModel):
    """The `"specedge"` extension object (docs/serve.md)."""

    model_config = ConfigDict(extra="forbid")
    spec_tokens: StrictInt | None = Field(None, ge=1, le=MAX_SPEC_TOKENS)
    speculation: StrictBool = True
    drafter: str | None = None
    adaptive_k: StrictBool = False
    guard: StrictBool = True
    task: str | None = Field(None, min_length=1, max_length=MAX_TASK_LEN, pattern=r"^[A-Za-z0-9_.:-]+$")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Common(BaseModel):
    # NaN and infinities (Python's JSON reader takes them) are refused as "a finite number"
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=0)
    seed: StrictInt | None = Field(None, ge=0, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    logprobs: StrictBool | StrictInt | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    specedge: SpecedgeOptions = Field(default_factory=SpecedgeOptions)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return None
        v = [v] if isinstance(v, str) else v
        if len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(not s for s in v):
            raise ValueError("stop strings must not be empty")
        return v or None

    @model_validator(mode="after")
    def _unsupported(self):
        if self.n != 1:
            raise ValueError("only n = 1 is supported")
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        if self.frequency_penalty != 0.0 or self.presence_penalty != 0.0:
            raise ValueError("frequency_penalty and presence_penalty are not supported (leave them at 0)")
        return self

    def generation_kwargs(self, default_max_tokens: int) -> dict:
        """Keyword arguments of Pipeline.stream (besides the prompt)."""
        ext = self.specedge
        return dict(
            max_new_tokens=self._max_tokens() or default_max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop=self.stop,
            spec_tokens=ext.spec_tokens,
            speculative=ext.speculation,
            adaptive_k=ext.adaptive_k,
            guard=ext.guard,
        )

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1, max_length=4096)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    tools: list | None = None

    @model_validator(mode="after")
    def _no_tools(self):
        if self.tools:
            raise ValueError("tools are not supported")
        return self

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def message_dicts(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Common):
    # a string, or token ids; a one-element list of strings is what some clients send for one prompt
    prompt: Text | list[StrictInt] | list[Text]
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None

    @model_validator(mode="after")
    def _check(self):
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise ValueError("the prompt is empty")
            if isinstance(self.prompt[0], str):
                if len(self.prompt) != 1:
                    raise ValueError("one prompt per request (a list of several prompts is not supported)")
                self.prompt = self.prompt[0]
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("only best_of = 1 is supported")
        return self

    def prompt_kwargs(self) -> dict:
        if isinstance(self.prompt, str):
            return {"prompt": self.prompt}
        return {"token_ids": list(self.prompt)}


def describe_validation_error(errors: list[dict]) -> tuple[str, str | None]:
    """One sentence and the offending parameter from pydantic's/FastAPI's error list."""
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    # union members appear as loc entries like 'str' / 'list[...]': keep the field path only
    path = [
        x
        for x in loc
        if not (x in ("str", "int", "float", "bool") or "[" in x or x.startswith(("function-", "constrained-")))
    ]
    param = ".".join(path) or None
    msg = e.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if e.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if e.get("type") == "missing":
        if param is None:  # the body itself is missing
            return "the request body is empty: send a JSON object (Content-Type: application/json)", None
        return f"missing required parameter '{param}'", param
    if param is None:
        if e.get("type") in ("model_attributes_type", "dict_type") and isinstance(e.get("input"), (bytes, str)):
            return "the request body is not valid JSON (send a JSON object as application/json)", None
        if e.get("type") in ("model_attributes_type", "dict_type"):
            return "the request body must be a JSON object", None
        return msg, None
    return f"invalid '{param}': {msg}", param
