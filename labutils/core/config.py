"""Configuration: YAML file -> typed dataclasses, with mode defaults and ``--set`` overrides.

Order of precedence (later wins): dataclass defaults < YAML file < mode defaults (smoke: the caps, then the
file's own ``smoke:`` section of "section.name": value) < explicit overrides. Every problem raises
:class:`ConfigError` with one line naming the file, key, value and what is allowed; the CLI turns it into exit code 2.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
import numbers
import os
import re
import reprlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from .precisions import NAMES

MODEL_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "tiny", "tiny-deep")  # labutils.models.spec.PRESETS
PRETRAINED = ("auto", "true", "false")
ATTENTION = ("sdpa", "eager", "sdpa_causal")  # sdpa_causal: causal SDPA without a mask (labutils.models.gpt2.CAUSAL_SDPA)
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # the same tanh GELU: ~9 elementwise ops, or one fused kernel
LOSSES = ("full", "chunked")  # chunked: the logits never whole (labutils.models.loss_chunks)
MAX_LOSS_CHUNK = 2**20
MAX_COMPILED_CHUNKS = 16  # under train.compile each loss chunk is unrolled into the graph: more compile for minutes
PAD_VOCAB_TO = (64, 128)  # or null: the vocabulary rounded up to a multiple of this, padded logits masked
MAX_POSITIONS = 1024  # GPT-2's learned position table
MAX_SEED = 2**32 - 1  # numpy.random.seed's limit (torch accepts more)
MAX_DATASET_TOKENS = 2**24  # num_samples x seq_length: the tokenised dataset is held in memory (3 int64 tensors)
MAX_EFFECTIVE_BATCH = 2**16  # micro_batch_size x accumulation_steps: sequences per optimizer step
SHOWN_CHARS = 80  # at most this much of a bad value (or key) is quoted in a message


class _Short(reprlib.Repr):
    """A bounded repr: a value built by YAML aliases can be huge when expanded; only its start is shown."""

    def __init__(self):
        super().__init__()
        self.maxlevel, self.maxdict, self.maxlist, self.maxtuple, self.maxset = 2, 3, 4, 4, 4
        self.maxstring = self.maxother = self.maxlong = SHOWN_CHARS


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` cut to about ``limit`` characters, whatever the value's size."""
    text = _Short().repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class ConfigError(ValueError):
    """A bad configuration: one line, names the file, key, value and what is allowed."""

    def __init__(self, source: str, key: str | None, value: Any, allowed: str):
        self.source, self.key, self.value, self.allowed = source, key, value, allowed
        key = key if key is None or len(key) <= SHOWN_CHARS else shown(key)
        where = f"{source}: {key}" if key else source
        quoted = "" if value is _MISSING else f" = {shown(value)}"
        super().__init__(f"{where}{quoted}: {allowed}")


_MISSING = object()


@dataclass
class ModelConfig:
    name: str = "gpt2"
    pretrained: str = "auto"
    dropout: float | None = None
    attn_implementation: str = "sdpa"
    # Defaults keep the labs' model exactly GPT-2 as published (and what lab 04 profiles): gelu_new, 50257 rows.
    activation: str = "gelu_new"         # gelu_new | gelu_pytorch_tanh (same maths, one kernel)
    pad_vocab_to: int | None = None      # null | 64 | 128: 50257 -> 50304 (64); padded logits are masked out
    loss: str = "full"                   # full | chunked (the logits never whole: labutils.models.loss_chunks)
    loss_chunk_size: int | None = None   # chunked: positions per chunk; unset: sized by memory (advise.fit_loss_chunk)


@dataclass
class DataConfig:
    corpus: str = "builtin"
    seq_length: int = 128
    num_samples: int = 512
    pack: bool = False


