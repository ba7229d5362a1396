// Exceptions thrown by moelink. Every message names what was wrong: the field
// or peer, the value seen and the rule or the phase.
#pragma once

#include <stdexcept>
#include <string>

namespace moelink {

// Base class of every moelink error.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A configuration field or call argument (shape, dtype, stride, call order) is
// invalid. Raised on the host before anything is launched.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A peer did not arrive within the timeout (MOELINK_TIMEOUT_S, default 30 s),
// a transfer to a peer failed (it is gone), or the process bootstrap could
// not reach a peer. The AllToAll object is unusable afterwards: destroy it.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// The device (or the CPU backend) saw bad input while running: an expert id
// outside [0, num_experts), bound_m > max_num_tokens, or more routes to one
// expert than it has rows. The offending routes were dropped, nothing was
// written out of bounds. Reported by AllToAll::check().
class InputError : public Error {
 public:
  using Error::Error;
};

// A CUDA, shared-memory or socket call failed.
class SystemError : public Error {
 public:
  using Error::Error;
};

}  // namespace moelink
