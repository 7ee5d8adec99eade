// Internal error type: thrown inside the library, turned into a status code + message at the C
// boundary (capi.cpp). Messages are one sentence meant for the user.
#pragma once
#include <stdexcept>
#include <string>

#include "specedge.h"

namespace specedge {

class Error : public std::runtime_error {
 public:
  Error(specedge_status code, const std::string& msg) : std::runtime_error(msg), code_(code) {}
  specedge_status code() const { return code_; }

 private:
  specedge_status code_;
};

[[noreturn]] inline void fail_bundle(const std::string& m) { throw Error(SPECEDGE_ERR_BUNDLE, m); }
[[noreturn]] inline void fail_arg(const std::string& m) { throw Error(SPECEDGE_ERR_INVALID_ARGUMENT, m); }
[[noreturn]] inline void fail_backend(const std::string& m) { throw Error(SPECEDGE_ERR_BACKEND, m); }
[[noreturn]] inline void fail_io(const std::string& m) { throw Error(SPECEDGE_ERR_IO, m); }

}  // namespace specedge
