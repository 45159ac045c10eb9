"""Chat templates and special tokens: jspec renders and encodes exactly as transformers does.

Each test builds a real tokenizer (a small `tokenizers` BPE in transformers' PreTrainedTokenizerFast), saves it
with `save_pretrained` into a tiny model's folder, and compares jspec's Target (which reads the very files
transformers wrote) with `AutoTokenizer.from_pretrained` of the same folder."""

from __future__ import annotations

import json
import os
import shutil

import jax
import pytest
from tokenizers import Tokenizer

import jspec
from jspec.io.chat import ChatError
from jspec.io.models import save_model
from jspec.models.config import ModelConfig
from jspec.models.transformer import init_params

CFG = ModelConfig(family="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=16, qk_norm=True, eos_token_ids=(2,), bos_token_id=1,
                  max_position_embeddings=512)
CORPUS = ["You are a helpful assistant. What is the weather like in Paris today?",
          "The weather in Paris is sunny, 21 degrees. get_weather(city) returns the forecast.",
          "def add(a, b):\n    return a + b  # numbers, strings and lists",
          "Hello! How are you? I am fine, thanks."] * 8

# A Qwen-style ChatML template: default system message, tools as JSON lines (tojson), tool calls and responses
CHATML = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls | default([]) %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.function.name + '", "arguments": ' }}
{{- tool_call.function.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

# Llama-2 style: BOS / EOS variables, strict alternation enforced with raise_exception
LLAMA2 = """\
{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}\
{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}\
{% set system_message = false %}{% endif %}
{% for message in loop_messages %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}
{% if loop.index0 == 0 and system_message != false %}\
{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}\
{% else %}{% set content = message['content'] %}{% endif %}
{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}\
{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}
{% endfor %}"""

# Everything else transformers' environment offers: loop controls, namespace, dict, tojson arguments, the
# generation tag, reasoning fields, strftime_now, the special-token variables
KITCHEN = """\
{%- set ns = namespace(n=0, last='') %}
{%- set meta = dict(a=1, b=[1, 2]) %}
{{- meta | tojson(indent=2, sort_keys=True) }}
{% for m in messages %}
{%- if m.role == 'skip' %}{% continue %}{% endif %}
{%- if m.role == 'stop' %}{% break %}{% endif %}
{%- set ns.n = ns.n + 1 %}{%- set ns.last = m.role %}
<{{ m.role }}>{% if m.reasoning_content %}[{{ m.reasoning_content }}|{{ m.thinking }}]{% endif %}
{%- if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}
{{ eos_token }}
{%- endfor %}
n={{ ns.n }} last={{ ns.last }} pad={{ pad_token }} unk={{ unk_token | default('none') }}
{{- ' year=' + strftime_now('%Y') }}
{%- if documents %}{% for d in documents %} doc:{{ d.title }}{% endfor %}{% endif %}
{%- if add_generation_prompt %}<assistant>{% endif %}"""


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0), std=0.05)


def bpe(specials, metaspace: bool = False, vocab: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if metaspace:  # Llama-2 style: sentencepiece-like BPE with byte fallback
        tok = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        alphabet = specials + [f"<0x{i:02X}>" for i in range(256)]
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=alphabet, show_progress=False)
    else:  # Qwen style: byte-level BPE
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def checkpoint(path, params, tokenizer) -> str:
    """A tiny model folder with the transformers tokenizer saved into it by save_pretrained."""
    save_model(str(path), CFG, params)
    tokenizer.save_pretrained(str(path))
    return str(path)


def qwen_tokenizer(chat_template=CHATML, **kw):
    from transformers import PreTrainedTokenizerFast

    tok = bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=chat_template, **kw)


def llama_tokenizer(chat_template=LLAMA2, **kw):
    from transformers import PreTrainedTokenizerFast

    tok = bpe(["<unk>", "<s>", "</s>"], metaspace=True)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   chat_template=chat_template, **kw)


