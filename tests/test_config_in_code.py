"""Issue 29 §2: a config changed in code after loading (a notebook cell: ``cfg.train.precision = "FP16"``) is
checked by ``run`` / ``train`` exactly as the YAML path checks a file, before anything is loaded or trained; and
§3: a limit that a ``--set`` value sets names that ``--set``, not the file.

The oracle for "the same message": the YAML path's own line for the same key and value, from a real file.
Without the check in ``run``, "FP16" trained as FP32 (autocast_for knows only the lower-case names) and was
recorded as "FP16"; a string ``train.steps`` crashed inside ``range``.
"""
import sys

import numpy as np
import pytest

import labutils as lu
from labutils.tools.cli import main
from labutils.core.config import ConfigError

lt = sys.modules["labutils.core.train"]  # the module (labutils.core.train is also the name of its function)


def yaml_line(tmp_path, section, key, value):
    """The YAML path's message for ``section.key = value`` (everything after the source)."""
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {key}: {value}\n")
    with pytest.raises(ConfigError) as info:
        lu.load_config(path, mode="smoke")
    text = str(info.value)
    assert text.startswith(f"{path}: {section}.{key}")
    return text[len(str(path)) + 2:]


@pytest.fixture
def no_work(monkeypatch):
    """Anything past validation fails loudly: the refusal must come before the model or data are built."""
    def prepare(*a, **k):
        raise AssertionError("run() loaded a model for an invalid config")
    monkeypatch.setattr(lt, "prepare", prepare)


CASES = [("train", "precision", "FP16", "'FP16'"), ("train", "steps", "3", "'3'"),
         ("train", "lr", "fast", "fast"), ("model", "attn_implementation", "flash", "flash"),
         ("data", "pack", "yes please", "yes please"), ("train", "max_grad_norm", float("nan"), ".nan")]


@pytest.mark.parametrize("section, key, value, yaml_value", CASES)
def test_run_refuses_a_value_set_in_code_with_the_yaml_paths_message(tmp_path, root, no_work, section, key, value,
                                                                     yaml_value):
    cfg = lu.load_config(root / "configs/fp32_config.yaml", mode="smoke")
    setattr(getattr(cfg, section), key, value)
    with pytest.raises(ConfigError) as info:
        lu.run(cfg, "cpu", progress=False, verbose=False)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"set in code after loading {root / 'configs/fp32_config.yaml'}: ")
    assert message.endswith(yaml_line(tmp_path, section, key, yaml_value))


def test_train_refuses_it_too(root):
    """``train`` (lab cells call it on a model they built) checks the config it is given."""
    cfg = lu.load_config(root / "configs/fp32_config.yaml", mode="smoke")
    loaded, ds = lu.prepare(cfg, "cpu", verbose=False)
    cfg.train.precision = "FP16"
    with pytest.raises(ConfigError, match=r"train.precision = 'FP16': must be one of fp32, tf32, fp16, bf16"):
        lu.train(cfg, loaded.model, ds, "cpu", progress=False)


def test_a_misspelt_key_set_in_code_is_refused(root, no_work):
    """``cfg.train.precison = "fp16"`` (a typo) adds an attribute the loop never reads: refused, not ignored."""
    cfg = lu.load_config(root / "configs/fp32_config.yaml", mode="smoke")
    cfg.train.precison = "fp16"
    with pytest.raises(ConfigError, match=r"train.precison = 'fp16': unknown key; allowed in 'train': steps"):
        lu.run(cfg, "cpu", progress=False, verbose=False)


def test_a_value_of_the_right_kind_is_taken_and_recorded_as_the_file_would_give_it(root):
    """An int for a float key, a numpy integer, True for model.pretrained: what YAML would have typed."""
    cfg = lu.load_config(root / "configs/fp32_config.yaml", mode="smoke")
    cfg.train.lr, cfg.train.steps, cfg.train.precision = 1, np.int64(2), "bf16"
    result = lu.run(cfg, "cpu", progress=False, verbose=False)
    assert result.ok and len(result.losses) == 2
    t = result.config["train"]
    assert t["precision"] == "bf16" and type(t["lr"]) is float and type(t["steps"]) is int


def test_an_unchanged_invalid_value_still_names_its_source(root):
    """Only a changed value is blamed on code; a key ``override`` set, unchanged, keeps naming ``override`` (here
    made invalid by a limit that code changed, which the line names as code's)."""
    cfg = lu.load_config(root / "configs/fp32_config.yaml", mode="smoke").override(
        {"train.micro_batch_size": 1, "train.accumulation_steps": 40000})
    cfg.train.micro_batch_size = 2
    with pytest.raises(ConfigError, match=r"^override: train.accumulation_steps = 40000: must be >= 1 and <= 32768 "
                                          r"\(given train.micro_batch_size = 2 from set in code after loading "):
        lu.run(cfg, "cpu", progress=False, verbose=False)


