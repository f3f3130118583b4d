"""Nothing a user types loses work (issue 14): every bad input is refused before any work starts, with exit code 2
and one line naming the source, the key or option, the value and what is allowed.

Classes covered here: (1) output paths checked before the work, (2) values that passed validation and crashed
later, (5) launcher variables, (7) the smaller ones (--set named as the source, duplicate YAML keys, the usage
hint, bounded messages). "No work" is checked by replacing the training/benchmark entry points with a function
that fails the test if called: the code under test (argument and config validation) is real.
"""
from __future__ import annotations

import errno
import importlib
import json
import os
from pathlib import Path

import pytest

from labutils.tools import cli
from labutils.core.results import write_json

CONFIG = "configs/fp32_config.yaml"


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if training or benchmarking starts."""
    calls = []

    def forbidden(*a, **k):
        calls.append(a)
        raise AssertionError("work started although the input was bad")

    # the modules, not the functions of the same names that labutils/__init__ exports
    monkeypatch.setattr(importlib.import_module("labutils.core.train"), "run", forbidden)
    monkeypatch.setattr(importlib.import_module("labutils.tools.bench"), "bench", forbidden)
    return calls


@pytest.fixture(autouse=True)
def in_repo(root, monkeypatch):
    monkeypatch.chdir(root)
    monkeypatch.setenv("LAB_SMOKE", "1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(name, raising=False)


def refused(capsys, argv, *expected) -> str:
    """Run the CLI; it must exit 2 with exactly one line on stderr containing each of ``expected``."""
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for e in expected:
        assert e in lines[0], lines[0]
    assert "Traceback" not in err
    return lines[0]


# ----------------------------------------------------------------------------------- (1) output paths
def bad_paths(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir(exist_ok=True)
    return {"a directory": tmp_path / "adir", "under a regular file": tmp_path / "afile" / "r.json",
            "deeper under a regular file": tmp_path / "afile" / "sub" / "r.json", "the current folder": Path(".")}


@pytest.mark.parametrize("case", ["a directory", "under a regular file", "deeper under a regular file",
                                  "the current folder"])
def test_run_json_to_a_bad_path_refuses_before_the_model_loads(tmp_path, capsys, no_work, case):
    path = bad_paths(tmp_path)[case]
    refused(capsys, ["run", CONFIG, "--json", str(path)], "--json")
    assert no_work == []  # no training happened
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize("case", ["a directory", "under a regular file", "deeper under a regular file"])
def test_estimate_json_to_a_bad_path_refuses_before_estimating(tmp_path, capsys, case):
    path = bad_paths(tmp_path)[case]
    code = cli.main(["estimate", CONFIG, "--json", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "--json" in err


@pytest.mark.parametrize("case", ["a regular file", "under a regular file"])
def test_regenerate_out_that_is_a_file_refuses(tmp_path, capsys, case):
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" if case == "a regular file" else tmp_path / "afile" / "results"
    refused(capsys, ["regenerate", "--smoke", "--out", str(out)], "--out", "is a file")
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("target", ["a directory", "a non-empty directory"])
def test_write_json_leaves_no_temp_file_when_it_fails(tmp_path, target):
    path = tmp_path / "adir"
    path.mkdir()
    if target == "a non-empty directory":
        (path / "x").write_text("x")
    with pytest.raises(OSError):
        write_json(path, {"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"]


# ----------------------------------------------------------------------------------- (2) values
@pytest.mark.parametrize("override, key, allowed", [
    ("train.lr=.nan", "train.lr", "finite"),
    ("train.lr=nan", "train.lr", "finite"),
    ("train.lr=inf", "train.lr", "finite"),
    ("model.dropout=.nan", "model.dropout", "finite"),
    ("train.weight_decay=.inf", "train.weight_decay", "finite"),
    ("train.max_grad_norm=-.inf", "train.max_grad_norm", "finite"),
    ("train.max_grad_norm=.nan", "train.max_grad_norm", "finite"),
    ("train.lr=1e400", "train.lr", "finite"),
    ("train.seed=4294967296", "train.seed", "<= 4294967295"),
    ("train.seed=18446744073709551616", "train.seed", "<= 4294967295"),
    ("data.num_samples=1000000000000", "data.num_samples", "<="),
    ("train.micro_batch_size=1000000000", "train.micro_batch_size", "<="),
    ("train.accumulation_steps=1000000000", "train.accumulation_steps", "<="),
])
def test_values_that_used_to_crash_later_are_refused_first(capsys, no_work, override, key, allowed):
    refused(capsys, ["run", CONFIG, "--set", override], "--set", key, allowed)
    assert no_work == []


@pytest.mark.parametrize("docs", ["a\n\nb\n\nc\n", "word\n", "x\n\n\n\ny\n", "single-token-ish\n\n!\n"])
def test_a_corpus_of_only_too_short_documents_is_refused(tmp_path, capsys, no_work, docs):
    corpus = tmp_path / "short.txt"
    corpus.write_text(docs, encoding="utf-8")
    refused(capsys, ["run", CONFIG, "--set", f"data.corpus={corpus}"], "data.corpus", "too short")


@pytest.mark.parametrize("raw", [b"train:\n  steps: \xff\n", b"\xfe\xff\x00t\x00r", "train:\n  steps: 3 # é\n".encode("latin-1")])
def test_a_config_file_that_is_not_utf8_is_refused(tmp_path, capsys, no_work, raw):
    path = tmp_path / "bad.yaml"
    path.write_bytes(raw)
    refused(capsys, ["run", str(path)], str(path), "not UTF-8")


@pytest.mark.parametrize("argv, option", [
    (["bench", CONFIG, "--repeats", "0"], "--repeats"),
    (["bench", CONFIG, "--repeats", "-3"], "--repeats"),
    (["bench", CONFIG, "--repeats", "many"], "--repeats"),
    (["estimate", CONFIG, "--gpus", "0"], "--gpus"),
    (["estimate", CONFIG, "--gpus", "-1"], "--gpus"),
    (["estimate", CONFIG, "--gpu-memory-gb", "nan"], "--gpu-memory-gb"),
    (["estimate", CONFIG, "--gpu-memory-gb", "inf"], "--gpu-memory-gb"),
    (["estimate", CONFIG, "--gpu-memory-gb", "-8"], "--gpu-memory-gb"),
    (["regenerate", "--smoke", "--gpu-memory-gb", "nan"], "--gpu-memory-gb"),
    (["regenerate", "--smoke", "--gpu-memory-gb", "-inf"], "--gpu-memory-gb"),
])
def test_cli_numbers_must_be_positive_and_finite(capsys, no_work, argv, option):
    refused(capsys, argv, f"argument {option}", f"see python -m labutils {argv[0]} --help")


def test_gpu_memory_gb_0_means_no_cap_in_every_command(capsys, monkeypatch):
    """0 = no cap (the whole card) for regenerate, and so for estimate too: never "a 0 GiB card"."""
    monkeypatch.setenv("LAB_GPU_MEMORY_GB", "4")
    assert cli.main(["estimate", CONFIG, "--gpu-memory-gb", "0"]) == 0
    out = capsys.readouterr().out
    budget = next(line for line in out.splitlines() if line.startswith("budget:"))
    assert "budget: 0.00 GiB" not in budget and "--gpu-memory-gb 0" not in budget
    assert "this GPU" in budget or "no GPU here" in budget
    assert os.environ["LAB_GPU_MEMORY_GB"] == "4"  # the process's own setting is restored
    from labutils.tools import regenerate as rg
    assert "LAB_GPU_MEMORY_GB" not in rg.kernel_env("/tmp/r", smoke=True, gpu_memory_gb=0.0, base={})


# ----------------------------------------------------------------------------------- (5) launcher variables
@pytest.mark.real_kernels  # trains one step on the default device
@pytest.mark.parametrize("env", [{"RANK": "1"}, {"RANK": "3", "LOCAL_RANK": "3"}, {"RANK": "2", "WORLD_SIZE": "1"}])
def test_a_stale_rank_without_a_launch_still_reports(tmp_path, capsys, monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    path = tmp_path / "r.json"
    code = cli.main(["run", CONFIG, "--set", "train.steps=1", "--quiet", "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0 and "status" in out and f"wrote {path}" in out
    assert json.loads(path.read_text())["status"] == "ok"


@pytest.mark.parametrize("env, name", [
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
    ({"RANK": "x"}, "RANK"),
    ({"RANK": "-1"}, "RANK"),
    ({"LOCAL_RANK": "1.5"}, "LOCAL_RANK"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK"),
    ({"WORLD_SIZE": "2"}, "RANK"),
])
def test_malformed_launcher_variables_are_refused(capsys, monkeypatch, no_work, env, name):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    refused(capsys, ["run", CONFIG], "environment", name)


# ----------------------------------------------------------------------------------- (7) smaller ones
@pytest.mark.parametrize("override, key", [("train.lr=-1", "train.lr"), ("train.steps=0", "train.steps"),
                                           ("model.dropout=2", "model.dropout"),
                                           ("data.corpus=missing.txt", "data.corpus"),
                                           ("train.precision=fp8", "train.precision")])
def test_set_errors_name_set_not_the_config_file(capsys, no_work, override, key):
    line = refused(capsys, ["run", CONFIG, "--set", override], f"--set: {key}")
    assert CONFIG not in line


def test_file_errors_still_name_the_file(tmp_path, capsys, no_work):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: -1\n")
    refused(capsys, ["run", str(path), "--set", "train.steps=2"], f"{path}: train.lr")


@pytest.mark.parametrize("text, line", [
    ("train:\n  steps: 1\n  steps: 2\n", 3),
    ("train:\n  steps: 1\ntrain:\n  lr: 0.1\n", 3),
    ("data:\n  pack: true\n  seq_length: 32\n  pack: false\n", 4),
])
def test_duplicate_yaml_keys_are_refused(tmp_path, capsys, no_work, text, line):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    refused(capsys, ["run", str(path)], str(path), "duplicate key", f"line {line}")


@pytest.mark.parametrize("argv, hint", [(["--bogus"], "see python -m labutils --help"),
                                        (["run"], "see python -m labutils run --help"),
                                        (["estimate", CONFIG, "--gpus", "x"], "see python -m labutils estimate --help")])
def test_usage_hint_names_the_real_command(capsys, argv, hint):
    line = refused(capsys, argv, hint)
    assert "labutils labutils" not in line


def alias_bomb(depth: int) -> str:
    lines = ["train:", "  steps:", "    - &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, depth):
        lines.append(f"    - &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("depth", [4, 6, 9])
def test_messages_show_a_bounded_part_of_a_value(tmp_path, capsys, no_work, depth):
    """A few hundred bytes of YAML aliases expand to 9**depth items; the message shows only its start."""
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb(depth))
    line = refused(capsys, ["run", str(path)], "train.steps", "must be an integer")
    assert len(line) < 300


@pytest.mark.parametrize("value", ["x" * 10_000, "[" + "1, " * 5000 + "1]",
                                   "{" + ", ".join(f"k{i}: {i}" for i in range(3000)) + "}"],
                         ids=["long string", "long list", "long mapping"])
def test_long_set_values_are_cut_in_messages(capsys, no_work, value):
    line = refused(capsys, ["run", CONFIG, "--set", f"train.steps={value}"], "--set: train.steps")
    assert len(line) < 300


def test_error_value_repr_is_bounded_without_expanding():
    from labutils.core.config import shown

    inner = ["lol"] * 9
    for _ in range(12):  # 9**12 items if expanded: must not be
        inner = [inner] * 9
    assert len(shown(inner)) <= 80


# ------------------------------------------------------------------------------------------------ issue 29 §3
@pytest.mark.parametrize("command", ["run", "estimate"])
@pytest.mark.parametrize("make", ["loop parent", "dangling parent", "loop target", "empty"])
def test_json_targets_that_would_lose_the_result_are_refused_first(tmp_path, capsys, no_work, command, make):
    """A symlink loop or a dangling link on the way fails only when writing (after the run); '' wrote nothing."""
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "dang").symlink_to(tmp_path / "missing" / "x")
    target = {"loop parent": tmp_path / "loop" / "r.json", "dangling parent": tmp_path / "dang" / "r.json",
              "loop target": tmp_path / "loop", "empty": ""}[make]
    line = refused(capsys, [command, CONFIG, "--json", str(target)], "--json")
    assert ("an empty file name" in line) if make == "empty" else ("leads nowhere" in line)


def test_doctor_json_empty_is_refused(capsys):
    refused(capsys, ["doctor", "--json", ""], "--json '': an empty file name")


@pytest.mark.parametrize("target, says", [(CONFIG, "is the config file this command reads"),
                                          ("README.md", "would overwrite README.md, a file of the repository"),
                                          ("pyproject.toml", "a file of the repository")])
def test_estimate_json_never_overwrites_an_input_or_a_repository_file(root, capsys, target, says):
    before = (root / target).read_bytes()
    refused(capsys, ["estimate", CONFIG, "--json", target], says)
    assert (root / target).read_bytes() == before


def test_estimate_json_refuses_the_corpus_it_reads(tmp_path, capsys, ragged_corpus):
    refused(capsys, ["estimate", CONFIG, "--set", f"data.corpus={ragged_corpus}", "--json", str(ragged_corpus)],
            "is the corpus (data.corpus) this command reads")


@pytest.mark.parametrize("value", ["1e308", "2e6", "-1"])
def test_gpu_memory_gb_out_of_range_is_refused(capsys, value):
    refused(capsys, ["estimate", CONFIG, "--gpu-memory-gb", value], "--gpu-memory-gb", "from 0 to 1048576")


@pytest.mark.parametrize("value", ["abc", "1e308", "-2", "nan"])
@pytest.mark.parametrize("argv", [["estimate", CONFIG], ["run", CONFIG], ["doctor"]])
def test_lab_gpu_memory_gb_one_rule_in_every_command(monkeypatch, capsys, no_work, value, argv):
    monkeypatch.setenv("LAB_GPU_MEMORY_GB", value)
    refused(capsys, argv, f"LAB_GPU_MEMORY_GB = {value!r}: must be a number of GiB from 0 to 1048576")


@pytest.mark.parametrize("argv", [["estimate", CONFIG], ["run", CONFIG], ["doctor"], ["bench", CONFIG]])
def test_a_card_too_small_for_the_cuda_context_is_refused_by_every_command(monkeypatch, capsys, no_work, argv):
    """Issue 46 §3: LAB_GPU_MEMORY_GB=0.001 ran `run` on a CPU (rc 0, no budget line) while `estimate` refused it;
    one rule (labutils.core.cards.card_gb) now refuses it in every command, before any work, naming the variable.
    The oracle is the card table's own refusal (card_total_bytes). Breaks if a command skips the check."""
    from labutils.core.cards import card_total_bytes

    with pytest.raises(ValueError, match="not more than the CUDA context"):
        card_total_bytes(0.001)
    monkeypatch.setenv("LAB_GPU_MEMORY_GB", "0.001")
    refused(capsys, argv, "LAB_GPU_MEMORY_GB = '0.001'", "not more than the CUDA context")


