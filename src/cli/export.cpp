// moetron export gguf: a Hugging Face model directory moetron reads (config.json + safetensors +
// tokenizer) as one GGUF file (llama.cpp's format, version 3, io/gguf.h), so a model moetron
// trained or fine-tuned runs in llama.cpp / ollama.
//
//   moetron export gguf --model DIR --output F.gguf [--type bf16|f16|f32|q8_0] [--tokenizer FILE]
//                       [--name NAME] [--sliding-window-as-context] [--force]
//
// What is written follows llama.cpp's convert_hf_to_gguf.py; the GGUF architecture of each
// model_type, what its graph computes and refuses, and its keys are io/gguf_arch.h's.
// The Q/K permutation: HF rotates the two halves of each head (rotate-half RoPE); llama.cpp's llama
// architecture rotates adjacent pairs. Row h*HD + 2i + j of the GGUF attn_q / attn_k is row
// h*HD + j*HD/2 + i of the HF tensor (i < HD/2, j in {0, 1}), per head h of NH (q) or NKV (k); the
// other architectures use rotate-half (NEOX) RoPE and take the rows as they are.
// Tensor types: the --type for matrices, F32 for 1-D tensors, norms, biases and the routers
// (ffn_gate_inp, ffn_gate_inp_shexp), as convert_hf_to_gguf.py does.
//
// The vocabulary is required (DIR/tokenizer.model, else DIR/tokenizer.json, or --tokenizer): a
// SentencePiece model becomes tokenizer.ggml.model "llama" (pieces, scores, SentencePiece types,
// add_space_prefix); a byte-level BPE tokenizer.json becomes "gpt2" (pieces, merges "a b", token
// types: special added tokens CONTROL, other added tokens USER_DEFINED) with tokenizer.ggml.pre
// "qwen2" for Qwen's split pattern, "gpt-2" for GPT-2's. Both are padded to vocab_size with
// "[PAD<id>]" (UNUSED). BOS / EOS / UNK / PAD are moetron's (the tokenizer's; EOS else the model's
// first eos id); add_bos_token is whether moetron's completion prompts start with BOS. The chat
// template is tokenizer_config.json's chat_template (a string, or a list: "default" and named
// ones), else chat_template.jinja.
//
// Weights are read through the model loaders (Hub per-expert names or transformers-5 packed
// experts, any float dtype, non-finite values refused) in row chunks and streamed into the file,
// so memory holds at most one chunk beside the mapping. The file appears complete or not at all
// (gguf::write_file). Exit 2, nothing written: bad input found before writing (a missing file, an
// unsupported architecture or field, an --output that exists without --force, is a directory or
// is one of the input files). Exit 1: a failure while writing (corrupt weights, I/O).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "core/json_limits.h"
#include "infer/model.h"
#include "io/gguf.h"
#include "io/gguf_arch.h"
#include "io/hf_config.h"
#include "io/model_files.h"
#include "io/output_guard.h"
#include "model/params.h"
#include "model/weights.h"
#include "tokenizer/sp_model.h"
#include "tokenizer/tokenizer.h"

