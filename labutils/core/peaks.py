"""Dense peak TFLOP/s of NVIDIA GPUs per precision, from the vendor's datasheets: the denominator of MFU.

``peak_tflops(gpu_name, precision)`` takes the name ``torch.cuda.get_device_name`` returns and a lab precision:
fp32 (CUDA cores, TF32 off), tf32 (TF32 tensor cores), fp16 / bf16 (tensor cores, FP32 accumulate: autocast's matmuls;
half rate on GeForce cards). Dense figures only. ``None`` when the card lacks the format (V100, T4, Turing GeForce: no
BF16 or TF32) or is not in the table: never a guess. Names are matched whole after dropping "NVIDIA", "GeForce",
"Tesla" and separators, so "RTX 4060 Ti" is never read as "RTX 4060", "H100 NVL" never as the SXM part, "A10G" as "A10".
Datacenter cards: each datasheet's figures. GeForce cards: CUDA cores x boost clock x FLOPs per core and clock from
the architecture whitepapers (:data:`PER_CORE_CLOCK`); GPU Boost may run a card above that clock. Laptop parts: the
top of NVIDIA's boost-clock range, so the peak is an upper bound for that chip and its MFU a lower bound.
"""
from __future__ import annotations

import re

from .precisions import get


def _dc(fp32, tf32, fp16, bf16, source):
    return {"fp32": fp32, "tf32": tf32, "fp16": fp16, "bf16": bf16, "source": source}


# Datacenter: (pattern matched whole against the normalised name, dense TFLOP/s, source).
V100 = "NVIDIA V100 datasheet (2020): FP32 / tensor (FP16, FP32 accumulate) TFLOP/s; no BF16, no TF32"
A100 = "NVIDIA A100 datasheet (2021): FP32 19.5, TF32 156, BF16 312, FP16 312 (SXM4 and PCIe, 40 and 80 GB)"
H100 = "NVIDIA H100 datasheet (2023; TF32/BF16/FP16 printed with sparsity, halved here)"
H200 = "NVIDIA H200 datasheet (2024; TF32/BF16/FP16 printed with sparsity, halved here)"
DATACENTER = [
    (r"v100 sxm2 (16|32)gb", _dc(15.7, None, 125.0, None, V100 + ", SXM2")),
    (r"v100 pcie (16|32)gb", _dc(14.0, None, 112.0, None, V100 + ", PCIe")),
    (r"v100s pcie 32gb", _dc(16.4, None, 130.0, None, V100 + ", V100S PCIe")),
    (r"t4", _dc(8.1, None, 65.0, None, "NVIDIA T4 datasheet: FP32 8.1, mixed FP16/FP32 65 TFLOP/s; no BF16, no TF32")),
    (r"a10", _dc(31.2, 62.5, 125.0, 125.0, "NVIDIA A10 datasheet (2021): FP32 31.2, TF32 62.5, BF16 125, FP16 125")),
    (r"a30", _dc(10.3, 82.0, 165.0, 165.0, "NVIDIA A30 datasheet (2021): FP32 10.3, TF32 82, BF16 165, FP16 165")),
    (r"a40", _dc(37.4, 74.8, 149.7, 149.7, "NVIDIA A40 datasheet (2021): FP32 37.4, TF32 74.8, BF16/FP16 149.7")),
    (r"a100 (sxm4?|pcie) (40|80)gb|a100 (40|80)gb (pcie|sxm4?)", _dc(19.5, 156.0, 312.0, 312.0, A100)),
    (r"l4", _dc(30.3, 60.0, 121.0, 121.0, "NVIDIA L4 datasheet (2023): FP32 30.3, TF32 120*, BF16/FP16 242* "
                                          "(* with sparsity, halved here)")),
    (r"l40", _dc(90.5, 90.5, 181.05, 181.05, "NVIDIA L40 datasheet (2022): FP32 90.5, TF32 90.5, "
                                               "BF16/FP16 with FP32 accumulate 181.05 (dense)")),
    (r"l40s", _dc(91.6, 183.0, 362.05, 362.05, "NVIDIA L40S datasheet (2023): FP32 91.6, TF32 183, "
                                                 "BF16/FP16 362.05 (dense)")),
    (r"h100 (sxm5? )?80gb( hbm3)?", _dc(67.0, 494.5, 989.5, 989.5, H100 + ", SXM: FP32 67, TF32 989*, BF16/FP16 1,979*")),
    (r"h100 (80gb )?pcie( 80gb)?", _dc(51.0, 378.0, 756.5, 756.5, H100 + ", PCIe: FP32 51, TF32 756*, BF16/FP16 1,513*")),
    (r"h100 nvl", _dc(60.0, 417.5, 835.5, 835.5, H100 + ", NVL: FP32 60, TF32 835*, BF16/FP16 1,671*")),
    (r"h200( sxm)?( 141gb)?( hbm3e)?", _dc(67.0, 494.5, 989.5, 989.5, H200 + ", SXM: FP32 67, TF32 989*, BF16/FP16 1,979*")),
    (r"h200 nvl", _dc(60.0, 417.5, 835.5, 835.5, H200 + ", NVL: FP32 60, TF32 835*, BF16/FP16 1,671*")),
]