@pytest.mark.parametrize("argv", [["estimate", CONFIG], ["regenerate", "--plan", "--gpu", "Tesla T4"]])
def test_gpu_memory_gb_too_small_is_the_same_refusal(capsys, argv):
    """--gpu-memory-gb 0.001: `regenerate --plan` ended in a traceback (issue 45) where `estimate` refused it."""
    refused(capsys, argv + ["--gpu-memory-gb", "0.001"], "--gpu-memory-gb", "not more than the CUDA context")


def test_a_valid_lab_gpu_memory_gb_is_the_estimates_card_on_the_cpu_too(monkeypatch, capsys):
    """Without a GPU, estimate used an 8 GB card whatever LAB_GPU_MEMORY_GB said; now it is the card to fit,
    named as such, and the same card --gpu-memory-gb gives."""
    monkeypatch.setattr(importlib.import_module("labutils.core.device"), "cuda_available", lambda: False)
    monkeypatch.setenv("LAB_GPU_MEMORY_GB", "12")
    assert cli.main(["estimate", CONFIG]) == 0
    env_line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("budget:"))
    monkeypatch.delenv("LAB_GPU_MEMORY_GB")
    assert cli.main(["estimate", CONFIG, "--gpu-memory-gb", "12"]) == 0
    opt_line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("budget:"))
    assert "LAB_GPU_MEMORY_GB=12:" in env_line and "--gpu-memory-gb 12:" in opt_line
    assert env_line.replace("LAB_GPU_MEMORY_GB=12", "--gpu-memory-gb 12") == opt_line


