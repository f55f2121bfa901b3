"""Every knob of the KV cache (docs/design.md §2) in one validated dataclass, plus the named modes.

A `KVConfig` is model-independent; `for_head_dim` resolves the one knob that depends on the
model (`group_v` is capped at `head_dim`) and checks the layout constraints for that width.

Mode f16 is the same cache with no quantization: every token stays in the fp16 window, so
the quantization knobs must all be 0 (an override of one of them is an error, not ignored).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ott_gguf.errors import InvalidArgumentError

from .rotation import CALIBRATED, HADAMARD, ROTATIONS

F16_BITS = 16  # bits value that means "stored as fp16, never quantized"
QUANT_BITS = (2, 4, 8)  # code widths of a quantized cache (KIVI / OTT groups)
TIER_HI_BITS, TIER_LO_BITS = 4, 1  # code widths of the key tiers hi_k and lo_k (bits_k is 2)
TIER_UNIT = 16  # hi_k and lo_k count channels per TIER_UNIT of the head dimension
RECENT_BITS = 4  # code width of keys and values in the `recent` newest blocks
KVQ_BITS = (2, 3, 4)  # code widths of the KVQuant scheme (codebook indices)
MAX_SUM_TERMS = 8192  # block and head_dim bound that keeps the float64 sums of
# fp16 values exact (outliers.py relies on it)


@dataclass(frozen=True)
class KVConfig:
    bits_k: int  # bits per key code; 16 = fp16 cache (mode f16)
    bits_v: int  # bits per value code; 16 = fp16 cache (mode f16)
    group_k: int  # key group: consecutive tokens of one channel (key_axis 0) or consecutive
    # channels of one token (key_axis 1)
    group_v: int  # channels per value group (one token, consecutive channels)
    block: int  # tokens quantized together at one quantization event
    window: int  # R: the fp16 window keeps R .. R+block-1 recent tokens
    pool: int  # outlier-pool capacity per KV head (0 = no OTT)
    extra_pool: int  # extra-pool capacity per KV head (tokens evicted from the pool)
    skip_layers: int  # layers 0 .. skip_layers-1 never trace outliers
    sink: int  # first tokens of a sequence kept in fp16 forever
    clip: int = 0  # 1: each group's range is the best of the clipped ones (quant.py)
    param_bits: int = 16  # a group's scale and min: 16 (fp16) or 8 (ufp8 scale, int8 min; quant.py)
    rot_k: int = 0  # rotation of keys (and queries): 0 none, 1 hadamard, 2 calibrated (rotation.py)
    rot_v: int = 0  # rotation of values, undone after attention: same kinds
    kvq: int = 0  # 1: the KVQuant scheme (kvquant.py): calibrated channel ranges, codebooks
    pre_rope: int = 0  # 1: keys cached before RoPE, rotated at their position in attention (either scheme)
    uniform: int = 0  # 1: uniform levels instead of the calibrated nuq codebooks (kvq)
    qnorm: int = 0  # 1: the codebooks of Q-Norm: dequantized calibration entries keep their mean and std (kvq)
    outliers: int = 0  # kvq dense-and-sparse: per 10000 of a block's keys (and values) kept in fp16
    key_axis: int = 0  # key groups: 0 per channel (KIVI), 1 per token along the head dimension
    hi_k: int = 0  # key tiers (block.py): of every 16 channels of a head-block, ranked by range
    # times a query scale, the first hi_k are coded with TIER_HI_BITS bits
    lo_k: int = 0  # ... and the last lo_k with TIER_LO_BITS bits; the others with bits_k (2)
    recent: int = 0  # the newest `recent` blocks take RECENT_BITS-bit keys and values (recent_cfg);
    # a block is re-coded to this config's codes when it ages out (cache.py)
    sym_v: int = 0  # 1: value groups symmetric around zero, the scale alone stored (quant.py)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(f"kv config: {f.name}={value!r} must be an integer >= 0")
        if self.bits_k == F16_BITS or self.bits_v == F16_BITS:
            self._check_f16()
        else:
            self._check_quantized()

    def _check_f16(self) -> None:
        if self.bits_k != self.bits_v:
            raise InvalidArgumentError(
                f"kv config: bits_k={self.bits_k} bits_v={self.bits_v}: "
                f"keys and values are both fp16 (16) or both quantized"
            )
        for name in (
            "group_k",
            "group_v",
            "block",
            "window",
            "pool",
            "extra_pool",
            "skip_layers",
            "sink",
            "clip",
            "param_bits",
            "rot_k",
            "rot_v",
            "kvq",
            "pre_rope",
            "uniform",
            "qnorm",
            "outliers",
            "key_axis",
            "hi_k",
            "lo_k",
            "recent",
            "sym_v",
        ):
            if getattr(self, name) != 0:
                raise InvalidArgumentError(
                    f"kv config: {name}={getattr(self, name)} does not apply to the fp16 cache "
                    f"(every token is kept in fp16)"
                )

    def _check_quantized(self) -> None:
        if self.kvq > 1:
            raise InvalidArgumentError(f"kv config: kvq={self.kvq} must be 0 (KIVI / OTT groups) or 1 (KVQuant)")
        if self.kvq:
            self._check_kvq()
        elif self.uniform or self.qnorm or self.outliers:
            raise InvalidArgumentError(
                f"kv config: uniform={self.uniform} qnorm={self.qnorm} outliers={self.outliers} "
                f"apply to the KVQuant scheme only (kvq=1)"
            )
        elif self.pre_rope > 1:
            raise InvalidArgumentError(f"kv config: pre_rope={self.pre_rope} must be 0 or 1")
        elif self.pre_rope and self.rot_k:
            raise InvalidArgumentError(
                f"kv config: rot_k={self.rot_k} does not compose with pre_rope=1 "
                f"(a rotation of keys before RoPE mixes the pairs it turns)"
            )
        for name in () if self.kvq else ("bits_k", "bits_v"):
            if getattr(self, name) not in QUANT_BITS:
                raise InvalidArgumentError(
                    f"kv config: {name}={getattr(self, name)} is not one of {QUANT_BITS} (or 16 for both: fp16 cache)"
                )
        if self.block == 0 or self.block % 8 or self.block > MAX_SUM_TERMS:
            raise InvalidArgumentError(f"kv config: block={self.block} must be a multiple of 8 in 8..{MAX_SUM_TERMS}")
        if self.key_axis not in (0, 1):
            raise InvalidArgumentError(f"kv config: key_axis={self.key_axis} is not 0 (per channel) or 1 (per token)")
        if self.group_k == 0 or (self.key_axis == 0 and self.block % self.group_k):
            raise InvalidArgumentError(f"kv config: block={self.block} is not a multiple of group_k={self.group_k}")
        if self.group_k * self.bits_k % 8:
            raise InvalidArgumentError(
                f"kv config: group_k={self.group_k} at bits_k={self.bits_k} does not fill whole bytes"
            )
        if self.group_v == 0 or self.group_v * self.bits_v % 8:
            raise InvalidArgumentError(
                f"kv config: group_v={self.group_v} at bits_v={self.bits_v} does not fill whole bytes"
            )
        if self.pool >= self.block:
            raise InvalidArgumentError(f"kv config: pool={self.pool} must be smaller than block={self.block}")
        if self.sym_v > 1:
            raise InvalidArgumentError(
                f"kv config: sym_v={self.sym_v} must be 0 (a minimum per group) or 1 (symmetric)"
            )
        if self.clip > 1:
            raise InvalidArgumentError(f"kv config: clip={self.clip} must be 0 (min-max ranges) or 1 (clipped)")
        if self.param_bits not in (8, 16):
            raise InvalidArgumentError(f"kv config: param_bits={self.param_bits} is not 16 (fp16) or 8")
        for name in ("rot_k", "rot_v"):
            if getattr(self, name) >= len(ROTATIONS):
                raise InvalidArgumentError(
                    f"kv config: {name}={getattr(self, name)} is not one of "
                    f"{', '.join(f'{i} ({r})' for i, r in enumerate(ROTATIONS))}"
                )
        if self.extra_pool and not self.pool:
            raise InvalidArgumentError(
                f"kv config: extra_pool={self.extra_pool} needs pool > 0 (it holds tokens evicted from the pool)"
            )
        if self.tiered:
            self._check_tiers()
        if self.recent:
            self._check_recent()

    def _check_recent(self) -> None:
        """Recent blocks: RECENT_BITS-bit codes for blocks of 2- or 4-bit codes (not KVQuant)."""
        if self.kvq or self.bits_k > RECENT_BITS or self.bits_v > RECENT_BITS:
            raise InvalidArgumentError(
                f"kv config: recent={self.recent} needs KIVI / OTT groups of at most {RECENT_BITS}-bit codes "
                f"(got kvq={self.kvq}, bits_k={self.bits_k}, bits_v={self.bits_v})"
            )
        if self.recent > 64:
            raise InvalidArgumentError(f"kv config: recent={self.recent} blocks is more than 64")

    def _check_tiers(self) -> None:
        """Key tiers: 2-bit keys grouped per channel over the whole block."""
        if self.hi_k + self.lo_k > TIER_UNIT:
            raise InvalidArgumentError(
                f"kv config: hi_k={self.hi_k} + lo_k={self.lo_k} channels per {TIER_UNIT} exceed {TIER_UNIT}"
            )
        if self.bits_k != 2 or self.key_axis != 0 or self.group_k != self.block:
            raise InvalidArgumentError(
                f"kv config: key tiers (hi_k={self.hi_k}, lo_k={self.lo_k}) need bits_k=2, key_axis=0 and "
                f"group_k=block (got bits_k={self.bits_k}, key_axis={self.key_axis}, group_k={self.group_k}, "
                f"block={self.block})"
            )

    def _check_kvq(self) -> None:
        """KVQuant: no groups of its own (keys take calibrated channel ranges, values one range
        per token), fp16 parameters, no rotation; OTT's token pools compose with it in the
        specification (cache.py), not in the runtime."""
        for name in ("bits_k", "bits_v"):
            if getattr(self, name) not in KVQ_BITS:
                raise InvalidArgumentError(
                    f"kv config: {name}={getattr(self, name)} is not one of {KVQ_BITS} (KVQuant codebooks)"
                )
        for name in ("clip", "rot_k", "rot_v", "key_axis", "hi_k", "lo_k", "sym_v"):
            if getattr(self, name):
                raise InvalidArgumentError(f"kv config: {name}={getattr(self, name)} does not apply to KVQuant (kvq=1)")
        if self.param_bits != 16:
            raise InvalidArgumentError(f"kv config: param_bits={self.param_bits} must be 16 with KVQuant (kvq=1)")
        if self.group_k != self.block:
            raise InvalidArgumentError(
                f"kv config: group_k={self.group_k} must equal block={self.block} with KVQuant "
                f"(keys take calibrated per-channel ranges)"
            )
        if self.pre_rope > 1 or self.uniform > 1 or self.qnorm > 1:
            raise InvalidArgumentError(
                f"kv config: pre_rope={self.pre_rope}, uniform={self.uniform} and qnorm={self.qnorm} are 0 or 1"
            )
        if self.uniform and self.qnorm:
            raise InvalidArgumentError("kv config: uniform=1 and qnorm=1 both choose the levels: take one")
        if self.outliers > 1000:
            raise InvalidArgumentError(f"kv config: outliers={self.outliers} per 10000 is more than 10 %")

    @property
    def recent_cfg(self) -> KVConfig:
        """How the newest `recent` blocks are coded: RECENT_BITS-bit keys and values in this
        config's groups, min-max ranges, no key tiers."""
        return replace(self, bits_k=RECENT_BITS, bits_v=RECENT_BITS, clip=0, hi_k=0, lo_k=0, recent=0)

    @property
    def tiered(self) -> bool:
        """Whether key channels are coded in tiers of different widths (hi_k, lo_k)."""
        return self.hi_k > 0 or self.lo_k > 0

    def key_row_bits(self, head_dim: int) -> list[int]:
        """Bits per code of each key row of a head-block (key_axis 0): with tiers, row r holds
        the channel of rank r (block.py), so rows 0 .. n_hi-1 take TIER_HI_BITS bits, the last
        n_lo TIER_LO_BITS, the others bits_k; without tiers every row takes bits_k."""
        n_hi, n_lo = self.hi_k * head_dim // TIER_UNIT, self.lo_k * head_dim // TIER_UNIT
        return [TIER_HI_BITS] * n_hi + [self.bits_k] * (head_dim - n_hi - n_lo) + [TIER_LO_BITS] * n_lo

    @property
    def quantized(self) -> bool:
        """False for the fp16 cache (mode f16), True when old tokens are quantized."""
        return self.bits_k != F16_BITS

    def traces(self, il: int) -> bool:
        """Whether layer `il` runs Outlier Token Tracing (has a pool)."""
        return self.quantized and self.pool > 0 and il >= self.skip_layers

    @property
    def calibrated(self) -> bool:
        """Whether the config needs a calibration sidecar (a calibrated rotation)."""
        return CALIBRATED in (self.rot_k, self.rot_v) or self.kvq == 1

    def for_head_dim(self, head_dim: int) -> KVConfig:
        """This config for a model of width `head_dim`: group_v (and group_k of per-token keys)
        capped at head_dim, checked."""
        if head_dim <= 0 or head_dim > MAX_SUM_TERMS:
            raise InvalidArgumentError(f"kv config: head_dim={head_dim} must be in 1..{MAX_SUM_TERMS}")
        if not self.quantized:
            return self
        for name in ("rot_k", "rot_v"):
            if getattr(self, name) == HADAMARD and head_dim & (head_dim - 1):
                raise InvalidArgumentError(
                    f"kv config: {name}=hadamard needs a head size that is a power of two, not {head_dim}"
                )
        cfg = replace(self, group_v=min(self.group_v, head_dim))
        if self.kvq and (cfg.group_v != head_dim or head_dim * self.bits_v % 8 or self.block * head_dim > 65536):
            raise InvalidArgumentError(
                f"kv config: KVQuant needs group_v >= head_dim={head_dim} (one range per token), whole bytes per "
                f"token at bits_v={self.bits_v}, and block·head_dim <= 65536 (16-bit sparse indices)"
            )
        if head_dim % cfg.group_v:
            raise InvalidArgumentError(f"kv config: group_v={cfg.group_v} does not divide head_dim={head_dim}")
        if cfg.tiered and (head_dim % TIER_UNIT or head_dim > 256):
            raise InvalidArgumentError(
                f"kv config: key tiers need a head size that is a multiple of {TIER_UNIT} up to 256, not {head_dim}"
            )
        if cfg.key_axis == 1:
            cfg = replace(cfg, group_k=min(cfg.group_k, head_dim))
            if head_dim % cfg.group_k:
                raise InvalidArgumentError(
                    f"kv config: group_k={cfg.group_k} of per-token keys does not divide head_dim={head_dim}"
                )
        return cfg

    def with_overrides(self, **overrides: int | None) -> KVConfig:
        """A copy with the given knobs replaced (None values are ignored), validated."""
        known = {f.name for f in fields(self)}
        for name in overrides:
            if name not in known:
                raise InvalidArgumentError(f"kv config: unknown knob {name!r}")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


