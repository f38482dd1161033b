"""The ONNX Runtime encoder: the vectors sentence-transformers gives, an export made once and reused, and a clear
refusal of pipelines it does not reproduce."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from inferscale_kv.embedding_model import DEFAULT_EMBEDDING_MODEL, resolve_model_path
from memory_service.embedder import TorchSentenceEncoder
from memory_service.onnx_encoder import OnnxSentenceEncoder, UnsupportedEncoder, export_key, read_pipeline

MODEL_DIR = Path(resolve_model_path(DEFAULT_EMBEDDING_MODEL))
TEXTS = [
    "The user enjoys hiking on weekends.",
    "what does the user enjoy, jazz?",
    "\tpadded with whitespace \n",
    "",
    "日本語の質問 🙂 — émigré, naïve, Ω≈ç√",
    "zero\u200bwidth and combining e\u0301",
    "a very long fact " * 300,  # truncated at the model's max_seq_length
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[OnnxSentenceEncoder, Path]:
    cache = tmp_path_factory.mktemp("embedding-onnx")
    return OnnxSentenceEncoder.load(MODEL_DIR, cache, threads=1), cache


def test_onnx_vectors_equal_sentence_transformers_to_float_rounding(exported) -> None:
    encoder, _ = exported
    reference = TorchSentenceEncoder(str(MODEL_DIR), "cpu", batch_size=64, threads=1)
    onnx_vectors, torch_vectors = encoder.encode(TEXTS), reference.encode(TEXTS)
    assert onnx_vectors.shape == (len(TEXTS), 384) and onnx_vectors.dtype == np.float32
    assert float(np.abs(onnx_vectors - torch_vectors).max()) < 1e-5
    np.testing.assert_allclose(np.linalg.norm(onnx_vectors, axis=1), 1.0, atol=1e-5)


def test_a_second_load_reuses_the_cached_export(exported) -> None:
    _, cache = exported
    (onnx_file,) = cache.glob("*.onnx")
    modified = onnx_file.stat().st_mtime_ns
    OnnxSentenceEncoder.load(MODEL_DIR, cache, threads=1)
    assert [path.name for path in cache.iterdir()] == [onnx_file.name]
    assert onnx_file.stat().st_mtime_ns == modified


def _pipeline_copy(tmp_path: Path) -> Path:
    """The model's pipeline description without its weights (enough for read_pipeline and export_key)."""
    copy = tmp_path / "model"
    shutil.copytree(MODEL_DIR, copy, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    return copy


def test_the_export_key_changes_with_the_models_files(tmp_path) -> None:
    model = _pipeline_copy(tmp_path)
    before = export_key(model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "layer_norm_eps": 1e-6}))
    assert export_key(model) != before


def test_a_pooling_it_does_not_reproduce_is_refused_naming_the_torch_backend(tmp_path) -> None:
    model = _pipeline_copy(tmp_path)
    pooling = model / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text())
    pooling.write_text(json.dumps({**config, "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": True}))
    with pytest.raises(UnsupportedEncoder, match="--embedding-backend torch"):
        read_pipeline(model)