def test_yaml_nested_thousands_deep_is_one_line(tmp_path, capsys):
    deep = tmp_path / "deep.yaml"
    deep.write_text("model: " + "[" * 5000 + "]" * 5000 + "\n")
    refused(capsys, ["estimate", str(deep)], str(deep), "nested too deeply")


def test_yaml_merge_keys_are_supported(tmp_path):
    """``<<: *anchor`` merges as YAML's merge key says: the mapping's own keys win; repeats of its own keys are
    still refused."""
    import labutils as lu

    path = tmp_path / "merge.yaml"
    path.write_text("data: &d {seq_length: 32}\ntrain:\n  <<: {steps: 7, lr: 0.5}\n  lr: 0.002\n")
    cfg = lu.load_config(path, mode="full")
    assert cfg.train.steps == 7 and cfg.train.lr == 0.002 and cfg.data.seq_length == 32
    path.write_text("train:\n  <<: [{steps: 7}]\n  steps: 3\n  steps: 4\n")
    with pytest.raises(lu.ConfigError, match="duplicate key 'steps'"):
        lu.load_config(path, mode="full")


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_config_that_is_not_a_regular_file_says_so(tmp_path, capsys, kind):
    path = tmp_path / "c.yaml"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    refused(capsys, ["estimate", str(path)], f"{path}: not a regular file")


