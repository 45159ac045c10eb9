"""The `jspec` command, end to end in-process, on a checkpoint with a real tokenizer.json."""

from __future__ import annotations

import json

import pytest

import jspec
from jspec.cli import main
from jspec.demo import DEMO_CONFIG, create_demo_model


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    import dataclasses

    small = dataclasses.replace(DEMO_CONFIG, hidden_size=64, intermediate_size=128, num_layers=2, head_dim=16,
                                layer_types=())
    return create_demo_model(str(tmp_path_factory.mktemp("demo")), cfg=small)


def test_generate_json_with_text_prompt(demo_dir, capsys):
    assert main(["generate", "--target", demo_dir, "--prompt", "def f(x):", "--max-new-tokens", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["tokens"]) == out["stats"]["new_tokens"] <= 6
    assert all(isinstance(t, int) for t in out["tokens"])
    assert out["stats"]["wall_s"] > 0
    target = jspec.load_target(demo_dir)
    assert out["text"] == target.decode(out["tokens"])
    # The same request through the Python API gives the same tokens.
    res = jspec.generate(target, [target.encode("def f(x):")], max_new_tokens=6)
    assert res.tokens[0] == out["tokens"]


def test_generate_prompt_ids_sampled_is_reproducible(demo_dir, capsys):
    argv = ["generate", "--target", demo_dir, "--prompt-ids", "5,6,7", "--max-new-tokens", "8", "--temperature", "1",
            "--top-k", "50", "--top-p", "0.9", "--seed", "3", "--json"]
    main(argv)
    first = json.loads(capsys.readouterr().out)["tokens"]
    main(argv)
    assert json.loads(capsys.readouterr().out)["tokens"] == first


@pytest.mark.parametrize("argv, match", [
    (["--temperature", "-1"], "temperature must be"),
    (["--top-p", "0"], "top_p must lie"),
    (["--prompt-ids", "1,99999"], "outside the vocabulary"),
])
def test_bad_arguments_exit_2_with_message(demo_dir, capsys, argv, match):
    base = ["generate", "--target", demo_dir, "--max-new-tokens", "4"]
    if "--prompt-ids" not in argv:
        base += ["--prompt-ids", "1,2"]
    assert main(base + argv) == 2
    assert match in capsys.readouterr().err