def hf(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def assert_same(target, ref, messages, **kw):
    """The rendered text and the ids agree with transformers' apply_chat_template (with a generation prompt
    unless told otherwise: jspec's default, where transformers' is False)."""
    kw.setdefault("add_generation_prompt", True)
    text = target.render_chat(messages, **kw)
    want = ref.apply_chat_template(messages, tokenize=False, **kw)
    assert text == want
    ids = target.apply_chat_template(messages, **kw)
    assert ids == ref.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)
    assert ids == ref.apply_chat_template(messages, tokenize=True, **kw)["input_ids"]
    return text, ids


SYSTEM_CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the weather like in Paris?"},
    {"role": "assistant", "content": "Sunny, 21 degrees."},
    {"role": "user", "content": "And tomorrow? <|im_start|> is just text here"},
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The forecast for a city (Paris, Zürich, ...)",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": '{"temperature": 21}'},
]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, params):
    path = checkpoint(tmp_path_factory.mktemp("qwen"), params, qwen_tokenizer())
    return jspec.load_target(path), hf(path)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", [SYSTEM_CHAT, SYSTEM_CHAT[1:], SYSTEM_CHAT[1:2]], ids=["system", "multi", "one"])
def test_chatml_matches_transformers(qwen, messages, add_generation_prompt):
    target, ref = qwen
    text, ids = assert_same(target, ref, messages, add_generation_prompt=add_generation_prompt)
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    assert ids[0] == ref.convert_tokens_to_ids("<|im_start|>")  # no BOS or other token added on top


def test_chatml_with_tools_and_template_variables(qwen):
    target, ref = qwen
    text, _ = assert_same(target, ref, TOOL_CHAT, tools=TOOLS, add_generation_prompt=True)
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text and "Zürich" in text  # tojson keeps non-ASCII
    text, _ = assert_same(target, ref, SYSTEM_CHAT[1:2], add_generation_prompt=True, enable_thinking=False)
    assert text.endswith("<think>\n\n</think>\n\n")


def test_the_default_is_a_generation_prompt(qwen):
    target, ref = qwen
    assert target.apply_chat_template(SYSTEM_CHAT) == ref.apply_chat_template(
        SYSTEM_CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_special_tokens_come_from_tokenizer_config(qwen):
    target, ref = qwen
    assert target.special_tokens == ref.special_tokens_map == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert (target.bos_token, target.eos_token, target.pad_token) == (None, "<|im_end|>", "<|endoftext|>")
    assert target.chat_template == ref.chat_template == CHATML
    assert target.chat_template_file == os.path.join(target.path, "chat_template.jinja")


def test_batch_of_conversations(qwen):
    target, ref = qwen
    batch = [SYSTEM_CHAT, SYSTEM_CHAT[1:2], TOOL_CHAT]
    got = target.chat_prompts(batch)
    assert got == ref.apply_chat_template(batch, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert got == [target.apply_chat_template(c) for c in batch]
    assert target.chat_prompts(batch, tools=TOOLS, add_generation_prompt=False) == ref.apply_chat_template(
        batch, tools=TOOLS, tokenize=True)["input_ids"]


def test_llama2_template_bos_eos_and_raise_exception(tmp_path, params):
    path = checkpoint(tmp_path / "llama", params, llama_tokenizer())
    target, ref = jspec.load_target(path), hf(path)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "How are you?"}]
    text, ids = assert_same(target, ref, chat, add_generation_prompt=False)
    assert text.startswith("<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi there [/INST] Hello! </s><s>[INST]")
    assert ids.count(ref.bos_token_id) == 2 and ids.count(ref.eos_token_id) == 1
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="must alternate"):
        ref.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatError, match=r"chat_template\.jinja refused the conversation: Conversation roles must "
                                         "alternate"):
        target.apply_chat_template(bad)
    with pytest.raises(ChatError, match=r"refused conversation 1: Conversation roles must alternate"):
        target.chat_prompts([chat[1:2], bad])