@dataclass
class TrainConfig:
    steps: int = 50
    micro_batch_size: int = 4
    accumulation_steps: int = 1
    precision: str = "fp32"
    gradient_checkpointing: bool = False
    checkpoint_every_n_layers: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.01
    warmup_steps: int = 0
    max_grad_norm: float | None = 1.0
    seed: int = 42
    timing_warmup_steps: int = 2
    compile: bool = False  # torch.compile the model before training (first steps compile: keep them in the warm-up)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mode: str = "full"  # set by load_config: "full" or "smoke"; not a YAML key
    source: str = "<defaults>"
    # where each explicitly set key came from ("--set", "override"), so a message names it, not the file
    origins: dict = field(default_factory=dict, repr=False, compare=False)
    # every key's value when validate() last passed: a value that differs was set in code since (a notebook cell's
    # `cfg.train.precision = "FP16"`), so a message names that, not the file
    validated: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def effective_batch_size(self) -> int:
        return self.train.micro_batch_size * self.train.accumulation_steps

    def to_dict(self) -> dict:
        return {s: dataclasses.asdict(getattr(self, s)) for s in SECTIONS}

    def override(self, overrides: Mapping[str, Any] | Iterable[str] | None = None, **kw) -> "Config":
        """A validated copy with explicit overrides: ``cfg.override({"train.precision": "bf16"})``,
        ``cfg.override(["train.steps=3"])`` or ``cfg.override(train__steps=3)``."""
        new = dataclasses.replace(self, model=copy.copy(self.model), data=copy.copy(self.data),  # a typo set in
                                  train=copy.copy(self.train), origins=dict(self.origins),  # code comes too
                                  validated=dict(self.validated))
        items = _override_items(overrides, source="override")
        items += [(k.replace("__", "."), v) for k, v in kw.items()]
        for key, value in items:
            _assign(new, key, value, "override")
        validate(new)
        return new


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}

# Smoke mode: the tiny model, short sequences, few steps, so every lab runs on a 2-core CPU in seconds.
# Values are caps (min with the file's value), except the model name; explicit overrides still win.
SMOKE_CAPS = {"data.seq_length": 64, "data.num_samples": 64, "train.steps": 4,
              "train.micro_batch_size": 4, "train.warmup_steps": 1, "train.timing_warmup_steps": 1}


def _coerce(source: str, key: str, value: Any, f: dataclasses.Field):
    """Check a value against the field's declared type; YAML already typed it."""
    optional = "None" in str(f.type)
    base = str(f.type).replace(" | None", "")
    if value is None:
        if optional:
            return None
        raise ConfigError(source, key, value, f"must not be null; expected {base.replace('str', 'a string')}")
    if base == "bool":
        if isinstance(value, bool):
            return value
        raise ConfigError(source, key, value, "must be true or false")
    if base == "int":
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # numpy integers too (code)
            return int(value)
        raise ConfigError(source, key, value, "must be an integer")
    if base == "float":
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(source, key, value, "must be a number") from None
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:  # an integer too large for a float
                raise ConfigError(source, key, value, "must be a finite number") from None
            if not math.isfinite(value):  # nan, inf, .inf pass every range check: refuse them here
                raise ConfigError(source, key, value, "must be a finite number" + (" or null" if optional else ""))
            return value
        raise ConfigError(source, key, value, "must be a number" + (" or null" if optional else ""))
    if base == "str":
        if key == "model.pretrained" and isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, str):
            return value
        raise ConfigError(source, key, value, "must be a string")
    raise AssertionError(f"unhandled field type {f.type}")  # pragma: no cover


def _assign(cfg: Config, key: str, value: Any, source: str) -> None:
    parts = key.split(".")
    if len(parts) != 2 or parts[0] not in SECTIONS:
        raise ConfigError(source, key, value, f"unknown key; keys are <section>.<name> with section one of "
                                               f"{', '.join(SECTIONS)}")
    section, name = parts
    flds = {f.name: f for f in fields(SECTIONS[section])}
    if name not in flds:
        raise ConfigError(source, key, value, f"unknown key; allowed in '{section}': {', '.join(flds)}")
    setattr(_section(cfg, section), name, _coerce(source, key, value, flds[name]))
    if source != cfg.source:
        cfg.origins[key] = source
        cfg.validated.pop(key, None)  # now the source's value, not one code changed


def _is_file(path: str) -> bool:
    try:
        return Path(path).is_file()
    except (OSError, ValueError):  # a name too long, a NUL byte
        return False


