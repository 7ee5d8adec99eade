// specedge_generate BUNDLE PROMPT|- [options]: generate text with speculative decoding, streamed
// to stdout (or one JSON object with --json), through the C++ wrapper of the C API.
// Bad input: exit code 2 and one line "error: ..." on stderr.
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "specedge.hpp"

namespace {

const char* kUsage =
    "usage: specedge_generate BUNDLE PROMPT|- [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]\n"
    "                         [--seed S] [--spec-tokens K] [--no-spec] [--adaptive-k] [--no-guard] [--tree]\n"
    "                         [--draft model|ngram|head] [--stop STR]... [--threads N] [--backend "
    "auto|ort-cpu|tensorrt]\n"
    "                         [--verify full|size|none] [--chat] [--system TEXT] [--json] [--stats]\n"
    "Greedy by default (temperature 0): exactly the target's own output.\n";

constexpr long long kMaxThreads = 1024;  // as the Python CLI and the C API

constexpr int kExitWrite = 74;  // an output that could not be written (docs/security.md's table)

// Writes to stdout through stdio, so a failed write keeps its errno: EPIPE (the reader left) ends
// the program quietly with 0, as the Python CLI; any other (a full disk) is one error line, exit 74.
int out_errno = 0;

bool put_out(const char* text, size_t len) {
  if (out_errno) return false;
  errno = 0;
  if ((len && std::fwrite(text, 1, len, stdout) != len) || std::fflush(stdout) != 0) out_errno = errno ? errno : EIO;
  return !out_errno;
}

int output_status() {
  if (!out_errno || out_errno == EPIPE) return 0;
  std::fprintf(stderr, "error: cannot write to standard output: %s\n", std::strerror(out_errno));
  return kExitWrite;
}

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

long long to_int(const std::string& opt, const std::string& v) {
  errno = 0;
  char* end = nullptr;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end || errno) throw UsageError("argument " + opt + ": invalid int value: '" + v + "'");
  return x;
}

// A seed: 0..SPECEDGE_SEED_MAX (the Python CLI's range and message).
uint64_t to_seed(const std::string& opt, const std::string& v) {
  const std::string range =
      opt + " must be an integer from 0 to " + std::to_string(SPECEDGE_SEED_MAX) + " (2^64-1), got " + v;
  if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos) {
    if (v.size() > 1 && v[0] == '-' && v.find_first_not_of("0123456789", 1) == std::string::npos)
      throw UsageError(range);
    throw UsageError("argument " + opt + ": invalid int value: '" + v + "'");
  }
  errno = 0;
  unsigned long long x = std::strtoull(v.c_str(), nullptr, 10);
  if (errno == ERANGE || x > SPECEDGE_SEED_MAX) throw UsageError(range);
  return uint64_t(x);
}

double to_float(const std::string& opt, const std::string& v) {
  errno = 0;
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end || errno) throw UsageError("argument " + opt + ": invalid float value: '" + v + "'");
  return x;
}

// The stats object of the Python CLI's --json, key for key (specedge/runtime/generator.py): the
// speculative-only keys appear only for a speculative request, as there.
nlohmann::json stats_json(const specedge_stats& s, const std::string& drafter) {
  nlohmann::json hist = nlohmann::json::array();
  for (int i = 0; i < s.n_accepted_histogram; ++i) hist.push_back(s.accepted_histogram[i]);
  nlohmann::json st = {{"tokens", s.tokens},
                       {"prompt_tokens", s.prompt_tokens},
                       {"tokens_per_s", s.tokens_per_s},
                       {"e2e_tokens_per_s", s.e2e_tokens_per_s},
                       {"ttft_s", s.ttft_s},
                       {"prefill_s", s.ttft_s},
                       {"decode_s", s.decode_s},
                       {"total_s", s.total_s},
                       {"time_draft_s", s.time_draft_s},
                       {"time_verify_s", s.time_verify_s},
                       {"time_other_s", s.time_other_s},
                       {"speculative", bool(s.speculative)},
                       {"drafter", s.speculative ? nlohmann::json(drafter) : nlohmann::json()},
                       {"acceptance_rate", s.acceptance_rate},
                       {"mean_accepted", s.mean_accepted},
                       {"accepted_histogram", hist},
                       {"target_calls", s.target_calls},
                       {"drafted", s.drafted},
                       {"accepted", s.accepted},
                       {"prefix_reused_tokens", s.prefix_reused_tokens},
                       {"k", s.k},
                       {"k_final", s.k_final},
                       {"fallbacks", s.fallbacks}};
  if (s.speculative) {
    nlohmann::json kh = nlohmann::json::object();
    for (int k = 0; k <= SPECEDGE_MAX_SPEC_TOKENS; ++k)
      if (s.k_histogram[k]) kh[std::to_string(k)] = s.k_histogram[k];
    st["k_histogram"] = kh;
    st["fallback_tokens"] = s.fallback_tokens;
    st["k_shrinks"] = s.k_shrinks;
    st["alpha_estimate"] = std::round(s.alpha_estimate * 1e4) / 1e4;
    st["draft_calls"] = s.draft_calls;
    st["draft_kv_copied"] = s.draft_kv_copied;
    if (s.tree_rounds) {  // only where trees ran, as the Python stats
      st["tree_rounds"] = s.tree_rounds;
      st["trees_off"] = bool(s.trees_off);
    }
  }
  return st;
}

}  // namespace

