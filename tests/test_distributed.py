"""Beyond one GPU: the same loop under torch.distributed (gloo, 2 CPU processes) and the engine configs."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from labutils.core.distributed import zero_bytes_per_gpu


def _run(root, tmp_path, name, launcher, sets, extra_env=None):
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "LAB_SMOKE": "1", "OMP_NUM_THREADS": "1", **(extra_env or {})}
    proc = subprocess.run([*launcher, "-m", "labutils", "run", "configs/fp32_config.yaml", "--quiet",
                           "--json", str(out), "--set", *sets], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def test_two_process_ddp_matches_single_process_on_padded_data(root, tmp_path, ragged_corpus):
    common = ["model.dropout=0.0", f"data.corpus={ragged_corpus}", "data.seq_length=48", "train.steps=4",
              "train.micro_batch_size=2", "train.warmup_steps=0"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517"]
    proc, ddp = _run(root, tmp_path, "ddp", torchrun, common + ["train.accumulation_steps=2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc1, single = _run(root, tmp_path, "single", [sys.executable], common + ["train.accumulation_steps=4"])
    assert proc1.returncode == 0, proc1.stderr[-3000:]
    assert ddp["env"]["world_size"] == 2 and "MULTI_CPU" in ddp["env"]["distributed_type"]
    assert ddp["effective_batch_size"] == single["effective_batch_size"] == 8
    rel = max(abs(a - b) / abs(b) for a, b in zip(ddp["losses"], single["losses"]))
    assert len(ddp["losses"]) == 4 and rel < 1e-5, (ddp["losses"], single["losses"])
    assert proc.stdout.count("wrote") == 1  # only rank 0 reports


def test_deepspeed_requested_but_missing_is_a_clear_error(root, tmp_path):
    pytest.importorskip("accelerate")
    if __import__("importlib").util.find_spec("deepspeed") is not None:
        pytest.skip("deepspeed is installed here: the missing-package error cannot happen")
    proc, _ = _run(root, tmp_path, "ds", [sys.executable], ["train.steps=1"],
                   {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": "no"})
    assert proc.returncode == 2
    assert "deepspeed package is not installed" in proc.stderr and "Traceback" not in proc.stderr


def test_fsdp_on_cpu_refuses_instead_of_silently_running_ddp(root, tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29518"]
    proc, _ = _run(root, tmp_path, "fsdp", torchrun, ["train.steps=1"],
                   {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"})
    assert proc.returncode != 0
    assert "FSDP" in proc.stderr and "torchrun" in proc.stderr


ACCEL = ["ddp", "fsdp", "deepspeed_zero1", "deepspeed_zero2_offload", "deepspeed_zero3"]


@pytest.mark.parametrize("name", ACCEL)
def test_accelerate_configs_are_valid(root, name):
    from accelerate.commands.config.config_args import load_config_from_file

    path = root / "configs" / "accelerate" / f"{name}.yaml"
    raw = yaml.safe_load(path.read_text())
    cfg = load_config_from_file(str(path))  # accelerate's own parser accepts it
    assert cfg.distributed_type.name == raw["distributed_type"]
    if raw["distributed_type"] == "DEEPSPEED":
        ds_path = root / raw["deepspeed_config"]["deepspeed_config_file"]
        ds = json.loads(ds_path.read_text())
        stage = ds["zero_optimization"]["stage"]
        assert stage == {"deepspeed_zero1": 1, "deepspeed_zero2_offload": 2, "deepspeed_zero3": 3}[name]
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                    "gradient_clipping"):
            assert ds[key] == "auto", key  # tied to the YAML config, never typed twice
        assert ds["fp16"]["enabled"] == "auto" and ds["bf16"]["enabled"] == "auto"
        assert ds["optimizer"]["params"]["lr"] == "auto"
        if stage < 3:
            assert "offload_param" not in ds["zero_optimization"]  # parameter offload exists only in ZeRO-3
        assert ("offload_optimizer" in ds["zero_optimization"]) == name.endswith("offload")


def test_zero_accounting_matches_the_papers_2p_2p_12p():
    P = 1_000_000
    assert zero_bytes_per_gpu(P, 0, 1)["total"] == 16 * P
    assert zero_bytes_per_gpu(P, 1, 4)["total"] == 2 * P + 2 * P + 12 * P // 4
    assert zero_bytes_per_gpu(P, 2, 4)["total"] == 2 * P + (2 * P + 12 * P) // 4
    assert zero_bytes_per_gpu(P, 3, 4)["total"] == 16 * P // 4
    off = zero_bytes_per_gpu(P, 2, 1, offload_optimizer=True)
    assert off["total"] == 4 * P and off["cpu_optimizer"] == 12 * P


def test_estimate_prints_the_zero_table_per_gpu(root, tmp_path):
    out = tmp_path / "est.json"
    proc = subprocess.run([sys.executable, "-m", "labutils", "estimate", "configs/optimized_config.yaml", "--gpus", "4",
                           "--json", str(out)], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ZeRO-3" in proc.stdout and "4 GPU" in proc.stdout
    rows = {r["setup"]: r for r in json.loads(out.read_text())["zero_per_gpu"]}
    assert rows["ZeRO-3"]["4 GPU"] < rows["ZeRO-2"]["4 GPU"] < rows["ZeRO-1"]["4 GPU"] < rows["DDP (no ZeRO)"]["4 GPU"]
    assert rows["DDP (no ZeRO)"]["1 GPU"] == rows["ZeRO-3"]["1 GPU"]  # nothing to shard on one GPU
