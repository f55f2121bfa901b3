// attn_vnni.h — the fused attention's dot products over packed codes as 16-bit integer
// multiply-adds (AVX-512 VNNI vpdpwssd), where the CPU has them (x86-64 with avx512vnni, checked
// at run time).
//
// One kernel serves keys and values: two rows of BITS-bit codes (keys: two channels' rows
// along tokens; values: two tokens' rows along channels) and a 16-bit weight per row and
// query row (keys: q·scale; values: p·scale, each in fixed point). Lane l of a 64-byte
// vector takes byte l of both rows, an AND keeps the code at bit BITS·s of each, and
// vpdpwssd adds w_a·code_a·2^(BITS·s) + w_b·code_b·2^(BITS·s) to lane l's exact int32 sum:
// 32 products per instruction, where a float FMA does 16. The sums of the (8/BITS) shifts are
// converted to float, scaled by 2^-(BITS·s), and interleaved back into code order.
//
// Error: only the caller's rounding of its weights to 16 bits (the int32 sums are exact for
// |w| < 2^15 over up to 256 rows: a masked code is at most 240, a 4-bit code at bit 4).
#pragma once

#include "ott.h"

#include <atomic>
#include <cstddef>
#include <cstdint>

// Whether this CPU runs the kernel below (false off x86-64 and on builds whose fused attention
// has no AVX-512 version, ott_ops_cpu.h: OTT_VERSIONS).
bool ott_vnni_available();

// Whether the fused attention uses it: available and not turned off (ott_set_cpu_int_dots).
bool ott_vnni_enabled();

// A process-wide switch of one use of AVX-512 VNNI (ott.h: ott_set_cpu_int_dots,
// ott_set_cpu_x8_vnni), `off` its state: on = 1 clears it (OTT_ERR_UNSUPPORTED, "this CPU
// lacks AVX-512 VNNI for <what>", where the CPU lacks it), 0 sets it, < 0 leaves it; *out (may
// be NULL) gets whether the use is on now (available and not off).
ott_status ott_vnni_switch(std::atomic<bool> & off, int32_t on, int32_t * out, const char * what);

// out[r][i] += scale[r]·Σ_p (w[r][2p]·code(row 2p, i) + w[r][2p+1]·code(row 2p+1, i)) for i < n
// and r < rb (<= 4): row j's codes start at byte 0 of rows + j·row_bytes, BITS (1, 2 or 4)
// bits each, LSB-first; w int16 [rb][w_stride]; out float [rb][ld]. Reads whole 16-byte
// pieces of each row from its first byte: up to 15 bytes past the n codes.
void ott_vnni_pair_dots(int32_t bits, const uint8_t * rows, size_t row_bytes, int32_t n_pairs, int32_t n,
                        const int16_t * w, int32_t w_stride, const float * scale, int32_t rb, float * out, int32_t ld);