# -------------------------------------------------------------------------------------------- issue 38 §2, §3, §6
@pytest.fixture
def no_doctor(monkeypatch):
    """Fail the test if the doctor's checks start (the output path must be refused first)."""
    def forbidden(*a, **k):
        raise AssertionError("the doctor ran although its --json was bad")

    monkeypatch.setattr(importlib.import_module("labutils.tools.doctor"), "run_doctor", forbidden)


def _argv(command: str, config, json_path) -> list[str]:
    return [command] + ([] if command == "doctor" else [str(config)]) + ["--json", str(json_path)]


@pytest.mark.parametrize("command", ["run", "bench", "estimate", "doctor"])
@pytest.mark.parametrize("target, says", [("its config", "is the config file this command reads"),
                                          ("README.md", "would overwrite README.md, a file of the repository"),
                                          ("a dangling link", "leads nowhere")])
def test_every_command_checks_its_json_path_the_same_way(root, tmp_path, capsys, no_work, no_doctor, command, target,
                                                         says):
    """§2: `bench mycfg.yaml --json mycfg.yaml` replaced the config, `--json README.md` the tracked README, and a
    dangling link became a file; run, estimate and doctor refused all three. One check for every command now."""
    if command == "doctor" and target == "its config":
        pytest.skip("the doctor reads no config")
    cfg = tmp_path / "mycfg.yaml"
    cfg.write_bytes((root / CONFIG).read_bytes())
    (tmp_path / "dangling.json").symlink_to(tmp_path / "missing.json")
    path = {"its config": cfg, "README.md": "README.md", "a dangling link": tmp_path / "dangling.json"}[target]
    before = {p: p.read_bytes() for p in (cfg, root / "README.md")}
    refused(capsys, _argv(command, cfg, path), "--json", says)
    assert {p: p.read_bytes() for p in before} == before
    assert (tmp_path / "dangling.json").is_symlink() and not (tmp_path / "missing.json").exists()


