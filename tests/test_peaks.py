"""peak_tflops: the datasheet figures, whole-name matching, and None instead of a guess."""
import pytest

import labutils as lu


@pytest.mark.parametrize("name,precision,expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.5),        # SXM: 1,979 with sparsity on the datasheet
    ("NVIDIA H100 80GB HBM3", "tf32", 494.5),
    ("NVIDIA H100 80GB HBM3", "fp32", 67.0),
    ("NVIDIA H100 PCIe", "bf16", 756.5),
    ("NVIDIA H100 NVL", "fp16", 835.5),
    ("NVIDIA H200", "bf16", 989.5),
    ("NVIDIA A100-SXM4-40GB", "bf16", 312.0),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
    ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
    ("NVIDIA A100-PCIE-40GB", "fp16", 312.0),
    ("Tesla T4", "fp16", 65.0),
    ("Tesla T4", "fp32", 8.1),
    ("Tesla V100-SXM2-16GB", "fp16", 125.0),
    ("Tesla V100-PCIE-32GB", "fp16", 112.0),
    ("NVIDIA A10", "bf16", 125.0),
    ("NVIDIA L4", "bf16", 121.0),
    ("NVIDIA L40S", "bf16", 362.05),
    ("NVIDIA L40", "bf16", 181.05),
    # GeForce: whitepaper tables (FP32 accumulate is half rate on GeForce)
    ("NVIDIA GeForce RTX 2080 Ti", "fp16", 53.8),
    ("NVIDIA GeForce RTX 3090", "fp32", 35.6),
    ("NVIDIA GeForce RTX 3090", "fp16", 71.2),
    ("NVIDIA GeForce RTX 3090", "tf32", 35.6),
    ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
    ("NVIDIA GeForce RTX 4090", "fp32", 82.6),
    ("NVIDIA GeForce RTX 5090", "fp16", 209.5),
])
def test_known_values(name, precision, expected):
    assert lu.peak_tflops(name, precision) == pytest.approx(expected, abs=0.06)


@pytest.mark.parametrize("name,precision", [
    ("Tesla T4", "bf16"), ("Tesla T4", "tf32"),                      # Turing: no BF16, no TF32
    ("Tesla V100-SXM2-32GB", "bf16"), ("Tesla V100-SXM2-32GB", "tf32"),
    ("NVIDIA GeForce RTX 2080 Ti", "bf16"),
    ("NVIDIA Quantum Widget 9000", "fp16"),                          # unknown
    ("NVIDIA A10G", "bf16"),                                         # AWS part, no NVIDIA datasheet: not the A10
    ("NVIDIA H100", "bf16"),                                         # which H100? no guess
    ("NVIDIA GeForce RTX 4090 D", "bf16"),
    (None, "fp32"),                                                  # CPU
])
def test_none_rather_than_a_guess(name, precision):
    assert lu.peak_tflops(name, precision) is None
    assert lu.peak_info(name, precision)[1]  # and a reason


def test_names_match_whole():
    p = lu.peak_tflops
    assert p("NVIDIA GeForce RTX 4060 Ti", "bf16") > p("NVIDIA GeForce RTX 4060", "bf16")
    assert p("NVIDIA GeForce RTX 3080 Ti", "fp32") > p("NVIDIA GeForce RTX 3080", "fp32")
    assert p("NVIDIA GeForce RTX 4080 SUPER", "fp32") > p("NVIDIA GeForce RTX 4080", "fp32")
    assert p("NVIDIA GeForce RTX 4070 Ti SUPER", "fp32") > p("NVIDIA GeForce RTX 4070 Ti", "fp32") > \
        p("NVIDIA GeForce RTX 4070 SUPER", "fp32") > p("NVIDIA GeForce RTX 4070", "fp32")
    sxm, pcie, nvl = (p(n, "bf16") for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL"))
    assert len({sxm, pcie, nvl}) == 3
    assert p("NVIDIA L40S", "bf16") > p("NVIDIA L40", "bf16")  # not read as each other
    assert p("NVIDIA H200 NVL", "bf16") == nvl and p("NVIDIA H200", "bf16") == sxm


def test_laptop_parts_are_upper_bounds_not_the_desktop_card():
    value, source = lu.peak_info("NVIDIA GeForce RTX 3060 Laptop GPU", "fp16")
    assert value is not None and value != lu.peak_tflops("NVIDIA GeForce RTX 3060", "fp16")
    assert "upper bound" in source
    assert lu.peak_tflops("NVIDIA GeForce RTX 4060 Laptop GPU", "bf16") is not None


def test_bad_precision_is_an_error():
    with pytest.raises(ValueError, match="fp32, tf32, fp16, bf16"):
        lu.peak_tflops("Tesla T4", "fp8")