int main(int argc, char** argv) {
  // A reader that leaves (`specedge_generate B P | head`) makes writes fail instead of killing us;
  // generation then stops and the program ends quietly, like the Python CLI.
  std::signal(SIGPIPE, SIG_IGN);
  std::vector<std::string> pos;
  specedge::GenParams gp;
  specedge::OpenOptions oo;
  bool json = false, stats = false, chat = false;
  std::optional<std::string> system;
  int threads = 0;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw UsageError("argument " + a + ": expected one argument");
        return argv[++i];
      };
      if (a == "-h" || a == "--help") {
        std::cout << kUsage;
        return 0;
      } else if (a == "--max-new-tokens") {
        long long v = to_int(a, value());
        if (v < 1) throw UsageError("--max-new-tokens must be >= 1, got " + std::to_string(v));
        if (v > 1 << 30)
          throw UsageError("--max-new-tokens must be <= " + std::to_string(1 << 30) + ", got " + std::to_string(v));
        gp.max_new_tokens = int(v);
      } else if (a == "--temperature") {
        gp.temperature = to_float(a, value());
        if (!(gp.temperature >= 0) || std::isinf(gp.temperature))
          throw UsageError("--temperature must be a finite number >= 0, got " + std::string(argv[i]));
      } else if (a == "--top-k") {
        long long v = to_int(a, value());
        if (v < 0) throw UsageError("--top-k must be >= 0 (0 disables it), got " + std::to_string(v));
        if (v > 1 << 30)
          throw UsageError("--top-k must be <= " + std::to_string(1 << 30) + ", got " + std::to_string(v));
        gp.top_k = int(v);
      } else if (a == "--top-p") {
        gp.top_p = to_float(a, value());
        if (!(gp.top_p > 0 && gp.top_p <= 1))
          throw UsageError("--top-p must be in (0, 1], got " + std::string(argv[i]));
      } else if (a == "--seed") {
        gp.seed = to_seed(a, value());
      } else if (a == "--spec-tokens") {
        long long v = to_int(a, value());
        if (v < 1 || v > SPECEDGE_MAX_SPEC_TOKENS)
          throw UsageError("--spec-tokens must be between 1 and " + std::to_string(SPECEDGE_MAX_SPEC_TOKENS) +
                           ", got " + std::to_string(v));
        gp.spec_tokens = int(v);
      } else if (a == "--threads") {
        long long v = to_int(a, value());
        if (v < 1) throw UsageError("--threads must be >= 1, got " + std::to_string(v));
        if (v > kMaxThreads)
          throw UsageError("--threads must be <= " + std::to_string(kMaxThreads) + ", got " + std::to_string(v));
        threads = int(v);
      } else if (a == "--no-spec") {
        gp.speculative = false;
      } else if (a == "--adaptive-k") {
        gp.adaptive_k = true;
      } else if (a == "--no-guard") {
        gp.guard = false;
      } else if (a == "--tree") {
        gp.tree = true;
      } else if (a == "--draft") {
        std::string d = value();
        // "head": the bundle's trained draft head (ort-cpu); the library refuses a bundle without one.
        if (d != "model" && d != "ngram" && d != "head")
          throw UsageError("argument --draft: invalid choice: '" + d + "' (choose from 'model', 'ngram', 'head')");
        oo.draft(d);
      } else if (a == "--stop") {
        std::string s = value();
        if (s.empty()) throw UsageError("--stop strings must not be empty");
        gp.stop.push_back(s);
      } else if (a == "--backend") {
        std::string b = value();
        // "tensorrt" is passed on: the library says whether it was built with TensorRT, and how to get it.
        if (b != "auto" && b != "ort-cpu" && b != "tensorrt")
          throw UsageError("argument --backend: invalid choice: '" + b +
                           "' (choose from 'auto', 'ort-cpu', 'tensorrt')");
        oo.backend(b);
      } else if (a == "--verify") {
        std::string v = value();
        if (v != "full" && v != "size" && v != "none")
          throw UsageError("argument --verify: invalid choice: '" + v + "' (choose from 'full', 'size', 'none')");
        oo.verify(v);
      } else if (a == "--chat") {
        chat = true;
      } else if (a == "--system") {
        system = value();
      } else if (a == "--json") {
        json = true;
      } else if (a == "--stats") {
        stats = true;
      } else if (a.size() > 1 && a[0] == '-' && a != "-") {
        throw UsageError("unrecognized argument: " + a);
      } else {
        pos.push_back(a);
      }
    }
    if (pos.size() != 2)
      throw UsageError(pos.size() < 2 ? "the following arguments are required: BUNDLE PROMPT"
                                      : "unrecognized argument: " + pos[2]);
    std::string prompt = pos[1];
    if (prompt == "-") {
      prompt.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
      if (!prompt.empty() && prompt.back() == '\n') prompt.pop_back();
    }
    if (prompt.empty()) throw UsageError("the prompt is empty");
    if (system && !chat) throw UsageError("--system needs --chat");
    if (threads) oo.threads(threads);

    specedge::Model model(pos[0], oo);
    if (chat) {
      std::vector<std::pair<std::string, std::string>> msgs;
      if (system) msgs.emplace_back("system", *system);
      msgs.emplace_back("user", prompt);
      prompt = model.apply_chat(msgs);
    }
    specedge::Result r;
    if (json) {
      r = chat ? model.generate(model.tokenize(prompt, 0), gp) : model.generate(prompt, gp);
      std::string doc = nlohmann::json{{"text", r.text},
                                       {"token_ids", r.token_ids},
                                       {"finish_reason", r.finish_reason},
                                       {"stats", stats_json(r.stats, model.drafter_kind())}}
                            .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) +
                        "\n";
      if (!put_out(doc.data(), doc.size())) return output_status();
    } else {
      auto cb = [](int32_t, std::string_view text) {
        return put_out(text.data(), text.size());  // false: stdout failed, stop generating
      };
      r = chat ? model.generate(model.tokenize(prompt, 0), gp, cb) : model.generate(prompt, gp, cb);
      if (!put_out("\n", 1)) return output_status();
    }
    if (stats) {
      const specedge_stats& s = r.stats;
      std::fprintf(stderr,
                   "stats: %lld tokens | %.1f tok/s | ttft %.0f ms | %s | acceptance %.2f | %.2f tokens/target call "
                   "| k %d->%d | %d fallback(s) | finish %s\n",
                   (long long)s.tokens, s.tokens_per_s, s.ttft_s * 1000,
                   s.speculative ? (model.drafter_kind() + " draft").c_str() : "target only", s.acceptance_rate,
                   s.mean_accepted, s.k, s.k_final, s.fallbacks, r.finish_reason.c_str());
    }
  } catch (const UsageError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const specedge::Exception& e) {
    // ONNX Runtime refusing a graph is about the bundle (as in the Python CLI): exit 2 like other
    // bad input; 1 is left for faults of this program.
    std::fprintf(stderr, "error: %s\n", e.what());
    return e.status() == SPECEDGE_ERR_INTERNAL ? 1 : 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: internal error: %s\n", e.what());
    return 1;
  }
  return 0;
}
