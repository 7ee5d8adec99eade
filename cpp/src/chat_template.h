// The bundle's chat format (mirrors specedge/runtime/chat_template.py's matcher): the template's
// text is recognised as ChatML or Gemma and rendered by hand, so no Jinja engine is needed.
#pragma once
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace specedge {

// Messages (role, content) in the format `tpl` (the template's text) names; `bos`: the BOS
// token's text, which Gemma's format starts with. Refuses (SPECEDGE_ERR_INVALID_ARGUMENT) no
// messages and a template of another format.
std::string apply_chat_template(const std::string& tpl, const std::optional<std::string>& bos,
                                const std::vector<std::pair<std::string, std::string>>& msgs, bool add_gen);

}  // namespace specedge
