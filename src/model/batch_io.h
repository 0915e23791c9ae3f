// Reading a micro-batch from a safetensors file (the `moetron forward` input contract, DESIGN §2):
//   input_ids (I32/I64 [B,T], required), labels, attention_mask, position_ids, segment_ids
//   (optional, same shape and integer dtypes).
#pragma once

#include <string>

#include "model/model.h"

namespace moetron {

Batch read_batch_safetensors(const std::string& path);

// Error naming the field and position unless the batch is well formed: B, T > 0; every given field
// has B*T values; input ids inside [0, vocab_size); labels inside it or -100; positions >= 0;
// attention_mask 0 or 1.
void validate_batch(const Batch& b, int vocab_size);

}  // namespace moetron
