// Reading a micro-batch from a safetensors file (the `moetron forward` input contract, DESIGN §2):
//   input_ids (I32/I64 [B,T], required), labels, attention_mask, position_ids, segment_ids
//   (optional, same shape and integer dtypes).
#pragma once

#include <string>

#include "model/mixtral.h"

namespace moetron {

Batch read_batch_safetensors(const std::string& path);

}  // namespace moetron
