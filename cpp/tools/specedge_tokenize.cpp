// Test tool: tokenizer parity with the Python `tokenizers` library.
//   specedge_tokenize TOKENIZER_JSON IN.json OUT.json
// IN.json is a list of strings; OUT.json gets {"ids": [[...], ...], "decoded": ["...", ...]}
// (decoded = decode(ids) with special tokens skipped).
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "error.h"
#include "tokenizer.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: specedge_tokenize TOKENIZER_JSON IN.json OUT.json\n");
    return 2;
  }
  try {
    auto tok = specedge::Tokenizer::from_file(argv[1]);
    std::ifstream in(argv[2]);
    std::stringstream ss;
    ss << in.rdbuf();
    auto texts = nlohmann::json::parse(ss.str());
    nlohmann::json ids = nlohmann::json::array(), dec = nlohmann::json::array();
    for (const auto& t : texts) {
      auto v = tok.encode(t.get<std::string>());
      ids.push_back(v);
      dec.push_back(tok.decode(v));
    }
    std::ofstream out(argv[3]);
    out << nlohmann::json{{"ids", ids}, {"decoded", dec}}.dump(-1, ' ', false,
                                                               nlohmann::json::error_handler_t::replace);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  return 0;
}
