"""Issue 43, the commands' half: on the H200 the doctor trained configs/fast_config.yaml 4 x 4 under the 8 GB cap and
bench 16 x 1 on the whole card: two compiles, two ratios for what is one comparison. Now regenerate hands both the
same card (regenerate.command_env), and both fit the file's micro-batch by one rule (train.for_this_card over
advise.default_budget_bytes) and say which budget. Under the pretend GPU (tests/fake_cuda.py): the doctor's check and
`python -m labutils bench` through the real CLI, with only the timed runs stood in for (no kernels to time)."""
from __future__ import annotations

import importlib
import json

import pytest

import labutils.tools.bench as bench
from labutils.tools import cli
from labutils.tools import doctor_speed as ds
from labutils.tools import command_parts, regenerate as rg
from tests.test_doctor_checks import CUDA0, FAST, _fake_run, pretend, rows

tr = importlib.import_module("labutils.core.train")


@pytest.mark.parametrize("profile,cap", [("h100", "8"), ("h100", None), ("rtx3070-8gb", None)])
def test_doctor_and_bench_train_the_same_micro_batch_under_one_budget(monkeypatch, capsys, tmp_path, profile, cap):
    """The same card and budget: the doctor's fast path and bench's headline section train the same micro-batch x
    accumulation, and both name the budget they fitted it to. Breaks if either fits to another budget, or the doctor
    fits its shortened copy of the file instead of the file bench fits."""
    pretend(monkeypatch, profile)
    monkeypatch.delenv("LAB_SMOKE", raising=False)
    if cap:
        monkeypatch.setenv("LAB_GPU_MEMORY_GB", cap)
    seen, compared = [], []
    monkeypatch.setattr(tr, "run", _fake_run(seen, 0.3))

    def compare(cfg, repeats, device, warmup):  # bench's timed runs, with chosen step times
        compared.append(cfg)
        return {side: {"status": "ok", "error": None, "step_time_seconds": [0.03] * repeats,
                       "timed_steps": [cfg.train.steps - warmup] * repeats, "num_alloc_retries": [0] * repeats,
                       "compiled_graphs": [2] * repeats, "compile_fallback": [None] * repeats}
                for side in bench.SIDES}
    monkeypatch.setattr(bench, "compare", compare)
    doctor_row = rows(ds.check_fast_path, CUDA0)[FAST]
    doctor_cfg, compared[:] = seen[0], []   # the doctor's own reference ratio also ran compare: only bench's now
    out = tmp_path / "bench.json"
    assert cli.main(["bench", str(ds.FAST_CONFIG), "--repeats", "1", "--json", str(out)]) == 0
    printed, got = capsys.readouterr().out, json.loads(out.read_text(encoding="utf-8"))
    shape = lambda c: (c.train.micro_batch_size, c.train.accumulation_steps)  # noqa: E731
    assert shape(compared[0]) == shape(doctor_cfg), (shape(compared[0]), shape(doctor_cfg))
    assert got["compiled"]["train"]["micro_batch_size"] == doctor_cfg.train.micro_batch_size
    where = got["budget"]["where"]
    assert f"micro-batch fitted to {where}" in printed and f"micro-batch fitted to {where}" in doctor_row["detail"]
    if profile == "rtx3070-8gb" or cap:  # an 8 GB card, real or behaved like: the 4 x 4, not 16 x 1
        assert ("8 GB card" if cap else "RTX 3070") in where and shape(doctor_cfg)[0] < 16
    else:
        assert shape(doctor_cfg) == (16, 1)


def test_regenerate_hands_the_doctor_and_the_bench_the_same_card(monkeypatch, tmp_path):
    """regenerate's doctor ran with LAB_GPU_MEMORY_GB=8 and its bench with whatever the shell had (usually none): the
    two subprocesses now get one environment. Breaks if either is built apart again."""
    envs = {}

    def fake_child(argv, env):  # python -m labutils ARGV as a child process
        envs["doctor" if "doctor" in argv else "bench"] = dict(env)
        return 0
    monkeypatch.setattr(command_parts, "_child", fake_child)
    monkeypatch.delenv("LAB_GPU_MEMORY_GB", raising=False)
    assert rg.run_doctor_first(tmp_path, 8) == 0
    rg.run_bench(tmp_path, 1, 8)
    assert envs["doctor"].get("LAB_GPU_MEMORY_GB") == envs["bench"].get("LAB_GPU_MEMORY_GB") == "8"
