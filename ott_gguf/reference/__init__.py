"""Executable specification of the OTT / KIVI / fp16 KV cache, in numpy.

The oracle the native CPU and CUDA code is checked against: codes, scales, mins, masks and
pool contents bit for bit; attention output within a budget of the float64 result here.

    config.py     KVConfig: every knob, presets f16 / kivi2 / kivi4 / ott2 / ott4 / ottr2 / ottr2t / ottr2tr / ottr3 / kvquant2-4, validation
    quant.py      one group: KIVI asymmetric quantization (exact float32 recipe), LSB-first packing
    nuq.py        KVQuant's non-uniform codebooks: nearest level, per-token and per-channel ranges
    kvquant.py    a KVQuant block: pre-RoPE per-channel keys, per-token values, sparse outliers
    rope.py       RoPE in float64 (attention rotates keys cached before RoPE)
    block.py      QuantBlock: the byte layout of a quantized block of one KV head
    outliers.py   Outlier Token Tracing: L1 scores, pool selection, stop rule, mean substitution
    store.py      fp16 token stores (sink, pool, extra pool, window), float32 -> fp16 input
    cache.py      HeadCache / LayerCache: schedule and quantization events
    attention.py  float64 attention over every store; decode, chunks, --prefill-fp16
    footprint.py  bytes per token per layer and bits per element, formula and measured
"""

from .attention import attend, forward_chunk, prefill
from .block import QuantBlock, quantize_block
from .cache import HeadCache, LayerCache
from .config import PRESETS, KVConfig, preset
from .footprint import Footprint, footprint, measure
from .quant import dequantize_groups, pack_codes, quantize_groups, unpack_codes

__all__ = [
    "KVConfig",
    "PRESETS",
    "preset",
    "quantize_groups",
    "dequantize_groups",
    "pack_codes",
    "unpack_codes",
    "QuantBlock",
    "quantize_block",
    "HeadCache",
    "LayerCache",
    "attend",
    "forward_chunk",
    "prefill",
    "Footprint",
    "footprint",
    "measure",
]
