"""Generate the cffi API-mode C source for native/include/ott.h.

The cdef is ott.h itself with preprocessor lines and the C++ guards removed, so the
declarations the binding uses are exactly the ones the compiler checks.
Usage: build_ffi.py path/to/ott.h out.c
"""

import sys

import cffi


def header_cdef(text: str) -> str:
    out, skip = [], False
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#ifdef __cplusplus"):
            skip = True
            continue
        if skip:
            skip = not s.startswith("#endif")
            continue
        if s.startswith("#"):
            continue
        out.append(line)
    return "\n".join(out)


def main(header: str, out_c: str) -> None:
    with open(header, encoding="utf-8") as f:
        cdef = header_cdef(f.read())
    ffi = cffi.FFI()
    ffi.cdef(cdef)
    ffi.set_source("ott_gguf._native._ott_cffi", '#include "ott.h"')
    ffi.emit_c_code(out_c)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
