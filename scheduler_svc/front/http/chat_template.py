"""Chat templates: a model's Jinja template, rendered the way transformers renders it.

The template comes from ``chat_template.jinja`` or, failing that, ``tokenizer_config.json``'s
``chat_template`` (a string, or a list of named templates of which ``default`` is used): the
order transformers loads them in. :meth:`ChatTemplate.render` gives the same text as
``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``: the
same Jinja environment options (``trim_blocks``, ``lstrip_blocks``, loop controls), the same
helpers (``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text), and
the tokenizer's named special tokens (``bos_token``, ``eos_token``, ...) as variables. The
text it returns already holds the special tokens, so it is tokenized without adding more.

Templates ship with models from anywhere, so they run in Jinja's ``ImmutableSandboxedEnvironment``
(no attribute access to Python internals, no mutation of the values passed in), and what they
see is plain JSON data (the request's messages).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagedserve.model_dir import is_gguf, open_gguf
from scheduler_svc.front.api_errors import ApiError, bad_field

log = logging.getLogger(__name__)

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
# transformers' SPECIAL_TOKENS_ATTRIBUTES: what apply_chat_template passes to every template.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (the template raised, or it failed on their content);
    ``param``: the request field at fault."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


MAX_TEMPLATE_KWARGS = 32  # chat_template_kwargs: variables a request may set (enable_thinking, ...)
MAX_TEMPLATE_KWARG_CHARS = 64
# What the server passes itself: a request may not set these through chat_template_kwargs.
_SERVER_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def template_error(e: ChatTemplateError) -> ApiError:
    """The 400 of a request its template cannot render, naming the field at fault."""
    if e.param == "messages":
        return bad_field("messages", f"the model's chat template refused them: {e}")
    return bad_field(e.param, str(e))


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' filter: Jinja's own escapes HTML characters, which no chat format wants.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace() without underscore names (as transformers: no reach into internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace)
    return env


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    source: str
    special_tokens: Mapping[str, str]
    template: jinja2.Template

    @classmethod
    def compile(cls, source: str, special_tokens: Mapping[str, str] | None = None) -> ChatTemplate:
        """Raises ValueError when the template does not parse (a broken model directory)."""
        try:
            template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not parse: {e.message} (line {e.lineno})") from e
        return cls(source, dict(special_tokens or {}), template)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
               template_kwargs: Mapping[str, Any] | None = None,
               documents: list[dict[str, str]] | None = None) -> str:
        """The prompt for ``messages`` (plain dicts: role, content, tool_calls, ...) and the request's
        ``tools`` (OpenAI's form: the template decides how the model sees them); ChatTemplateError if
        it fails. ``continue_final_message``: the prompt ends with the last message's content (what
        follows it, the template's end of turn, is cut), as transformers' apply_chat_template does.
        ``template_kwargs``: the request's ``chat_template_kwargs``, more variables for the template
        (e.g. ``enable_thinking``), as vLLM passes them to apply_chat_template. ``documents``: the
        request's (vLLM's), for templates that ground an answer in them (Command-R's, Granite's)."""
        extra = self._checked_kwargs(template_kwargs) if template_kwargs else {}
        try:
            rendered = self.template.render(messages=messages, tools=tools, documents=documents,
                                            add_generation_prompt=add_generation_prompt,
                                            **{**extra, **self.special_tokens})
        except jinja2.exceptions.TemplateError as e:  # raise_exception(), sandbox violations, undefined values
            raise ChatTemplateError(str(e)) from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"the chat template failed on these messages ({type(e).__name__}: {e})") from e
        return _open_final_message(rendered, messages[-1].get("content") or "") if continue_final_message else rendered


    def _checked_kwargs(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The variables a request adds; none may replace what the server passes (the messages, the
        tools, the special tokens) or a helper the templates call."""
        if len(kwargs) > MAX_TEMPLATE_KWARGS:
            raise ChatTemplateError(f"has {len(kwargs)} entries, at most {MAX_TEMPLATE_KWARGS}", "chat_template_kwargs")
        for name in kwargs:
            field = f"chat_template_kwargs.{name[:MAX_TEMPLATE_KWARG_CHARS]}"
            if len(name) > MAX_TEMPLATE_KWARG_CHARS or not name.isidentifier():
                raise ChatTemplateError(f"must be a name of at most {MAX_TEMPLATE_KWARG_CHARS} characters "
                                        "(letters, digits, underscores)", field)
            if name in _SERVER_VARIABLES or name in self.special_tokens or name in self.template.globals:
                raise ChatTemplateError("is set by the server and cannot be given in chat_template_kwargs", field)
        return dict(kwargs)


def _open_final_message(rendered: str, final: str) -> str:
    """``rendered`` cut right after the last occurrence of the final message's content (or of it stripped,
    for templates that trim it)."""
    for text in (final, final.strip()):
        at = rendered.rfind(text)
        if at != -1:
            return rendered[:at + len(text)]
    raise ChatTemplateError("the final message's content does not appear in the prompt the chat template "
                            "rendered", "continue_final_message")


def load_chat_template(model_dir: Path) -> ChatTemplate | None:
    """The model directory's chat template, or None when it has none (chat requests are then rejected).

    Raises ValueError when a template is there but broken: better at startup than on every request.
    A GGUF file's template and special tokens come from its metadata.
    """
    if is_gguf(model_dir):
        gguf = open_gguf(model_dir)
        source = gguf.chat_template()
        return None if source is None else ChatTemplate.compile(source, gguf.special_tokens())
    config = _read_json(model_dir / TOKENIZER_CONFIG)
    source = _template_source(model_dir, config)
    if source is None:
        return None
    return ChatTemplate.compile(source, _special_tokens(model_dir, config))


def _template_source(model_dir: Path, config: dict[str, Any]) -> str | None:
    path = model_dir / TEMPLATE_FILE
    if path.is_file():  # transformers: a template file wins over tokenizer_config.json
        return path.read_text(encoding="utf-8")
    value = config.get("chat_template")
    if isinstance(value, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{model_dir / TOKENIZER_CONFIG}: chat_template must be a string (got {type(value).__name__})")
    return value


def _special_tokens(model_dir: Path, config: dict[str, Any]) -> dict[str, str]:
    """Named special tokens as strings; tokenizer_config.json first, then special_tokens_map.json."""
    out: dict[str, str] = {}
    for source in (config, _read_json(model_dir / "special_tokens_map.json")):
        for name in SPECIAL_TOKEN_NAMES:
            value = source.get(name)
            if isinstance(value, dict):  # a serialized AddedToken
                value = value.get("content")
            if isinstance(value, str) and name not in out:
                out[name] = value
    return out


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}
