#include "bundle_files.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

#include "error.h"

namespace specedge {
namespace {

constexpr int kMaxNesting = 64;  // protobuf message levels (a subgraph adds 3), as in Python

// Message kinds and, per kind, field number -> kind of the embedded message (onnx.proto3).
enum Kind { kModel, kTraining, kFunction, kGraph, kNode, kAttribute, kSparse, kTensor };

Kind child_kind(Kind parent, uint64_t field, bool* found) {
  static const std::map<std::pair<int, uint64_t>, Kind> table = {
      {{kModel, 7}, kGraph},         {{kModel, 20}, kTraining},   {{kModel, 25}, kFunction},
      {{kTraining, 1}, kGraph},      {{kTraining, 2}, kGraph},    {{kFunction, 7}, kNode},
      {{kFunction, 11}, kAttribute}, {{kGraph, 1}, kNode},        {{kGraph, 5}, kTensor},
      {{kGraph, 15}, kSparse},       {{kNode, 5}, kAttribute},    {{kAttribute, 5}, kTensor},
      {{kAttribute, 6}, kGraph},     {{kAttribute, 10}, kTensor}, {{kAttribute, 11}, kGraph},
      {{kAttribute, 22}, kSparse},   {{kAttribute, 23}, kSparse}, {{kSparse, 1}, kTensor},
      {{kSparse, 2}, kTensor}};
  auto it = table.find({parent, field});
  *found = it != table.end();
  return *found ? it->second : kModel;
}

struct Malformed : std::invalid_argument {
  Malformed() : std::invalid_argument("it is not a valid ONNX protobuf") {}
};

uint64_t varint(const std::string& b, size_t& pos, size_t end) {
  uint64_t v = 0;
  for (int shift = 0;; shift += 7) {
    if (pos >= end || shift > 63) throw Malformed();
    uint8_t c = uint8_t(b[pos++]);
    v |= uint64_t(c & 0x7F) << shift;
    if (c < 0x80) return v;
  }
}

struct Field {
  uint64_t number;
  int wire;
  uint64_t value;     // wire 0
  size_t start, end;  // wire 2
};

// Calls f(field) for each field of the message in [start, end).
template <class F>
void for_fields(const std::string& b, size_t start, size_t end, F&& f) {
  size_t pos = start;
  while (pos < end) {
    uint64_t tag = varint(b, pos, end);
    Field fd{tag >> 3, int(tag & 7), 0, 0, 0};
    if (fd.wire == 0) {
      fd.value = varint(b, pos, end);
    } else if (fd.wire == 2) {
      uint64_t n = varint(b, pos, end);
      if (n > end - pos) throw Malformed();
      fd.start = pos;
      fd.end = pos + size_t(n);
      pos = fd.end;
    } else if (fd.wire == 1) {
      if (end - pos < 8) throw Malformed();
      pos += 8;
    } else if (fd.wire == 5) {
      if (end - pos < 4) throw Malformed();
      pos += 4;
    } else {
      throw Malformed();  // groups and unknown wire types: not in ONNX
    }
    f(fd);
  }
}

// The location of a tensor stored outside the graph file, or false.
bool tensor_location(const std::string& b, size_t start, size_t end, std::string* loc) {
  bool external = false, named = false;
  for_fields(b, start, end, [&](const Field& fd) {
    if (fd.number == 14 && fd.wire == 0) external = fd.value == 1;
    if (fd.number == 13 && fd.wire == 2) {
      std::string key, value;
      bool has_value = false;
      for_fields(b, fd.start, fd.end, [&](const Field& e) {
        if (e.wire != 2) return;
        if (e.number == 1) key = b.substr(e.start, e.end - e.start);
        if (e.number == 2) value = b.substr(e.start, e.end - e.start), has_value = true;
      });
      if (key == "location") {
        *loc = has_value ? value : "";
        named = true;
      }
    }
  });
  return external || named;
}

// `text` for a one-line message: control characters (a NUL, a newline) escaped, as in Python.
std::string shown(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += char(c);
    }
  }
  return out;
}

}  // namespace

std::vector<std::string> external_locations(const std::string& b) {
  std::vector<std::string> found;
  struct Item {
    Kind kind;
    size_t start, end;
    int depth;
  };
  std::vector<Item> stack{{kModel, 0, b.size(), 0}};
  while (!stack.empty()) {
    Item it = stack.back();
    stack.pop_back();
    if (it.depth > kMaxNesting)
      throw std::invalid_argument("it nests subgraphs more than " + std::to_string(kMaxNesting) +
                                  " protobuf levels deep");
    if (it.kind == kTensor) {
      std::string loc;
      if (tensor_location(b, it.start, it.end, &loc) && std::find(found.begin(), found.end(), loc) == found.end())
        found.push_back(loc);
      continue;
    }
    for_fields(b, it.start, it.end, [&](const Field& fd) {
      bool known = false;
      Kind child = child_kind(it.kind, fd.number, &known);
      if (known && fd.wire == 2) stack.push_back({child, fd.start, fd.end, it.depth + 1});
    });
  }
  return found;
}

void check_graph_files(const Manifest& m) {
  for (const ModelSpec* spec : {&m.target, &m.draft, &m.head}) {  // m.head: kind "" and no graphs without a head
    if (!spec->is_model() && spec->kind != "head") continue;
    for (const auto& g : spec->graphs) {
      std::ifstream in(m.path(g.path), std::ios::binary);
      if (!in) fail_bundle("cannot read the " + spec->role + " graph '" + g.path + "'");
      std::stringstream ss;
      ss << in.rdbuf();
      std::string bytes = ss.str();
      std::vector<std::string> locations;
      try {
        if (bytes.empty()) throw std::invalid_argument("it is empty");
        locations = external_locations(bytes);
      } catch (const std::invalid_argument& e) {
        fail_bundle("the " + spec->role + " graph '" + g.path + "' is not a usable ONNX file: " + e.what());
      }
      std::string folder = g.path.find('/') == std::string::npos ? "" : g.path.substr(0, g.path.rfind('/') + 1);
      for (const auto& loc : locations) {
        bool bad = loc.empty() || loc[0] == '/' || loc.find('\\') != std::string::npos ||
                   loc.find(':') != std::string::npos || loc.find('\0') != std::string::npos;
        std::stringstream parts(loc);
        std::string part, rel = folder;
        bool first = true;
        while (!bad && std::getline(parts, part, '/')) {
          if (part == "..") bad = true;
          if (part.empty() || part == ".") continue;
          rel += (first ? "" : "/") + part;
          first = false;
        }
        if (bad)
          fail_bundle("the " + spec->role + " graph '" + g.path + "' reads weights from '" + shown(loc) +
                      "', outside the bundle");
        resolve_inside(m.root, rel);  // a link that leaves the bundle
        if (std::find(g.external_data.begin(), g.external_data.end(), rel) == g.external_data.end())
          fail_bundle("the " + spec->role + " graph '" + g.path + "' reads weights from '" + shown(loc) +
                      "', which the manifest does not list as its external data");
      }
    }
  }
}

}  // namespace specedge
