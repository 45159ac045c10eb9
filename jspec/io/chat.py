"""Chat templates: conversations rendered and tokenized exactly as transformers' `apply_chat_template` does.

Where a checkpoint's template comes from (`load_chat_template`), as transformers' tokenizers read it:
1. `chat_template.jinja` (the default template) and `additional_chat_templates/NAME.jinja` (named ones):
   these files, when present, replace any template in tokenizer_config.json;
2. else tokenizer_config.json's "chat_template": one template, or a list of {"name", "template"};
3. else the legacy processor file `chat_template.json` ({"chat_template": ...}), which transformers'
   tokenizers never read (AutoProcessor does): a last resort for checkpoints that ship only that.
Several templates form a dict: "tool_use" serves calls with tools when the checkpoint has one, "default"
serves the rest, and any of them can be chosen by name (`chat_template="tool_use"`).

Rendering (`render_conversations`) uses the environment transformers builds: a jinja2
ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks, the loop-controls extension and the
`{% generation %}` tag; the `tojson` filter (json.dumps, ensure_ascii=False, with indent / separators /
sort_keys), `raise_exception(message)`, `strftime_now(format)`, a `dict` that builds plain dicts and a
`namespace` that refuses underscore names. The template sees `messages`, `tools`, `documents`,
`add_generation_prompt`, the tokenizer's special tokens (`bos_token`, `eos_token`, `pad_token`, ...) and
any extra keyword (e.g. `enable_thinking=False`), which overrides a special token of the same name.
Messages are copied as plain JSON data first, keys whose value is None are dropped, and a message's
reasoning given as "reasoning_content", "thinking" or "reasoning" is offered under the first two names, as
transformers does. The text is then encoded with no special tokens added (`encode_chat`): the template
writes BOS and the turn markers itself.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime

import numpy as np

from jspec.errors import JspecError
from jspec.io.files import read_json_object

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
LEGACY_TEMPLATE_FILE = "chat_template.json"
RESERVED = ("messages", "tools", "documents", "add_generation_prompt")
# transformers' apply_chat_template options that are not template variables and that jspec does not take
HF_CALL_OPTIONS = ("tokenize", "return_dict", "return_tensors", "padding", "truncation", "max_length",
                   "tokenizer_kwargs", "return_assistant_tokens_mask", "sanitize_control_tokens")
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatError(JspecError, ValueError):
    """A conversation cannot be rendered: no chat template, malformed messages, or a template that refuses
    them (its `raise_exception`) or does not parse; the message names the file or the message at fault."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's chat template(s): one Jinja source, or name -> source; `source`: the file(s) it came from."""

    templates: str | dict
    source: str


def searched_files(model_dir: str) -> str:
    """Where `load_chat_template` looks, in order, for error messages."""
    return (f"{os.path.join(model_dir, TEMPLATE_FILE)}, {os.path.join(model_dir, TEMPLATE_DIR)}/*.jinja, the "
            f"\"chat_template\" entry of {os.path.join(model_dir, 'tokenizer_config.json')} and "
            f"{os.path.join(model_dir, LEGACY_TEMPLATE_FILE)}")


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as err:
        raise ChatError(f"{path} is not UTF-8 text (invalid byte at {err.start}): the chat template file is "
                        "damaged") from None


def _template_entries(value, where: str) -> str | dict:
    """tokenizer_config.json / chat_template.json's "chat_template": a string or a list of {name, template}."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, Mapping) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ChatError(f"{where}: \"chat_template\" is {type(value).__name__} {str(value)[:60]!r}; expected a Jinja "
                    "template string or a list of {\"name\": ..., \"template\": ...}: the file is damaged")


def load_chat_template(model_dir: str, tokenizer_config: Mapping | None = None) -> ChatTemplate | None:
    """The folder's chat template(s) by the precedence in the module docstring, or None when it has none.
    tokenizer_config: the folder's tokenizer_config.json, already read (jspec.io.tokenizer)."""
    found: dict = {}
    files = []
    default = os.path.join(model_dir, TEMPLATE_FILE)
    if os.path.isfile(default):
        found["default"] = _read_text(default)
        files.append(default)
    extra_dir = os.path.join(model_dir, TEMPLATE_DIR)
    if os.path.isdir(extra_dir):
        for name in sorted(os.listdir(extra_dir)):
            if name.endswith(".jinja") and os.path.isfile(os.path.join(extra_dir, name)):
                found[name[: -len(".jinja")]] = _read_text(os.path.join(extra_dir, name))
                files.append(os.path.join(extra_dir, name))
    if found:
        templates = found["default"] if list(found) == ["default"] else found
        return ChatTemplate(templates, ", ".join(files))
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    if tokenizer_config is None and os.path.exists(config_path):
        tokenizer_config = read_json_object(config_path)
    if tokenizer_config and tokenizer_config.get("chat_template") is not None:
        return ChatTemplate(_template_entries(tokenizer_config["chat_template"], config_path), config_path)
    legacy = os.path.join(model_dir, LEGACY_TEMPLATE_FILE)
    if os.path.isfile(legacy):
        entry = read_json_object(legacy).get("chat_template")
        if entry is None:
            raise ChatError(f"{legacy} has no \"chat_template\" entry: the file is damaged")
        return ChatTemplate(_template_entries(entry, legacy), legacy)
    return None


