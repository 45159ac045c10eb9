"""The `jspec` command's conventions: help with defaults, options before or after the command, logging
levels, the persistent compilation cache, batch generation from JSONL, stop strings and chat prompts."""

from __future__ import annotations

import argparse
import re
import json
import os
import subprocess
import sys

import pytest

import jspec
from jspec.cli import build_parser, main, read_requests
from jspec.demo import DEMO_CONFIG, create_demo_model


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    import dataclasses

    small = dataclasses.replace(DEMO_CONFIG, hidden_size=64, intermediate_size=128, num_layers=2, head_dim=16,
                                layer_types=())
    return create_demo_model(str(tmp_path_factory.mktemp("demo")), cfg=small)


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def test_every_option_has_help_and_the_help_shows_defaults():
    parser = build_parser()
    for name, sub in _subparsers(parser):
        for action in sub._actions:
            assert action.help, f"jspec {name} {action.option_strings or action.dest} has no help text"
    gen = " ".join(dict(_subparsers(parser))["generate"].format_help().split())  # unwrapped
    assert "(default: 64)" in gen  # --max-new-tokens
    assert "(default: float32)" in gen and "(default: reference)" in gen


def test_common_options_go_before_or_after_the_command():
    parser = build_parser()
    before = parser.parse_args(["--quiet", "--compile-cache", "/x", "generate", "--prompt-ids", "1"])
    after = parser.parse_args(["generate", "--prompt-ids", "1", "--quiet", "--compile-cache", "/x"])
    plain = parser.parse_args(["generate", "--prompt-ids", "1"])
    for args in (before, after):
        assert args.quiet and args.compile_cache == "/x" and not args.verbose and not args.debug
    assert not plain.quiet and plain.compile_cache is None
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--quiet", "--verbose"])


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_batch_generation_matches_single_requests(demo_dir, tmp_path, capsys):
    target = jspec.load_target(demo_dir)
    rows = [{"prompt": "def f(x):", "id": "a"}, {"prompt_ids": [5, 6, 7], "seed": 11},
            {"prompt": "import os", "id": 3}]
    src, out = _jsonl(tmp_path / "in.jsonl", rows), str(tmp_path / "out.jsonl")
    argv = ["generate", "--target", demo_dir, "--input-file", src, "--output-file", out, "--max-new-tokens", "5",
            "--temperature", "1", "--seed", "4", "--batch-size", "2"]
    assert main(argv) == 0
    assert "3 requests" in capsys.readouterr().err  # the summary line, at the default log level
    results = [json.loads(line) for line in open(out)]
    assert [r.get("id") for r in results] == ["a", None, 3] and [r["index"] for r in results] == [0, 1, 2]
    prompts = [target.encode("def f(x):"), [5, 6, 7], target.encode("import os")]
    seeds = [4 + 0, 11, 4 + 2]  # a row's own seed, else --seed + its index
    for r, p, s in zip(results, prompts, seeds):
        one = jspec.generate(target, [p], max_new_tokens=5, sampling=jspec.SamplingParams(1.0), seeds=[s])
        assert r["tokens"] == one.tokens[0] and r["new_tokens"] == len(r["tokens"])
        assert r["stopped_by"] == one.stats["stopped_by"][0]
        assert r["text"] == target.decode(one.tokens[0])
    assert main(argv + ["--quiet"]) == 0
    assert capsys.readouterr().err == ""  # --quiet: no summary line


