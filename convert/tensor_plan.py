"""Which GGUF tensors a checkpoint becomes: names, shapes, types, checked before writing.

Planning needs only the checkpoint's headers, so every name and shape problem is found
before the output file is opened; the data are then produced one tensor at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import MODEL_TENSOR, GGMLQuantizationType, get_tensor_name_map

from ott_gguf.errors import ModelFileError, UnsupportedError

from .architecture import Architecture
from .outtype import encode, source_dtype, tensor_nbytes, tensor_type
from .source import TensorRef

# recomputed by every runtime from the rope base; HF stores them as buffers in old checkpoints
SKIPPED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class PlannedTensor:
    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    shape: tuple[int, ...]  # numpy order [.., n_rows, n_cols] (GGUF ne reversed)
    qtype: GGMLQuantizationType
    kind: MODEL_TENSOR | None
    source: TensorRef | None  # None for a tensor computed from config.json
    computed: np.ndarray | None = None  # F32, when source is None

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.qtype, self.shape)

    def produce(self, arch: Architecture) -> np.ndarray:
        """Load, transform and encode this tensor; the only time its data are in memory."""
        if self.source is None:
            return encode(self.computed, "F32", self.qtype)
        data = arch.transform(self.kind, self.source.load())
        return encode(data, source_dtype(data), self.qtype)


def plan_tensors(arch: Architecture, tensors: dict[str, TensorRef], outtype: str, where: Path) -> list[PlannedTensor]:
    hp = arch.hparams
    name_map = get_tensor_name_map(arch.gguf_arch, hp.n_layer)
    planned = [
        PlannedTensor(name, data.shape, tensor_type(outtype, name, data.shape), None, None, data)
        for name, data in arch.extra_tensors().items()
    ]
    sources: dict[str, str] = {}
    for ref in tensors.values():
        if ref.name.endswith(SKIPPED_SUFFIXES):
            continue
        mapped = name_map.get_type_and_name(ref.name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise UnsupportedError(
                f"{ref.file}: tensor {ref.name} has no place in a {hp.architecture} model of {hp.n_layer} layers"
            )
        kind, name = mapped
        expected = arch.expected_shape(kind, ".bias" if name.endswith(".bias") else ".weight")
        if expected is None:
            raise UnsupportedError(f"{ref.file}: tensor {ref.name} ({name}) is not converted for {hp.architecture}")
        if ref.shape != expected:
            raise ModelFileError(
                f"{ref.file}: tensor {ref.name} has shape {list(ref.shape)} but config.json implies {list(expected)}"
            )
        if name in sources:
            raise ModelFileError(f"{ref.file}: tensors {sources[name]} and {ref.name} both map to {name}")
        sources[name] = ref.name
        planned.append(PlannedTensor(name, ref.shape, tensor_type(outtype, name, ref.shape), kind, ref))

    missing = [name for name in arch.required_tensors() if name not in sources]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelFileError(
            f"{where}: checkpoint lacks {', '.join(missing[:3])}{more} (GGUF names) that config.json implies"
        )
    return planned
