// GGUF: the writer and reader of io/gguf on their own, and `moetron export gguf` through the binary,
// read back with the reader. For every architecture: the metadata equals config.json; every tensor
// is there under llama.cpp's name with its shape and type, and holds exactly the bf16 / f16 / f32
// encoding of the weights moetron loads (the llama architecture's q/k rows un-permuted back from
// llama.cpp's interleaved-pair order first); the vocabulary equals moetron's tokenizer (pieces,
// scores and types of the SentencePiece model; pieces, added-token types and merges of the
// tokenizer.json); configs llama.cpp would compute differently and bad input are refused with exit 2,
// naming the field or file, and nothing is written. No network and no llama.cpp needed
// (tools/check_gguf_llama.sh runs the files in llama.cpp).
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "io/gguf.h"
#include "io/hf_config.h"
#include "io/model_files.h"
#include "io/safetensors.h"
#include "model/params.h"
#include "model/weights.h"
#include "interrupt_cli.h"
#include "temp_dir.h"
#include "tokenizer/sp_model.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;
using namespace moetron;
using gguf::TensorType;
using nlohmann::json;

namespace {

const fs::path kGolden = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden";
const fs::path kShared = fs::path(MOETRON_SOURCE_DIR) / ".." / "shared" / "data";

struct Dir : moetron::testing::TestDir {
  Dir() : TestDir("gguf") {}
};

using moetron::testing::read_text;

void write_text(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary);
  f << s;
}

