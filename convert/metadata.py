"""general.* keys: what the file is, its size class, and the sampling defaults of generation_config.json."""

from __future__ import annotations

import math
from pathlib import Path

from gguf import GGML_QUANT_VERSION, GGUFType, GGUFWriter, LlamaFileType, size_label

from .hparams import read_json
from .tensor_plan import PlannedTensor

# generation_config.json key -> GGUFWriter method, as llama.cpp's converter maps them
SAMPLING_KEYS = {
    "top_k": "add_sampling_top_k",
    "top_p": "add_sampling_top_p",
    "min_p": "add_sampling_min_p",
    "temperature": "add_sampling_temp",
    "repetition_penalty": "add_sampling_penalty_repeat",
}


def add_general(
    w: GGUFWriter, name: str, file_type: LlamaFileType, tensors: list[PlannedTensor], directory: Path
) -> None:
    w.add_type(GGUFType.MODEL)
    w.add_name(name)
    n_params = sum(math.prod(t.shape) for t in tensors)
    w.add_size_label(size_label(n_params, n_params, 0, 0))
    w.add_file_type(file_type)
    w.add_quantization_version(GGML_QUANT_VERSION)
    path = directory / "generation_config.json"
    generation = read_json(path) if path.is_file() else {}
    for key, method in SAMPLING_KEYS.items():
        if isinstance(generation.get(key), (int, float)):
            getattr(w, method)(generation[key])
