"""The memory of common GPUs as torch reports it: what ``--gpu-memory-gb G`` models.

A card sold as "8 GB" gives torch less: ``get_device_properties(i).total_memory`` (an OOM message's "X GiB total
capacity") is what the driver leaves, and it moves a little between drivers. The numbers are read from real OOM
messages in public issues (each row names them), never computed; where sources disagree the smallest is kept. Windows
(WDDM) reports the round size and takes the driver's share from free memory; the smaller Linux figure holds on both.
``card_total_bytes(G)``: the smallest total among cards sold as G GB; another G: the nearest card scaled (``rule``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

GiB = 2**30
MAX_GB = 2**20  # GiB (1 PiB): above any card; far beyond it a size in bytes overflows (1e308 GiB)
CUDA_CONTEXT_BYTES = int(0.5 * GiB)   # CUDA context + kernels outside PyTorch's allocator (typical 0.3-0.6 GiB)


@dataclass(frozen=True)
class Card:
    key: str
    name: str
    sold_as_gb: int                  # the size on the box / the cloud's price list
    torch_total_gib: float | None    # "X GiB total capacity" as torch printed it (2 decimals); None: no source
    sources: tuple[str, ...]         # issues quoting that figure (owner/repo#number: what it shows)
    note: str = ""

    @property
    def total_bytes(self) -> int | None:
        """torch's total, to the precision torch prints it (2 decimals of GiB, i.e. within 5.2 MiB)."""
        return None if self.torch_total_gib is None else int(round(self.torch_total_gib * GiB))


CARDS: tuple[Card, ...] = (
    Card("geforce-8gb", "NVIDIA GeForce RTX 3070 (8 GB GeForce: also 3060 Ti, 4060 Ti 8GB)", 8, 7.78,
         ("akshitac8/OW-DETR#46: RTX 3070, '7.78 GiB total capacity'",
          "meta-llama/codellama#82: RTX 3070, 'GPU 0 has a total capacty of 7.78 GiB'",
          "ryujaehun/pytorch-gpu-benchmark#1: an 8 GB card, '7.79 GiB total capacity'"),
         "Linux driver; Windows reports 8.00 GiB and takes the driver's share from free memory"),
    Card("geforce-12gb", "NVIDIA GeForce RTX 3060 12GB (12 GB GeForce: also 4070)", 12, 11.75,
         ("Kunhao-Liu/StyleGaussian#12: RTX 3060, '11.75 GiB total capacity'",
          "smy20011/dreambooth-gui#78: RTX 3060 12GB, '11.75 GiB total capacity'",
          "TencentARC/PhotoMaker#47: RTX 3060 12gb, '11.76 GiB total capacity'")),
    Card("t4", "Tesla T4 (Colab's free GPU)", 16, 14.56,
         ("facebookresearch/tribev2#28: Colab (2026), 'GPU 0 has a total capacity of 14.56 GiB'",
          "Zheng-Chong/CatVTON#133: Tesla T4 on GCP, 'total capacity of 14.56 GiB'",
          "hpcaitech/Open-Sora#697: Colab T4 (2024), 'total capacity of 14.75 GiB'",
          "googlecolab/colabtools#3439: Colab (2023), '14.75 GiB total capacity'"),
         "older drivers report 14.75 GiB; current Colab 14.56 GiB"),
    Card("l4", "NVIDIA L4", 24, None,
         ("lmstudio-ai/lmstudio-bug-tracker#1638: NVIDIA L4, nvidia-smi '23034MiB' (not torch's figure)",
          "modal-labs/modal-client#2797: L4 nvidia-smi 23034MiB"),
         "no torch 'total capacity' for an L4 found yet: nvidia-smi's total is larger than torch's (T4: "
         "15360 MiB vs 14.75 GiB), so it is not used; G = 24 falls back to the scaled rule"),
    Card("a100-40gb", "NVIDIA A100 40GB", 40, 39.50,
         ("TianheWu/CoSeR#10: one A100, 'GPU 0 has a total capacity of 39.50 GiB'",
          "williamyang1991/FRESCO#28: Colab A100 40G, '39.56 GiB total capacity'")),
    Card("a100-80gb", "NVIDIA A100 80GB", 80, 79.25,
         ("HiDream-ai/VAREdit#6: A100, 'GPU 0 has a total capacity of 79.25 GiB'",
          "levihsu/OOTDiffusion#235: A100, '79.25 GiB total capacity'",
          "Instruction-Tuning-with-GPT-4/GPT-4-LLM#16: A100 80G, '79.35 GiB total capacity'")),
    Card("h100-80gb", "NVIDIA H100 80GB HBM3", 80, 79.11,
         ("vllm-project/vllm#27508: NVIDIA H100 80GB HBM3, 'GPU 0 has a total capacity of 79.11 GiB'",)),
)