std::set<std::string> entries(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

struct CliRun {
  int exit_code = -1;
  std::string out, err;
};

CliRun run_export(const Dir& d, const std::string& args) {
  const fs::path out = d.path / "stdout.txt", err = d.path / "stderr.txt";
  const std::string cmd =
      std::string(MOETRON_BINARY) + " export gguf " + args + " > " + out.string() + " 2> " + err.string();
  const int status = std::system(cmd.c_str());
  CliRun r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = read_text(out);
  r.err = read_text(err);
  fs::remove(out);
  fs::remove(err);
  return r;
}

// Appended piece by piece: GCC 12 reports a false -Wrestrict for "'" + std::string (its bug 105329).
std::string q(const fs::path& p) {
  std::string s = "'";
  s += p.string();
  s += '\'';
  return s;
}

// Exit 2 naming every needle, and the output directory holds what it held before (no GGUF, no
// temporary file).
void expect_refused(const CliRun& r, const std::vector<std::string>& needles, const fs::path& out_dir,
                    const std::set<std::string>& before) {
  EXPECT_EQ(r.exit_code, 2) << r.err;
  for (const std::string& n : needles)
    EXPECT_NE(r.err.find(n), std::string::npos) << "missing '" << n << "' in: " << r.err;
  EXPECT_EQ(entries(out_dir), before);
}

// ---- model directories built for the tests -------------------------------------------------------

// A copy of model `src` in `dst` with config.json edited by `edit`, only the decoder layers `keep`
// (renumbered from 0; empty: all), every kept tensor byte for byte, and the tokenizer files.
void derive(const fs::path& src, const fs::path& dst, const std::function<void(json&)>& edit,
            const std::vector<int>& keep = {}) {
  fs::create_directories(dst);
  json cfg = json::parse(read_text(src / "config.json"));
  if (!keep.empty()) cfg["num_hidden_layers"] = keep.size();
  edit(cfg);
  write_text(dst / "config.json", cfg.dump(2));
  const ModelTensors m = ModelTensors::open(src.string());
  SafetensorsWriter w;
  for (const std::string& name : m.names()) {
    std::string out = name;
    const std::string pre = "model.layers.";
    if (!keep.empty() && name.rfind(pre, 0) == 0) {
      const size_t dot = name.find('.', pre.size());
      const int l = std::stoi(name.substr(pre.size(), dot - pre.size()));
      const auto it = std::find(keep.begin(), keep.end(), l);
      if (it == keep.end()) continue;
      out = pre + std::to_string(it - keep.begin()) + name.substr(dot);
    }
    const TensorView& t = m.get(name);
    w.add_copy(out, t.dtype, t.shape, t.data);
  }
  w.write((dst / "model.safetensors").string());
  for (const char* f : {"tokenizer.model", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"})
    if (fs::exists(src / f)) fs::copy_file(src / f, dst / f);
}

// Sets element `index` of tensor `name` in `model`'s model.safetensors to `value`, the tensor stored as
// bf16 (the other tensors byte for byte).
void set_weight(const fs::path& model, const std::string& name, size_t index, float value) {
  const fs::path tmp = model / "tmp.safetensors";
  {
    const ModelTensors m = ModelTensors::open(model.string());
    SafetensorsWriter w;
    std::vector<float> v;
    for (const std::string& n : m.names()) {
      if (n == name) {
        v = to_f32(m.get(n));
        v.at(index) = value;
        w.add_f32(n, m.get(n).shape, v.data(), DType::BF16);
      } else {
        w.add_copy(n, m.get(n).dtype, m.get(n).shape, m.get(n).data);
      }
    }
    w.write(tmp.string());
  }
  fs::rename(tmp, model / "model.safetensors");
}

// Qwen's split pattern, as tokenizer.json stores it.
constexpr const char* kQwenPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// A small byte-level BPE tokenizer.json: three special added tokens (0-2), the letters a-z (3-28),
// "Ġ" (29), "ab" "Ġa" "abc" (30-32) from merges in both spellings, no piece for id 33, and a
// non-special added token "<extra>" (34). The added tokens are vocabulary pieces too (as GPT-2's
// <|endoftext|> is), the only way their ids, and the hole at 33, are the ones Hugging Face tokenizers
// gives. `qwen_split`: Qwen's Split + ByteLevel pre-tokenizer, else GPT-2's lone ByteLevel.
json small_tokenizer_json(bool qwen_split) {
  json vocab = {{"<|endoftext|>", 0}, {"<|im_start|>", 1}, {"<|im_end|>", 2}, {"<extra>", 34}};
  int id = 3;
  for (char c = 'a'; c <= 'z'; c++) vocab[std::string(1, c)] = id++;
  vocab["\u0120"] = 29;
  vocab["ab"] = 30;
  vocab["\u0120a"] = 31;
  vocab["abc"] = 32;
  auto added = [](int i, const char* content, bool special) {
    return json{{"id", i},         {"content", content},  {"single_word", false}, {"lstrip", false},
                {"rstrip", false}, {"normalized", false}, {"special", special}};
  };
  json pre =
      qwen_split
          ? json{{"type", "Sequence"},
                 {"pretokenizers", json::array({json{{"type", "Split"},
                                                     {"pattern", {{"Regex", kQwenPattern}}},
                                                     {"behavior", "Isolated"},
                                                     {"invert", false}},
                                                json{{"type", "ByteLevel"},
                                                     {"add_prefix_space", false},
                                                     {"trim_offsets", false},
                                                     {"use_regex", false}}})}}
          : json{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  return json{
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", json::array({added(0, "<|endoftext|>", true), added(1, "<|im_start|>", true),
                                    added(2, "<|im_end|>", true), added(34, "<extra>", false)})},
      {"normalizer", nullptr},
      {"pre_tokenizer", pre},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", json::array({"a b", json::array({"\u0120", "a"}), "ab c"})}}}};
}

fs::path write_small_tokenizer(const fs::path& dir, bool qwen_split) {
  fs::create_directories(dir);
  write_text(dir / "tokenizer.json", small_tokenizer_json(qwen_split).dump(1));
  write_text(dir / "tokenizer_config.json", json{{"eos_token", "<|im_end|>"}, {"bos_token", nullptr}}.dump());
  return dir / "tokenizer.json";
}

// ---- what the GGUF must hold ----------------------------------------------------------------------

uint64_t kv_u32(const gguf::File& f, const std::string& key) {
  const gguf::Value* v = f.find(key);
  if (!v) {
    ADD_FAILURE() << "missing key " << key;
    return 0;
  }
  EXPECT_EQ(v->type, gguf::ValueType::u32) << key;
  return v->u;
}
double kv_f32(const gguf::File& f, const std::string& key) {
  const gguf::Value* v = f.find(key);
  if (!v) {
    ADD_FAILURE() << "missing key " << key;
    return 0;
  }
  EXPECT_EQ(v->type, gguf::ValueType::f32) << key;
  return v->f;
}
std::string kv_str(const gguf::File& f, const std::string& key) {
  const gguf::Value* v = f.find(key);
  if (!v) {
    ADD_FAILURE() << "missing key " << key;
    return "";
  }
  EXPECT_EQ(v->type, gguf::ValueType::string) << key;
  return v->s;
}
bool kv_bool(const gguf::File& f, const std::string& key) {
  const gguf::Value* v = f.find(key);
  if (!v) {
    ADD_FAILURE() << "missing key " << key;
    return false;
  }
  EXPECT_EQ(v->type, gguf::ValueType::boolean) << key;
  return v->u != 0;
}

// One expected GGUF tensor: HF-ordered fp32 values, its ggml shape and type; `heads` > 0 when the
// file holds the rows in llama.cpp's interleaved order (heads of head_dim rows).
struct Want {
  std::vector<int64_t> ne;
  TensorType type = TensorType::F32;
  std::vector<float> values;
  int64_t heads = 0;
};

std::vector<uint8_t> encode(TensorType t, const std::vector<float>& v) {
  if (t == TensorType::Q8_0) {  // llama.cpp's block_q8_0: f16 scale, 32 int8 (core/dtype.h's rule)
    std::vector<uint8_t> out(v.size() / 32 * 34);
    for (size_t b = 0; b < v.size() / 32; b++) {
      float d;
      quantize_q8_0_block(v.data() + b * 32, reinterpret_cast<int8_t*>(&out[b * 34 + 2]), d);
      const uint16_t h = f32_to_f16(d);
      std::memcpy(&out[b * 34], &h, 2);
    }
    return out;
  }
  const size_t es = t == TensorType::F32 ? 4 : 2;
  std::vector<uint8_t> out(v.size() * es);
  for (size_t i = 0; i < v.size(); i++) {
    if (t == TensorType::F32) {
      std::memcpy(&out[i * 4], &v[i], 4);
    } else {
      const uint16_t h = t == TensorType::BF16 ? f32_to_bf16(v[i]) : f32_to_f16(v[i]);
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

// The GGUF tensors of a model as llama.cpp's loaders name and shape them, from moetron's weights.
std::map<std::string, Want> want_tensors(const ModelConfig& cfg, const ParamTable& t, const std::vector<float>& p,
                                         const std::string& arch, TensorType mt) {
  std::map<std::string, Want> w;
  const int64_t C = cfg.hidden_size, HD = cfg.head_dim, NH = cfg.num_attention_heads, NKV = cfg.num_key_value_heads;
  auto vals = [&](ParamKind k, int l, size_t from, size_t n) {
    const ParamSpec& s = t.at(k, l);
    return std::vector<float>(p.begin() + s.offset + from, p.begin() + s.offset + from + n);
  };
  auto whole = [&](ParamKind k, int l) { return vals(k, l, 0, t.at(k, l).numel); };
  auto put = [&](const std::string& name, std::vector<int64_t> ne, TensorType type, std::vector<float> v,
                 int64_t heads = 0) {
    // Q8_0 rows must be whole 32-value blocks: other matrices are written in bf16.
    if (type == TensorType::Q8_0 && ne[0] % 32 != 0) type = TensorType::BF16;
    w[name] = Want{std::move(ne), type, std::move(v), heads};
  };
  const bool llama = arch == "llama";
  const int64_t V = cfg.vocab_size;
  put("token_embd.weight", {C, V}, mt, whole(ParamKind::embedding, -1));
  for (int l = 0; l < cfg.num_hidden_layers; l++) {
    const std::string b = "blk." + std::to_string(l) + ".";
    put(b + "attn_norm.weight", {C}, TensorType::F32, whole(ParamKind::input_norm, l));
    put(b + "attn_q.weight", {C, NH * HD}, mt, whole(ParamKind::q_proj, l), llama ? NH : 0);
    put(b + "attn_k.weight", {C, NKV * HD}, mt, whole(ParamKind::k_proj, l), llama ? NKV : 0);
    put(b + "attn_v.weight", {C, NKV * HD}, mt, whole(ParamKind::v_proj, l));
    put(b + "attn_output.weight", {NH * HD, C}, mt, whole(ParamKind::o_proj, l));
    if (cfg.qkv_bias) {
      put(b + "attn_q.bias", {NH * HD}, TensorType::F32, whole(ParamKind::q_bias, l), llama ? NH : 0);
      put(b + "attn_k.bias", {NKV * HD}, TensorType::F32, whole(ParamKind::k_bias, l), llama ? NKV : 0);
      put(b + "attn_v.bias", {NKV * HD}, TensorType::F32, whole(ParamKind::v_bias, l));
    }
    if (cfg.qk_norm_full) {
      put(b + "attn_q_norm.weight", {NH * HD}, TensorType::F32, whole(ParamKind::q_norm, l));
      put(b + "attn_k_norm.weight", {NKV * HD}, TensorType::F32, whole(ParamKind::k_norm, l));
    } else if (cfg.qk_norm) {
      put(b + "attn_q_norm.weight", {HD}, TensorType::F32, whole(ParamKind::q_norm, l));
      put(b + "attn_k_norm.weight", {HD}, TensorType::F32, whole(ParamKind::k_norm, l));
    }
    const bool glm = arch == "glm4moe";  // the FFN input norm is post_attention_norm; the selection bias
    put(b + (glm ? "post_attention_norm.weight" : "ffn_norm.weight"), {C}, TensorType::F32,
        whole(ParamKind::post_norm, l));
    const int64_t I = cfg.ffn_size(l);
    if (cfg.is_moe_layer(l)) {
      const int64_t E = cfg.num_local_experts;
      put(b + "ffn_gate_inp.weight", {C, E}, TensorType::F32, whole(ParamKind::router, l));
      if (glm) put(b + "exp_probs_b.bias", {E}, TensorType::F32, whole(ParamKind::router_bias, l));
      std::vector<float> gate, up;  // w13 holds per expert I gate rows, then I up rows
      for (int64_t e = 0; e < E; e++) {
        const auto g = vals(ParamKind::ffn_w13, l, (size_t)(e * 2 * I * C), (size_t)(I * C));
        const auto u = vals(ParamKind::ffn_w13, l, (size_t)((e * 2 + 1) * I * C), (size_t)(I * C));
        gate.insert(gate.end(), g.begin(), g.end());
        up.insert(up.end(), u.begin(), u.end());
      }
      put(b + "ffn_gate_exps.weight", {C, I, E}, mt, gate);
      put(b + "ffn_up_exps.weight", {C, I, E}, mt, up);
      put(b + "ffn_down_exps.weight", {I, C, E}, mt, whole(ParamKind::ffn_w2, l));
    } else {
      put(b + "ffn_gate.weight", {C, I}, mt, vals(ParamKind::ffn_w13, l, 0, (size_t)(I * C)));
      put(b + "ffn_up.weight", {C, I}, mt, vals(ParamKind::ffn_w13, l, (size_t)(I * C), (size_t)(I * C)));
      put(b + "ffn_down.weight", {I, C}, mt, whole(ParamKind::ffn_w2, l));
    }
    if (cfg.has_shared_expert() && cfg.is_moe_layer(l)) {
      const int64_t Is = cfg.shared_expert_intermediate_size;
      if (cfg.shared_expert_gated())
        put(b + "ffn_gate_inp_shexp.weight", {C}, TensorType::F32, whole(ParamKind::shared_gate, l));
      put(b + "ffn_gate_shexp.weight", {C, Is}, mt, vals(ParamKind::shared_w13, l, 0, (size_t)(Is * C)));
      put(b + "ffn_up_shexp.weight", {C, Is}, mt, vals(ParamKind::shared_w13, l, (size_t)(Is * C), (size_t)(Is * C)));
      put(b + "ffn_down_shexp.weight", {Is, C}, mt, whole(ParamKind::shared_w2, l));
    }
  }
  put("output_norm.weight", {C}, TensorType::F32, whole(ParamKind::final_norm, -1));
  // Tied heads: llama / qwen3 / qwen3moe fall back to token_embd; olmoe / qwen2moe need output.weight.
  if (!cfg.tie_word_embeddings)
    put("output.weight", {C, V}, mt, whole(ParamKind::lm_head, -1));
  else if (arch == "olmoe" || arch == "qwen2moe")
    put("output.weight", {C, V}, mt, whole(ParamKind::embedding, -1));
  return w;
}

// The rows of `bytes` (heads of hd rows of row_bytes) taken back from llama.cpp's interleaved order:
// HF row h*hd + j*hd/2 + i is GGUF row h*hd + 2i + j.
std::vector<uint8_t> unpermute(const uint8_t* bytes, int64_t heads, int64_t hd, size_t row_bytes) {
  std::vector<uint8_t> out((size_t)(heads * hd) * row_bytes);
  for (int64_t h = 0; h < heads; h++)
    for (int64_t i = 0; i < hd / 2; i++)
      for (int64_t j = 0; j < 2; j++)
        std::memcpy(&out[(size_t)(h * hd + j * hd / 2 + i) * row_bytes],
                    bytes + (size_t)(h * hd + 2 * i + j) * row_bytes, row_bytes);
  return out;
}

struct Expect {
  std::string arch;
  TensorType type = TensorType::BF16;
  int context = 0;        // 0: max_position_embeddings
  std::string tokenizer;  // "" : the model directory's
};

// Everything the GGUF at `path` must hold for the model in `model_dir`.
void check_gguf(const fs::path& path, const fs::path& model_dir, const Expect& x) {
  SCOPED_TRACE(path.string());
  const ModelConfig cfg = load_model_config((model_dir / "config.json").string());
  const ParamTable table(cfg);
  const ModelTensors files = ModelTensors::open(model_dir.string());
  std::vector<float> params(table.total());
  load_hf_weights(files, table, params.data(), model_dir.string());
  const gguf::File f = gguf::File::open(path.string());
  const std::string& A = x.arch;

  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.data_offset() % 32, 0u);
  EXPECT_EQ(kv_str(f, "general.architecture"), A);
  EXPECT_EQ(kv_u32(f, "general.file_type"), x.type == TensorType::F32    ? 0u
                                             : x.type == TensorType::F16  ? 1u
                                             : x.type == TensorType::Q8_0 ? 7u
                                                                          : 32u);
  EXPECT_EQ(kv_u32(f, A + ".context_length"), (uint64_t)(x.context ? x.context : cfg.max_position_embeddings));
  EXPECT_EQ(kv_u32(f, A + ".embedding_length"), (uint64_t)cfg.hidden_size);
  EXPECT_EQ(kv_u32(f, A + ".block_count"), (uint64_t)cfg.num_hidden_layers);
  EXPECT_EQ(kv_u32(f, A + ".feed_forward_length"), (uint64_t)cfg.intermediate_size);
  EXPECT_EQ(kv_u32(f, A + ".attention.head_count"), (uint64_t)cfg.num_attention_heads);
  EXPECT_EQ(kv_u32(f, A + ".attention.head_count_kv"), (uint64_t)cfg.num_key_value_heads);
  EXPECT_EQ(kv_u32(f, A + ".attention.key_length"), (uint64_t)cfg.head_dim);
  EXPECT_EQ(kv_u32(f, A + ".attention.value_length"), (uint64_t)cfg.head_dim);
  EXPECT_EQ(kv_u32(f, A + ".rope.dimension_count"), (uint64_t)cfg.rope_dim());
  EXPECT_EQ(kv_f32(f, A + ".rope.freq_base"), (double)(float)cfg.rope_theta);
  EXPECT_EQ(kv_f32(f, A + ".attention.layer_norm_rms_epsilon"), (double)(float)cfg.rms_norm_eps);
  if (cfg.is_moe()) {
    EXPECT_EQ(kv_u32(f, A + ".expert_count"), (uint64_t)cfg.num_local_experts);
    EXPECT_EQ(kv_u32(f, A + ".expert_used_count"), (uint64_t)cfg.num_experts_per_tok);
    if (A == "qwen3moe" || A == "qwen2moe") {
      EXPECT_EQ(kv_u32(f, A + ".expert_feed_forward_length"), (uint64_t)cfg.expert_intermediate_size());
    }
  } else {
    EXPECT_EQ(f.find(A + ".expert_count"), nullptr);
  }
  if (A == "glm4moe") {  // llama.cpp's glm4moe keys (src/models/glm4-moe.cpp)
    EXPECT_EQ(kv_u32(f, A + ".expert_feed_forward_length"), (uint64_t)cfg.expert_intermediate_size());
    EXPECT_EQ(kv_u32(f, A + ".expert_shared_count"), (uint64_t)cfg.n_shared_experts);
    EXPECT_EQ(kv_u32(f, A + ".leading_dense_block_count"), (uint64_t)cfg.first_k_dense_replace);
    EXPECT_EQ(kv_f32(f, A + ".expert_weights_scale"), (double)(float)cfg.routed_scaling_factor);
    EXPECT_EQ(kv_u32(f, A + ".expert_gating_func"), 2u);  // sigmoid
  } else if (cfg.has_shared_expert()) {
    EXPECT_EQ(kv_u32(f, A + ".expert_shared_feed_forward_length"), (uint64_t)cfg.shared_expert_intermediate_size);
  }

  const auto want = want_tensors(cfg, table, params, A, x.type);
  std::set<std::string> got_names, want_names;
  for (const auto& t : f.tensors()) got_names.insert(t.name);
  for (const auto& [n, _] : want) want_names.insert(n);
  EXPECT_EQ(got_names, want_names);
  for (const auto& [name, wt] : want) {
    const gguf::TensorInfo* t = f.find_tensor(name);
    if (!t) continue;
    SCOPED_TRACE(name);
    EXPECT_EQ(t->offset % 32, 0u);
    EXPECT_EQ(t->ne, wt.ne);
    EXPECT_EQ(t->type, wt.type);
    if (t->ne != wt.ne || t->type != wt.type) continue;
    const std::vector<uint8_t> expected = encode(wt.type, wt.values);
    ASSERT_EQ(t->bytes, expected.size());
    std::vector<uint8_t> got(f.data(*t), f.data(*t) + t->bytes);
    if (wt.heads > 0) {
      const size_t rows = (size_t)(wt.ne.size() == 1 ? wt.ne[0] : wt.ne[1]);
      got = unpermute(got.data(), wt.heads, (int64_t)rows / wt.heads, got.size() / rows);
    }
    EXPECT_TRUE(got == expected) << "the bytes differ from the encoding of moetron's weights";
  }

  // The vocabulary: moetron's tokenizer, padded to vocab_size.
  std::string tok_path = x.tokenizer;
  if (tok_path.empty())
    tok_path =
        (model_dir / (fs::exists(model_dir / "tokenizer.model") ? "tokenizer.model" : "tokenizer.json")).string();
  const Tokenizer tok = Tokenizer::load(tok_path);
  const gguf::Value* tokens = f.find("tokenizer.ggml.tokens");
  const gguf::Value* types = f.find("tokenizer.ggml.token_type");
  ASSERT_TRUE(tokens && types);
  ASSERT_EQ(tokens->sa.size(), (size_t)cfg.vocab_size);
  ASSERT_EQ(types->ia.size(), (size_t)cfg.vocab_size);
  for (int i = tok.vocab_size(); i < cfg.vocab_size; i++) {
    EXPECT_EQ(tokens->sa[i], "[PAD" + std::to_string(i) + "]");
    EXPECT_EQ(types->ia[i], 5);  // UNUSED
  }
  EXPECT_EQ(kv_bool(f, "tokenizer.ggml.add_bos_token"), tok.bos_id() >= 0);
  if (tok.bos_id() >= 0) {
    EXPECT_EQ(kv_u32(f, "tokenizer.ggml.bos_token_id"), (uint64_t)tok.bos_id());
  }
  if (tok.eos_id() >= 0) {
    EXPECT_EQ(kv_u32(f, "tokenizer.ggml.eos_token_id"), (uint64_t)tok.eos_id());
  }
  if (!tok.byte_level()) {
    EXPECT_EQ(kv_str(f, "tokenizer.ggml.model"), "llama");
    const std::string bytes = read_text(tok_path);
    spm::ParsedModel m;
    ASSERT_TRUE(spm::parse_model(bytes, m));
    const gguf::Value* scores = f.find("tokenizer.ggml.scores");
    ASSERT_TRUE(scores);
    ASSERT_EQ(scores->fa.size(), (size_t)cfg.vocab_size);
    for (int i = 0; i < tok.vocab_size(); i++) {
      EXPECT_EQ(tokens->sa[i], tok.id_to_piece(i)) << i;
      EXPECT_EQ(scores->fa[i], (double)m.pieces[i].score) << i;
      EXPECT_EQ(types->ia[i], m.pieces[i].type) << i;
    }
    EXPECT_EQ(kv_bool(f, "tokenizer.ggml.add_space_prefix"), tok.adds_dummy_prefix());
    EXPECT_EQ(kv_u32(f, "tokenizer.ggml.unknown_token_id"), (uint64_t)tok.unk_id());
  } else {
    EXPECT_EQ(kv_str(f, "tokenizer.ggml.model"), "gpt2");
    const json j = json::parse(read_text(tok_path));
    std::map<int, bool> added;  // id -> special
    for (const json& a : j["added_tokens"]) added[a["id"].get<int>()] = a["special"].get<bool>();
    for (int i = 0; i < tok.vocab_size(); i++) {
      const std::string piece = tok.id_to_piece(i);
      EXPECT_EQ(tokens->sa[i], piece.empty() ? "[PAD" + std::to_string(i) + "]" : piece) << i;
      const int want_type = added.count(i) ? (added[i] ? 3 : 4) : piece.empty() ? 5 : 1;
      EXPECT_EQ(types->ia[i], want_type) << i;
    }
    const gguf::Value* merges = f.find("tokenizer.ggml.merges");
    ASSERT_TRUE(merges);
    const json& jm = j["model"]["merges"];
    ASSERT_EQ(merges->sa.size(), jm.size());
    for (size_t i = 0; i < jm.size(); i++) {
      const std::string m = jm[i].is_string() ? jm[i].get<std::string>()
                                              : jm[i][0].get<std::string>() + " " + jm[i][1].get<std::string>();
      EXPECT_EQ(merges->sa[i], m) << i;
    }
    const bool qwen = j["pre_tokenizer"]["type"] == "Sequence";
    EXPECT_EQ(kv_str(f, "tokenizer.ggml.pre"), qwen ? "qwen2" : "gpt-2");
  }
}

// ---- the writer and the reader --------------------------------------------------------------------

TEST(GgufFile, RoundTripsEveryValueTypeAndAlignsEveryTensor) {
  Dir d;
  gguf::KeyValues kv;
  auto num = [](gguf::ValueType t, uint64_t u, int64_t i, double f) {
    gguf::Value v;
    v.type = t;
    v.u = u, v.i = i, v.f = f;
    return v;
  };
  using VT = gguf::ValueType;
  kv.emplace_back("a.u8", num(VT::u8, 255, 0, 0));
  kv.emplace_back("a.i8", num(VT::i8, 0, -128, 0));
  kv.emplace_back("a.u16", num(VT::u16, 65535, 0, 0));
  kv.emplace_back("a.i16", num(VT::i16, 0, -32768, 0));
  kv.emplace_back("a.u32", gguf::Value::u32(4000000000u));
  kv.emplace_back("a.i32", gguf::Value::i32(-7));
  kv.emplace_back("a.f32", gguf::Value::f32(0.1f));
  kv.emplace_back("a.bool", gguf::Value::boolean(true));
  kv.emplace_back("a.str", gguf::Value::str(std::string("h\0llo ▁", 9)));
  kv.emplace_back("a.u64", num(VT::u64, UINT64_MAX, 0, 0));
  kv.emplace_back("a.i64", num(VT::i64, 0, INT64_MIN, 0));
  kv.emplace_back("a.f64", num(VT::f64, 0, 0, 1e-300));
  kv.emplace_back("a.strs", gguf::Value::strings({"", "x", "yz"}));
  kv.emplace_back("a.f32s", gguf::Value::f32s({1.5f, -2.0f}));
  kv.emplace_back("a.i32s", gguf::Value::i32s({-1, 2, 3}));
  gguf::Value bools;
  bools.type = VT::array;
  bools.elem_type = VT::boolean;
  bools.ua = {1, 0, 1};
  kv.emplace_back("a.bools", bools);

  std::vector<float> v1(15), v2(7), v3(12);
  for (size_t i = 0; i < v1.size(); i++) v1[i] = 0.37f * (float)i - 2.0f;
  for (size_t i = 0; i < v2.size(); i++) v2[i] = 1.0f / (1.0f + (float)i);
  for (size_t i = 0; i < v3.size(); i++) v3[i] = 3.1f * (float)i;
  std::vector<gguf::TensorToWrite> ts = {
      {"t.f32", {5, 3}, TensorType::F32, [&](gguf::TensorSink& s) { s.put(v1.data(), 4), s.put(v1.data() + 4, 11); }},
      {"t.f16", {7}, TensorType::F16, [&](gguf::TensorSink& s) { s.put(v2.data(), 7); }},
      {"t.bf16", {2, 3, 2}, TensorType::BF16, [&](gguf::TensorSink& s) {
         for (float x : v3) s.put(&x, 1);
       }}};
  const fs::path p = d.path / "t.gguf";
  gguf::write_file(p.string(), kv, ts);
  EXPECT_EQ(entries(d.path), std::set<std::string>{"t.gguf"});

  const gguf::File f = gguf::File::open(p.string());
  ASSERT_EQ(f.kv().size(), kv.size());
  for (size_t i = 0; i < kv.size(); i++) {
    const auto& [k, v] = f.kv()[i];
    EXPECT_EQ(k, kv[i].first);
    EXPECT_EQ(v.type, kv[i].second.type) << k;
    EXPECT_EQ(v.elem_type, kv[i].second.elem_type) << k;
    EXPECT_EQ(v.u, kv[i].second.u) << k;
    EXPECT_EQ(v.i, kv[i].second.i) << k;
    EXPECT_EQ(v.s, kv[i].second.s) << k;
    EXPECT_EQ(v.sa, kv[i].second.sa) << k;
    EXPECT_EQ(v.ia, kv[i].second.ia) << k;
    EXPECT_EQ(v.ua, kv[i].second.ua) << k;
  }
  EXPECT_EQ(f.find("a.f32")->f, (double)0.1f);
  EXPECT_EQ(f.find("a.f64")->f, 1e-300);
  EXPECT_EQ(f.find("a.f32s")->fa, (std::vector<double>{1.5, -2.0}));
  ASSERT_EQ(f.tensors().size(), 3u);
  EXPECT_EQ(f.data_offset() % 32, 0u);
  const std::vector<std::vector<float>*> vals = {&v1, &v2, &v3};
  for (size_t i = 0; i < 3; i++) {
    const gguf::TensorInfo& t = f.tensors()[i];
    EXPECT_EQ(t.name, ts[i].name);
    EXPECT_EQ(t.ne, ts[i].ne);
    EXPECT_EQ(t.type, ts[i].type);
    EXPECT_EQ(t.offset % 32, 0u);
    const std::vector<uint8_t> want = encode(t.type, *vals[i]);
    ASSERT_EQ(t.bytes, want.size());
    EXPECT_EQ(std::memcmp(f.data(t), want.data(), want.size()), 0) << t.name;
  }
  // The header by hand: magic, version, counts.
  const std::string raw = read_text(p);
  EXPECT_EQ(raw.substr(0, 4), "GGUF");
  uint32_t version;
  uint64_t n_tensors, n_kv;
  std::memcpy(&version, raw.data() + 4, 4);
  std::memcpy(&n_tensors, raw.data() + 8, 8);
  std::memcpy(&n_kv, raw.data() + 16, 8);
  EXPECT_EQ(version, 3u);
  EXPECT_EQ(n_tensors, 3u);
  EXPECT_EQ(n_kv, kv.size());
  // bf16 round to nearest even: 3.1f * 1 encodes as f32_to_bf16.
  EXPECT_EQ(f.to_f32(f.tensors()[2])[1], bf16_to_f32(f32_to_bf16(3.1f)));
}

TEST(GgufFile, AFailedWriteLeavesTheOldFileAndNoTemporary) {
  Dir d;
  const fs::path p = d.path / "m.gguf";
  write_text(p, "old contents");
  std::vector<float> v(8, 1.0f);
  auto attempt = [&](std::function<void(gguf::TensorSink&)> fill) {
    std::vector<gguf::TensorToWrite> ts = {
        {"a", {8}, TensorType::F32, [&](gguf::TensorSink& s) { s.put(v.data(), 8); }},
        {"b", {8}, TensorType::F16, std::move(fill)}};
    EXPECT_THROW(gguf::write_file(p.string(), {{"k", gguf::Value::u32(1)}}, ts), Error);
    EXPECT_EQ(read_text(p), "old contents");
    EXPECT_EQ(entries(d.path), std::set<std::string>{"m.gguf"});
  };
  attempt([](gguf::TensorSink&) { throw Error("the weights are corrupt"); });
  attempt([&](gguf::TensorSink& s) { s.put(v.data(), 7); });  // one value short
  attempt([&](gguf::TensorSink& s) {
    s.put(v.data(), 8);
    s.put(v.data(), 1);  // one too many
  });
}

TEST(GgufFile, RefusesDuplicatesNamesAndValuesItCannotWrite) {
  Dir d;
  const fs::path p = d.path / "x.gguf";
  std::vector<float> v(4, 0.0f);
  auto fill = [&](gguf::TensorSink& s) { s.put(v.data(), 4); };
  auto refused = [&](const gguf::KeyValues& kv, const std::vector<gguf::TensorToWrite>& ts, const std::string& needle) {
    try {
      gguf::write_file(p.string(), kv, ts);
      ADD_FAILURE() << "not refused: " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_TRUE(entries(d.path).empty());
  };
  refused({{"k", gguf::Value::u32(1)}, {"k", gguf::Value::u32(2)}}, {}, "'k' given twice");
  refused({}, {{"t", {4}, TensorType::F32, fill}, {"t", {4}, TensorType::F32, fill}}, "'t' given twice");
  refused({}, {{std::string(64, 'n'), {4}, TensorType::F32, fill}}, "1..63 bytes");
  gguf::Value big = gguf::Value::u32(0);
  big.u = uint64_t{1} << 33;
  refused({{"big", big}}, {}, "does not fit");
  refused({}, {{"z", {4, 0}, TensorType::F32, fill}}, "dimension is 0");
}

// A tensor's byte count never wraps: 2^62 f32 values are 2^64 bytes, which read as 0 once fitted
// nothing into the file and then asked for a 2^62-float vector (found by fuzz_gguf).
TEST(GgufFile, TensorBytesThatWouldOverflowAreRefused) {
  EXPECT_THROW(gguf::tensor_bytes(TensorType::F32, {int64_t{1} << 61, 2}), Error);
  EXPECT_THROW(gguf::tensor_bytes(TensorType::Q8_0, {int64_t{1} << 61, 2}), Error);
  EXPECT_EQ(gguf::tensor_bytes(TensorType::F32, {int64_t{1} << 20, 4}), uint64_t{1} << 24);
  EXPECT_EQ(gguf::tensor_bytes(TensorType::Q8_0, {64, 3}), 6u * 34u);
  EXPECT_THROW(gguf::tensor_bytes(TensorType::Q8_0, {48, 2}), Error);  // rows of whole blocks only
}

TEST(GgufFile, ReaderRefusesEveryTruncationAndCorruptHeaders) {
  Dir d;
  const fs::path p = d.path / "ok.gguf";
  std::vector<float> v(6, 0.5f);
  gguf::write_file(p.string(),
                   {{"general.architecture", gguf::Value::str("llama")}, {"n", gguf::Value::strings({"a", "b"})}},
                   {{"w", {3, 2}, TensorType::BF16, [&](gguf::TensorSink& s) { s.put(v.data(), 6); }}});
  const std::string good = read_text(p);
  ASSERT_NO_THROW(gguf::File::open(p.string()));
  const fs::path bad = d.path / "bad.gguf";
  for (size_t n = 0; n < good.size(); n++) {
    write_text(bad, good.substr(0, n));
    EXPECT_THROW(gguf::File::open(bad.string()), Error) << "a file cut at byte " << n << " was read";
  }
  auto patched = [&](size_t at, const void* bytes, size_t k) {
    std::string s = good;
    std::memcpy(s.data() + at, bytes, k);
    write_text(bad, s);
    try {
      gguf::File::open(bad.string());
      return std::string("read");
    } catch (const Error& e) {
      return std::string(e.what());
    }
  };
  const uint32_t v2 = 2;
  EXPECT_NE(patched(0, "GGML", 4).find("bad magic"), std::string::npos);
  EXPECT_NE(patched(4, &v2, 4).find("version 2"), std::string::npos);
  const uint64_t huge = uint64_t{1} << 60;
  EXPECT_NE(patched(16, &huge, 8).find("runs past the end"), std::string::npos);  // n_kv
  // The tensor's offset is the last 8 bytes of the header before the padding: make it unaligned.
  const gguf::File f = gguf::File::open(p.string());
  size_t header_end = 24;
  {
    // key-value section: known layout
    for (const auto& [k, val] : f.kv()) {
      header_end += 8 + k.size() + 4;
      if (val.type == gguf::ValueType::string)
        header_end += 8 + val.s.size();
      else {
        header_end += 4 + 8;
        for (const auto& s : val.sa) header_end += 8 + s.size();
      }
    }
    header_end += 8 + 1 + 4 + 2 * 8 + 4 + 8;  // "w", 2 dims, type, offset
  }
  const uint64_t odd = 3;
  EXPECT_NE(patched(header_end - 8, &odd, 8).find("not aligned"), std::string::npos);
  const uint32_t q4 = 2;
  EXPECT_NE(patched(header_end - 12, &q4, 4).find("tensor type 2"), std::string::npos);
}

// ---- moetron export gguf --------------------------------------------------------------------------

TEST(GgufExport, MixtralWithSentencePieceInEveryType) {
  Dir d;
  const fs::path model = kGolden / "generate" / "mixtral_gqa";
  for (const auto& [flag, type] : std::vector<std::pair<std::string, TensorType>>{
           {"bf16", TensorType::BF16}, {"f16", TensorType::F16}, {"f32", TensorType::F32}, {"q8_0", TensorType::Q8_0}}) {
    const fs::path out = d.path / ("mixtral-" + flag + ".gguf");
    const CliRun r = run_export(
        d, "--model " + q(model) + " --output " + q(out) + " --type " + flag + " --sliding-window-as-context");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find("context_length is the sliding window (16)"), std::string::npos) << r.out;
    check_gguf(out, model, {"llama", type, 16, ""});
    EXPECT_EQ(kv_str(gguf::File::open(out.string()), "general.name"), "mixtral_gqa");
  }
  // The default type is bf16.
  const fs::path out = d.path / "default.gguf";
  ASSERT_EQ(run_export(d, "--model " + q(model) + " --output " + q(out) + " --sliding-window-as-context").exit_code, 0);
  EXPECT_EQ(read_text(out), read_text(d.path / "mixtral-bf16.gguf"));
}

TEST(GgufExport, PackedTransformers5ExpertsGiveTheSameFile) {
  Dir d;
  const fs::path src = kGolden / "generate" / "mixtral_gqa", packed = d.path / "packed";
  // The Hub's per-expert tensors, packed as transformers 5 holds them: mlp.gate, gate_up_proj [E, 2I, C]
  // (gate rows first), down_proj [E, C, I].
  fs::create_directories(packed);
  fs::copy_file(src / "config.json", packed / "config.json");
  fs::copy_file(src / "tokenizer.model", packed / "tokenizer.model");
  const ModelConfig cfg = load_model_config((src / "config.json").string());
  const ModelTensors m = ModelTensors::open(src.string());
  const int64_t E = cfg.num_local_experts, I = cfg.intermediate_size, C = cfg.hidden_size;
  SafetensorsWriter w;
  std::vector<std::vector<float>> keep;
  for (const std::string& name : m.names())
    if (name.find("block_sparse_moe") == std::string::npos)
      w.add_copy(name, m.get(name).dtype, m.get(name).shape, m.get(name).data);
  for (int l = 0; l < cfg.num_hidden_layers; l++) {
    const std::string b = "model.layers." + std::to_string(l) + ".";
    w.add_copy(b + "mlp.gate.weight", DType::BF16, {E, C}, m.get(b + "block_sparse_moe.gate.weight").data);
    std::vector<float> gu, down;
    for (int64_t e = 0; e < E; e++) {
      const std::string x = b + "block_sparse_moe.experts." + std::to_string(e) + ".";
      for (const char* wn : {"w1", "w3"}) {
        const auto v = to_f32(m.get(x + wn + ".weight"));
        gu.insert(gu.end(), v.begin(), v.end());
      }
      const auto v2 = to_f32(m.get(x + "w2.weight"));
      down.insert(down.end(), v2.begin(), v2.end());
    }
    keep.push_back(std::move(gu));
    w.add_f32(b + "mlp.experts.gate_up_proj", {E, 2 * I, C}, keep.back().data(), DType::BF16);
    keep.push_back(std::move(down));
    w.add_f32(b + "mlp.experts.down_proj", {E, C, I}, keep.back().data(), DType::BF16);
  }
  w.write((packed / "model.safetensors").string());
  ASSERT_EQ(ModelTensors::open(packed.string()).find("model.layers.0.block_sparse_moe.experts.0.w1.weight"), nullptr);

  const fs::path a = d.path / "hub.gguf", b = d.path / "packed.gguf";
  const std::string common = " --sliding-window-as-context --name same";
  ASSERT_EQ(run_export(d, "--model " + q(src) + " --output " + q(a) + common).exit_code, 0);
  const CliRun r = run_export(d, "--model " + q(packed) + " --output " + q(b) + common);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(read_text(a), read_text(b));
}

TEST(GgufExport, Qwen3MoeWithByteLevelBpeAndChatTemplate) {
  Dir d;
  // The generation golden without its dense layer 1 and with norm_topk_prob: what llama.cpp's
  // qwen3moe graph computes (the golden itself is refused below).
  const fs::path src = kGolden / "generate" / "qwen3_moe", model = d.path / "qwen3_moe_all_moe";
  derive(src, model, [](json& c) { c["mlp_only_layers"] = json::array(), c["norm_topk_prob"] = true; }, {0, 2});
  const fs::path out = d.path / "q.gguf";
  const CliRun r = run_export(d, "--model " + q(model) + " --output " + q(out) + " --type f16");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  check_gguf(out, model, {"qwen3moe", TensorType::F16, 0, ""});
  // Q8_0: the rows of 32 values (q, k, v: hidden 32) in Q8_0, the others (o_proj 48, experts 24) bf16.
  const fs::path out8 = d.path / "q8.gguf";
  ASSERT_EQ(run_export(d, "--model " + q(model) + " --output " + q(out8) + " --type q8_0").exit_code, 0);
  check_gguf(out8, model, {"qwen3moe", TensorType::Q8_0, 0, ""});
  EXPECT_EQ(gguf::File::open(out8.string()).find_tensor("blk.0.attn_q.weight")->type, TensorType::Q8_0);
  EXPECT_EQ(gguf::File::open(out8.string()).find_tensor("blk.0.attn_output.weight")->type, TensorType::BF16);
  const gguf::File f = gguf::File::open(out.string());
  const json tc = json::parse(read_text(src / "tokenizer_config.json"));
  EXPECT_EQ(kv_str(f, "tokenizer.chat_template"), tc["chat_template"].get<std::string>());
  EXPECT_EQ(kv_u32(f, "tokenizer.ggml.eos_token_id"), 2u);  // <|im_end|>
  EXPECT_EQ(f.find("tokenizer.ggml.bos_token_id"), nullptr);
  EXPECT_EQ(kv_u32(f, "tokenizer.ggml.padding_token_id"), 0u);  // <|endoftext|>
}

TEST(GgufExport, Qwen2MoeSharedExpertQwenSplitAndJinjaTemplate) {
  Dir d;
  const fs::path model = d.path / "qwen2_moe";
  derive(kGolden / "qwen2_moe_shared", model,
         [](json& c) {
           c["mlp_only_layers"] = json::array();
           c["layer_types"] = json::array({"full_attention", "full_attention"});
         },
         {0, 1});
  write_small_tokenizer(model, /*qwen_split=*/true);
  write_text(model / "chat_template.jinja", "{{ messages[0]['content'] }}");
  const fs::path out = d.path / "q2.gguf";
  const CliRun r = run_export(d, "--model " + q(model) + " --output " + q(out));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  check_gguf(out, model, {"qwen2moe", TensorType::BF16, 0, ""});
  const gguf::File f = gguf::File::open(out.string());
  EXPECT_EQ(kv_str(f, "tokenizer.chat_template"), "{{ messages[0]['content'] }}");
  EXPECT_EQ(kv_str(f, "tokenizer.ggml.pre"), "qwen2");
  EXPECT_EQ(f.find_tensor("blk.0.attn_q.bias")->type, TensorType::F32);
}

// GLM-4.5 as llama.cpp's glm4moe (tools/check_gguf_llama.py runs it there: greedy tokens equal):
// every tensor under its name, the selection bias as exp_probs_b, partial RoPE's width; the golden's
// two expert groups (one searched) are refused naming the fields.
TEST(GgufExport, Glm4MoeWithTheSelectionBiasAndSharedExpert) {
  Dir d;
  const fs::path tok = write_small_tokenizer(d.path / "tok", false);
  const fs::path model = d.path / "glm";
  derive(kGolden / "generate" / "glm4_moe", model, [](json& c) { c["n_group"] = 1, c["topk_group"] = 1; });
  const fs::path out = d.path / "glm.gguf";
  const CliRun r = run_export(d, "--model " + q(model) + " --tokenizer " + q(tok) + " --output " + q(out));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  check_gguf(out, model, {"glm4moe", TensorType::BF16, 0, tok.string()});
  const gguf::File f = gguf::File::open(out.string());
  EXPECT_EQ(kv_u32(f, "glm4moe.rope.dimension_count"), 8u);  // head_dim 16 x partial_rotary_factor 0.5
  EXPECT_NE(f.find_tensor("blk.1.exp_probs_b.bias"), nullptr);
  EXPECT_EQ(f.find_tensor("blk.0.exp_probs_b.bias"), nullptr);  // layer 0 is dense
  const fs::path refused = d.path / "refused.gguf";
  const CliRun g = run_export(d, "--model " + q(kGolden / "generate" / "glm4_moe") + " --tokenizer " + q(tok) +
                                     " --output " + q(refused));
  EXPECT_EQ(g.exit_code, 2);
  EXPECT_NE(g.err.find("'n_group'"), std::string::npos) << g.err;
  EXPECT_FALSE(fs::exists(refused));
}

TEST(GgufExport, DenseAndOlmoeModelsWithAGivenTokenizer) {
  Dir d;
  const fs::path tok = write_small_tokenizer(d.path / "tok", false);
  const std::vector<std::pair<fs::path, std::string>> cases = {
      {kGolden / "llama_dense", "llama"},   {kGolden / "mistral_dense", "llama"},
      {kGolden / "mixtral_e3_k1", "llama"}, {kGolden / "olmoe_plain", "olmoe"},
      {kGolden / "qwen3_dense", "qwen3"},   {kGolden / "generate" / "llama_dense", "llama"}};
  for (const auto& [model, arch] : cases) {
    SCOPED_TRACE(model.string());
    const fs::path out = d.path / (model.parent_path().filename().string() + "-" + model.filename().string() + ".gguf");
    const CliRun r = run_export(d, "--model " + q(model) + " --output " + q(out) + " --type f32 --tokenizer " + q(tok));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    check_gguf(out, model, {arch, TensorType::F32, 0, tok.string()});
  }
  // qwen3_dense ties its head: llama.cpp's qwen3 graph reads token_embd, so no output.weight.
  EXPECT_EQ(gguf::File::open((d.path / "golden-qwen3_dense.gguf").string()).find_tensor("output.weight"), nullptr);
}

TEST(GgufExport, TiedHeadIsWrittenOutForOlmoe) {
  Dir d;
  const fs::path model = d.path / "olmoe_tied";
  derive(kGolden / "olmoe_plain", model, [](json& c) { c["tie_word_embeddings"] = true; });
  {  // drop lm_head.weight: transformers does not save a tied head
    const ModelTensors m = ModelTensors::open(model.string());
    SafetensorsWriter w;
    for (const std::string& n : m.names())
      if (n != "lm_head.weight") w.add_copy(n, m.get(n).dtype, m.get(n).shape, m.get(n).data);
    w.write((d.path / "tmp.safetensors").string());
  }
  fs::rename(d.path / "tmp.safetensors", model / "model.safetensors");
  const fs::path tok = write_small_tokenizer(d.path / "tok", false), out = d.path / "o.gguf";
  const CliRun r = run_export(d, "--model " + q(model) + " --output " + q(out) + " --tokenizer " + q(tok));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  check_gguf(out, model, {"olmoe", TensorType::BF16, 0, tok.string()});
  const gguf::File f = gguf::File::open(out.string());
  const gguf::TensorInfo *o = f.find_tensor("output.weight"), *e = f.find_tensor("token_embd.weight");
  ASSERT_TRUE(o && e);
  EXPECT_EQ(std::memcmp(f.data(*o), f.data(*e), e->bytes), 0);
}

TEST(GgufExport, RefusesWhatLlamaCppWouldComputeDifferentlyNamingTheField) {
  Dir d;
  const fs::path out_dir = d.path / "out";
  fs::create_directories(out_dir);
  const fs::path tok = write_small_tokenizer(d.path / "tok", false);
  const fs::path norm_false = d.path / "qwen3_moe_norm_false", olmoe_gqa = d.path / "olmoe_gqa";
  derive(kGolden / "generate" / "qwen3_moe", norm_false, [](json& c) { c["mlp_only_layers"] = json::array(); }, {0, 2});
  derive(kGolden / "olmoe_clip", olmoe_gqa, [](json& c) { c["clip_qkv"] = nullptr, c["norm_topk_prob"] = false; });
  const std::vector<std::pair<fs::path, std::vector<std::string>>> cases = {
      {kGolden / "generate" / "mixtral_gqa", {"'sliding_window' = 16", "--sliding-window-as-context"}},
      {kGolden / "mixtral_swa_padded", {"'sliding_window' = 5"}},
      {kGolden / "generate" / "qwen3_moe", {"'mlp_only_layers'", "layer 1"}},
      {kGolden / "qwen2_moe_shared", {"'mlp_only_layers'", "layer 2"}},
      {kGolden / "qwen3_moe_norm_topk_padded", {"'decoder_sparse_step'", "layer 0"}},
      {norm_false, {"'norm_topk_prob' = false", "always renormalises"}},
      {kGolden / "olmoe_clip", {"'norm_topk_prob' = true"}},
      {kGolden / "generate" / "olmoe", {"'clip_qkv' = 2"}},
      {olmoe_gqa, {"'num_key_value_heads' = 2"}},
  };
  for (const auto& [model, needles] : cases) {
    SCOPED_TRACE(model.string());
    const CliRun r =
        run_export(d, "--model " + q(model) + " --output " + q(out_dir / "m.gguf") + " --tokenizer " + q(tok));
    expect_refused(r, needles, out_dir, {});
    EXPECT_NE(r.err.find("config.json"), std::string::npos) << r.err;
  }
}

TEST(GgufExport, BadInputIsRefusedAndNothingIsWritten) {
  Dir d;
  const fs::path out_dir = d.path / "out";
  fs::create_directories(out_dir);
  const fs::path mixtral = kGolden / "generate" / "mixtral_gqa", out = out_dir / "m.gguf";
  const std::string ok = " --sliding-window-as-context";
  auto refused = [&](const std::string& args, const std::vector<std::string>& needles) {
    SCOPED_TRACE(args);
    const std::set<std::string> before = entries(out_dir);
    expect_refused(run_export(d, args), needles, out_dir, before);
  };
  refused("--model " + q(d.path / "nope") + " --output " + q(out), {"nope", "not a directory"});
  fs::create_directories(d.path / "empty");
  refused("--model " + q(d.path / "empty") + " --output " + q(out), {"no config.json"});
  refused("--model " + q(mixtral) + " --output " + q(out) + ok + " --type q4_0", {"--type", "q4_0"});
  refused("--model " + q(mixtral) + " --output " + q(out_dir) + ok, {"is a directory"});
  refused("--model " + q(mixtral) + " --output " + q(d.path / "missing" / "m.gguf") + ok, {"does not exist"});
  EXPECT_FALSE(fs::exists(d.path / "missing"));
  // No tokenizer: a GGUF carries its vocabulary.
  refused("--model " + q(kGolden / "llama_dense") + " --output " + q(out),
          {"no tokenizer.model or tokenizer.json", "--tokenizer"});
  refused("--model " + q(kGolden / "llama_dense") + " --output " + q(out) + " --tokenizer " + q(d.path / "t.json"),
          {"t.json"});
  // A tokenizer with more pieces than the model's vocabulary.
  refused("--model " + q(kGolden / "llama_dense") + " --output " + q(out) + " --tokenizer " +
              q(mixtral / "tokenizer.model"),
          {"320 pieces", "vocab_size is 120"});
  // An architecture moetron does not read.
  fs::create_directories(d.path / "gpt2");
  write_text(d.path / "gpt2" / "config.json", R"({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})");
  refused("--model " + q(d.path / "gpt2") + " --output " + q(out), {"config.json", "GPT2LMHeadModel"});
  // Weights missing a tensor.
  const fs::path broken = d.path / "broken";
  derive(mixtral, broken, [](json&) {});
  {
    const ModelTensors m = ModelTensors::open(broken.string());
    SafetensorsWriter w;
    for (const std::string& n : m.names())
      if (n != "model.norm.weight") w.add_copy(n, m.get(n).dtype, m.get(n).shape, m.get(n).data);
    w.write((d.path / "tmp.safetensors").string());
  }
  fs::rename(d.path / "tmp.safetensors", broken / "model.safetensors");
  refused("--model " + q(broken) + " --output " + q(out) + ok, {"model.norm.weight", "missing"});

  // An existing output is kept unless --force, and never when it is one of the inputs.
  write_text(out, "mine");
  refused("--model " + q(mixtral) + " --output " + q(out) + ok, {"already exists", "--force"});
  EXPECT_EQ(read_text(out), "mine");
  const fs::path copy = d.path / "copy";
  derive(mixtral, copy, [](json&) {});
  const std::string cfg_before = read_text(copy / "config.json");
  const std::set<std::string> copy_before = entries(copy);
  const CliRun r = run_export(d, "--model " + q(copy) + " --output " + q(copy / "config.json") + ok + " --force");
  expect_refused(r, {"one of the input files"}, copy, copy_before);
  EXPECT_EQ(read_text(copy / "config.json"), cfg_before);
  const CliRun forced = run_export(d, "--model " + q(mixtral) + " --output " + q(out) + ok + " --force");
  ASSERT_EQ(forced.exit_code, 0) << forced.err;
  check_gguf(out, mixtral, {"llama", TensorType::BF16, 16, ""});
  EXPECT_EQ(entries(out_dir), std::set<std::string>{"m.gguf"});
}

// --force replaces an earlier GGUF, never a file the export reads (the review destroyed a model and a
// tokenizer_config.json this way): the tokenizer_config.json beside --tokenizer (read for BOS/EOS), a
// shard that the index places in a subdirectory, and a symlink to that shard.
TEST(GgufExport, ForceNeverReplacesAnInputBesideTheTokenizerOrInAnIndexSubdirectory) {
  Dir d;
  const fs::path model = d.path / "model", tok = d.path / "tok";
  derive(kGolden / "generate" / "mixtral_gqa", model, [](json&) {});
  fs::create_directories(tok);
  fs::rename(model / "tokenizer.model", tok / "tokenizer.model");
  write_text(tok / "tokenizer_config.json", R"({"bos_token": "<s>", "eos_token": "</s>"})");
  const fs::path shard = model / "sub" / "model-00001-of-00001.safetensors";
  fs::create_directories(model / "sub");
  fs::rename(model / "model.safetensors", shard);
  json index = {{"metadata", json::object()}, {"weight_map", json::object()}};
  for (const std::string& n : SafetensorsFile::open(shard.string()).names())
    index["weight_map"][n] = "sub/model-00001-of-00001.safetensors";
  write_text(model / "model.safetensors.index.json", index.dump());
  fs::create_symlink(shard, d.path / "link.gguf");
  const std::string args = " --sliding-window-as-context --force --tokenizer " + q(tok / "tokenizer.model");
  const std::string tok_config = read_text(tok / "tokenizer_config.json"), weights = read_text(shard);
  for (const fs::path& out : {tok / "tokenizer_config.json", shard, d.path / "link.gguf"}) {
    SCOPED_TRACE(out.string());
    const std::set<std::string> before = entries(out.parent_path());
    expect_refused(run_export(d, "--model " + q(model) + " --output " + q(out) + args),
                   {"one of the input files", "never replaced"}, out.parent_path(), before);
  }
  EXPECT_EQ(read_text(tok / "tokenizer_config.json"), tok_config);
  EXPECT_EQ(read_text(shard), weights);
  // The same model and tokenizer export fine to a new file, inside the model directory too.
  const CliRun ok = run_export(d, "--model " + q(model) + " --output " + q(model / "m.gguf") + args);
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_TRUE(fs::exists(model / "m.gguf"));
}

// Finite weights beyond f16's range (65504) are refused by --type f16 naming the tensor, not written
// as Inf (the review's export exited 0 with an Inf in the file).
TEST(GgufExport, WeightsBeyondF16AreRefusedNotWrittenAsInf) {
  Dir d;
  const fs::path model = d.path / "big";
  derive(kGolden / "generate" / "mixtral_gqa", model, [](json&) {});
  // bf16 holds it (as 70144); f16 tops out at 65504.
  set_weight(model, "model.layers.1.self_attn.o_proj.weight", 5, 70000.0f);
  const fs::path out_dir = d.path / "out";
  fs::create_directories(out_dir);
  const std::string args = "--model " + q(model) + " --sliding-window-as-context --output ";
  const CliRun r = run_export(d, args + q(out_dir / "m.gguf") + " --type f16");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  for (const char* needle : {"blk.1.attn_output.weight", "element 5", "70144", "65504"})
    EXPECT_NE(r.err.find(needle), std::string::npos) << "missing '" << needle << "' in: " << r.err;
  EXPECT_TRUE(entries(out_dir).empty());
  // bf16 and f32 hold the value.
  EXPECT_EQ(run_export(d, args + q(out_dir / "m.gguf") + " --type bf16").exit_code, 0);
}

// Ctrl-C while export writes (the review found .NAME.tmp-PID files left behind): the command unwinds,
// removes its temporary and exits 130, the output directory as it was.
TEST(GgufExport, CtrlCMidWriteLeavesNoTemporary) {
  Dir d;
  const fs::path model = d.path / "model", out_dir = d.path / "out";
  ASSERT_TRUE(moetron::testing::make_model_to_interrupt(model.string()));
  fs::create_directories(out_dir);
  auto writing = [&] {  // the temporary holds bytes
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(out_dir, ec))
      if (e.path().filename().string().rfind(".m.gguf.tmp-", 0) == 0 && fs::file_size(e.path(), ec) > 0) return true;
    return false;
  };
  const moetron::testing::Interrupted r = moetron::testing::interrupt_mid_write(
      {"export", "gguf", "--model", model.string(), "--output", (out_dir / "m.gguf").string(), "--tokenizer",
       (kGolden / "generate" / "mixtral_gqa" / "tokenizer.model").string()},
      writing);
  EXPECT_TRUE(r.mid_write) << "export finished before its write was seen";
  EXPECT_EQ(r.exit_status, 130);
  EXPECT_TRUE(entries(out_dir).empty());
}

TEST(GgufExport, CorruptWeightsFoundWhileWritingLeaveNoFile) {
  Dir d;
  const fs::path model = d.path / "nan";
  derive(kGolden / "generate" / "mixtral_gqa", model, [](json&) {});
  set_weight(model, "model.layers.1.self_attn.v_proj.weight", 5, std::nanf(""));
  const fs::path out_dir = d.path / "out";
  fs::create_directories(out_dir);
  const CliRun r =
      run_export(d, "--model " + q(model) + " --output " + q(out_dir / "m.gguf") + " --sliding-window-as-context");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("model.layers.1.self_attn.v_proj.weight"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("non-finite"), std::string::npos) << r.err;
  EXPECT_TRUE(entries(out_dir).empty());
}

// A tiny model of `vocab` ids for a real tokenizer (random weights; only the vocabulary matters).
fs::path tiny_model(const fs::path& dir, int vocab, const std::string& arch) {
  fs::create_directories(dir);
  json c = {{"architectures", {arch}},  {"vocab_size", vocab},    {"hidden_size", 8},
            {"intermediate_size", 8},   {"num_hidden_layers", 1}, {"num_attention_heads", 2},
            {"num_key_value_heads", 1}, {"head_dim", 4},          {"max_position_embeddings", 64},
            {"rms_norm_eps", 1e-6},     {"rope_theta", 10000.0},  {"tie_word_embeddings", true}};
  write_text(dir / "config.json", c.dump());
  const ModelConfig cfg = load_model_config((dir / "config.json").string());
  const ParamTable t(cfg);
  std::vector<float> p(t.total());
  init_parameters(t, cfg, 1, p.data());
  std::vector<ModelTensorToWrite> ts;
  for (const HfTensorRef& r : t.hf_tensors()) ts.push_back({r.name, DType::BF16, r.shape, p.data() + r.offset});
  write_model_safetensors(dir.string(), ts);
  return dir;
}

TEST(GgufExport, RealQwenTokenizerFromSharedData) {
  const fs::path qwen = kShared / "qwen-tokenizer.json";
  if (!fs::exists(qwen)) GTEST_SKIP() << qwen << " is absent (../shared/data); the Qwen vocabulary is not checked";
  Dir d;
  const fs::path model = tiny_model(d.path / "qwen3", 151936, "Qwen3ForCausalLM"), out = d.path / "q.gguf";
  const CliRun r = run_export(d, "--model " + q(model) + " --output " + q(out) + " --tokenizer " + q(qwen));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  check_gguf(out, model, {"qwen3", TensorType::BF16, 0, qwen.string()});
  const gguf::File f = gguf::File::open(out.string());
  EXPECT_EQ(kv_str(f, "tokenizer.ggml.pre"), "qwen2");
  const gguf::Value* tokens = f.find("tokenizer.ggml.tokens");
  EXPECT_EQ(tokens->sa[151643], "<|endoftext|>");
  EXPECT_EQ(f.find("tokenizer.ggml.token_type")->ia[151643], 3);
}

TEST(GgufExport, RealMixtralTokenizerFromSharedData) {
  const fs::path spm = kShared / "mixtral-tokenizer.model";
  if (!fs::exists(spm)) GTEST_SKIP() << spm << " is absent (../shared/data); the Mixtral vocabulary is not checked";
  Dir d;
  const fs::path model = tiny_model(d.path / "llama", 32000, "LlamaForCausalLM"), out = d.path / "l.gguf";
  const CliRun r = run_export(d, "--model " + q(model) + " --output " + q(out) + " --tokenizer " + q(spm));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  check_gguf(out, model, {"llama", TensorType::BF16, 0, spm.string()});
  const gguf::File f = gguf::File::open(out.string());
  EXPECT_EQ(f.find("tokenizer.ggml.tokens")->sa[13], "<0x0A>");
  EXPECT_EQ(f.find("tokenizer.ggml.token_type")->ia[13], 6);  // BYTE
}

}  // namespace
