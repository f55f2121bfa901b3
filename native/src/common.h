// common.h — status/error plumbing shared by every native file.
#pragma once

#include "ott.h"

#include <cstdarg>
#include <string>

// Record a one-line error message for ott_last_error() and return the status.
ott_status ott_fail(ott_status status, const char * fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

// Propagate a non-OK status.
#define OTT_TRY(expr)                                                                                                  \
    do {                                                                                                               \
        ott_status _st = (expr);                                                                                       \
        if (_st != OTT_OK) return _st;                                                                                 \
    } while (0)
