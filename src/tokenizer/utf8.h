// UTF-8 validation shared by the tokenizer and the JSONL reader.
#pragma once

#include <string_view>

namespace moetron {

// Strict UTF-8 (RFC 3629): no overlong forms, no surrogates, nothing above U+10FFFF.
bool is_valid_utf8(std::string_view s);

}  // namespace moetron
