"""Where a model config comes from (:mod:`pipeloom.plan.cluster.model.source`): a config.json, a model folder, or
a Hugging Face model id whose config is in the local cache, laid out as ``huggingface_hub`` lays it out
(``models--OWNER--NAME/refs/main`` naming a ``snapshots/REVISION`` folder); and the one-line refusals."""

from __future__ import annotations

import json

import pytest
from tests.plan.cluster.tiny import TINY

from pipeloom.cli import main
from pipeloom.plan.cluster import ModelConfigError, model_spec
from pipeloom.plan.cluster.model.source import hub_cache, read_config

LLAMA = dict(TINY["llama"], model_type="llama")


def _cache_model(cache, model_id: str, revisions: dict[str, dict], main_ref: str | None = None):
    """A cache holding ``model_id``'s config at each revision (``refs/main`` naming ``main_ref``)."""
    repo = cache / f"models--{model_id.replace('/', '--')}"
    for revision, config in revisions.items():
        folder = repo / "snapshots" / revision
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(config))
    if main_ref is not None:
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(main_ref + "\n")


def test_a_model_folder_is_read_through_its_config_json(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert read_config(tmp_path) == LLAMA
    assert model_spec(str(tmp_path)).hidden == LLAMA["hidden_size"]
    monkeypatch.setenv("HOME", str(tmp_path))  # a path from the home folder, as the Python API is given one
    assert read_config("~") == read_config("~/config.json") == LLAMA
    with pytest.raises(ModelConfigError, match=r"model folder .* has no config.json; pass the path"):
        read_config(tmp_path / "..")


def test_a_hub_id_is_read_from_the_snapshot_refs_main_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    older = dict(LLAMA, hidden_size=32)
    _cache_model(tmp_path / "hub", "acme/tiny-llama", {"a1": older, "b2": LLAMA}, main_ref="b2")
    assert read_config("acme/tiny-llama") == LLAMA
    assert model_spec("acme/tiny-llama").hidden == LLAMA["hidden_size"]
    _cache_model(tmp_path / "hub", "solo", {"c3": older})  # one revision, no refs: that one; a bare name is an id
    assert read_config("solo") == older


def test_the_cache_is_where_huggingface_hub_puts_it(tmp_path, monkeypatch):
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub_cache() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "legacy"))
    assert hub_cache() == tmp_path / "legacy"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub_cache() == tmp_path / "hub"
    _cache_model(tmp_path / "hub", "acme/tiny-llama", {"b2": LLAMA}, main_ref="b2")
    assert read_config("acme/tiny-llama") == LLAMA


def test_what_is_neither_a_file_nor_cached_is_refused_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelConfigError, match=r"no such file or folder, and the local Hugging Face cache \(.*hub\) "
                                               r"holds no config of a model 'acme/missing'; download it \(hf download "
                                               r"acme/missing config.json\) or pass the path"):
        read_config("acme/missing")
    for path in ("missing.json", "./acme/missing", "a/b/c"):  # paths, not ids: read as paths
        with pytest.raises(ModelConfigError, match=r"cannot read model config .*No such file"):
            read_config(path)
    _cache_model(tmp_path / "hub", "acme/two", {"a1": LLAMA, "b2": LLAMA})  # two revisions and no refs/main
    with pytest.raises(ModelConfigError, match="holds 2 revisions of models--acme--two and no refs/main"):
        read_config("acme/two")
    _cache_model(tmp_path / "hub", "acme/moved", {"a1": LLAMA, "b2": LLAMA}, main_ref="c3")  # refs/main elsewhere
    with pytest.raises(ModelConfigError, match="revisions of models--acme--moved whose refs/main names none of them"):
        read_config("acme/moved")