namespace moetron::cli {

namespace {

namespace fs = std::filesystem;
using gguf::TensorType;
using gguf::Value;
using nlohmann::json;

// GGUF token types (llama.cpp's llama_token_type); SentencePiece's types use the same numbers.
constexpr int32_t kTokNormal = 1, kTokControl = 3, kTokUserDefined = 4, kTokUnused = 5;
// Values read per chunk while streaming a tensor (64 MiB of fp32).
constexpr size_t kChunkFloats = size_t{16} << 20;

struct Options {
  std::string model_dir, output, type = "bf16", tokenizer, name;
  bool window_as_context = false, force = false;
};

[[noreturn]] void refuse(const std::string& msg) { throw InputError(msg); }

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) refuse(fmt::format("{}: cannot read", p.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// ---- the tensors --------------------------------------------------------------------------------

// One GGUF tensor: whole HF tensors (or an expert's part of a packed one) concatenated along
// dim 0 -- one for most, E for stacked experts -- with q/k rows permuted by heads when
// permute_head_dim > 0.
struct Planned {
  std::string name;
  std::vector<int64_t> ne;
  TensorType type = TensorType::F32;
  std::vector<const HfTensorRef*> parts;
  int64_t permute_head_dim = 0;
};

// Row h*HD + 2i + j of `out` is row h*HD + j*HD/2 + i of `in` (rows of `row_len` values; `rows` a
// multiple of HD).
void permute_rows(const float* in, float* out, int64_t rows, int64_t row_len, int64_t hd) {
  for (int64_t h = 0; h < rows / hd; h++)
    for (int64_t r = 0; r < hd; r++) {
      const int64_t src = h * hd + (r % 2) * (hd / 2) + r / 2;
      std::copy_n(in + src * row_len, row_len, out + (h * hd + r) * row_len);
    }
}

// The HF refs of each parameter spec, in table order (w13: gate, up per expert).
std::vector<std::vector<const HfTensorRef*>> refs_by_spec(const ParamTable& table) {
  std::vector<std::vector<const HfTensorRef*>> out(table.specs().size());
  for (const HfTensorRef& r : table.hf_tensors()) out[r.spec_index].push_back(&r);
  return out;
}

std::vector<Planned> plan_tensors(const ModelConfig& cfg, const ParamTable& table, const gguf::Arch& a,
                                  TensorType matrix_type) {
  const auto refs = refs_by_spec(table);
  const int64_t C = cfg.hidden_size, HD = cfg.head_dim;
  std::vector<Planned> out;
  auto spec_refs = [&](ParamKind k, int l) -> const std::vector<const HfTensorRef*>& {
    return refs[(size_t)(&table.at(k, l) - table.specs().data())];
  };
  // ne: the row-major shape reversed; 1-D tensors and the routers in F32.
  auto add = [&](std::string name, std::vector<int64_t> shape, std::vector<const HfTensorRef*> parts, bool f32,
                 int64_t permute = 0) {
    Planned p;
    p.name = std::move(name);
    p.ne.assign(shape.rbegin(), shape.rend());
    p.type = f32 || shape.size() == 1 ? TensorType::F32 : matrix_type;
    // Q8_0 needs rows of whole blocks; other matrices stay bf16 (exact for a bf16 model).
    if (p.type == TensorType::Q8_0 && shape.back() % gguf::tensor_type_traits(TensorType::Q8_0).block_elems != 0)
      p.type = TensorType::BF16;
    p.parts = std::move(parts);
    p.permute_head_dim = permute;
    out.push_back(std::move(p));
  };
  auto one = [&](const std::string& name, ParamKind k, int l, bool f32 = false, int64_t permute = 0) {
    const auto& r = spec_refs(k, l);
    MOETRON_ASSERT(r.size() == 1);
    add(name, r[0]->shape, r, f32, permute);
  };
  const int64_t perm = a.permute_qk ? HD : 0;
  one("token_embd.weight", ParamKind::embedding, -1);
  for (int l = 0; l < cfg.num_hidden_layers; l++) {
    const std::string b = fmt::format("blk.{}.", l);
    one(b + "attn_norm.weight", ParamKind::input_norm, l, true);
    one(b + "attn_q.weight", ParamKind::q_proj, l, false, perm);
    one(b + "attn_k.weight", ParamKind::k_proj, l, false, perm);
    one(b + "attn_v.weight", ParamKind::v_proj, l);
    one(b + "attn_output.weight", ParamKind::o_proj, l);
    if (table.has(ParamKind::q_bias, l)) {
      one(b + "attn_q.bias", ParamKind::q_bias, l, true, perm);
      one(b + "attn_k.bias", ParamKind::k_bias, l, true, perm);
      one(b + "attn_v.bias", ParamKind::v_bias, l, true);
    }
    if (table.has(ParamKind::q_norm, l)) {
      one(b + "attn_q_norm.weight", ParamKind::q_norm, l, true);
      one(b + "attn_k_norm.weight", ParamKind::k_norm, l, true);
    }
    // glm4moe's graph reads the FFN input norm as post_attention_norm.
    one(b + (a.sigmoid_router ? "post_attention_norm.weight" : "ffn_norm.weight"), ParamKind::post_norm, l, true);
    const auto& w13 = spec_refs(ParamKind::ffn_w13, l);
    const auto& w2 = spec_refs(ParamKind::ffn_w2, l);
    std::vector<const HfTensorRef*> gates, ups;
    for (size_t i = 0; i < w13.size(); i++) (i % 2 == 0 ? gates : ups).push_back(w13[i]);
    if (cfg.is_moe_layer(l)) {
      const int64_t E = cfg.num_local_experts, I = cfg.ffn_size(l);
      one(b + "ffn_gate_inp.weight", ParamKind::router, l, true);
      if (table.has(ParamKind::router_bias, l)) one(b + "exp_probs_b.bias", ParamKind::router_bias, l, true);
      add(b + "ffn_gate_exps.weight", {E, I, C}, gates, false);
      add(b + "ffn_up_exps.weight", {E, I, C}, ups, false);
      add(b + "ffn_down_exps.weight", {E, C, I}, w2, false);
    } else {
      add(b + "ffn_gate.weight", gates[0]->shape, gates, false);
      add(b + "ffn_up.weight", ups[0]->shape, ups, false);
      add(b + "ffn_down.weight", w2[0]->shape, w2, false);
    }
    if (table.has(ParamKind::shared_w13, l)) {
      const auto& s13 = spec_refs(ParamKind::shared_w13, l);
      if (table.has(ParamKind::shared_gate, l))
        add(b + "ffn_gate_inp_shexp.weight", {C}, spec_refs(ParamKind::shared_gate, l), true);
      add(b + "ffn_gate_shexp.weight", s13[0]->shape, {s13[0]}, false);
      add(b + "ffn_up_shexp.weight", s13[1]->shape, {s13[1]}, false);
      add(b + "ffn_down_shexp.weight", spec_refs(ParamKind::shared_w2, l)[0]->shape, spec_refs(ParamKind::shared_w2, l),
          false);
    }
  }
  one("output_norm.weight", ParamKind::final_norm, -1, true);
  if (table.has(ParamKind::lm_head))
    one("output.weight", ParamKind::lm_head, -1);
  else if (a.needs_output)  // tied: the graph has no fallback to token_embd, so the head is written out
    one("output.weight", ParamKind::embedding, -1);
  return out;
}

// Streams a planned tensor's values: each part in chunks of whole rows (whole heads when permuting).
void fill_tensor(gguf::TensorSink& sink, const Planned& p, const ModelTensors& files, const ParamTable& table,
                 const std::string& src) {
  std::vector<float> buf, perm;
  for (const HfTensorRef* ref : p.parts) {
    const int64_t rows = ref->shape[0];
    const int64_t row_len = (int64_t)ref->numel / rows;
    const int64_t unit = p.permute_head_dim > 0 ? p.permute_head_dim : 1;
    if (rows % unit != 0) fail("{}: tensor '{}' has {} rows, not whole heads of {}", src, ref->name, rows, unit);
    const int64_t step = std::max<int64_t>(unit, (int64_t)kChunkFloats / std::max<int64_t>(row_len, 1) / unit * unit);
    for (int64_t r0 = 0; r0 < rows; r0 += step) {
      const int64_t r1 = std::min(rows, r0 + step);
      HfTensorSlice s;
      s.ref = ref;
      s.dim = 0;
      s.begin = r0;
      s.end = r1;
      buf.resize(s.numel());
      read_hf_slice(files, table, s, buf.data(), src);
      if (p.permute_head_dim > 0) {
        perm.resize(buf.size());
        permute_rows(buf.data(), perm.data(), r1 - r0, row_len, p.permute_head_dim);
        sink.put(perm.data(), perm.size());
      } else {
        sink.put(buf.data(), buf.size());
      }
    }
  }
}

// ---- the vocabulary -----------------------------------------------------------------------------

void add_sentencepiece_vocab(gguf::KeyValues& kv, const Tokenizer& tok, int V) {
  const std::string bytes = read_file(tok.path());
  spm::ParsedModel m;
  if (!spm::parse_model(bytes, m)) refuse(fmt::format("{}: not a SentencePiece model", tok.path()));
  if ((int64_t)m.pieces.size() != tok.vocab_size())
    refuse(
        fmt::format("{}: {} pieces in the file, {} in the tokenizer", tok.path(), m.pieces.size(), tok.vocab_size()));
  std::vector<std::string> tokens(V);
  std::vector<float> scores(V, -10000.0f);
  std::vector<int32_t> types(V, kTokUnused);
  for (int i = 0; i < V; i++) tokens[i] = fmt::format("[PAD{}]", i);
  for (int i = 0; i < tok.vocab_size(); i++) {
    tokens[i] = std::string(m.pieces[i].piece);
    scores[i] = m.pieces[i].score;
    types[i] = m.pieces[i].type;
  }
  kv.emplace_back("tokenizer.ggml.model", Value::str("llama"));
  kv.emplace_back("tokenizer.ggml.pre", Value::str("default"));
  kv.emplace_back("tokenizer.ggml.tokens", Value::strings(std::move(tokens)));
  kv.emplace_back("tokenizer.ggml.scores", Value::f32s(scores));
  kv.emplace_back("tokenizer.ggml.token_type", Value::i32s(types));
  kv.emplace_back("tokenizer.ggml.add_space_prefix", Value::boolean(tok.adds_dummy_prefix()));
}

void add_byte_bpe_vocab(gguf::KeyValues& kv, const Tokenizer& tok, int V) {
  const json j = parse_json(read_file(tok.path()), tok.path());  // already validated by the tokenizer
  std::vector<std::string> tokens(V);
  std::vector<int32_t> types(V, kTokUnused);
  for (int i = 0; i < V; i++) tokens[i] = fmt::format("[PAD{}]", i);
  for (int i = 0; i < tok.vocab_size(); i++) {
    std::string piece = tok.id_to_piece(i);
    if (piece.empty()) continue;  // an id the file gives no piece
    tokens[i] = std::move(piece);
    types[i] = kTokNormal;
  }
  if (const auto it = j.find("added_tokens"); it != j.end() && it->is_array())
    for (const json& a : *it) {
      const int64_t id = a.value("id", (int64_t)-1);
      if (id < 0 || id >= V) continue;
      const std::string content = a.value("content", std::string());
      const bool looks_special =
          content.size() >= 4 && content.rfind("<|", 0) == 0 && content.compare(content.size() - 2, 2, "|>") == 0;
      types[id] = a.value("special", false) || looks_special ? kTokControl : kTokUserDefined;
    }
  std::vector<std::string> merges;
  const json& ms = j.at("model").at("merges");
  merges.reserve(ms.size());
  for (size_t i = 0; i < ms.size(); i++) {
    if (ms[i].is_string()) {
      merges.push_back(ms[i].get<std::string>());
      continue;
    }
    const std::string x = ms[i][0].get<std::string>(), y = ms[i][1].get<std::string>();
    // llama.cpp splits a merge at its first space: pieces holding one cannot be written.
    if (x.find(' ') != std::string::npos || y.find(' ') != std::string::npos)
      refuse(fmt::format("{}: model.merges[{}] joins pieces holding a space, which GGUF's \"a b\" merges cannot hold",
                         tok.path(), i));
    merges.push_back(x + " " + y);
  }
  // The split pattern (the tokenizer accepted only Qwen's or GPT-2's): Qwen's starts case-insensitive.
  std::string pre = "gpt-2";
  const json& pt = j.at("pre_tokenizer");
  if (pt.value("type", std::string()) == "Sequence") {
    const json& split = pt.at("pretokenizers").at(0);
    if (split.value("type", std::string()) == "Split" &&
        split.at("pattern").value("Regex", std::string()).rfind("(?i:", 0) == 0)
      pre = "qwen2";
  }
  kv.emplace_back("tokenizer.ggml.model", Value::str("gpt2"));
  kv.emplace_back("tokenizer.ggml.pre", Value::str(pre));
  kv.emplace_back("tokenizer.ggml.tokens", Value::strings(std::move(tokens)));
  kv.emplace_back("tokenizer.ggml.token_type", Value::i32s(types));
  kv.emplace_back("tokenizer.ggml.merges", Value::strings(std::move(merges)));
}

void add_vocab(gguf::KeyValues& kv, const Tokenizer& tok, const ModelConfig& cfg, const std::string& model_dir) {
  const int V = cfg.vocab_size;
  if (tok.byte_level())
    add_byte_bpe_vocab(kv, tok, V);
  else
    add_sentencepiece_vocab(kv, tok, V);
  auto id = [&](const char* key, int64_t v) {
    if (v >= 0 && v < V) kv.emplace_back(key, Value::u32((uint32_t)v));
  };
  id("tokenizer.ggml.bos_token_id", tok.bos_id());
  int64_t eos = tok.eos_id();
  if (eos < 0) {
    const std::vector<int32_t> ids = model_eos_ids(model_dir, cfg, &tok);
    if (!ids.empty()) eos = ids[0];
  }
  id("tokenizer.ggml.eos_token_id", eos);
  id("tokenizer.ggml.unknown_token_id", tok.unk_id());
  id("tokenizer.ggml.padding_token_id", tok.pad_id() >= 0 ? tok.pad_id() : cfg.pad_token_id);
  kv.emplace_back("tokenizer.ggml.add_bos_token", Value::boolean(tok.bos_id() >= 0));
  kv.emplace_back("tokenizer.ggml.add_eos_token", Value::boolean(false));
}

// tokenizer_config.json's chat_template (a string, or [{name, template}]), else chat_template.jinja.
// Returns what was written ("" when none).
std::string add_chat_template(gguf::KeyValues& kv, const fs::path& dir) {
  std::error_code ec;
  if (fs::is_regular_file(dir / "tokenizer_config.json", ec)) {
    const std::string path = (dir / "tokenizer_config.json").string();
    const json tc = parse_json(read_file(path), path);
    if (tc.is_object() && tc.contains("chat_template")) {
      const json& t = tc["chat_template"];
      if (t.is_string()) {
        kv.emplace_back("tokenizer.chat_template", Value::str(t.get<std::string>()));
        return "tokenizer_config.json";
      }
      if (t.is_array()) {
        for (const json& e : t) {
          if (!e.is_object() || !e.value("name", json()).is_string() || !e.value("template", json()).is_string())
            refuse(fmt::format("{}: chat_template entries must be {{\"name\": ..., \"template\": ...}}", path));
          const std::string name = e["name"].get<std::string>();
          kv.emplace_back(name == "default" ? "tokenizer.chat_template" : "tokenizer.chat_template." + name,
                          Value::str(e["template"].get<std::string>()));
        }
        return "tokenizer_config.json";
      }
      if (!t.is_null()) refuse(fmt::format("{}: chat_template is neither a string nor a list of templates", path));
    }
  }
  if (fs::is_regular_file(dir / "chat_template.jinja", ec)) {
    kv.emplace_back("tokenizer.chat_template", Value::str(read_file(dir / "chat_template.jinja")));
    return "chat_template.jinja";
  }
  return "";
}

// ---- the command --------------------------------------------------------------------------------

TensorType parse_type(const std::string& s) {
  if (s == "bf16") return TensorType::BF16;
  if (s == "f16") return TensorType::F16;
  if (s == "f32") return TensorType::F32;
  if (s == "q8_0") return TensorType::Q8_0;
  refuse(fmt::format("--type: '{}' is not supported (expected bf16, f16, f32 or q8_0)", s));
}

// llama.cpp's general.file_type (llama_ftype): what most tensors are.
uint32_t file_type(TensorType t) {
  switch (t) {
    case TensorType::F32:
      return 0;
    case TensorType::F16:
      return 1;
    case TensorType::Q8_0:
      return 7;
    default:
      return 32;  // bf16
  }
}

// Where the GGUF goes: a file path in an existing directory, replaced only with --force.  (That it is
// none of the inputs is refuse_output_over_inputs' job, once they are open.)
void check_output(const Options& o) {
  const fs::path out(o.output);
  std::error_code ec;
  if (fs::is_directory(out, ec)) refuse(fmt::format("--output {}: is a directory (expected a file path)", o.output));
  const fs::path parent = out.has_parent_path() ? out.parent_path() : fs::path(".");
  if (!fs::is_directory(parent, ec))
    refuse(fmt::format("--output {}: directory {} does not exist", o.output, parent.string()));
  if (!fs::exists(out, ec)) return;
  if (!fs::is_regular_file(out, ec)) refuse(fmt::format("--output {}: exists and is not a regular file", o.output));
  if (!o.force) refuse(fmt::format("--output {}: already exists (pass --force to replace it)", o.output));
}

int run_export_gguf(int argc, char** argv) {
  CLI::App app{"Write a Hugging Face model directory as a GGUF file (llama.cpp's format) for llama.cpp / ollama.",
               "moetron export gguf"};
  Options o;
  app.add_option("--model", o.model_dir, "model directory (config.json + safetensors + tokenizer)")->required();
  app.add_option("--output", o.output, "the GGUF file to write")->required();
  app.add_option("--type", o.type,
                 "tensor type of the matrices: bf16 (default), f16, f32 or q8_0 (norms, biases, routers: f32; q8_0: "
                 "matrices whose rows are not whole 32-value blocks stay bf16)");
  app.add_option("--tokenizer", o.tokenizer,
                 "tokenizer.model or tokenizer.json (default: MODEL/tokenizer.model, else "
                 "MODEL/tokenizer.json)");
  app.add_option("--name", o.name, "general.name (default: the model directory's name)");
  app.add_flag("--sliding-window-as-context", o.window_as_context,
               "for a sliding_window shorter than max_position_embeddings: write context_length = sliding_window "
               "(llama.cpp's llama graph has no window; within it the model is exact)");
  app.add_flag("--force", o.force, "replace an existing --output file");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  const TensorType type = parse_type(o.type);
  const fs::path model(o.model_dir);
  std::error_code ec;
  if (!fs::is_directory(model, ec)) refuse(fmt::format("--model {}: not a directory", o.model_dir));
  const std::string cfg_path = (model / "config.json").string();
  if (!fs::is_regular_file(cfg_path, ec)) refuse(fmt::format("--model {}: no config.json", o.model_dir));
  check_output(o);

  // Everything about the input, checked before a byte is written.
  ModelConfig cfg;
  gguf::Arch arch;
  int context = 0;
  std::optional<ModelTensors> files;
  std::optional<ParamTable> table;
  std::unique_ptr<Tokenizer> tok;
  gguf::KeyValues kv;
  std::string template_source;
  try {
    cfg = load_model_config(cfg_path);
    arch = gguf::arch_for(cfg, cfg_path);
    context = gguf::check_expressible(cfg, arch, o.window_as_context, cfg_path);
    files.emplace(ModelTensors::open(o.model_dir));
    table.emplace(cfg);
    check_weights_size(*files, *table, o.model_dir);
    tok = load_model_tokenizer(o.model_dir, o.tokenizer, cfg, /*required=*/false);
    if (!tok)
      refuse(
          fmt::format("--model {}: no tokenizer.model or tokenizer.json, and a GGUF carries its vocabulary: pass "
                      "--tokenizer FILE",
                      o.model_dir));

    std::string name = o.name;
    if (name.empty()) name = fs::weakly_canonical(fs::absolute(model)).filename().string();
    kv.emplace_back("general.architecture", Value::str(arch.name));
    kv.emplace_back("general.type", Value::str("model"));
    kv.emplace_back("general.name", Value::str(name));
    kv.emplace_back("general.file_type", Value::u32(file_type(type)));
    kv.emplace_back("general.quantization_version", Value::u32(2));
    gguf::add_arch_keys(kv, cfg, arch, context);
    add_vocab(kv, *tok, cfg, o.model_dir);
    template_source = add_chat_template(kv, model);
    // What the export read, --force or not, never becomes its output: every file of the model
    // directory but a GGUF (its subdirectories too, where an index may place shards), each shard
    // wherever it lies, --tokenizer and the files beside it (tokenizer_config.json gives BOS/EOS).
    InputPaths inputs;
    inputs.add_tree(model, ".gguf");
    for (size_t i = 0; i < files->num_files(); i++) inputs.files.emplace_back(files->file(i).path());
    if (!o.tokenizer.empty()) inputs.add_with_siblings(o.tokenizer, ".gguf");
    refuse_output_over_inputs(o.output, inputs, "--output");
  } catch (const InputError&) {
    throw;
  } catch (const Error& e) {
    throw InputError(e.what());
  }

  const std::vector<Planned> plan = plan_tensors(cfg, *table, arch, type);
  std::vector<gguf::TensorToWrite> tensors;
  for (const Planned& p : plan) {
    gguf::TensorToWrite t;
    t.name = p.name;
    t.ne = p.ne;
    t.type = p.type;
    t.fill = [&p, &files, &table, &o](gguf::TensorSink& sink) { fill_tensor(sink, p, *files, *table, o.model_dir); };
    tensors.push_back(std::move(t));
  }
  gguf::write_file(o.output, kv, tensors);

  std::printf(
      "wrote %s: GGUF v3, architecture %s (%s), %zu tensors, %s matrices, %d positions, vocabulary %s (%d "
      "tokens), chat template: %s\n",
      o.output.c_str(), arch.name.c_str(), cfg.architecture.c_str(), plan.size(), gguf::tensor_type_traits(type).name,
      context, tok->byte_level() ? "gpt2" : "llama", cfg.vocab_size,
      template_source.empty() ? "none" : template_source.c_str());
  if (context < cfg.max_position_embeddings)
    std::printf("note: context_length is the sliding window (%d), not max_position_embeddings (%d)\n", context,
                cfg.max_position_embeddings);
  return 0;
}

}  // namespace

int run_export(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    std::fprintf(argc < 2 ? stderr : stdout,
                 "usage: moetron export gguf --model DIR --output F.gguf [--type bf16|f16|f32|q8_0] [--tokenizer FILE]\n");
    return argc < 2 ? 2 : 0;
  }
  const std::string what = argv[1];
  if (what == "gguf") return run_export_gguf(argc - 1, argv + 1);
  std::fprintf(stderr, "moetron export: unknown subcommand '%s' (available: gguf)\n", what.c_str());
  return 2;
}

}  // namespace moetron::cli
