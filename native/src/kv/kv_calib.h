// kv_calib.h — the calibration sidecar of a model (docs/design.md §8): a small GGUF written by
// `python -m ott_gguf calibrate` (ott_gguf/calibrate.py) with
//
//   ott.calib.architecture, ott.calib.block_count, ott.calib.head_count_kv,
//   ott.calib.key_length        the model it was computed for (must match)
//   ott.calib.model_hash        ott_gguf_data_hash of the model file, 16 hex digits (must match)
//   ott.calib.text, ott.calib.n_tokens, ott.calib.version    what it was computed from
//   ott.rot_k.{il}, ott.rot_v.{il}        F32 [d, d, n_head_kv]: R row-major per KV head
//   ott.center_k.{il}, ott.center_v.{il}  F32 [d, n_head_kv]
//
// Rotations must be orthogonal and every value finite; anything else is one error line.
#pragma once

#include "kv/kv_rotation.h"
#include "model.h"

// The fingerprint of a GGUF file's tensor data: its bytes from data_offset to the end as
// little-endian uint64 words w_i (the last zero-padded), h = Σ mix(w_i ^ i·GOLDEN) mod 2^64,
// then mix(h ^ n_bytes); mix = splitmix64's finaliser (ott_gguf/calibrate.py: data_hash).
ott_status ott_gguf_data_hash(const char * path, uint64_t data_offset, uint64_t & out);

// Read the sidecar at path for model m: per layer the rotations and centres it holds of keys
// (want_k) and values (want_v).
ott_status ott_kv_calib_load(const char * path, const ott_model & m, bool want_k, bool want_v,
                             std::vector<ott_kv_rot_layer> & out);
