"""Writing a GGUF file one tensor at a time, atomically.

GGUFWriter normally keeps every tensor until the end; here the header, the metadata and the
tensor infos (names, shapes, types, sizes known from the plan) are written first, then each
tensor is produced, written and dropped. The file is written as OUT.tmp beside OUT and
renamed at the end; on any failure the .tmp file is removed, so no partial OUT ever exists.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from tqdm import tqdm

from ott_gguf.errors import ModelFileError

from .tensor_plan import PlannedTensor


def write_gguf(
    out: Path,
    arch_name: str,
    add_metadata: Callable[[GGUFWriter], None],
    tensors: list[PlannedTensor],
    produce: Callable[[PlannedTensor], np.ndarray],
) -> None:
    tmp = out.with_name(out.name + ".tmp")
    w = GGUFWriter(tmp, arch_name)
    try:
        add_metadata(w)
        for t in tensors:
            # with raw_dtype given, a non-uint8 dtype makes GGUFWriter take the shape as elements
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in tqdm(tensors, desc=f"writing {out.name}", unit="tensor"):
            w.write_tensor_data(produce(t))
        w.close()
        os.replace(tmp, out)
    except OSError as e:
        w.close()
        tmp.unlink(missing_ok=True)
        raise ModelFileError(f"{e.filename or out}: {e.strerror or e}") from None
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