@pytest.mark.parametrize("command", ["run", "bench", "estimate", "doctor"])
def test_a_json_path_ending_in_a_slash_is_refused(tmp_path, capsys, no_work, no_doctor, command):
    """§6: `--json newdir/` wrote a file named newdir."""
    refused(capsys, _argv(command, CONFIG, f"{tmp_path / 'newdir'}/"), "--json", "not a file name")
    assert list(tmp_path.iterdir()) == []


def test_json_through_a_link_to_a_file_keeps_the_link(tmp_path, capsys):
    """§6: `--json link.json` (a link to a file) replaced the link with a regular file; it writes through it now."""
    (tmp_path / "real.json").write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to("real.json")
    assert cli.main(["estimate", CONFIG, "--json", str(link)]) == 0, capsys.readouterr()
    assert link.is_symlink() and os.readlink(link) == "real.json"
    assert "recommendation" in json.loads((tmp_path / "real.json").read_text())


class _FullDisk:
    """A binary file on a filesystem that fills up: its write stores part of the data, then fails as the OS does."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        self.f.write(bytes(data[:len(data) // 2]))
        self.f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.fixture
def full_disk(monkeypatch):
    """``full_disk(folder)``: from now on, files opened for writing under ``folder`` hit a full disk (ENOSPC). The
    writing code is the real one; only the OS's answer to its write changes."""
    real = os.fdopen

    def install(folder: Path):
        def fdopen(fd, *a, **k):
            f = real(fd, *a, **k)
            return _FullDisk(f) if os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder)) else f

        monkeypatch.setattr(os, "fdopen", fdopen)
    return install