@pytest.mark.parametrize("text, match", [
    ("{\"prompt\": 1}\n", "line 1: \"prompt\" must be text"),
    ("\n{\"prompt\": \"a\", \"promt_ids\": [1]}\n", "line 2: unknown keys \\['promt_ids'\\]"),
    ("{\"prompt\": \"a\", \"prompt_ids\": [1]}\n", "exactly one of"),
    ("[1, 2]\n", "line 1 is a JSON list"),
    ("{\"prompt\": \"a\"\n", "line 1 is not JSON"),
    ("\n\n", "holds no request"),
])
def test_bad_jsonl_is_named_by_line(tmp_path, text, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_requests(str(path))


def test_jsonl_out_of_vocabulary_ids_name_the_lines(demo_dir, tmp_path, capsys):
    src = _jsonl(tmp_path / "in.jsonl", [{"prompt_ids": [1, 2]}, {"prompt_ids": [1, 10 ** 6]}])
    assert main(["generate", "--target", demo_dir, "--input-file", src, "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "lines 1-2" in err and "outside the vocabulary" in err


def test_stop_strings_end_rows_and_trim_the_text(demo_dir, capsys):
    target = jspec.load_target(demo_dir)
    base = ["generate", "--target", demo_dir, "--prompt", "def f(x):", "--max-new-tokens", "24", "--json"]
    assert main(base) == 0
    free = json.loads(capsys.readouterr().out)
    text = free["text"]
    # a stop string that the free continuation completes strictly inside it: the 3 characters ending at the
    # text of its first 8 tokens
    cut = len(target.decode(free["tokens"][:8]))
    stop = text[cut - 3:cut]
    assert main(base + ["--stop", stop]) == 0
    stopped = json.loads(capsys.readouterr().out)
    first = text.index(stop)
    assert stopped["text"] == text[:first]
    assert stopped["stats"]["stopped_by"] == ["stop"]
    n = len(stopped["tokens"])
    assert stopped["tokens"] == free["tokens"][:n]
    assert stop in target.decode(free["tokens"][:n]) and stop not in target.decode(free["tokens"][:n - 1])
    # a stop id ends the row after that token
    assert main(base + ["--stop-id", str(free["tokens"][4])]) == 0
    by_id = json.loads(capsys.readouterr().out)
    assert by_id["tokens"] == free["tokens"][:free["tokens"].index(free["tokens"][4]) + 1]


def test_chat_prompt_renders_the_template(demo_dir, tmp_path, capsys):
    import shutil

    folder = tmp_path / "chat_model"
    shutil.copytree(demo_dir, folder)
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    cfg_path = folder / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg_path.write_text(json.dumps(dict(tok_cfg, chat_template=template)))
    target = jspec.load_target(str(folder))
    expected = target.encode("<|system|>be brief\n<|user|>def f(x):\n<|assistant|>")
    assert target.apply_chat_template([{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "def f(x):"}]) == expected
    argv = ["generate", "--target", str(folder), "--prompt", "def f(x):", "--chat", "--system", "be brief",
            "--max-new-tokens", "4", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == jspec.generate(target, [expected], max_new_tokens=4).tokens[0]
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}]
    assert jspec.generate(target, messages=[conversation], max_new_tokens=4).tokens[0] == out["tokens"]
    for bad in ({}, {"prompts": [expected], "messages": [conversation]}):
        with pytest.raises(jspec.api.RequestError, match="pass prompts .* or messages"):
            jspec.generate(target, max_new_tokens=4, **bad)
    assert main(["generate", "--target", str(folder), "--prompt", "x", "--system", "s"]) == 2
    assert "add --chat" in capsys.readouterr().err


_COUNT = """
import collections, json, sys
import jax.monitoring
counts = collections.Counter()
jax.monitoring.register_event_listener(lambda name, **kw: counts.update([name]))
from jspec.cli import main
rc = main(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    json.dump({"rc": rc, **counts}, f)
"""


def test_second_run_loads_its_programs_from_the_compile_cache(demo_dir, tmp_path):
    """Two `jspec generate` processes with the same shapes: the first compiles and stores every program,
    the second loads every one of them (JAX's own cache events, counted in each process)."""
    cache = tmp_path / "cache"
    argv = ["generate", "--target", demo_dir, "--prompt-ids", "1,2,3", "--max-new-tokens", "4",
            "--drafter", "lookup", "--compile-cache", str(cache), "--json"]
    env = dict(os.environ)
    env.pop("JSPEC_COMPILE_CACHE", None)
    counts = []
    for i in range(2):
        out = tmp_path / f"counts{i}.json"
        proc = subprocess.run([sys.executable, "-c", _COUNT, str(out), *argv], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        counts.append(json.loads(out.read_text()))
    first, second = counts
    assert first["rc"] == second["rc"] == 0
    misses = first.get("/jax/compilation_cache/cache_misses", 0)
    assert misses > 0 and first.get("/jax/compilation_cache/cache_hits", 0) == 0
    assert second.get("/jax/compilation_cache/cache_hits", 0) == misses
    assert second.get("/jax/compilation_cache/cache_misses", 0) == 0
    assert os.listdir(cache)
    # --no-compile-cache: nothing is looked up
    out = tmp_path / "off.json"
    proc = subprocess.run([sys.executable, "-c", _COUNT, str(out), *argv, "--no-compile-cache"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    off = json.loads(out.read_text())
    assert off.get("/jax/compilation_cache/cache_hits", 0) == 0 == off.get("/jax/compilation_cache/cache_misses", 0)


def test_log_levels(capsys):
    import logging

    from jspec import logs

    log = logging.getLogger("jspec.some.module")
    saved = logs.snapshot()
    try:
        for level, shown in ((logs.QUIET, ["jspec: warning: w"]), (logs.NORMAL, ["i", "jspec: warning: w"]),
                             (logs.VERBOSE, ["d", "i", "jspec: warning: w"])):
            logs.configure(level)
            log.debug("d")
            log.info("i")
            log.warning("w")
            assert capsys.readouterr().err.splitlines() == shown
            library = logging.getLogger("absl").getEffectiveLevel()
            assert library == (logging.INFO if level == logs.VERBOSE else logging.ERROR)
            assert logs.progress_enabled() == (level != logs.QUIET)
    finally:
        logs.restore(saved)
    assert logging.getLogger("jspec").propagate and logging.getLogger("absl").level == saved[1]["absl"][0]


def test_the_command_leaves_logging_and_the_cache_as_it_found_them(demo_dir, tmp_path, capsys):
    import logging

    import jax

    before = {n: logging.getLogger(n).level for n in ("jax", "absl", "jspec")}
    handlers = list(logging.getLogger("jspec").handlers)
    cache = jax.config.jax_compilation_cache_dir
    # (JSPEC_COMPILE_CACHE is off in the suite: JAX reads its cache folder once per process, so a test
    # that turned the cache on would leave it on for its whole worker.)
    assert main(["generate", "--target", demo_dir, "--prompt-ids", "1,2", "--max-new-tokens", "2", "--quiet"]) == 0
    assert {n: logging.getLogger(n).level for n in ("jax", "absl", "jspec")} == before
    assert logging.getLogger("jspec").handlers == handlers
    assert jax.config.jax_compilation_cache_dir == cache


@pytest.mark.parametrize("argv, match", [
    (["--prompt-ids", "1,2", "--batch-size", "4"], "go with --input-file"),
    (["--prompt-ids", "1,2", "--chat"], "--chat renders text"),
    (["--prompt-ids", "1,2", "--quiet", "--verbose"], "not allowed with argument"),
    (["-q", "--prompt-ids", "1,2"], None),
    (["--prompt-ids", "1,2", "--compile-cache", "/tmp/x", "--no-compile-cache"], "contradict each other"),
    (["--prompt-ids", "1,2", "--stop", "ab\udcff"], "--stop is not valid UTF-8 text \\(byte 0xff"),
])
def test_contradictory_or_ignored_options_are_refused(demo_dir, capsys, argv, match):
    base = ["generate", "--target", demo_dir, "--max-new-tokens", "2"]
    if match is None:  # -q before the command and -v after it: the same contradiction across the two levels
        code = main(["-v", *base, *argv])
        assert code == 2 and "--quiet and --verbose contradict" in capsys.readouterr().err
        return
    try:
        code = main(base + argv)
    except SystemExit as exit_:  # argparse's own refusal (exit 2)
        code = exit_.code
    assert code == 2
    assert re.search(match, capsys.readouterr().err)


def test_system_with_whole_conversations_is_refused(demo_dir, tmp_path, capsys):
    src = _jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, {"messages": [{"role": "user", "content": "b"}]}])
    assert main(["generate", "--target", demo_dir, "--input-file", src, "--chat", "--system", "s"]) == 2
    assert "line 2 is a whole conversation" in capsys.readouterr().err