def choose_template(templates: str | Mapping | None, chat_template: str | None = None, tools=None,
                    where: str = "this target") -> str:
    """The Jinja source to render, as transformers' `get_chat_template` picks it: `chat_template` (a template,
    or the name of one of several) wins; of several, "tool_use" serves calls with tools, else "default"."""
    if isinstance(templates, Mapping):
        if chat_template is not None:
            return templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ChatError(f"{where} has several chat templates and none named \"default\": pass "
                        f"chat_template=NAME, one of {sorted(templates)}")
    if chat_template is not None:
        return chat_template
    if templates is None:
        raise ChatError(f"{where} has no chat template: pass chat_template=... (a Jinja template), or use a chat "
                        "model's checkpoint")
    return templates


# --- the Jinja environment -----------------------------------------------------------------------------


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson: plain json.dumps (Jinja's own filter escapes HTML characters)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):  # noqa: A002 (the templates' keyword)
    return datetime.now().strftime(format)


class _PlainDict:
    """The templates' `dict`: builds plain dicts (dict(...), dict.fromkeys(...)) and gives no access to the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


@functools.lru_cache(maxsize=64)
def compile_template(source: str):
    """The compiled jinja2 Template of a chat template source, in transformers' sandboxed environment."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """`namespace(...)` refusing underscore attributes (no way to CPython internals)."""

        def __init__(*args, **kwargs):  # Jinja's signature trick: `self` may also be an attribute name
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _PlainDict()
    env.globals["namespace"] = Namespace
    return env.from_string(source)


# --- inputs --------------------------------------------------------------------------------------------


