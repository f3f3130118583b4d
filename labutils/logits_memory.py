"""Lab 04: the logits' share of a training step's peak memory, with the full loss and with the chunked loss.

:func:`logits_share_rows` trains a config twice through the one training loop (``lu.run``: forward, backward,
optimizer), once with ``model.loss: full`` and once with ``model.loss: chunked``, under the memory tracker, and
returns one row per side: the measured peak, the largest logits tensor each loss holds (the whole ``[B, T, V]``
fp32 logits; one chunk of them) and its share of that peak, and what the chunked loss took off the peak.
"""
from __future__ import annotations

from .loss_chunks import DEFAULT_CHUNK
from .memory import fmt_bytes
from .models import padded_vocab_size, vocab_size
from .train import run


def logits_share_rows(cfg, device=None, chunk_size: int | None = None, verbose: bool = True,
                      progress: bool = False) -> list[dict]:
    """Train ``cfg`` once with each loss (``full``, then ``chunked`` with ``chunk_size`` positions a chunk; None:
    the config's ``model.loss_chunk_size``) and return ``[full_row, chunked_row]``.

    Each row: ``loss``, ``chunk_size`` (None for full), ``status``, ``peak_bytes`` (the tracker's peak: CUDA's
    ``max_memory_allocated``, on the CPU live tensor bytes), ``start_bytes``, ``logits_bytes`` (one fp32 ``[B, T, V]``
    tensor of a micro-batch, V the head's rows: what the full loss materialises, two to three times over),
    ``largest_logits_bytes`` (full: ``logits_bytes``; chunked: one chunk, ``min(chunk, B*T) * V * 4``),
    ``logits_share`` (``logits_bytes / peak_bytes``), ``largest_logits_share``, ``saved_bytes`` (full peak minus
    this row's peak: 0 for full), ``saved_logits`` (``saved_bytes / logits_bytes``), ``final_loss``, ``error``.
    With ``verbose`` one line per row is printed from those numbers."""
    rows = []
    chunk = int(chunk_size or cfg.model.loss_chunk_size or DEFAULT_CHUNK)
    positions = cfg.train.micro_batch_size * cfg.data.seq_length
    vocab = padded_vocab_size(vocab_size(cfg.model.name), cfg.model.pad_vocab_to)
    logits = 4 * positions * vocab
    for loss in ("full", "chunked"):
        c = cfg.override({"model.loss": loss, "model.loss_chunk_size": chunk})
        res = run(c, device, progress=progress, verbose=False, desc=f"loss {loss}")
        largest = logits if loss == "full" else 4 * min(chunk, positions) * vocab
        peak = res.peak_memory_bytes
        row = {"loss": loss, "chunk_size": chunk if loss == "chunked" else None, "status": res.status,
               "peak_bytes": peak, "start_bytes": res.memory.get("start_bytes"), "logits_bytes": logits,
               "largest_logits_bytes": largest, "logits_share": logits / peak if peak else None,
               "largest_logits_share": largest / peak if peak else None,
               "final_loss": res.losses[-1] if res.losses else None, "error": res.error}
        rows.append(row)
    full_peak = rows[0]["peak_bytes"]
    for row in rows:
        ok = full_peak is not None and row["peak_bytes"] is not None
        row["saved_bytes"] = full_peak - row["peak_bytes"] if ok else None
        row["saved_logits"] = row["saved_bytes"] / logits if ok else None
    if verbose:
        for row in rows:
            print(_line(row, positions))
    return rows


def _line(row: dict, positions: int) -> str:
    if row["peak_bytes"] is None:
        return f"loss {row['loss']:<8} {row['status']}: no peak measured ({row['error']})"
    what = (f"whole logits {fmt_bytes(row['largest_logits_bytes'])} (fp32 [{positions} positions, V])"
            if row["loss"] == "full" else
            f"largest logits {fmt_bytes(row['largest_logits_bytes'])} (one chunk of "
            f"{min(row['chunk_size'], positions)} positions)")
    line = (f"loss {row['loss']:<8} peak {fmt_bytes(row['peak_bytes'])}; {what} = "
            f"{100 * row['largest_logits_share']:.1f} % of the peak")
    if row["loss"] != "full" and row["saved_bytes"] is not None:
        way = "lower" if row["saved_bytes"] >= 0 else "higher"
        line += (f"; peak {way} by {fmt_bytes(abs(row['saved_bytes']))} = {abs(row['saved_logits']):.2f} x the "
                 f"whole logits ({fmt_bytes(row['logits_bytes'])}) than with the full loss")
    return line