def _flat(cfg: Config) -> dict:
    return {f"{s}.{k}": v for s, c in SECTIONS.items() if type(getattr(cfg, s)) is c
            for k, v in vars(getattr(cfg, s)).items()}


def source_of(cfg: Config, key: str) -> str:
    """What set ``key`` (a message names it): code, when the value differs from the one the last validation saw
    (or the key or section is new since: a typo, ``cfg.train = None``); else "--set" / "override" for what those
    set, "smoke mode" for the tiny model; else the file."""
    before = cfg.validated.get(key, _MISSING)
    if (cfg.validated and key not in cfg.origins) if before is _MISSING else _flat(cfg).get(key, _MISSING) != before:
        return f"set in code after loading {cfg.source}"
    return cfg.origins.get(key, cfg.source)


def _section(cfg: Config, section: str):
    obj = getattr(cfg, section)
    if type(obj) is not SECTIONS[section]:
        raise ConfigError(source_of(cfg, section), section, obj, f"must be a {SECTIONS[section].__name__} (a section "
                                                                   "of key: value)")
    return obj


def validate(cfg: Config) -> Config:
    """Check every key of ``cfg`` (types, allowed values, ranges); raise :class:`ConfigError` with one line naming the
    source, key, value and what is allowed. The one check for files, overrides and configs changed in code."""
    if not isinstance(cfg, Config):
        raise ConfigError("config", None, cfg, "must be a labutils Config (labutils.load_config)")
    if cfg.mode not in ("full", "smoke"):
        raise ConfigError("mode", None, cfg.mode, "must be full or smoke")
    s = functools.partial(source_of, cfg)  # the source that set a key
    # every section of its class, no key the class lacks, every value of its field's type (coerced as the YAML path
    # coerces it: an int for a float key becomes a float, True for model.pretrained becomes "true")
    for section, cls in SECTIONS.items():
        obj = _section(cfg, section)
        flds = {f.name: f for f in fields(cls)}
        for name, value in vars(obj).items():  # a misspelt key assigned in code lands here, not in a field
            key = f"{section}.{name}"
            if name not in flds:
                raise ConfigError(s(key), key, value, f"unknown key; allowed in '{section}': {', '.join(flds)}")
            setattr(obj, name, _coerce(s(key), key, value, flds[name]))
    m, d, t = cfg.model, cfg.data, cfg.train

    def given(key, other):  # a limit that another key sets: name that key, and its source when it differs
        value = _flat(cfg)[other]
        src = s(other)
        if src == s(key):
            return f" (given {other} = {shown(value)})"
        return f" (given {other} = {shown(value)} from " + (f"{src} {other}={value}" if src in ("--set", "override")
                                                           else src) + ")"

    def rng(key, value, lo=None, hi=None, lo_open=False, allow_none=False, other=None):
        if value is None and allow_none:
            return
        if (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi):
            lo_s = "" if lo is None else (f"> {lo}" if lo_open else f">= {lo}")
            hi_s = "" if hi is None else f"<= {hi}"
            raise ConfigError(s(key), key, value, "must be " + " and ".join(b for b in (lo_s, hi_s) if b)
                              + (" (or null)" if allow_none else "") + (given(key, other) if other else ""))

    def choice(key, value, allowed):
        if value not in allowed:
            raise ConfigError(s(key), key, value, f"must be one of {', '.join(allowed)}")

    choice("model.name", m.name, MODEL_NAMES)
    choice("model.pretrained", m.pretrained, PRETRAINED)
    choice("model.attn_implementation", m.attn_implementation, ATTENTION)
    choice("model.activation", m.activation, ACTIVATIONS)
    choice("model.loss", m.loss, LOSSES)
    rng("model.loss_chunk_size", m.loss_chunk_size, 1, MAX_LOSS_CHUNK, allow_none=True)
    if m.pad_vocab_to is not None and m.pad_vocab_to not in PAD_VOCAB_TO:
        raise ConfigError(s("model.pad_vocab_to"), "model.pad_vocab_to", m.pad_vocab_to,
                          f"must be null or one of {', '.join(map(str, PAD_VOCAB_TO))}")
    if m.name.startswith("tiny") and m.pretrained == "true":
        raise ConfigError(s("model.pretrained"), "model.pretrained", m.pretrained,
                          "the tiny model has no pretrained weights; use auto or false"
                          + (given("model.pretrained", "model.name") if s("model.name") != s("model.pretrained")
                             else ""))
    rng("model.dropout", m.dropout, 0.0, 0.99, allow_none=True)
    rng("data.seq_length", d.seq_length, 2, MAX_POSITIONS)
    rng("data.num_samples", d.num_samples, 1, MAX_DATASET_TOKENS // d.seq_length, other="data.seq_length")
    if d.corpus != "builtin":
        if not _is_file(d.corpus):
            raise ConfigError(s("data.corpus"), "data.corpus", d.corpus,
                              "must be 'builtin' or the path of an existing .txt file")
        try:
            text = Path(d.corpus).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise ConfigError(s("data.corpus"), "data.corpus", d.corpus,
                              f"cannot be read ({exc.strerror or exc})") from None
        if not text.strip():
            raise ConfigError(s("data.corpus"), "data.corpus", d.corpus, "the file is empty; it needs documents "
                                                                         "separated by blank lines")
        # a sample needs two tokens (one input, one target): two words are two tokens or more under any GPT-2
        # tokenizer (BPE never merges across a space) and the byte-level stand-in alike
        if not any(len(doc.split()) >= 2 for doc in re.split(r"\n\s*\n", text)):
            raise ConfigError(s("data.corpus"), "data.corpus", d.corpus,
                              "every document is too short to train on; a document (paragraphs are separated "
                              "by blank lines) needs two or more words")
    rng("train.steps", t.steps, 1)
    rng("train.micro_batch_size", t.micro_batch_size, 1, MAX_EFFECTIVE_BATCH)
    rng("train.accumulation_steps", t.accumulation_steps, 1, MAX_EFFECTIVE_BATCH // t.micro_batch_size,
        other="train.micro_batch_size")
    choice("train.precision", t.precision, NAMES)  # the precision table's rows
    rng("train.checkpoint_every_n_layers", t.checkpoint_every_n_layers, 1)
    rng("train.lr", t.lr, 0.0, lo_open=True)
    rng("train.weight_decay", t.weight_decay, 0.0)
    rng("train.warmup_steps", t.warmup_steps, 0)
    rng("train.max_grad_norm", t.max_grad_norm, 0.0, lo_open=True, allow_none=True)
    rng("train.seed", t.seed, 0, MAX_SEED)
    rng("train.timing_warmup_steps", t.timing_warmup_steps, 0)
    positions = t.micro_batch_size * d.seq_length
    if m.loss == "chunked" and t.compile and -(-positions // (m.loss_chunk_size or positions)) > MAX_COMPILED_CHUNKS:
        # dynamo unrolls the chunk loop: 256 chunks of the tiny model compiled for 257 s, two for 23 s (issue 46)
        raise ConfigError(s("model.loss_chunk_size"), "model.loss_chunk_size", m.loss_chunk_size,
                          f"must be >= {-(-positions // MAX_COMPILED_CHUNKS)} under train.compile: true (at most "
                          f"{MAX_COMPILED_CHUNKS} chunks of the {t.micro_batch_size} x {d.seq_length} micro-batch, "
                          f"each unrolled into the compiled graph), or train.compile: false")
    cfg.validated = _flat(cfg)
    return cfg


def parse_set(item: str, source: str = "--set") -> tuple[str, Any]:
    """``a.b=value`` -> (key, YAML-typed value)."""
    if "=" not in item:
        raise ConfigError(source, None, item, f"malformed override {shown(item)}; expected KEY=VALUE such as "
                                              "train.steps=3")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(source, None, item, "malformed override: empty key; expected KEY=VALUE")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        raise ConfigError(source, key, raw, "the value is not valid YAML") from None
    return key, value


def _override_items(overrides, source: str) -> list[tuple[str, Any]]:
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return list(overrides.items())
    if isinstance(overrides, str):
        overrides = [overrides]
    return [parse_set(o, source) for o in overrides]


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key repeated in one mapping is an error (PyYAML silently keeps the last).
    Merge keys (``<<: *anchor``) work as in PyYAML; only the mapping's own keys are checked for repeats."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<`: merged by SafeConstructor.flatten_mapping below
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: let PyYAML report it
                continue
            if first is not key_node:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {shown(key)} (first on line {first.start_mark.line + 1}); "
                                "each key may appear once", key_node.start_mark)
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path) -> dict:
    src = str(path)
    if not _is_file(src):
        try:
            exists = path.exists()
        except (OSError, ValueError):
            exists = False
        raise ConfigError(src, None, _MISSING, "not a regular file (a folder, FIFO or device); give a YAML file"
                          if exists else "config file not found")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(src, None, _MISSING, f"cannot be read ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(src, None, _MISSING, f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                                               f"{exc.start}); save the config as UTF-8") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise ConfigError(src, None, _MISSING, f"malformed YAML{where}: "
                                               f"{getattr(exc, 'problem', None) or 'cannot parse'}") from None
    except RecursionError:  # PyYAML composes and constructs recursively
        raise ConfigError(src, None, _MISSING, "nested too deeply to read (thousands of levels); a config is "
                                               "sections of key: value") from None
    if raw is None:  # empty, whitespace, comments only, a bare `---` or `null`: nothing was configured
        raise ConfigError(src, None, _MISSING, f"the file holds no settings (empty, comments only or null); "
                                               f"give a mapping with sections {', '.join(SECTIONS)}")
    if not isinstance(raw, dict):
        raise ConfigError(src, None, _MISSING, f"the top level must be a mapping with sections "
                                               f"{', '.join(SECTIONS)}, not a {type(raw).__name__}")
    return raw