# FLOPs per CUDA core per clock (dense), GeForce parts: NVIDIA's Turing (2018), Ampere GA102 (2020), Ada (2022)
# and RTX Blackwell (2025) architecture whitepapers' tables of peak TFLOP/s per card.
PER_CORE_CLOCK = {
    "turing": {"fp32": 2, "tf32": None, "fp16": 8, "bf16": None},
    "ampere": {"fp32": 2, "tf32": 2, "fp16": 4, "bf16": 4},
    "ada": {"fp32": 2, "tf32": 2, "fp16": 4, "bf16": 4},
    "blackwell": {"fp32": 2, "tf32": 2, "fp16": 4, "bf16": 4},
}

# GeForce: normalised name -> (architecture, CUDA cores, boost clock MHz) from NVIDIA's product spec pages
# (reference boost clock; laptops: top of the published range). RTX 3080 is the 10 GB card (8704 cores): the
# 12 GB card (8960 cores) reports the same name, so its MFU reads 3 % high.
GEFORCE = {
    # RTX 20 series (Turing): geforce.com/hardware/graphics-cards, reference boost clocks
    "rtx 2080 ti": ("turing", 4352, 1545), "rtx 2080 super": ("turing", 3072, 1815),
    "rtx 2080": ("turing", 2944, 1710), "rtx 2070 super": ("turing", 2560, 1770),
    "rtx 2070": ("turing", 2304, 1620), "rtx 2060 super": ("turing", 2176, 1650),
    "rtx 2060": ("turing", 1920, 1680),
    # RTX 30 series (Ampere GA10x)
    "rtx 3090 ti": ("ampere", 10752, 1860), "rtx 3090": ("ampere", 10496, 1695),
    "rtx 3080 ti": ("ampere", 10240, 1665), "rtx 3080": ("ampere", 8704, 1710),
    "rtx 3070 ti": ("ampere", 6144, 1770), "rtx 3070": ("ampere", 5888, 1725),
    "rtx 3060 ti": ("ampere", 4864, 1665), "rtx 3060": ("ampere", 3584, 1777),
    # RTX 40 series (Ada)
    "rtx 4090": ("ada", 16384, 2520), "rtx 4080 super": ("ada", 10240, 2550), "rtx 4080": ("ada", 9728, 2505),
    "rtx 4070 ti super": ("ada", 8448, 2610), "rtx 4070 ti": ("ada", 7680, 2610),
    "rtx 4070 super": ("ada", 7168, 2475), "rtx 4070": ("ada", 5888, 2475),
    "rtx 4060 ti": ("ada", 4352, 2535), "rtx 4060": ("ada", 3072, 2460),
    # RTX 50 series (Blackwell)
    "rtx 5090": ("blackwell", 21760, 2407), "rtx 5080": ("blackwell", 10752, 2617),
    "rtx 5070 ti": ("blackwell", 8960, 2452), "rtx 5070": ("blackwell", 6144, 2512),
    # Laptop GPUs: top of NVIDIA's boost-clock range (the laptop maker's power limit picks the real clock)
    "rtx 3060 laptop gpu": ("ampere", 3840, 1703), "rtx 3070 laptop gpu": ("ampere", 5120, 1620),
    "rtx 3080 laptop gpu": ("ampere", 6144, 1710),
    "rtx 4050 laptop gpu": ("ada", 2560, 2370), "rtx 4060 laptop gpu": ("ada", 3072, 2370),
    "rtx 4070 laptop gpu": ("ada", 4608, 2175), "rtx 4080 laptop gpu": ("ada", 7424, 2280),
    "rtx 4090 laptop gpu": ("ada", 9728, 2040),
}


def normalise(gpu_name: str) -> str:
    """'NVIDIA GeForce RTX 4060 Ti' -> 'rtx 4060 ti'; 'NVIDIA A100-SXM4-40GB' -> 'a100 sxm4 40gb'."""
    s = re.sub(r"[-_/]+", " ", gpu_name.lower())
    s = re.sub(r"\b(nvidia|geforce|tesla)\b", " ", s)
    return " ".join(s.split())


def peak_info(gpu_name: str | None, precision: str) -> tuple[float | None, str]:
    """(dense peak TFLOP/s or None, where it comes from or why there is none)."""
    column = get(precision).peak  # a ValueError naming the allowed ones
    if not gpu_name:
        return None, "no GPU: MFU is defined against a GPU's peak"
    name = normalise(gpu_name)
    for pattern, row in DATACENTER:
        if re.fullmatch(pattern, name):
            value = row[column]
            return value, (row["source"] if value is not None else f"{gpu_name} has no {precision} tensor cores "
                                                                     f"({row['source']})")
    if name in GEFORCE:
        arch, cores, mhz = GEFORCE[name]
        rate = PER_CORE_CLOCK[arch][column]
        if rate is None:
            return None, f"{gpu_name} ({arch}) has no {precision} tensor cores"
        laptop = "laptop" in name
        return round(cores * mhz * 1e6 * rate / 1e12, 1), (
            f"{cores} CUDA cores x {'top of the boost-clock range ' if laptop else 'boost clock '}{mhz} MHz x "
            f"{rate} FLOP/core/clock ({arch} whitepaper" + (", GeForce: FP32 accumulate at half rate"
                                                            if get(precision).amp else "") + ")"
            + ("; an upper bound for this chip, so MFU is a lower bound" if laptop else ""))
    return None, f"{gpu_name!r} is not in labutils' peak table: no MFU rather than a guessed peak"


def peak_tflops(gpu_name: str | None, precision: str) -> float | None:
    """Dense peak TFLOP/s of ``gpu_name`` (as ``torch.cuda.get_device_name`` returns it) in ``precision``;
    None on CPU, for a format the card lacks, or a card not in the table."""
    return peak_info(gpu_name, precision)[0]