GOOD = '{"earlier": "good result"}\n'


def _one_line_no_space(capsys, code: int, path: Path) -> str:
    out, err = capsys.readouterr()
    assert code == 1, (out, err)
    assert err.strip().splitlines() == [f"error: cannot write {path}: no space left on device"], err
    assert path.read_text() == GOOD  # the earlier good file is whole
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp file, nothing half-written
    return out


@pytest.mark.parametrize("command", ["estimate", "bench", "doctor"])
def test_a_full_disk_is_one_line_and_keeps_the_earlier_file(tmp_path, capsys, monkeypatch, full_disk, command):
    """§3: on a full filesystem each command's --json ended in an OSError [Errno 28] traceback. (bench's and the
    doctor's measurements are replaced by a stand-in result: what is tested is writing it.)"""
    monkeypatch.setattr(importlib.import_module("labutils.tools.bench"), "bench", lambda cfg, repeats: {"ratio": 1.0})
    monkeypatch.setattr(importlib.import_module("labutils.tools.doctor"), "run_doctor",
                        lambda: {"checks": [], "summary": {"pass": 0, "fail": 0, "skip": 0}})
    path = tmp_path / "full" / "r.json"
    path.parent.mkdir()
    path.write_text(GOOD)
    full_disk(path.parent)
    _one_line_no_space(capsys, cli.main(_argv(command, CONFIG, path)), path)


def test_a_full_disk_after_a_run_is_one_line_after_its_summary(tmp_path, capsys, full_disk):
    """§3: `run ... --json` on a full disk lost the finished run in a traceback; its summary is printed, then one
    line says what could not be written."""
    path = tmp_path / "full" / "r.json"
    path.parent.mkdir()
    path.write_text(GOOD)
    full_disk(path.parent)
    code = cli.main(["run", CONFIG, "--quiet", "--set", "train.steps=2", "train.timing_warmup_steps=1",
                     "--json", str(path)])
    out = _one_line_no_space(capsys, code, path)
    assert "status" in out and "loss" in out  # what was measured is on the screen
