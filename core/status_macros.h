// status_macros.h: RETURN_IF_ERROR, for functions that run a chain of checks
// each returning an absl::Status and stop at the first failure.
#pragma once

#include "absl/status/status.h"

// Evaluates `expr` (an absl::Status) once; returns it from the enclosing
// function unless it is OK.
#define RETURN_IF_ERROR(expr)                                                \
  do {                                                                       \
    if (::absl::Status status_if_error = (expr); !status_if_error.ok()) {    \
      return status_if_error;                                                \
    }                                                                        \
  } while (false)
