// The files an ONNX graph makes ONNX Runtime open: the external-data `location`s its tensors
// name, read from the graph's protobuf before any session exists (specedge/bundle_files.py is
// the same check in Python; both follow docs/security.md).
#pragma once
#include <string>
#include <vector>

#include "manifest.h"

namespace specedge {

// Every external-data location in an ONNX ModelProto, in order, repeats removed. Throws
// std::invalid_argument when the bytes are not a well-formed protobuf or nest too deeply.
std::vector<std::string> external_locations(const std::string& model_bytes);

// Refuses (SPECEDGE_ERR_BUNDLE) a graph whose external data is absolute, climbs out with "..",
// leaves the bundle through a link or is not among the graph's `external_data` in the manifest.
void check_graph_files(const Manifest& m);

}  // namespace specedge