@pytest.mark.parametrize("how, source", [(["train.steps=2"], "--set"), ({"train.steps": 2}, "override")])
def test_a_value_set_in_code_after_a_set_is_codes(root, no_work, how, source):
    """Issue 38 §5: ``load_config(..., ["train.steps=2"])`` (or ``.override``), then ``cfg.train.steps = 0`` in code:
    code set the 0, not the ``--set``. Before: "--set: train.steps = 0"."""
    path = root / "configs/fp32_config.yaml"
    cfg = (lu.load_config(path, how, mode="smoke") if source == "--set"
           else lu.load_config(path, mode="smoke").override(how))
    assert cfg.train.steps == 2
    cfg.train.steps = 0
    with pytest.raises(ConfigError, match=rf"^set in code after loading {path}: train.steps = 0: must be >= 1$"):
        lu.run(cfg, "cpu", progress=False, verbose=False)


def test_a_model_name_set_in_code_is_not_smoke_modes(root, no_work):
    """Smoke mode sets the tiny model; ``cfg.model.name = "gpt3"`` afterwards is code's. Before: "smoke mode: ..."."""
    path = root / "configs/fp32_config.yaml"
    cfg = lu.load_config(path, mode="smoke")
    cfg.model.name = "gpt3"
    with pytest.raises(ConfigError, match=rf"^set in code after loading {path}: model.name = 'gpt3': must be one of"):
        lu.run(cfg, "cpu", progress=False, verbose=False)


@pytest.mark.parametrize("section", [None, {"steps": 3}, 3])
def test_a_section_replaced_in_code_is_a_config_error(root, no_work, section):
    """``cfg.train = None`` or ``= {"steps": 3}``: one line naming code and the section, from ``run`` and from
    ``override``. Before: a TypeError inside validate (looking up the value's source: ``vars(None)``)."""
    path = root / "configs/fp32_config.yaml"
    cfg = lu.load_config(path, mode="smoke")
    cfg.train = section
    expected = rf"^set in code after loading {path}: train = .*: must be a TrainConfig \(a section of key: value\)$"
    with pytest.raises(ConfigError, match=expected):
        lu.run(cfg, "cpu", progress=False, verbose=False)
    with pytest.raises(ConfigError, match=expected):
        cfg.override({"train.steps": 3})


def test_override_refuses_a_typo_set_in_code(root):
    """``cfg.train.stpes = 3`` then ``cfg.override(...)``: refused as ``run`` refuses it. Before: the copy dropped
    the typo silently, and the run went on with the file's steps."""
    path = root / "configs/fp32_config.yaml"
    cfg = lu.load_config(path, mode="smoke")
    cfg.train.stpes = 3
    with pytest.raises(ConfigError, match=rf"^set in code after loading {path}: train.stpes = 3: unknown key"):
        cfg.override({"train.lr": 1e-3})


@pytest.mark.parametrize("key, value, yaml_value", [
    ("train.precision", "FP16", "FP16"), ("train.precision", "b16", "b16"),
    ("train.gradient_checkpointing", "no", "'no'"), ("data.seq_length", 2000, "2000"), ("model.dropout", 1.5, "1.5"),
    ("train.micro_batch_size", "4", "'4'"), ("model.name", "gpt3", "gpt3")])
def test_estimate_memory_checks_the_config_as_run_does(tmp_path, root, key, value, yaml_value):
    """Issue 38 §5: ``estimate_memory(cfg)`` after a value set in code: the YAML path's message, through the one
    ``validate``. Before: "FP16" / "b16" gave the FP32 estimate, "no" the checkpointed one, 2000 and 1.5 numbers,
    "4" and "gpt3" a TypeError / KeyError."""
    from labutils.estimator.estimate import estimate_memory

    path = root / "configs/fp32_config.yaml"
    cfg = lu.load_config(path, mode="full")
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError) as info:
        estimate_memory(cfg)
    assert str(info.value) == f"set in code after loading {path}: " + yaml_line(tmp_path, section, name, yaml_value)


def test_bench_names_the_set_that_gave_too_few_steps(root, capsys):
    """``bench CONFIG --set train.steps=1``: the --set gave the 1, not the file. Before: "CONFIG: train.steps = 1"."""
    assert main(["bench", str(root / "configs/fp32_config.yaml"), "--set", "train.steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --set: train.steps = 1: bench times the steps after its warm-up"), err


@pytest.mark.parametrize("file_text, override, key, given", [
    ("train:\n  accumulation_steps: 4\n", "train.micro_batch_size=60000", "train.accumulation_steps",
     "train.micro_batch_size = 60000 from --set train.micro_batch_size=60000"),
    ("data:\n  num_samples: 40000\n", "data.seq_length=1024", "data.num_samples",
     "data.seq_length = 1024 from --set data.seq_length=1024"),
    ("model:\n  name: gpt2\n  pretrained: true\n", "model.name=tiny", "model.pretrained",
     "model.name = 'tiny' from --set model.name=tiny"),
])
def test_a_limit_set_by_set_names_the_set(tmp_path, capsys, file_text, override, key, given):
    """The file's value is fine on its own; the ``--set`` made it wrong, and the line says so."""
    path = tmp_path / "c.yaml"
    path.write_text(file_text)
    assert main(["estimate", str(path), "--set", override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {path}: {key}") and err.endswith(f"(given {given})"), err


def test_the_tiny_model_set_by_smoke_mode_is_named_as_the_modes(tmp_path):
    """Smoke mode swaps in the tiny model; a file asking for pretrained weights hears that the mode did it."""
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  pretrained: true\n")
    with pytest.raises(ConfigError, match=r"\(given model.name = 'tiny' from smoke mode\)$"):
        lu.load_config(path, mode="smoke")