def test_a_config_json_that_does_not_parse_is_named_with_why(tmp_path):
    """Not JSON, not UTF-8, or a number past Python's 4,300 digits: a ModelConfigError naming the file (the last two
    had escaped as bare ValueErrors, one naming sys.set_int_max_str_digits)."""
    for name, data, why in (("broken.json", b"{", "Expecting property name"),
                            ("latin.json", b'{"model_type": "ll\xe1ma"}', "can't decode byte 0xe1"),
                            ("digits.json", b'{"hidden_size": ' + b"1" * 5000 + b"}",
                             "a number of more than 4,300 digits, surely a typo")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ModelConfigError, match=rf"model config '.*{name}' is not JSON \(.*{why}"):
            read_config(str(tmp_path / name))


def test_a_byte_order_mark_is_read_and_a_key_given_twice_refused_as_in_hardware_files(tmp_path):
    """A config.json with a UTF-8 byte-order mark had been refused with Python's words, and a key given twice planned
    with the last value without a word (a new user's trial, 2026-12-06); hardware files read the first and refuse
    the second."""
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(LLAMA).encode())
    assert read_config(str(tmp_path / "bom.json")) == LLAMA
    text = json.dumps(LLAMA)
    (tmp_path / "twice.json").write_text(text[:-1] + ', "hidden_size": 4096}')
    with pytest.raises(ModelConfigError, match=r"model config '.*twice.json' gives 'hidden_size' twice; keep one"):
        read_config(str(tmp_path / "twice.json"))


