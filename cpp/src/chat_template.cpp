#include "chat_template.h"

#include "error.h"

namespace specedge {

namespace {
using Messages = std::vector<std::pair<std::string, std::string>>;

// ChatML; a template that injects a default system message when none is given (SmolLM2) has it
// as the literal after "messages[0]['role'] != 'system'".
std::string chatml(const std::string& tpl, const Messages& msgs, bool add_gen) {
  std::string out;
  size_t cond = tpl.find("messages[0]['role'] != 'system'");
  std::string key = "<|im_start|>system\n";
  if (msgs[0].first != "system" && cond != std::string::npos) {
    size_t a = tpl.find(key, cond), b = a == std::string::npos ? a : tpl.find("<|im_end|>", a);
    if (a != std::string::npos && b != std::string::npos) out += tpl.substr(a, b - a) + "<|im_end|>\n";
  }
  for (const auto& [role, content] : msgs) out += "<|im_start|>" + role + "\n" + content + "<|im_end|>\n";
  if (add_gen) out += "<|im_start|>assistant\n";
  return out;
}

// Gemma: BOS, the system message folded into the first user turn, "assistant" is "model".
std::string gemma(const std::optional<std::string>& bos, const Messages& msgs, bool add_gen) {
  std::string out = bos ? *bos : std::string();
  std::string system;
  size_t i = 0;
  if (msgs[0].first == "system") {
    system = msgs[0].second + "\n\n";
    i = 1;
  }
  for (bool first = true; i < msgs.size(); ++i, first = false) {
    std::string role = msgs[i].first == "assistant" ? "model" : msgs[i].first;
    out += "<start_of_turn>" + role + "\n" + (first ? system : "") + msgs[i].second + "<end_of_turn>\n";
  }
  if (add_gen) out += "<start_of_turn>model\n";
  return out;
}
}  // namespace

std::string apply_chat_template(const std::string& tpl, const std::optional<std::string>& bos, const Messages& msgs,
                                bool add_gen) {
  if (msgs.empty()) fail_arg("messages must be a non-empty list");
  if (tpl.find("<|im_start|>") != std::string::npos) return chatml(tpl, msgs, add_gen);
  if (tpl.find("<start_of_turn>") != std::string::npos) return gemma(bos, msgs, add_gen);
  fail_arg("the bundle's chat template is not a format this runtime knows (ChatML or Gemma)");
}

}  // namespace specedge