BY_KEY = {c.key: c for c in CARDS}


def card_total_bytes(gb: float) -> tuple[int, str]:
    """(bytes torch would report on a card sold as ``gb`` GB, the rule that gave it): the table's smallest total among
    cards sold as ``gb`` GB ("80" -> the H100's 79.11 GiB), else the nearest card with a torch figure, scaled."""
    if not gb > 0:
        raise ValueError(f"a card size must be > 0 GB, got {gb!r}")
    known = [c for c in CARDS if c.total_bytes is not None]
    same = [c for c in known if c.sold_as_gb == gb]
    if same:
        c = min(same, key=lambda c: c.total_bytes)
        return c.total_bytes, f"card table: {c.key} reports {c.torch_total_gib:.2f} GiB to torch ({c.sources[0].split(':')[0]})"
    c = min(known, key=lambda c: (abs(c.sold_as_gb - gb), c.sold_as_gb))
    total = int(c.total_bytes * gb / c.sold_as_gb)
    if total <= CUDA_CONTEXT_BYTES:  # not even the CUDA context fits: every budget check would be negative
        raise ValueError(f"a {gb:g} GB card gives torch {total / GiB:.2f} GiB, not more than the CUDA context "
                         f"({CUDA_CONTEXT_BYTES / GiB:.2f} GiB): a card must be over "
                         f"{CUDA_CONTEXT_BYTES * c.sold_as_gb / c.total_bytes:.2f} GB")
    return total, (f"no {gb:g} GB card in the table: {c.key}'s {c.torch_total_gib:.2f} GiB scaled by "
                   f"{gb:g}/{c.sold_as_gb} = {total / GiB:.2f} GiB")


def card_gb(value: float, name: str) -> float | None:
    """The one rule for a card size (``--gpu-memory-gb`` and ``LAB_GPU_MEMORY_GB``, every command, GPU or CPU): GiB
    from 0 to :data:`MAX_GB`, 0 = no cap (None); a card too small for the CUDA context is refused as the estimator
    refuses it. ValueError naming ``name`` and the allowed values."""
    if not 0 <= value <= MAX_GB:
        raise ValueError(f"{name} = {value!r}: must be a number of GiB from 0 to {MAX_GB} (the card to behave like, "
                         f"e.g. 8; 0 or unset = no cap)")
    if not value:
        return None
    try:
        card_total_bytes(value)
    except ValueError as exc:
        raise ValueError(f"{name} = {value:g}: {exc}") from None
    return value


def budget_from_env() -> float | None:
    """``LAB_GPU_MEMORY_GB``, the card every lab and command behaves like, by :func:`card_gb`'s rule; None (no cap:
    the whole card) when unset, empty or 0; else ValueError naming the variable."""
    raw = os.environ.get("LAB_GPU_MEMORY_GB", "").strip()
    try:
        gb = float(raw or 0)
    except ValueError:
        raise ValueError(f"LAB_GPU_MEMORY_GB = {raw[:40]!r}: must be a number of GiB from 0 to {MAX_GB} (the card "
                         f"to behave like, e.g. 8; 0 or unset = no cap)") from None
    return card_gb(gb, "LAB_GPU_MEMORY_GB")