def test_the_command_plans_a_cached_hub_id_and_refuses_a_missing_one_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    _cache_model(tmp_path / "hub", "acme/tiny-llama", {"b2": LLAMA}, main_ref="b2")
    argv = ["plan", "--hardware", "h100", "--gpus", "8", "--global-batch", "16", "--seq", "512", "--json"]
    assert main([*argv, "--model", "acme/tiny-llama"]) == 0
    assert json.loads(capsys.readouterr().out)["best"]["step_time"] > 0
    assert main([*argv, "--model", "acme/other"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "hf download acme/other config.json" in err, err


def test_a_multimodal_model_is_planned_as_its_language_model_and_says_so(tmp_path, capsys):
    """A downloaded Gemma 3 folder (model_type gemma3, its language model in text_config): the report names the
    language model and what is not planned; --json gives the wrapper's model_type."""
    text = dict(TINY["gemma3_text"], model_type="gemma3_text")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text,
                                                      "vision_config": {"model_type": "siglip_vision_model"}}))
    argv = ["plan", "--model", str(tmp_path), "--hardware", "h100", "--gpus", "8", "--global-batch", "16", "--seq",
            "512"]
    assert main(argv) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert head.startswith("gemma3_text (the language model of a gemma3 config: its vision tower and image tokens "
                           "are not planned) (2 layers, "), head
    assert " parameters) on 8 x h100" in head, head
    assert main([*argv, "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["family"] == "gemma3_text" and model["text_of"] == "gemma3"


QWEN25_32B = {"model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
              "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064, "tie_word_embeddings": False}


@pytest.mark.parametrize(("typo", "field"), [("num_hidden_layer", "num_hidden_layers"),
                                              ("intermediate_sise", "intermediate_size"),
                                              ("hiden_size", "hidden_size")])
def test_a_misspelled_size_field_is_refused_with_the_name_it_is_close_to(typo, field):
    """A key one or two letters from a field the config leaves out would leave that field at transformers' default:
    Qwen2.5-32B with ``num_hidden_layer`` had been planned as a 14.4B model of 32 layers, without a word."""
    config = {key: value for key, value in QWEN25_32B.items() if key != field} | {typo: QWEN25_32B[field]}
    with pytest.raises(ModelConfigError, match=f"the config's '{typo}' is no qwen2 field; did you mean '{field}'\\? "
                                               f"That field is left out, so transformers' default"):
        model_spec(config)
    assert model_spec(QWEN25_32B).defaulted == ()  # a whole config: nothing defaulted, no key taken for a typo
    assert model_spec(QWEN25_32B | {"torch_dtype": "bfloat16", "rope_theta": 1e6}).defaulted == ()


def test_size_fields_left_out_are_named_with_the_defaults_planned(tmp_path, capsys):
    """The report names each size field the config leaves out and the default read in its place, and its first line
    says how many layers and parameters were planned; --json lists them under model.defaulted."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 2048, "num_attention_heads": 16}))
    argv = ["plan", "--model", str(path), "--hardware", "h100", "--gpus", "8", "--global-batch", "32", "--seq", "4096"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("llama (32 layers, 2.83B parameters) on 8 x h100"), out
    assert ("note: the config leaves out intermediate_size, num_hidden_layers, vocab_size, num_key_value_heads: "
            "transformers' llama defaults were planned (intermediate_size 11008, num_hidden_layers 32, vocab_size "
            "32000, num_key_value_heads 16)") in out  # the key/value heads: the query heads, as the class sets them
    assert main([*argv, "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["defaulted"] == {"intermediate_size": 11008, "num_hidden_layers": 32, "vocab_size": 32000,
                                  "num_key_value_heads": 16}
    path.write_text(json.dumps(QWEN25_32B))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("qwen2 (64 layers, 32.76B parameters) on 8 x h100") and "leaves out" not in out


def test_a_sequence_past_the_trained_length_is_noted(tmp_path, capsys):
    """A rotary model's max_position_embeddings is the length it was trained to: a longer --seq is planned (rope
    scaling extends it) with a note saying so, a shorter one without."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN25_32B | {"max_position_embeddings": 4096}))
    argv = ["plan", "--model", str(path), "--hardware", "h100", "--gpus", "64", "--global-batch", "64", "--seq"]
    assert main([*argv, "8192"]) == 0
    assert ("note: --seq 8,192 is past the config's max_position_embeddings 4,096, the length the model was trained "
            "to (rope_scaling extends it)") in capsys.readouterr().out
    assert main([*argv, "4096"]) == 0
    assert "max_position_embeddings" not in capsys.readouterr().out


def test_a_global_batch_that_caps_data_parallelism_is_noted(tmp_path, capsys):
    """dp divides both the global batch and the GPU count: where that caps it and the chosen layout sits at the cap,
    a note says so and names the nearest global batches that lift it; none where the batch is a multiple of the GPU
    count."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN25_32B))
    argv = ["plan", "--model", str(path), "--hardware", "h100", "--gpus", "64", "--seq", "4096", "--global-batch"]
    assert main([*argv, "100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["best"]["layout"]["dp"] == 4  # the cap: gcd(100, 64)
    assert main([*argv, "100"]) == 0
    out = capsys.readouterr().out
    assert ("note: dp divides both the global batch (100) and the GPU count (64), so it is at most 4 here, where the "
            "chosen layout is; a larger global batch lets the search replicate the model more: 104 (dp up to 8), 112 "
            "(16) or 128 (64)") in out  # the nearest that lift the cap (only 128, 2.6 times 37 at 96 GPUs, was said)
    assert main([*argv, "128"]) == 0
    assert "dp divides" not in capsys.readouterr().out


def test_a_tiny_models_step_time_shows_its_digits(tmp_path, capsys):
    """Below 10 ms the report's seconds keep three significant digits (a tiny model's step printed 0.000 s)."""
    import re

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "vocab_size": 100,
                                "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}))
    assert main(["plan", "--model", str(path), "--hardware", "h100", "--gpus", "4", "--global-batch", "8", "--seq",
                 "16"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("step time:"))
    assert re.fullmatch(r"step time: 0\.000[1-9]\d* s \(pipeline .*\)", line) and "0.000 s" not in line, line
    # what is none is said as 0 (one replica's exposed data-parallel time had read 0.000 s beside 3-digit values)
    main(["plan", "--model", str(path), "--hardware", "h100", "--gpus", "4", "--global-batch", "8", "--seq", "16",
          "--layout", "dp=1,tp=1,pp=4,vp=1,cp=1,ep=1,mbs=1,fsdp=0,recompute=none,schedule=1f1b"])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("step time:"))
    assert ", exposed dp 0 s," in line, line