_OTT = dict(group_k=128, group_v=64, block=128, window=32, pool=3, extra_pool=32, skip_layers=2, sink=0)
_KIVI = dict(group_k=32, group_v=32, block=128, window=128, pool=0, extra_pool=0, skip_layers=0, sink=0)
# This project's caches (docs/results.md says how they were chosen): OTT's per-channel keys
# and pools, values Hadamard-rotated in one group per head (capped at 128 channels), 8-bit
# group parameters, no fp16 window beyond the block being filled.
_OTTR = dict(_OTT, group_v=128, window=0, param_bits=8, rot_v=HADAMARD)

# KVQuant (kvquant.py): pre-RoPE per-channel keys, per-token values, nuq codebooks, 1 %
# dense-and-sparse outliers, one fp16 sink token. Keys need no per-block ranges, so blocks are
# short: the fp16 stretch of the block being filled is small.
_KVQ = dict(
    group_k=32,
    group_v=MAX_SUM_TERMS,
    block=32,
    window=0,
    pool=0,
    extra_pool=0,
    skip_layers=0,
    sink=1,
    kvq=1,
    pre_rope=1,
    outliers=100,
)

PRESETS: dict[str, KVConfig] = {
    "f16": KVConfig(
        bits_k=16,
        bits_v=16,
        group_k=0,
        group_v=0,
        block=0,
        window=0,
        pool=0,
        extra_pool=0,
        skip_layers=0,
        sink=0,
        param_bits=0,
    ),
    "kivi2": KVConfig(bits_k=2, bits_v=2, **_KIVI),
    "kivi4": KVConfig(bits_k=4, bits_v=4, **_KIVI),
    "ott2": KVConfig(bits_k=2, bits_v=2, **_OTT),
    "ott4": KVConfig(bits_k=4, bits_v=4, **_OTT),
    # 2-bit codes want clipped ranges (at 4 bits the min-max range does better: ottr3)
    "ottr2": KVConfig(bits_k=2, bits_v=2, clip=1, **_OTTR),
    # ottr2 with key tiers: of every 16 key channels of a block, the 4 that weigh most in the
    # scores at 4 bits, the 8 that weigh least at 1 bit (still 2 bits per key code)
    "ottr2t": KVConfig(bits_k=2, bits_v=2, clip=1, hi_k=4, lo_k=8, **_OTTR),
    # ottr2t with keys cached before RoPE, there 5 of every 16 key channels at 4 bits and 10 at
    # 1, its newest 5 blocks at 4 bits, symmetric value groups (the bits of the fifth block),
    # and without the extra pool (it bought less than 0.003 of KL for 0.09 bits): 2.48 bits
    # per element at 4096 tokens (on a GPU its keys take the FFMA kernel: auto is ottr2tg there)
    "ottr2tr": KVConfig(
        bits_k=2, bits_v=2, clip=1, hi_k=5, lo_k=10, recent=5, sym_v=1, pre_rope=1, **dict(_OTTR, extra_pool=0)
    ),
    # ottr2tr with keys cached after RoPE, for the GPU: there its tiers 4 + 8 of 16 (with keys
    # after RoPE, 5 + 10 bought nothing) keep the attention on the integer tensor-core kernel
    "ottr2tg": KVConfig(bits_k=2, bits_v=2, clip=1, hi_k=4, lo_k=8, recent=5, sym_v=1, **dict(_OTTR, extra_pool=0)),
    "ottr3": KVConfig(bits_k=4, bits_v=2, **_OTTR),
    "kvquant2": KVConfig(bits_k=2, bits_v=2, **_KVQ),
    "kvquant3": KVConfig(bits_k=3, bits_v=3, **_KVQ),
    "kvquant4": KVConfig(bits_k=4, bits_v=4, **_KVQ),
}
# --kv auto: the recommended cache, the first of AUTO_ORDER a model's cache takes
# (Weights.kv_config asks the native library). AUTO_CPU, the most accurate 2-bit one, is taken
# on the CPU for a plain RoPE (keys before RoPE) and a power-of-two head size that takes key
# tiers (a GPU runs it too, but slower than ottr2tg: its keys before RoPE cannot take the
# integer tensor cores); ottr2tg (its keys after RoPE) on either backend for such a head
# size; AUTO (4-bit keys, 2-bit values; the answer without a model) needs a power-of-two head
# size for its Hadamard rotation; kivi4 takes any head size that is a multiple of 32.
AUTO_CPU = "ottr2tr"
AUTO = "ottr3"
AUTO_ORDER = (AUTO_CPU, "ottr2tg", AUTO, "kivi4")