def plain_data(value):
    """A copy of `value` made of plain JSON types (what the sandboxed template may see): str / int / float /
    bool / None, dicts, lists, tuples; subclasses (enums, numpy scalars) become their base type, dataclasses
    and pydantic models dicts, anything else the placeholder "<TypeName>" (as transformers does)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if isinstance(value, np.generic):
        return plain_data(value.item())  # numpy scalars (np.bool_(False) must stay falsy)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def check_conversation(messages, where: str = "messages") -> list[dict]:
    """The conversation as a list of message dicts, checked: a non-empty list of {"role": str, "content": ...}
    dicts (content: text, a list of content blocks, or absent / None on an assistant message with
    "tool_calls"); ChatError naming the message and the fix otherwise. Keys whose value is None are dropped,
    as transformers drops them."""
    example = '[{"role": "user", "content": "Hello"}]'
    if isinstance(messages, (str, bytes)):
        raise ChatError(f"{where} is text ({messages[:40]!r}), not a conversation: pass a list of messages, e.g. "
                        f"{example}")
    if isinstance(messages, Mapping):
        raise ChatError(f"{where} is one message dict, not a conversation: wrap it in a list, [message]")
    if not isinstance(messages, Sequence):
        raise ChatError(f"{where} is {type(messages).__name__}, not a conversation: pass a list of messages, e.g. "
                        f"{example}")
    if len(messages) == 0:
        raise ChatError(f"{where} is an empty conversation: pass at least one message, e.g. {example}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            hint = (" (a list of conversations is a batch: Target.chat_prompts takes it)"
                    if isinstance(m, Sequence) and not isinstance(m, (str, bytes)) else "")
            raise ChatError(f"{where}[{i}] is {type(m).__name__} {str(m)[:40]!r}, not a message: each message is a "
                            f"dict with \"role\" and \"content\", e.g. {example}{hint}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ChatError(f"{where}[{i}] has role {role!r}: each message needs a \"role\" string (\"system\", "
                            "\"user\", \"assistant\", \"tool\", ...)")
        content = m.get("content")
        if content is None and not m.get("tool_calls"):
            raise ChatError(f"{where}[{i}] ({role}) has no \"content\": give the message's text (only an assistant "
                            "message carrying \"tool_calls\" may go without)")
        if content is not None and not isinstance(content, (str, list, tuple)):
            raise ChatError(f"{where}[{i}] ({role}) has content of type {type(content).__name__}: content is text or "
                            "a list of content blocks ({\"type\": \"text\", \"text\": ...})")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def check_conversations(conversations, where: str = "conversations") -> list[list[dict]]:
    """A batch: a non-empty list of conversations, each checked by `check_conversation`."""
    if isinstance(conversations, (str, bytes, Mapping)) or not isinstance(conversations, Sequence):
        raise ChatError(f"{where} must be a list of conversations (each a list of message dicts), got "
                        f"{type(conversations).__name__}")
    if len(conversations) == 0:
        raise ChatError(f"{where} is empty: pass at least one conversation")
    if isinstance(conversations[0], Mapping):
        raise ChatError(f"{where} is one conversation (a list of messages), not a batch: wrap it in a list, "
                        "[messages], or use Target.apply_chat_template(messages)")
    return [check_conversation(c, f"{where}[{i}]") for i, c in enumerate(conversations)]


def _tool_schemas(tools):
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ChatError(f"tools must be a list of JSON-schema dicts, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            hint = (" (transformers.utils.get_json_schema(fn) writes one for a function)" if callable(tool) else "")
            raise ChatError(f"tools[{i}] is {type(tool).__name__}, not a JSON schema dict such as "
                            f"{{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": ...}}}}{hint}")
    return plain_data(list(tools))


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    out = []
    for m in chat:
        reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_conversations(template: str, conversations: list[list[dict]], *, special_tokens: Mapping | None = None,
                         add_generation_prompt: bool = False, tools=None, documents=None,
                         continue_final_message: bool | str = False, where: str = "the chat template",
                         **kwargs) -> list[str]:
    """Each (checked) conversation rendered by the Jinja `template`, as transformers' apply_chat_template(...,
    tokenize=False) renders it. special_tokens: the names chat templates see (TokenizerSettings.special_tokens);
    kwargs: extra template variables (they override special tokens). continue_final_message: leave the last
    message open (True: its "content"; a string: that field) for the model to continue; it excludes
    add_generation_prompt. ChatError when the template does not parse or refuses the conversation."""
    import jinja2

    options = [k for k in HF_CALL_OPTIONS if k in kwargs]
    if options:
        raise ChatError(f"{', '.join(options)}: transformers' apply_chat_template options, not taken here (the "
                        "chat is rendered whole, unpadded: render_chat gives the text, apply_chat_template the ids)")
    clash = [k for k in RESERVED if k in kwargs]
    if clash:
        raise ChatError(f"{', '.join(clash)} {'is' if len(clash) == 1 else 'are'} set by the chat call itself, not a "
                        "template variable: pass the conversation / tools / documents / add_generation_prompt as "
                        "arguments")
    if continue_final_message and add_generation_prompt:
        raise ChatError("continue_final_message continues the last message and add_generation_prompt opens a new "
                        "assistant turn: pass add_generation_prompt=False with continue_final_message")
    if documents is not None and (isinstance(documents, (str, bytes)) or not isinstance(documents, Sequence)
                                  or not all(isinstance(d, Mapping) for d in documents)):
        raise ChatError("documents must be a list of dicts (e.g. {\"title\": ..., \"text\": ...})")
    try:
        compiled = compile_template(template)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise ChatError(f"{where} is not a valid Jinja template: {err.message} at line {err.lineno}") from err
    variables = plain_data({**(special_tokens or {}), **kwargs})
    tool_schemas, documents = _tool_schemas(tools), plain_data(documents)
    out = []
    for n, conversation in enumerate(conversations):
        chat = _alias_reasoning(plain_data(list(conversation)))
        field, final = None, None
        if continue_final_message:
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            final = chat[-1].get(field)
            if final is None:
                raise ChatError(f"continue_final_message: the last message has no {field!r} to continue")
            fields = [field]
            if field in _REASONING_KEYS:  # reasoning is copied under several names: tag each copy
                fields = [k for k in _REASONING_KEYS if chat[-1].get(k) == final]
            if not any(k in template for k in fields):
                raise ChatError(f"continue_final_message is {field!r}, a field {where} never reads")
            if isinstance(final, (list, tuple)):
                for block in reversed(final):
                    if isinstance(block, dict) and "text" in block:
                        final = block["text"]
                        block["text"] = block["text"] + _CONTINUE_TAG
                        break
                else:
                    raise ChatError("continue_final_message: the last message has no text block to continue")
            else:
                for k in fields:
                    chat[-1][k] = chat[-1][k] + _CONTINUE_TAG
        try:
            text = compiled.render(messages=chat, tools=tool_schemas, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.SecurityError as err:
            raise ChatError(f"{where} tried something the sandbox forbids: {err}") from err
        except jinja2.exceptions.TemplateError as err:
            which = f"conversation {n}" if len(conversations) > 1 else "the conversation"
            raise ChatError(f"{where} refused {which}: {err}") from err
        if continue_final_message:
            tag = _CONTINUE_TAG.strip()
            if final.strip() not in text or tag not in text:
                raise ChatError("continue_final_message: the chat template dropped part of the final message, so "
                                "it cannot be continued")
            at = text.rindex(tag)
            text = text[:at] if text[at: at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        out.append(text)
    return out


def encode_chat(tokenizer, text: str) -> list[int]:
    """The ids of a rendered chat, as transformers encodes it (`tokenizer(text, add_special_tokens=False)`): the
    template's own BOS and turn markers are the only special tokens."""
    return tokenizer.encode(text, add_special_tokens=False).ids
