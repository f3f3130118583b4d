"""The path students with internet take, rehearsed without it: ``from_pretrained`` reading a local hub cache.

A session fixture writes a Hugging Face hub cache in the layout huggingface_hub itself keeps
(``hub/models--openai-community--gpt2/{blobs,snapshots/<commit>,refs/main}``) holding checkpoints made with
``save_pretrained``: a GPT-2 of small dimensions under GPT-2's real id, with GPT-2's real tokenizer, and a
``tiny`` checkpoint under :data:`labutils.models.hub.TINY_CACHE_ID`. Subprocesses then run with ``HF_HUB_OFFLINE=1``
and ``HF_HOME`` pointing at it (huggingface_hub reads both when it is imported), so transformers' own loading
code runs end to end. Nothing is mocked.

The loads and refusals run as cases of ONE child process (:data:`DRIVER`; its imports cost more than the loads):
before each case it points ``$HF_HOME/hub``, a symlink, at that case's cache (huggingface_hub fixes the folder at
import but looks files up in it at every call), captures file descriptors 1 and 2 as a process of its own would
print them, and forgets what a process warns only once.

The small GPT-2 is honest for what is tested here (where the weights come from, training mode, the KV cache,
the CLI's record): ``from_pretrained`` builds the model from the cache's ``config.json``, as it does online.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from labutils.models.hub import HUB_IDS, TINY_CACHE_ID, offline_gpt2_tokenizer
from labutils.models.gpt2 import gpt2_config

REPO = Path(__file__).resolve().parent.parent
# Under pytest-xdist one worker takes them all: the cache (hf_home) is written, and the cases' process runs, once
pytestmark = pytest.mark.xdist_group("hub_cache")


def write_hub_cache(hub: Path, repo_id: str, model, tokenizer=None) -> str:
    """Save ``model`` (and ``tokenizer``) with ``save_pretrained`` into ``hub`` as huggingface_hub caches a
    download: content-addressed blobs, a snapshot folder of links named by commit, and ``refs/main``."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        files = sorted(p for p in Path(tmp).iterdir() if p.is_file())
        digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
        commit = hashlib.sha1(json.dumps(digests, sort_keys=True).encode()).hexdigest()  # 40 hex digits
        snapshot = repo / "snapshots" / commit
        (repo / "blobs").mkdir(parents=True, exist_ok=True)
        snapshot.mkdir(parents=True, exist_ok=True)
        for p in files:
            blob = repo / "blobs" / digests[p.name]
            shutil.copyfile(p, blob)
            (snapshot / p.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return commit


@pytest.fixture(scope="session")
def hf_home(tmp_path_factory) -> Path:
    """An ``HF_HOME`` whose hub cache holds a small GPT-2 (GPT-2's tokenizer) and a tiny checkpoint."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    home = tmp_path_factory.mktemp("hf_home")
    torch.manual_seed(1)
    # use_cache=True, as the hub's GPT-2 config says (it is written for generation): load_model must cope
    small = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=50257, n_positions=1024, use_cache=True)
    write_hub_cache(home / "hub", HUB_IDS["gpt2"], GPT2LMHeadModel(small), offline_gpt2_tokenizer().tok)
    for name in ("tiny", "tiny-deep"):  # lab 03's smoke model is tiny-deep (its config's smoke: section)
        tiny = gpt2_config(name)
        tiny.use_cache = True
        write_hub_cache(home / "hub", TINY_CACHE_ID + name[4:], GPT2LMHeadModel(tiny))
    return home


def offline_env(hf_home: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "TRANSFORMERS_CACHE", "LAB_RESULTS_DIR")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(hf_home), **extra)
    return env


DRIVER = r"""
import json, logging, os, sys, tempfile, traceback, warnings
import pytest

link = os.path.join(os.environ["HF_HOME"], "hub")
for case in json.loads(sys.stdin.read()):
    os.symlink(case["hub"], link + ".next")
    os.replace(link + ".next", link)  # where huggingface_hub looks, now this case's cache
    env, mp, error = dict(os.environ), pytest.MonkeyPatch(), None
    for key in case["unset"]:
        os.environ.pop(key, None)
    warnings.filterwarnings("default", append=True)  # the default action (a no-op filter): once-per-place warns again
    for once in ("warning_once", "info_once"):  # transformers' once-per-process log lines: said again
        getattr(getattr(logging.Logger, once, None), "cache_clear", lambda: None)()
    files, saved = [tempfile.TemporaryFile() for _ in "12"], [os.dup(1), os.dup(2)]
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(files[0].fileno(), 1), os.dup2(files[1].fileno(), 2)
    try:
        exec(case["code"], {"MP": mp})
    except BaseException:  # what the case's own process would die of, its traceback on its stderr
        error = traceback.format_exc()
        sys.stderr.write(error)
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        mp.undo()
        os.environ.clear(), os.environ.update(env)
    for f in files:
        f.seek(0)
    out, err = (f.read().decode(errors="replace") for f in files)
    try:  # the case's result: the last line it printed, JSON
        result = json.loads(out.strip().splitlines()[-1]) if error is None else {}
    except (IndexError, ValueError):
        result, error = {}, "its last line of stdout is not JSON"
    print("CASE " + json.dumps({**result, "id": case["id"], "error": error, "stdout": out, "stderr": err}))
"""


def run_cases(hf_home: Path, cases: list[dict], timeout: int = 600) -> dict:
    """Run ``cases`` ({"id", "hub": the cache folder, "code": prints its result as the last JSON line of stdout,
    "unset": environment variables it runs without}) in one child process: {id: result, with its stdout, stderr
    and error (its traceback, or None)}."""
    home = hf_home.parent / f"{hf_home.name}_cases"
    home.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, "-c", DRIVER], cwd=REPO, env=offline_env(home), capture_output=True,
                          text=True, timeout=timeout, input=json.dumps(cases, default=str))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("CASE ")]
    assert [r["id"] for r in results] == [c["id"] for c in cases], proc.stderr[-3000:]
    return {r["id"]: r for r in results}


def passed(hub_cases: dict, case: str) -> dict:
    r = hub_cases[case]
    assert r["error"] is None, r["stdout"][-2000:] + r["stderr"][-3000:]
    return r


# ------------------------------------------------------------------------------------------------ the cases
LOAD = r"""
import json, torch
import labutils as lu
from labutils.core.config import ModelConfig
loaded = lu.load_model(ModelConfig(name="gpt2"), "cpu")
m = loaded.model
out = {"weights": loaded.weights, "training": m.training, "n_layer": m.config.n_layer,
       "tokenizer": loaded.tokenizer.name, "notice": loaded.notice,
       "hello": loaded.tokenizer.encode("Hello world"), "dropout_active": None}
ids = torch.randint(0, 50257, (2, 16))
lu.enable_checkpointing(m)
o = m(input_ids=ids, labels=ids, use_cache=True)  # ask for the cache, as a pretrained config's use_cache=True does
out["cache_is_none"] = o.past_key_values is None
o.loss.backward()
out["grads"] = all(p.grad is not None for p in m.parameters())
with torch.no_grad():
    out["dropout_active"] = not torch.equal(m(input_ids=ids).logits, m(input_ids=ids).logits)
"""

FAST_LOAD = r"""
from safetensors.torch import load_file
from huggingface_hub import snapshot_download
path = snapshot_download("%s", local_files_only=True)
ckpt = load_file(path + "/model.safetensors")["transformer.wte.weight"]
loaded = lu.load_model(ModelConfig(name="gpt2", activation="gelu_pytorch_tanh", pad_vocab_to=64,
                                   attn_implementation="sdpa_causal"), "cpu")
m = loaded.model
wte = m.get_input_embeddings().weight
ids = torch.randint(0, 50257, (2, 16))
logits = m(input_ids=ids).logits
print(json.dumps({"out": out, "fast": {
    "weights": loaded.weights, "rows": wte.shape[0], "real": lu.models.gpt2.real_vocab_size(m),
    "kept": bool(torch.equal(wte[:50257], ckpt)), "tied": m.lm_head.weight is wte, "act": m.config.activation_function,
    "padded_win": int((logits.argmax(-1) >= 50257).sum())}}))
""" % HUB_IDS["gpt2"]

LOAD_AUTO = r"""
import json
import labutils as lu
from labutils.core.config import ModelConfig
loaded = lu.load_model(ModelConfig(name="%s", pretrained="auto"), "cpu", verbose=False)
print(json.dumps({"weights": loaded.weights, "notice": loaded.notice}))
"""

# `run` in full mode (what a GPU machine runs): the pretend GPU of tests/fake_cuda.py makes the CLI choose it here
# (installed with the case's MonkeyPatch, MP, undone after it). The refusal comes from loading, before any CUDA work,
# so the pretend driver is never asked for a kernel.
RUN_TRUE = r"""
import json
from tests import fake_cuda
fake_cuda.install(MP)
from labutils.tools.cli import main
print(json.dumps({"rc": main(["run", "configs/fp32_config.yaml", "--quiet", "--set", "model.pretrained=true"])}))
"""


# Issue 29 §2: a corrupt model.safetensors in the hub cache (a download cut short, a bad disk) and pretrained: true
# without the checkpoint are refused or fallen back from in one line, never a traceback. The cache is the real one
# above, copied and its weights blob damaged; transformers and safetensors read it for real.
def damaged_copy(hf_home: Path, to: Path, how: str) -> Path:
    home = to / f"hf_{how}"
    shutil.copytree(hf_home, home, symlinks=True)
    snapshot = next((home / "hub" / f"models--{HUB_IDS['gpt2'].replace('/', '--')}" / "snapshots").iterdir())
    blob = (snapshot / "model.safetensors").resolve()
    data = blob.read_bytes()
    blob.write_bytes(data[:len(data) * 9 // 10] if how == "truncated" else os.urandom(4096))
    return home


# Issue 38 §4: a broken or different config.json in the cache. It was a TypeError or a validation-error traceback
# (auto and true alike), reported, where reported at all, as "model.safetensors cannot be read"; a config of 3 layers
# over 2 layers' weights trained a third, random layer as "pretrained". The cache is the real one, its config.json
# blob rewritten; transformers reads it for real.
def edited_config(hf_home: Path, to: Path, repo_id: str, broken: str) -> Path:
    home = to / f"hf_{repo_id.replace('/', '--')}_{broken.replace(' ', '_')}"
    shutil.copytree(hf_home, home, symlinks=True)
    snapshot = next((home / "hub" / f"models--{repo_id.replace('/', '--')}" / "snapshots").iterdir())
    blob = (snapshot / "config.json").resolve()
    blob.write_text(json.dumps(BROKEN[broken](json.loads(blob.read_text()))))
    return home


BROKEN = {"a list": lambda c: [1, 2], "n_embd wide": lambda c: {**c, "n_embd": "wide"},
          "n_layer 3 over 2 layers of weights": lambda c: {**c, "n_layer": 3}}
CORRUPT = ["truncated", "garbage"]
# Every kind under GPT-2's id, and tiny's id once (the same check, hub.check_cached_config, reads both)
BROKEN_CONFIGS = [(broken, "gpt2") for broken in BROKEN] + [("n_layer 3 over 2 layers of weights", "tiny")]
REFUSED_CONFIGS = ["n_layer 3 over 2 layers of weights"]  # the kind that trained a random layer; the others: auto


@pytest.fixture(scope="module")
def hub_cases(hf_home, tmp_path_factory) -> dict:
    """Every case of this module but the CLI run and the lab, in one process (:data:`DRIVER`): the refusals first, so
    the first one starts from a fresh interpreter (imports and all) as ``python -c`` would."""
    import torch
    from transformers import GPT2LMHeadModel

    to = tmp_path_factory.mktemp("hub_cases")
    corrupt = {how: damaged_copy(hf_home, to, how) / "hub" for how in CORRUPT}
    broken_config = {(broken, repo): edited_config(hf_home, to, repo, broken) / "hub" for broken, repo in
                     {(b, HUB_IDS.get(name, TINY_CACHE_ID)) for b, name in BROKEN_CONFIGS}}
    (to / "empty").mkdir()  # nothing cached
    torch.manual_seed(0)  # a whole 3-layer checkpoint cached under tiny's id
    config = gpt2_config("tiny")
    config.n_layer = 3
    write_hub_cache(to / "three_layers", TINY_CACHE_ID, GPT2LMHeadModel(config))

    full = ["LAB_SMOKE"]  # full mode: the GPT-2 size the config names
    cases = [{"id": "true corrupt", "hub": corrupt["truncated"], "code": RUN_TRUE, "unset": full},
             {"id": "true offline", "hub": to / "empty", "code": RUN_TRUE, "unset": full}]
    cases += [{"id": f"true {broken}", "hub": broken_config[broken, HUB_IDS["gpt2"]], "code": RUN_TRUE,
               "unset": full} for broken in REFUSED_CONFIGS]
    cases.append({"id": "loaded twice", "hub": hf_home / "hub", "code": LOAD + FAST_LOAD, "unset": []})
    cases += [{"id": f"auto {how}", "hub": corrupt[how], "code": LOAD_AUTO % "gpt2", "unset": []} for how in CORRUPT]
    cases += [{"id": f"auto {broken}-{name}", "hub": broken_config[broken, HUB_IDS.get(name, TINY_CACHE_ID)],
               "code": LOAD_AUTO % name, "unset": []} for broken, name in BROKEN_CONFIGS]
    cases.append({"id": "other sizes", "hub": to / "three_layers", "code": LOAD_AUTO % "tiny", "unset": []})
    return run_cases(hf_home, cases)


# ------------------------------------------------------------------------------------------------ the tests
def test_load_model_from_the_hub_cache_is_pretrained_and_trains(hub_cases):
    twice = passed(hub_cases, "loaded twice")
    r = {"stdout": twice["stdout"], **twice["out"]}
    assert r["weights"] == "pretrained" and r["n_layer"] == 2  # the cache's checkpoint, not a fresh GPT-2 small
    assert "random weights" not in r["stdout"]  # a cache hit is not the offline fallback
    assert r["notice"].startswith("[labutils] the cached openai-community/gpt2 is not gpt2's architecture: ")
    assert r["training"] is True  # from_pretrained gives eval mode; load_model must hand back a training model
    assert r["dropout_active"] is True
    assert r["cache_is_none"] is True  # training + checkpointing: transformers returns no KV cache
    assert r["grads"] is True
    assert r["tokenizer"] == "GPT-2 BPE (local hub cache)" and r["hello"] == [15496, 995]


def test_the_fast_keys_load_from_the_hub_cache(hub_cases):
    """The online branch with the fast path's keys: from_pretrained reads the local hub cache, then the vocabulary
    is padded (50257 -> 50304) keeping every checkpoint row (oracle: the cached safetensors file itself), head
    and embedding still tied, the one-kernel GELU in the config, and no padded logit ever the argmax. Breaks if
    padding came before loading (rows lost or resized away), or the keys never reach a pretrained model."""
    r = passed(hub_cases, "loaded twice")["fast"]
    assert r["weights"] == "pretrained" and r["rows"] == 50304 and r["real"] == 50257
    assert r["kept"] and r["tied"] and r["act"] == "gelu_pytorch_tanh" and r["padded_win"] == 0


@pytest.mark.parametrize("how", CORRUPT)
def test_a_corrupt_cached_checkpoint_falls_back_with_the_notice(hub_cases, how):
    """auto: random weights and the usual notice, naming the unreadable file and how to fix it."""
    r = passed(hub_cases, f"auto {how}")
    assert r["weights"] == "random"
    assert "model.safetensors cannot be read (SafetensorError" in r["notice"]
    assert "hf cache rm model/openai-community/gpt2" in r["notice"] and "random weights" in r["notice"]


def one_line_refusal(hub_cases: dict, case: str) -> str:
    r = hub_cases[case]
    assert r.get("rc") == 2, r["stdout"][-2000:] + r["stderr"][-3000:]
    assert "Traceback" not in r["stderr"], r["stderr"][-3000:]
    lines = r["stderr"].strip().splitlines()
    assert len(lines) == 1, r["stderr"]
    return lines[0]


def test_pretrained_true_with_a_corrupt_cached_checkpoint_is_one_line_exit_2(hub_cases):
    line = one_line_refusal(hub_cases, "true corrupt")
    assert line.startswith("error: openai-community/gpt2: model.pretrained = 'true': the cached ")
    assert "cannot be read (SafetensorError" in line and "hf cache rm model/openai-community/gpt2" in line


def test_pretrained_true_offline_is_one_line_exit_2(hub_cases):
    """Nothing cached, no hub: one line naming the checkpoint and the fixes (was a RuntimeError traceback)."""
    line = one_line_refusal(hub_cases, "true offline")
    assert line == ("error: openai-community/gpt2: model.pretrained = 'true': hub unreachable, not in the local "
                    "cache; download it once online, or set model.pretrained to auto (random weights, with a "
                    "notice) or false")


@pytest.mark.parametrize("broken,name", BROKEN_CONFIGS)
def test_a_broken_cached_config_falls_back_naming_it(hub_cases, broken, name):
    repo = HUB_IDS.get(name, TINY_CACHE_ID)
    r = passed(hub_cases, f"auto {broken}-{name}")
    assert r["weights"] == "random", r
    assert f"{repo} is not available (the cached " in r["notice"] and "/config.json cannot be read" in r["notice"]
    assert "model.safetensors cannot be read" not in r["notice"] and "random weights" in r["notice"]


@pytest.mark.parametrize("broken", REFUSED_CONFIGS)
def test_pretrained_true_with_a_broken_cached_config_is_one_line_exit_2(hub_cases, broken):
    line = one_line_refusal(hub_cases, f"true {broken}")
    assert line.startswith("error: openai-community/gpt2: model.pretrained = 'true': the cached ")
    assert "/config.json cannot be read" in line and "hf cache rm model/openai-community/gpt2" in line


def test_a_cached_checkpoint_of_other_sizes_is_said(hub_cases):
    """A whole 3-layer checkpoint cached under tiny's id: trained as it is, and said (it said nothing)."""
    r = passed(hub_cases, "other sizes")
    assert r["weights"] == "pretrained"
    assert r["notice"] == ("[labutils] the cached labutils/gpt2-tiny is not tiny's architecture: (n_layer, n_embd, "
                           "n_head) = (3, 128, 4), tiny is (2, 128, 4); its pretrained weights are used as they are")


def test_cli_run_on_the_hub_cache(hf_home, tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.run(
        [sys.executable, "-m", "labutils", "run", "configs/fp32_config.yaml", "--quiet", "--json", str(out),
         "--set", "model.name=gpt2", "model.pretrained=true", "data.seq_length=32", "data.num_samples=8",
         "train.micro_batch_size=2", "train.steps=2", "train.timing_warmup_steps=1"],
        cwd=REPO, env=offline_env(hf_home, LAB_SMOKE="1"), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["status"] == "ok" and d["env"]["weights"] == "pretrained"
    assert d["env"]["tokenizer"] == "GPT-2 BPE (local hub cache)"
    assert "random weights" not in proc.stdout and "pretrained weights" in proc.stdout
    assert "target tokens/s" in proc.stdout and "SDPA kernel" in proc.stdout
    assert d["parameters"] < 10_000_000  # the cached small checkpoint ran, not 124M random weights
    assert d["config"]["data"]["pack"] is True and d["padding_fraction"] == 0.0
    assert 0 < d["target_tokens_per_second"] <= d["positions_per_second"] == d["tokens_per_second"]


def test_lab03_runs_on_pretrained_weights_from_the_cache(hf_home, tmp_path, monkeypatch):
    """Lab 03's cells, in a real kernel, on weights ``from_pretrained`` read (the stand-in tiny checkpoint): lab 03 is
    where eval mode broke things (its saved-activation accounting and its KV-cache check, which failed). Its cells in
    order up to that check, but for the ones that train through ``lu.run`` (the CLI run above trains on cached weights;
    every cell, random weights: the session's ``regenerate --smoke`` run). Breaks if a cell fails on a pretrained
    model, or the lab records other weights or tokenizer than the cached checkpoint's."""
    from tests.lab_kernel import LabKernel, code_cells, notebook_of

    cells = code_cells(notebook_of("03"))
    upto = next(n for n, (_, src) in enumerate(cells) if "use_cache = True" in src)  # the KV-cache check
    cells = [(i, src) for i, src in cells[:upto + 1] if not any(t in src for t in ("lu.run(", "largest_batch("))]
    for key in ("HF_HUB_CACHE", "TRANSFORMERS_CACHE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(hf_home))  # the kernel's environment is ours (regenerate.kernel_env)
    with LabKernel(tmp_path) as k:
        for i, src in cells:
            r = k.run(src)
            assert r.status == "ok", f"cell {i}: {r.text[-3000:]}"
        r = k.run('import json; print(json.dumps(lu.environment(device, MODE, WEIGHTS)))')  # what the lab records
    assert r.status == "ok", r.text
    env = json.loads(r.text.strip().splitlines()[-1])
    assert env["weights"] == "pretrained"
    assert env["tokenizer"].startswith("byte-level (tiny")