def test_everything_the_environment_offers(tmp_path, params):
    path = checkpoint(tmp_path / "kitchen", params, llama_tokenizer(chat_template=KITCHEN, pad_token="<unk>"))
    target, ref = jspec.load_target(path), hf(path)
    chat = [{"role": "user", "content": "q1"}, {"role": "skip", "content": "hidden"},
            {"role": "assistant", "content": "a1", "reasoning": "because"},
            {"role": "assistant", "content": "a2", "thinking": "hmm", "tool_calls": None},
            {"role": "stop", "content": "x"}, {"role": "user", "content": "never"}]
    docs = [{"title": "One", "text": "first"}, {"title": "Two", "text": "second"}]
    text, _ = assert_same(target, ref, chat, documents=docs, add_generation_prompt=True)
    assert "[because|because]" in text and "[hmm|hmm]" in text and "n=3 last=assistant pad=<unk> unk=<unk>" in text
    assert text.endswith("doc:One doc:Two<assistant>")
    assert_same(target, ref, chat, add_generation_prompt=False, pad_token="OVERRIDE")  # kwargs beat special tokens


def test_continue_final_message(qwen):
    target, ref = qwen
    chat = SYSTEM_CHAT[1:3]
    text, _ = assert_same(target, ref, chat, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("Sunny, 21 degrees.")
    with pytest.raises(ChatError, match="add_generation_prompt=False"):
        target.apply_chat_template(chat, continue_final_message=True)


def test_several_templates_tool_use_and_names(tmp_path, params):
    templates = {"default": CHATML, "tool_use": "TOOLS {{ tools | tojson }} {{ messages[-1].content }}",
                 "short": "{{ messages[0].content }}"}
    path = checkpoint(tmp_path / "many", params, qwen_tokenizer(chat_template=templates))
    assert os.path.isfile(os.path.join(path, "additional_chat_templates", "tool_use.jinja"))
    target, ref = jspec.load_target(path), hf(path)
    assert target.chat_template == ref.chat_template == templates
    assert_same(target, ref, SYSTEM_CHAT)
    text, _ = assert_same(target, ref, TOOL_CHAT, tools=TOOLS)
    assert text.startswith("TOOLS [")
    assert_same(target, ref, SYSTEM_CHAT, chat_template="short")
    own = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
    assert_same(target, ref, SYSTEM_CHAT, chat_template=own)


def test_template_file_precedence(tmp_path, params):
    """chat_template.jinja wins over tokenizer_config.json's entry; chat_template.json is the last resort."""
    path = checkpoint(tmp_path / "m", params, qwen_tokenizer(chat_template="JINJA {{ messages[0].content }}"))
    config_file = os.path.join(path, "tokenizer_config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["chat_template"] = "CONFIG {{ messages[0].content }}"
    with open(config_file, "w") as f:
        json.dump(config, f)
    msgs = [{"role": "user", "content": "hi"}]
    target, ref = jspec.load_target(path), hf(path)
    assert target.render_chat(msgs) == ref.apply_chat_template(msgs, tokenize=False) == "JINJA hi"
    os.remove(os.path.join(path, "chat_template.jinja"))
    target, ref = jspec.load_target(path), hf(path)
    assert target.render_chat(msgs) == ref.apply_chat_template(msgs, tokenize=False) == "CONFIG hi"
    assert target.chat_template_file == config_file
    del config["chat_template"]
    with open(config_file, "w") as f:
        json.dump(config, f)
    with open(os.path.join(path, "chat_template.json"), "w") as f:
        json.dump({"chat_template": "LEGACY {{ messages[0].content }}"}, f)
    assert hf(path).chat_template is None  # transformers' tokenizer never reads chat_template.json (processors do)
    assert jspec.load_target(path).render_chat(msgs) == "LEGACY hi"


def test_no_template_names_the_files_looked_for(tmp_path, params):
    path = checkpoint(tmp_path / "plain", params, qwen_tokenizer(chat_template=None))
    target = jspec.load_target(path)
    assert target.chat_template is None
    with pytest.raises(ChatError, match="has no chat template") as err:
        target.apply_chat_template([{"role": "user", "content": "hi"}])
    for name in ("chat_template.jinja", "tokenizer_config.json", "chat_template.json"):
        assert os.path.join(path, name) in str(err.value)
    assert "chat_template=" in str(err.value)
    own = "{{ messages[0].content }}!"
    assert target.render_chat([{"role": "user", "content": "hi"}], chat_template=own) == "hi!"


def test_damaged_template_files_are_named(tmp_path, params):
    path = checkpoint(tmp_path / "broken", params, qwen_tokenizer(chat_template="{% for m in messages %}"))
    with pytest.raises(ChatError, match=r"chat_template\.jinja is not a valid Jinja template"):
        jspec.load_target(path).render_chat([{"role": "user", "content": "hi"}])
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        f.write('{"eos_token": ')
    with pytest.raises(jspec.errors.CheckpointError, match=r"tokenizer_config\.json is not valid JSON"):
        jspec.load_target(path)


@pytest.mark.parametrize("messages, message", [
    ("hello", "is text"),
    ({"role": "user", "content": "hi"}, "one message dict"),
    ([], "empty conversation"),
    ([{"role": "user", "content": "hi"}, "oops"], r"messages\[1\] is str"),
    ([{"content": "hi"}], r"messages\[0\] has role None"),
    ([{"role": "user"}], r"messages\[0\] \(user\) has no \"content\""),
    ([{"role": "user", "content": 3}], "content of type int"),
    ([[{"role": "user", "content": "hi"}]], "Target.chat_prompts"),
    (None, "not a conversation"),
])
def test_malformed_messages_are_refused(qwen, messages, message):
    target, _ = qwen
    with pytest.raises(ChatError, match=message):
        target.apply_chat_template(messages)
    assert issubclass(ChatError, ValueError)


def test_malformed_batches_and_arguments_are_refused(qwen):
    target, _ = qwen
    with pytest.raises(ChatError, match="one conversation"):
        target.chat_prompts(SYSTEM_CHAT)
    with pytest.raises(ChatError, match=r"conversations\[1\]\[0\] has role"):
        target.chat_prompts([SYSTEM_CHAT, [{"content": "x"}]])
    with pytest.raises(ChatError, match="tools"):
        target.apply_chat_template(SYSTEM_CHAT, tools=[len])
    with pytest.raises(ChatError, match="transformers' apply_chat_template options"):
        target.apply_chat_template(SYSTEM_CHAT, tokenize=False)
    with pytest.raises(ChatError, match="messages is set by the chat call itself"):
        target.chat_prompts([SYSTEM_CHAT], messages=[])


def test_a_target_without_tokenizer_renders_but_cannot_encode(tmp_path, params):
    path = checkpoint(tmp_path / "ids", params, qwen_tokenizer())
    os.remove(os.path.join(path, "tokenizer.json"))
    target = jspec.load_target(path)
    assert target.tokenizer is None and target.render_chat(SYSTEM_CHAT).startswith("<|im_start|>system")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        target.apply_chat_template(SYSTEM_CHAT)


# --- plain text: add_bos_token and special tokens --------------------------------------------------

TEXTS = ["Hello! How are you?", "<s>weather</s> in Paris", "def add(a, b): return a + b", ""]


def _edit_json(path, edit):
    with open(path) as f:
        data = json.load(f)
    edit(data)
    with open(path, "w") as f:
        json.dump(data, f)


@pytest.mark.parametrize("post_processor_bos", [True, False])
@pytest.mark.parametrize("add_bos_token", [True, False, None])
@pytest.mark.parametrize("tokenizer_class", ["TokenizersBackend", "LlamaTokenizer"])
def test_encode_matches_transformers_with_and_without_add_bos_token(tmp_path, params, post_processor_bos,
                                                                    add_bos_token, tokenizer_class):
    """transformers 5 takes BOS from tokenizer.json's post_processor and drops tokenizer_config.json's
    add_bos_token beside a tokenizer.json; jspec's encode gives the same ids in every combination."""
    path = checkpoint(tmp_path / "m", params, llama_tokenizer(add_bos_token=post_processor_bos))

    def config(c):
        c["tokenizer_class"] = tokenizer_class
        c.pop("add_bos_token", None)
        if add_bos_token is not None:
            c["add_bos_token"] = add_bos_token

    _edit_json(os.path.join(path, "tokenizer_config.json"), config)
    target, ref = jspec.load_target(path), hf(path)
    for text in TEXTS:
        assert target.encode(text) == ref(text)["input_ids"], text
    assert (target.encode("Hello")[0] == ref.bos_token_id) == post_processor_bos


def test_encode_without_post_processor(tmp_path, params):
    path = checkpoint(tmp_path / "m", params, llama_tokenizer())
    _edit_json(os.path.join(path, "tokenizer.json"), lambda t: t.update(post_processor=None))
    _edit_json(os.path.join(path, "tokenizer_config.json"), lambda c: c.update(add_bos_token=True))
    target, ref = jspec.load_target(path), hf(path)
    for text in TEXTS:
        assert target.encode(text) == ref(text)["input_ids"], text
    assert target.encode("Hello")[0] != ref.bos_token_id  # add_bos_token alone adds nothing in transformers 5


def test_special_tokens_missing_from_tokenizer_json_are_added(tmp_path, params):
    """A tokenizer.json that does not list the config's special tokens as added tokens: transformers adds them
    (so "<s>" in text is one token), and so does jspec."""
    path = checkpoint(tmp_path / "m", params, llama_tokenizer())
    _edit_json(os.path.join(path, "tokenizer.json"),
               lambda t: t.update(added_tokens=[a for a in t["added_tokens"] if a["content"] not in ("<s>", "</s>")]))
    raw = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    assert len(raw.encode("<s>", add_special_tokens=False).ids) > 1  # without them "<s>" is split
    target, ref = jspec.load_target(path), hf(path)
    for text in TEXTS:
        assert target.encode(text) == ref(text)["input_ids"], text
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert_same(target, ref, chat, add_generation_prompt=False)


def test_split_special_tokens(tmp_path, params):
    path = checkpoint(tmp_path / "m", params, qwen_tokenizer())
    _edit_json(os.path.join(path, "tokenizer_config.json"), lambda c: c.update(split_special_tokens=True))
    target, ref = jspec.load_target(path), hf(path)
    text = "<|im_start|>user hi<|im_end|>"
    assert target.encode(text) == ref(text)["input_ids"]
    assert ref.convert_tokens_to_ids("<|im_start|>") not in target.encode(text)
    assert_same(target, ref, SYSTEM_CHAT)


def test_legacy_special_tokens_map(tmp_path, params):
    path = checkpoint(tmp_path / "m", params, llama_tokenizer())
    with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": {"content": "<s>", "lstrip": False, "rstrip": False, "normalized": False,
                                 "single_word": False}, "pad_token": "</s>"}, f)
    target, ref = jspec.load_target(path), hf(path)
    assert target.special_tokens == ref.special_tokens_map
    assert target.pad_token == "</s>"


def test_a_copied_checkpoint_in_the_hf_cache_keeps_its_chat(tmp_path, params, monkeypatch):
    """Everything above, through a repo id: the cache snapshot holds the same files."""
    src = checkpoint(tmp_path / "src", params, qwen_tokenizer())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = tmp_path / "hub" / "models--org--chat" / "snapshots" / ("ab" * 20)
    shutil.copytree(src, snap)
    (tmp_path / "hub" / "models--org--chat" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--chat" / "refs" / "main").write_text("ab" * 20)
    target = jspec.load_target("org/chat")
    assert target.apply_chat_template(SYSTEM_CHAT) == hf(src).apply_chat_template(
        SYSTEM_CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