def load_config(path: str | os.PathLike | None = None, overrides=None, mode: str | None = None) -> Config:
    """Read a YAML config, apply the mode's defaults, then explicit overrides, and validate. ``mode``: "full", "smoke",
    or None to decide from the environment (:func:`labutils.core.device.detect_mode`)."""
    if mode is None:
        from .device import detect_mode  # imports torch: only when the mode is not given
        mode = detect_mode()[0]
    if mode not in ("full", "smoke"):
        raise ConfigError("mode", None, mode, "must be full or smoke")
    cfg, smoke = Config(mode=mode), {}
    if path is not None:
        p = Path(path)
        cfg.source = str(path)
        raw = _read_yaml(p)
        smoke = raw.pop("smoke", None) or {}  # the file's own smoke sizes ("section.name": value), after the caps
        for section, values in raw.items():
            if section not in SECTIONS:
                raise ConfigError(cfg.source, str(section), _MISSING,
                                  f"unknown section; allowed: {', '.join(SECTIONS)}")
            if values is None:
                continue
            if not isinstance(values, dict):
                raise ConfigError(cfg.source, section, values, "a section must be a mapping of key: value")
            for name, value in values.items():
                _assign(cfg, f"{section}.{name}", value, cfg.source)
        if cfg.data.corpus != "builtin" and not Path(cfg.data.corpus).is_absolute():
            rel = p.parent / cfg.data.corpus
            if rel.is_file() and not Path(cfg.data.corpus).is_file():
                cfg.data.corpus = str(rel)
        validate(cfg)  # the file's own values must be valid, whatever the mode does to them next
    if mode == "smoke":
        cfg.model.name = "tiny"
        for key, cap in SMOKE_CAPS.items():
            section, name = key.split(".")
            if getattr(getattr(cfg, section), name) > cap:  # a capped value comes from the mode, not the file
                setattr(getattr(cfg, section), name, cap)
                cfg.origins[key] = "smoke mode"
        cfg.validated = {}  # the mode's values are not code's
        cfg.origins.setdefault("model.name", "smoke mode")  # a message about the tiny model names the mode
        for key, value in (smoke.items() if isinstance(smoke, dict) else [("smoke", smoke)]):
            _assign(cfg, str(key), value, f"{cfg.source} (smoke:)")
    for key, value in _override_items(overrides, "--set"):
        _assign(cfg, key, value, "--set")
    return validate(cfg)
