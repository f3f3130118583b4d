import torch

from labutils.core.data import IGNORE_INDEX, build_dataset, load_documents
from labutils.models.gpt2 import ByteTokenizer, load_model

from conftest import tiny_config


def test_builtin_corpus_is_real_english_offline():
    docs = load_documents("builtin")
    assert len(docs) > 500
    text = " ".join(docs[:200])
    assert text.count(" the ") > 100  # prose, not a synthetic word salad
    lengths = sorted(len(d) for d in docs)
    assert lengths[len(lengths) // 10] < lengths[9 * len(lengths) // 10] / 2  # variable-length documents


def test_padding_gets_ignore_label_and_zero_mask(ragged_corpus):
    cfg = tiny_config(ragged_corpus)
    ds = build_dataset(cfg.data, ByteTokenizer(257))
    assert ds.padding_fraction > 0.3  # the ragged corpus really pads
    pad = ds.attention_mask == 0
    assert (ds.labels[pad] == IGNORE_INDEX).all() and (ds.labels[~pad] != IGNORE_INDEX).all()
    assert ds.targets == (ds.labels[:, 1:] != IGNORE_INDEX).sum(1).tolist()


def test_packing_has_no_padding(ragged_corpus):
    cfg = tiny_config(ragged_corpus, data__pack=True)
    ds = build_dataset(cfg.data, ByteTokenizer(257))
    assert ds.padding_fraction == 0 and all(t == cfg.data.seq_length - 1 for t in ds.targets)


def test_same_seed_same_order_and_split_independent_samples(ragged_corpus):
    cfg = tiny_config(ragged_corpus)
    ds = build_dataset(cfg.data, ByteTokenizer(257))
    a = ds.step_indices(8, seed=3)
    b = ds.step_indices(8, seed=3)
    c = ds.step_indices(8, seed=4)
    steps_a = [next(a) for _ in range(20)]  # 160 samples: crosses epochs of 64
    assert steps_a == [next(b) for _ in range(20)]
    assert steps_a != [next(c) for _ in range(20)]
    for (w1, w2) in zip(ds.windows(8, 1, seed=3), ds.windows(2, 4, seed=3)):
        ids1 = torch.cat([m["input_ids"] for m in w1.micro_batches])
        ids2 = torch.cat([m["input_ids"] for m in w2.micro_batches])
        assert torch.equal(ids1, ids2) and w1.num_targets == w2.num_targets
        assert len(w2.micro_batches) == 4
        break


def test_pad_tokens_never_count_in_the_loss(ragged_corpus):
    """Oracle: the padded batch's loss equals the token-weighted mean of each document alone, unpadded;
    and whatever token ids sit in the padding, loss and gradients do not change."""
    cfg = tiny_config(ragged_corpus)
    ds = build_dataset(cfg.data, ByteTokenizer(257))
    model = load_model(cfg.model, "cpu", seed=0).model.eval()
    batch = ds.batch(list(range(8)))
    n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    loss = model(**batch, num_items_in_batch=n).loss
    total = 0.0
    for i in range(8):
        L = int(batch["attention_mask"][i].sum())
        ids = batch["input_ids"][i:i + 1, :L]
        total += model(input_ids=ids, labels=ids).loss.item() * (L - 1)
    assert abs(loss.item() - total / n) < 1e-5
    loss.backward()
    g1 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    noisy = dict(batch)
    noisy["input_ids"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 97)  # 'a', not EOS
    loss2 = model(**noisy, num_items_in_batch=n).loss
    loss2.backward()
    assert abs(loss.item() - loss2.item()) < 1e-6
    assert all(torch.allclose(a, p.grad, atol=1e-7) for a, p in zip(g1, model.parameters()))


def test_a_step_larger_than_the_dataset_says_each_sample_repeats(capsys):
    """Issue 38 §6: ``data.num_samples=3`` with ``accumulation_steps=100`` (micro-batch 4): each step took 400
    samples from 3, every sample about 133 times a step, and ``lu.run`` said nothing. The oracle: the sampler's own
    indices for one step, counted. Said once a process for the same sizes; a step within the dataset says nothing."""
    from collections import Counter

    import labutils as lu

    cfg = tiny_config(data__num_samples=3, train__micro_batch_size=1, train__accumulation_steps=12, train__steps=1)
    assert lu.run(cfg, "cpu", progress=False, verbose=False, track_memory=False).ok  # the user's path, kept short
    out = capsys.readouterr().out
    ds = build_dataset(cfg.data, ByteTokenizer(257))
    assert sorted(Counter(next(ds.step_indices(12, cfg.train.seed))).values()) == [4, 4, 4]
    assert "12 samples" in out and "dataset of 3" in out and "about 4 times" in out, out
    next(ds.windows(1, 12, 0))                                                    # the same sizes: said already
    next(ds.windows(4, 100, 0))                                                   # the sizes
    assert sorted(Counter(next(ds.step_indices(400, 0))).values()) == [133, 133, 134]
    out = capsys.readouterr().out
    assert out.count("notice") == 1 and "400 samples" in out and "about 133 times" in out, out
    next(build_dataset(tiny_config(data__num_samples=8).data, ByteTokenizer(257)).windows(4, 2, 0))  # 8 of 8
    assert "notice" not in capsys.readouterr().out
