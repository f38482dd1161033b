"""Sentence embeddings through ONNX Runtime: the same model, tokenizer and pooling as sentence-transformers, at a
fraction of its per-call overhead on CPU.

The model is exported from its sentence-transformers folder once, checked against the torch encoder on probe
texts, and cached under a key naming everything that changes the bytes (the model's files, torch and the export
recipe); later starts load the cached file.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np

EXPORT_RECIPE = "inferscale-st-onnx-v1"  # bump when the exported graph or the pooling below changes
ONNX_OPSET = 17
# The check an export must pass against sentence-transformers: unit vectors agreeing to this, per coordinate.
MAX_EXPORT_DEVIATION = 1e-5
PROBE_TEXTS = [
    "The user enjoys hiking on weekends.",
    "  leading and trailing spaces  ",
    "",
    "日本語のテキスト 🙂 émigré naïve",
    "a long one " * 200,  # past the model's max_seq_length: truncation must match
]


class UnsupportedEncoder(ValueError):
    """The model's sentence-transformers pipeline is not one this encoder reproduces (use the torch backend)."""


@dataclass(frozen=True)
class PipelineSpec:
    """What sentence-transformers does around the transformer, read from the model folder."""

    max_seq_length: int
    lowercase: bool


def read_pipeline(model_dir: Path) -> PipelineSpec:
    """Accepts Transformer -> mean Pooling [-> Normalize] only, the layout of the MiniLM/MPNet sentence models."""
    modules = json.loads((model_dir / "modules.json").read_text())
    kinds = [module["type"].rsplit(".", 1)[-1] for module in modules]
    if kinds not in (["Transformer", "Pooling", "Normalize"], ["Transformer", "Pooling"]):
        raise UnsupportedEncoder(f"{model_dir}: modules {kinds}; the onnx backend supports Transformer, Pooling"
                                 " [, Normalize] (use --embedding-backend torch)")
    pooling = json.loads((model_dir / modules[1]["path"] / "config.json").read_text())
    modes = sorted(key for key, value in pooling.items() if key.startswith("pooling_mode") and value is True)
    if modes != ["pooling_mode_mean_tokens"]:
        raise UnsupportedEncoder(f"{model_dir}: pooling {modes}; the onnx backend supports mean pooling only"
                                 " (use --embedding-backend torch)")
    bert_config = json.loads((model_dir / "sentence_bert_config.json").read_text())
    return PipelineSpec(max_seq_length=int(bert_config["max_seq_length"]),
                        lowercase=bool(bert_config.get("do_lower_case", False)))


def export_key(model_dir: Path) -> str:
    """A digest of the model's weights and configs, torch's version (the exporter) and the export recipe."""
    digest = hashlib.sha256(f"{EXPORT_RECIPE}|opset{ONNX_OPSET}|torch{importlib.metadata.version('torch')}".encode())
    for path in sorted(model_dir.rglob("*")):
        if path.is_file() and path.suffix in {".json", ".safetensors", ".bin", ".txt"}:
            digest.update(str(path.relative_to(model_dir)).encode())
            with path.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()[:24]


class OnnxSentenceEncoder:
    """Unit-normalized float32 sentence embeddings from an ONNX Runtime session; `encode` is thread-safe."""

    def __init__(self, model_dir: Path, spec: PipelineSpec, onnx_path: Path, threads: int) -> None:
        import onnxruntime
        from transformers import AutoTokenizer

        self.spec = spec
        self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # Idle intra-op threads sleep instead of spinning: a spinning thread holds a core that the event loop and the
        # other session need, which raised the paced p99 of the load test.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._session = onnxruntime.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        self._input_names = [node.name for node in self._session.get_inputs()]
        self.dim = int(self.encode(["dimension probe"]).shape[1])

    @classmethod
    def load(cls, model_dir: Path, cache_dir: Path, threads: int) -> OnnxSentenceEncoder:
        """The cached export for this model, made (and checked) first if missing."""
        spec = read_pipeline(model_dir)  # refuses unsupported layouts before an export is spent on them
        onnx_path = cache_dir / f"{model_dir.name}-{export_key(model_dir)}.onnx"
        if onnx_path.exists():
            return cls(model_dir, spec, onnx_path, threads)
        return _export_checked(model_dir, spec, onnx_path, threads)

    def encode(self, texts: list[str]) -> np.ndarray:
        """[len(texts), dim] unit vectors, as sentence-transformers' encode(normalize_embeddings=True) gives."""
        texts = [text.strip() for text in texts]
        if self.spec.lowercase:
            texts = [text.lower() for text in texts]
        tokens = self._tokenizer(texts, padding=True, truncation="longest_first", max_length=self.spec.max_seq_length,
                                 return_tensors="np")
        inputs = {name: tokens[name].astype(np.int64) for name in self._input_names}
        hidden = self._session.run(None, inputs)[0]
        mask = tokens["attention_mask"][..., None].astype(np.float32)
        pooled = (hidden * mask).sum(axis=1) / np.clip(mask.sum(axis=1), 1e-9, None)
        norms = np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)
        return (pooled / norms).astype(np.float32)


def _export_checked(model_dir: Path, spec: PipelineSpec, onnx_path: Path, threads: int) -> OnnxSentenceEncoder:
    """Exports the transformer to `onnx_path` (atomically) once its embeddings match sentence-transformers';
    returns the encoder the check ran on (its session holds the model in memory, wherever the file moves)."""
    import torch
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(model_dir), device="cpu")
    transformer = cast(torch.nn.Module, reference[0].auto_model).eval()  # a Module, whatever its stub says
    tokenizer = reference.tokenizer
    sample = tokenizer(["an export sample"], return_tensors="pt")
    input_names = [name for name in ("input_ids", "attention_mask", "token_type_ids") if name in sample]

    class LastHiddenState(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = transformer

        def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
            return self.transformer(**dict(zip(input_names, inputs, strict=True))).last_hidden_state

    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    partial = onnx_path.with_suffix(f".partial-{os.getpid()}")
    dynamic = {0: "batch", 1: "sequence"}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on data-dependent branches, fixed for this graph
        torch.onnx.export(LastHiddenState(), tuple(sample[name] for name in input_names), str(partial),
                          input_names=input_names, output_names=["last_hidden_state"],
                          dynamic_axes={name: dynamic for name in [*input_names, "last_hidden_state"]},
                          opset_version=ONNX_OPSET, dynamo=False)
    try:
        encoder = OnnxSentenceEncoder(model_dir, spec, partial, threads)
        exported = encoder.encode(PROBE_TEXTS)
        expected = reference.encode(PROBE_TEXTS, normalize_embeddings=True, convert_to_numpy=True,
                                    show_progress_bar=False)
        deviation = float(np.abs(exported - expected).max())
        if deviation > MAX_EXPORT_DEVIATION:
            raise UnsupportedEncoder(f"{model_dir}: the ONNX export deviates from sentence-transformers by "
                                     f"{deviation:.2e} (> {MAX_EXPORT_DEVIATION:.0e}); use --embedding-backend torch")
        partial.replace(onnx_path)
    finally:
        partial.unlink(missing_ok=True)
    return encoder
