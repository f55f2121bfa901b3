"""The default context size: the model's trained context, capped by the memory there is.

A GGUF file states its trained context (`context_length`, up to 2^24 tokens); a context of
that many tokens is allocated up front, so a small file could otherwise make a run take
gigabytes. Without an explicit n_ctx a context gets min(trained context, cap): the cap is the
number of tokens whose KV cache (what the chosen mode allocates, `Weights.kv_seq_bytes`, every
sequence) and attention buffers (a score and a mask entry per head, ubatch row and context position) fit
in a quarter of the memory available now (MemAvailable, and the cgroup's limit where one is
set), rounded down to a multiple of 256 tokens. An explicit n_ctx is never capped.
"""

from __future__ import annotations

from pathlib import Path

MEMORY_FRACTION = 4  # the default context may take 1/MEMORY_FRACTION of the available memory
CTX_ALIGN = 256
F32_BYTES = 4


def available_memory() -> int | None:
    """Bytes available to this process now; None when the system does not say."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:  # cgroup v2: the limit less what the group already uses
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append(max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def context_bytes_per_token(kv_bytes_per_token: float, n_head: int, n_ubatch: int) -> float:
    """Bytes one more context position costs: its KV cache entries and its attention buffers."""
    return kv_bytes_per_token + n_ubatch * (n_head + 1) * F32_BYTES


def default_n_ctx(n_ctx_train: int, bytes_per_token: float, available: int | None) -> int:
    """min(n_ctx_train, the cap): see the module's docstring. At least CTX_ALIGN tokens (or the
    trained context when it is shorter)."""
    if available is None or bytes_per_token <= 0:
        return n_ctx_train
    cap = int(available // MEMORY_FRACTION / bytes_per_token) // CTX_ALIGN * CTX_ALIGN
    return min(n_ctx_train, max(cap, CTX_ALIGN))
