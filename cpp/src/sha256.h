// SHA-256 (FIPS 180-4), small and dependency-free: the manifest's file checksums.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace specedge {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  std::string hex_digest();  // finalizes; the object must not be updated afterwards

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
};

std::string sha256_hex(const std::string& data);
// Hex digest of a file's content; throws specedge::Error (SPECEDGE_ERR_IO) when unreadable.
std::string sha256_file(const std::string& path);

}  // namespace specedge