def parse_mode(spec: str) -> str | KVConfig:
    """A KV mode as the bench scripts spell it: 'ott2' as it is, 'ott2:rot_k=1:pool=0' the
    preset with those knobs."""
    name, *knobs = spec.split(":")
    if not knobs:
        return name
    overrides = {}
    for knob in knobs:
        k, _, v = knob.partition("=")
        try:
            overrides[k] = int(v)
        except ValueError:
            raise InvalidArgumentError(f"kv mode {spec!r}: knob {knob!r} is not name=integer") from None
    return preset(name).with_overrides(**overrides)


def mode_config(spec: str) -> KVConfig:
    """The KVConfig of a mode as parse_mode reads it (a preset's name resolved by preset)."""
    mode = parse_mode(spec)
    return preset(mode) if isinstance(mode, str) else mode


def preset(name: str) -> KVConfig:
    """The named KV mode (f16, kivi2, kivi4, ott2, ott4, ottr2, ottr2t, ottr2tr, ottr2tg, ottr3, kvquant2/3/4, or auto:
    AUTO's, the recommended cache without a model to ask; Weights.kv_config resolves auto for one)."""
    if name == "auto":
        name = AUTO
    if name not in PRESETS:
        raise InvalidArgumentError(f"kv mode {name!r} is not one of {', '.join(PRESETS)}, auto")
    return PRESETS[name]
