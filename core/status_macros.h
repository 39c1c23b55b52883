// status_macros.h: RETURN_IF_ERROR and ASSIGN_OR_RETURN, for functions that
// run a chain of checks each returning an absl::Status (or StatusOr) and
// stop at the first failure.
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

#define ATTENTION_STATUS_CONCAT_INNER(a, b) a##b
#define ATTENTION_STATUS_CONCAT(a, b) ATTENTION_STATUS_CONCAT_INNER(a, b)

// Evaluates `expr` (an absl::StatusOr<T>) once; returns its status from the
// enclosing function unless it is OK, else assigns its value to `lhs` (a
// declaration or an lvalue).
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL(ATTENTION_STATUS_CONCAT(status_or_value_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL(result, lhs, expr) \
  auto result = (expr);                          \
  if (!result.ok()) return result.status();      \
  lhs = std::move(*result)
