// gguf_scan.h — a bounded walk over a GGUF file's header before ggml parses it.
#pragma once

#include "common.h"

#include <cstdint>

// Counts of the header a file may declare. ggml's parser compares every key and tensor name
// with all the ones before it (quadratic in their number) and trusts the counts it reads;
// real models hold tens of keys and at most a few thousand tensors (1024 layers × ~12).
#define OTT_GGUF_MAX_KV 4096
#define OTT_GGUF_MAX_TENSORS 16384

// Walk the metadata section of the GGUF file at `path` (f is open on it, file_size its
// length): the counts are within the limits above, every length stays inside the file, keys
// and string values hold no NUL byte (C strings would silently cut them: "llama\0x" would
// read as "llama"), and no array nests another. OTT_ERR_FORMAT naming the key otherwise.
ott_status ott_gguf_scan(const char * path, FILE * f, int64_t file_size);
