#include "infer/model.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "backend/kernels/gemv.h"
#include "backend/kernels/q8.h"
#include "core/error.h"
#include "core/json_limits.h"
#include "core/mmap.h"
#include "io/model_files.h"
#include "jinja/model_template.h"
#include "model/lora.h"
#include "model/weights.h"

namespace fs = std::filesystem;

namespace moetron {

namespace {

std::optional<nlohmann::json> read_json_if_exists(const fs::path& p) {
  std::error_code ec;
  if (!fs::is_regular_file(p, ec)) return std::nullopt;
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  auto j = parse_json_or_discarded(ss.str());
  if (j.is_discarded()) return std::nullopt;
  return j;
}

// dataset.json of the data a moetron checkpoint was trained on (trainer_state.json's config snapshot
// names the data directory, relative to where training ran); nullopt when unknown or not found.
std::optional<nlohmann::json> training_dataset(const std::string& model_dir) {
  const auto st = read_json_if_exists(fs::path(model_dir) / "trainer_state.json");
  if (!st || !st->is_object()) return std::nullopt;
  const auto cfg = st->find("config");
  if (cfg == st->end() || !cfg->is_object()) return std::nullopt;
  const auto data = cfg->find("data");
  if (data == cfg->end() || !data->is_object() || !data->contains("path") || !(*data)["path"].is_string())
    return std::nullopt;
  return read_json_if_exists(fs::path((*data)["path"].get<std::string>()) / "dataset.json");
}

std::optional<ChatTemplate> template_from_jinja(const std::string& jinja) {
  if (jinja.find("<|im_start|>") != std::string::npos) return ChatTemplate::chatml;
  if (jinja.find("<<SYS>>") != std::string::npos) return ChatTemplate::llama2;
  if (jinja.find("[INST]") != std::string::npos) return ChatTemplate::mistral;
  return std::nullopt;
}

}  // namespace

InferenceModel::InferenceModel(const ModelConfig& c, bool allocate_owned) : cfg(c), table(c) {
  for (size_t i = 0; i < table.specs().size(); i++) sources_.emplace_back(*this, i);
  spec_refs_.resize(table.specs().size());
  const auto& hf = table.hf_tensors();
  for (size_t i = 0; i < hf.size(); i++) spec_refs_[hf[i].spec_index].push_back(i);
  for (auto& v : spec_refs_)
    std::sort(v.begin(), v.end(), [&](size_t a, size_t b) { return hf[a].offset < hf[b].offset; });
  if (!allocate_owned) return;
  owned.assign(table.total(), 0.0f);
  for (const HfTensorRef& r : hf) refs_.push_back({owned.data() + r.offset, DType::F32});
}

bool InferenceModel::is_small(ParamKind kind) {
  switch (kind) {
    case ParamKind::input_norm:
    case ParamKind::post_norm:
    case ParamKind::final_norm:
    case ParamKind::q_norm:
    case ParamKind::k_norm:
    case ParamKind::q_bias:
    case ParamKind::k_bias:
    case ParamKind::v_bias:
    case ParamKind::router:
    case ParamKind::router_bias:
    case ParamKind::shared_gate:
    case ParamKind::q_a_norm:
    case ParamKind::kv_a_norm:
      return true;
    default:
      return false;
  }
}

WeightQuant parse_weight_quant(const std::string& name, const char* what) {
  if (name == "none") return WeightQuant::none;
  if (name == "q8_0") return WeightQuant::q8_0;
  fail("{}: '{}' is not a weight format (expected none or q8_0)", what, name);
}

void InferenceModel::set_weights(std::vector<WeightRef> refs, std::shared_ptr<const void> keep_alive,
                                 std::vector<float> small, std::vector<size_t> small_offset,
                                 HugeVector<int8_t> quantized, HugeVector<uint16_t> scales,
                                 std::optional<TensorView> embedding, bool embedding_q8) {
  MOETRON_ASSERT(refs.size() == table.hf_tensors().size() && small_offset.size() == table.specs().size());
  q8_ = std::move(quantized);  // a moved vector keeps its buffer: the refs into it stay valid
  q8_scales_ = std::move(scales);
  refs_ = std::move(refs);
  files_ = std::move(keep_alive);
  small_ = std::move(small);
  small_offset_ = std::move(small_offset);
  embedding_file_ = std::move(embedding);
  embedding_q8_ = embedding_file_ && embedding_q8;
}

void InferenceModel::embedding_row(float* out, size_t token, std::vector<uint8_t>& scratch) const {
  const int C = cfg.hidden_size;
  if (token >= (size_t)cfg.vocab_size)
    fail("[InferenceModel::embedding_row] token {} is outside the vocabulary of {}", token, cfg.vocab_size);
  if (!embedding_file_) {
    kernels::widen_row(out, mat(ParamKind::embedding, -1, 0, (size_t)cfg.vocab_size * C), token, C);
    return;
  }
  // scratch: the row as stored, then (Q8_0) its int8 values and f16 scales -- 2-byte aligned, as the
  // row's bytes and C (whole blocks) are even.
  const size_t row_bytes = (size_t)C * dtype_size(embedding_file_->dtype);
  scratch.resize(row_bytes + (embedding_q8_ ? (size_t)C + (size_t)C / kernels::kQ8Block * sizeof(uint16_t) : 0));
  read_stored_bytes(*embedding_file_, token * row_bytes, row_bytes, scratch.data());
  const WeightRef stored{scratch.data(), embedding_file_->dtype};
  if (!embedding_q8_) {
    kernels::widen_row(out, stored, 0, C);
    return;
  }
  int8_t* q = reinterpret_cast<int8_t*>(scratch.data() + row_bytes);
  uint16_t* d = reinterpret_cast<uint16_t*>(scratch.data() + row_bytes + C);
  // (checked at load: every block's scale is within f16)
  MOETRON_ASSERT(kernels::quantize_q8_0(stored, 1, C, q, d));
  kernels::widen_row(out, {q, DType::U8, d}, 0, C);
}

const float* InferenceModel::vec(ParamKind kind, int layer) const {
  return const_cast<InferenceModel*>(this)->vec_mut(kind, layer);
}

float* InferenceModel::vec_mut(ParamKind kind, int layer) {
  const ParamSpec& s = table.at(kind, layer);
  MOETRON_ASSERT(is_small(kind));
  if (!owned.empty()) return owned.data() + s.offset;
  const size_t i = (size_t)(&s - table.specs().data());
  return small_.data() + small_offset_[i];
}

size_t InferenceModel::ref_of(size_t i, size_t at) const {
  // spec_refs_[i] is sorted by offset: the last tensor starting at or before `at`.
  const auto& hf = table.hf_tensors();
  const std::vector<size_t>& refs = spec_refs_[i];
  const auto it = std::upper_bound(refs.begin(), refs.end(), at,
                                   [&](size_t a, size_t r) { return a < hf[r].offset; });
  if (it == refs.begin() || at >= hf[*(it - 1)].offset + hf[*(it - 1)].numel)
    fail("[InferenceModel] element {} of {} is outside its tensors", at - table.specs()[i].offset,
         table.specs()[i].name);
  return *(it - 1);
}

WeightRef InferenceModel::mat(ParamKind kind, int layer, size_t offset, size_t count) const {
  const ParamSpec& s = table.at(kind, layer);
  return sources_[(size_t)(&s - table.specs().data())].at(offset, count);
}

WeightSource::Piece InferenceModel::Source::piece(size_t offset) const {
  const ParamSpec& s = m_.table.specs()[spec_];
  const size_t at = s.offset + offset;
  const size_t r = m_.ref_of(spec_, at);
  const HfTensorRef& ref = m_.table.hf_tensors()[r];
  MOETRON_ASSERT(m_.refs_[r].data != nullptr);  // not read by row (embedding_row)
  return {m_.refs_[r].at(at - ref.offset), ref.offset + ref.numel - at};
}

void InferenceModel::Source::rows(float* out, const int32_t* idx, long n, int C) const {
  MOETRON_ASSERT(m_.table.specs()[spec_].kind == ParamKind::embedding && C == m_.cfg.hidden_size);
  for (long i = 0; i < n; i++) m_.embedding_row(out + (size_t)i * C, (size_t)idx[i], scratch_);
}

Tensor InferenceModel::weight(ParamKind kind, int layer) const {
  const ParamSpec& s = table.at(kind, layer);
  if (is_small(kind)) return Tensor{const_cast<float*>(vec(kind, layer)), s.numel, Store::f32, 4};
  return Tensor{const_cast<Source*>(&sources_[(size_t)(&s - table.specs().data())]), s.numel, Store::stored, 0, 0};
}

Tensor InferenceModel::adapter_factor(ParamKind target, int layer, bool b) const {
  const ParamSpec* s = lora ? lora->table.find_lora(target, layer, b) : nullptr;
  if (s == nullptr) return Tensor{};
  return Tensor{const_cast<float*>(lora->values.data() + s->offset), s->numel, Store::f32, 4};
}

std::string InferenceModel::storage_name() const {
  const char* names[4] = {"F32", "BF16", "F16", "Q8_0"};
  size_t by[4] = {0, 0, 0, 0};  // elements of each
  const auto& hf = table.hf_tensors();
  for (size_t i = 0; i < hf.size(); i++)
    if (!is_small(table.spec_of(hf[i]).kind))
      by[held_q8(i) ? 3 : refs_[i].dtype == DType::BF16 ? 1 : refs_[i].dtype == DType::F16 ? 2 : 0] += hf[i].numel;
  return names[std::max_element(by, by + 4) - by];
}

size_t InferenceModel::weight_bytes() const {
  size_t b = 0;
  const auto& hf = table.hf_tensors();
  for (size_t i = 0; i < hf.size(); i++) {
    if (is_small(table.spec_of(hf[i]).kind))
      b += hf[i].numel * sizeof(float);
    else if (held_q8(i))
      b += hf[i].numel + hf[i].numel / kernels::kQ8Block * sizeof(uint16_t);
    else
      b += hf[i].numel * dtype_size(refs_[i].dtype);
  }
  return b;
}

namespace {

// First non-finite value of a stored tensor (numel values), or numel.  bf16 and f16 by their exponent
// bits, so nothing is converted.
size_t first_non_finite_stored(const TensorView& t, size_t numel) {
  if (t.dtype == DType::F32) {
    for (size_t i = 0; i < numel; i++) {
      uint32_t b;
      std::memcpy(&b, t.data + 4 * i, 4);
      if ((b & 0x7f800000u) == 0x7f800000u) return i;
    }
    return numel;
  }
  const uint16_t mask = t.dtype == DType::BF16 ? 0x7f80 : 0x7c00;
  for (size_t i = 0; i < numel; i++) {
    uint16_t h;
    std::memcpy(&h, t.data + 2 * i, 2);
    if ((h & mask) == mask) return i;
  }
  return numel;
}

// Tensor v, rows x IC values, read from its file in pieces of ~1 MiB into `buffer` (read_stored_bytes:
// never through the mapping, so never resident): fn(piece, n, at) for each, `piece` a view of the
// buffer holding the n rows from element `at`.
template <class F>
void for_each_stored_piece(const TensorView& v, size_t rows, size_t IC, std::vector<uint8_t>& buffer, F&& fn) {
  const size_t esize = dtype_size(v.dtype);
  const size_t piece = std::max<size_t>(1, (1u << 20) / (IC * esize));
  buffer.resize(std::min(piece, rows) * IC * esize);
  TensorView part = v;
  part.data = buffer.data();
  part.mapped = false;
  for (size_t r0 = 0; r0 < rows; r0 += piece) {
    const size_t n = std::min(piece, rows - r0), at = r0 * IC;
    read_stored_bytes(v, at * esize, n * IC * esize, buffer.data());
    fn(part, n, at);
  }
}

}  // namespace

std::unique_ptr<InferenceModel> load_inference_model(const std::string& dir, const std::string& lora_dir,
                                                     bool widen_to_fp32, WeightQuant quant) {
  MOETRON_ASSERT(!(widen_to_fp32 && quant != WeightQuant::none));
  const ModelConfig cfg = load_model_config((fs::path(dir) / "config.json").string());
  auto files = std::make_shared<ModelTensors>(ModelTensors::open(dir));
  {
    const ParamTable whole(cfg);
    const size_t mtp = check_weights_size(*files, whole, dir);  // before allocating what config.json asks for
    if (mtp > 0) fmt::print(stderr, "note: {}\n", mtp_note(mtp, whole, dir));
  }
  // The adapter is read (and checked against the base) before the base's memory is allocated.
  std::optional<PeftAdapter> adapter;
  if (!lora_dir.empty()) adapter = read_peft_adapter(lora_dir, cfg);
  auto m = std::make_unique<InferenceModel>(cfg, widen_to_fp32);
  if (widen_to_fp32) {
    load_hf_weights(*files, m->table, m->owned.data(), dir);
  } else {
    // Matrices used in place: 2 MiB pages asked for before the first read (MappedFile::
    // advise_huge_pages; Q8_0 reads the files with pread and maps nothing).
    const bool huge_pages = quant == WeightQuant::none;
    if (huge_pages)
      for (size_t i = 0; i < files->num_files(); i++) files->file(i).mapping().advise_huge_pages();
    std::map<const uint8_t*, std::vector<std::pair<size_t, size_t>>> in_place;  // per mapping: file ranges
    const ParamTable& t = m->table;
    std::vector<WeightRef> refs;
    std::vector<float> small;
    std::vector<size_t> small_offset(t.specs().size(), 0);
    for (size_t i = 0; i < t.specs().size(); i++)
      if (InferenceModel::is_small(t.specs()[i].kind)) {
        small_offset[i] = small.size();
        small.resize(small.size() + t.specs()[i].numel);
      }
    // Q8_0: which matrices (rows of whole blocks) and where each goes in one allocation.
    auto row_length = [&](const HfTensorRef& ref) { return (size_t)t.spec_of(ref).shape.back(); };
    // An untied embedding is read by row from the file (InferenceModel::embedding_row).
    auto by_row = [&](const HfTensorRef& ref) {
      return t.spec_of(ref).kind == ParamKind::embedding && t.head_kind() != ParamKind::embedding;
    };
    auto quantized = [&](const HfTensorRef& ref) {
      return quant == WeightQuant::q8_0 && !InferenceModel::is_small(t.spec_of(ref).kind) && !by_row(ref) &&
             row_length(ref) % kernels::kQ8Block == 0;
    };
    size_t q8_total = 0;
    for (const HfTensorRef& ref : t.hf_tensors())
      if (quantized(ref)) q8_total += ref.numel;
    HugeVector<int8_t> q8(q8_total);  // on 2 MiB pages, as the mapped matrices
    HugeVector<uint16_t> q8_scales(q8_total / kernels::kQ8Block);
    size_t q8_at = 0;
    std::vector<uint8_t> piece_buffer;                       // one piece of a tensor read in pieces, as stored
    std::optional<TensorView> embedding;                     // read by row
    bool embedding_q8 = false;                               // and quantized per row
    for (const HfTensorRef& ref : t.hf_tensors()) {
      const ParamSpec& spec = t.spec_of(ref);
      const size_t si = ref.spec_index;
      if (InferenceModel::is_small(spec.kind)) {
        float* dst = small.data() + small_offset[si] + (ref.offset - spec.offset);
        refs.push_back({nullptr, DType::F32});
        const TensorView sv = quant == WeightQuant::q8_0 ? hf_tensor_view(*files, t, ref, dir) : TensorView{};
        if (quant == WeightQuant::q8_0 &&
            (sv.dtype == DType::F32 || sv.dtype == DType::BF16 || sv.dtype == DType::F16)) {
          // Q8_0 maps no page of the files: read with pread, as the matrices (a fault in the mapping maps
          // the page-cache folios around the page, up to MiBs resident until released).
          for_each_stored_piece(sv, 1, ref.numel, piece_buffer, [&](const TensorView& part, size_t, size_t) {
            if (const size_t bad = first_non_finite_stored(part, ref.numel); bad < ref.numel)
              fail("{}: tensor '{}' holds a non-finite value (NaN or Inf) at element {}: the weights are corrupt, "
                   "and a model computed from them would give NaN logits",
                   sv.file, sv.name, bad);
            kernels::widen_row(dst, {part.data, sv.dtype}, 0, (int)ref.numel);
          });
          continue;
        }
        HfTensorSlice whole;
        whole.ref = &ref;
        read_hf_slice(*files, t, whole, dst, dir);
        continue;
      }
      const TensorView v = hf_tensor_view(*files, t, ref, dir);
      if (v.dtype != DType::F32 && v.dtype != DType::BF16 && v.dtype != DType::F16)
        fail("{}: tensor '{}' in {} has dtype {}; moetron reads weights in F32, BF16 or F16", dir, v.name, v.file,
             dtype_name(v.dtype));
      auto non_finite = [&](size_t at) {
        fail("{}: tensor '{}' holds a non-finite value (NaN or Inf) at element {}: the weights are corrupt, and a "
             "model computed from them would give NaN logits",
             v.file, v.name, at);
      };
      auto beyond_q8 = [&] {
        fail("{}: tensor '{}' holds a value beyond Q8_0's range (a block scale above f16's 65504): load it without "
             "--quantize",
             v.file, v.name);
      };
      const size_t IC = row_length(ref), rows = ref.numel / IC;
      if (by_row(ref)) {
        // Checked here (and, for Q8_0, that it quantizes: embedding_row quantizes a row per lookup).
        embedding_q8 = quant == WeightQuant::q8_0 && IC % kernels::kQ8Block == 0;
        std::vector<int8_t> q;  // one piece's Q8_0, only to check it quantizes
        std::vector<uint16_t> d;
        for_each_stored_piece(v, rows, IC, piece_buffer, [&](const TensorView& part, size_t n, size_t at) {
          if (const size_t bad = first_non_finite_stored(part, n * IC); bad < n * IC) non_finite(at + bad);
          if (embedding_q8) {
            q.resize(n * IC);
            d.resize(n * IC / kernels::kQ8Block);
            if (!kernels::quantize_q8_0({part.data, v.dtype}, n, (int)IC, q.data(), d.data())) beyond_q8();
          }
        });
        embedding = v;
        refs.push_back({nullptr, v.dtype});
        continue;
      }
      if (quantized(ref)) {
        // Each piece checked and quantized: the process holds the Q8_0 copy and one piece.
        int8_t* q = q8.data() + q8_at;
        uint16_t* d = q8_scales.data() + q8_at / kernels::kQ8Block;
        for_each_stored_piece(v, rows, IC, piece_buffer, [&](const TensorView& part, size_t n, size_t at) {
          if (const size_t bad = first_non_finite_stored(part, n * IC); bad < n * IC) non_finite(at + bad);
          if (!kernels::quantize_q8_0({part.data, v.dtype}, n, (int)IC, q + at, d + at / kernels::kQ8Block))
            beyond_q8();
        });
        refs.push_back({q, DType::U8, d});
        q8_at += ref.numel;
        continue;
      }
      if (const size_t bad = first_non_finite_stored(v, ref.numel); bad < ref.numel) non_finite(bad);
      refs.push_back({v.data, v.dtype});
      if (huge_pages && v.mapped)
        in_place[v.map_base].emplace_back(v.data - v.map_base, ref.numel * dtype_size(v.dtype));
    }
    // Each file's matrices, read once by the checks above, on 2 MiB pages where the kernel gives them.
    for (size_t i = 0; i < files->num_files(); i++) {
      const MappedFile& f = files->file(i).mapping();
      const auto it = in_place.find(f.data());
      if (it == in_place.end()) continue;
      const MappedFile::HugePages h = f.back_with_huge_pages(it->second);
      m->huge_pages.huge += h.huge;
      m->huge_pages.windows += h.windows;
      m->huge_pages.reread = m->huge_pages.reread || h.reread;
    }
    // Q8_0: no page of the files is read through the mappings from here on (the matrices quantized,
    // the embedding read with pread), so every page the load mapped leaves the process -- the
    // headers, small tensors of other dtypes: a fault maps the page-cache folios around a page, 2 MiB
    // of a file cached in 2 MiB folios.  Released at the end, as a range released early can come
    // back.  (A matrix left in place, its rows not whole blocks, faults back in when read.)
    if (quant == WeightQuant::q8_0)
      for (size_t i = 0; i < files->num_files(); i++)
        release_mapped_pages(files->file(i).mapping().data(), files->file(i).mapping().size());
    m->set_weights(std::move(refs), files, std::move(small), std::move(small_offset), std::move(q8),
                   std::move(q8_scales), std::move(embedding), embedding_q8);
  }
  if (adapter) {
    ParamTable t(cfg, adapter->spec);
    m->lora.reset(new InferenceModel::Adapter{adapter->spec, std::move(t), std::move(adapter->values)});
  }
  return m;
}

namespace {

TemplateChoice jinja_choice(const jinja::ModelTemplate& mt) {
  TemplateChoice c;
  c.jinja = std::make_shared<const jinja::Template>(mt.source, fs::path(mt.origin).filename().string());
  c.special_tokens = mt.special_tokens;
  c.source = mt.origin;
  return c;
}

TemplateChoice required_model_template(const std::string& model_dir, bool byte_level, const std::string& why) {
  const auto mt = jinja::load_model_template(model_dir);
  if (!mt)
    throw InputError(fmt::format("{}: {} holds no chat template (chat_template.jinja or tokenizer_config.json's "
                                 "\"chat_template\")", why, model_dir));
  if (!byte_level)
    throw InputError(fmt::format("{}: the model's Jinja template needs a byte-level BPE tokenizer.json; with a "
                                 "SentencePiece tokenizer use --template mistral | llama2 | chatml | raw", why));
  return jinja_choice(*mt);
}

}  // namespace

TemplateChoice choose_chat_template(const std::string& model_dir, const std::string& explicit_name, bool byte_level) {
  if (!explicit_name.empty() && explicit_name != "auto") {
    if (explicit_name == "jinja") {
      TemplateChoice c = required_model_template(model_dir, byte_level, "--template jinja");
      return c;
    }
    if (explicit_name.size() > 6 && explicit_name.compare(explicit_name.size() - 6, 6, ".jinja") == 0) {
      if (!byte_level)
        throw InputError(fmt::format("--template {}: a Jinja template needs a byte-level BPE tokenizer.json", explicit_name));
      return jinja_choice(jinja::load_template_file(explicit_name, model_dir));
    }
    return {parse_chat_template(explicit_name), "--template"};
  }
  if (const auto ds = training_dataset(model_dir); ds && ds->contains("template") && (*ds)["template"].is_string()) {
    const std::string name = (*ds)["template"].get<std::string>();
    if (name == "jinja") return required_model_template(model_dir, byte_level, "the training dataset's dataset.json (template jinja)");
    return {parse_chat_template(name), "the training dataset's dataset.json"};
  }
  if (byte_level)
    if (const auto mt = jinja::load_model_template(model_dir)) return jinja_choice(*mt);
  if (const auto tc = read_json_if_exists(fs::path(model_dir) / "tokenizer_config.json");
      tc && tc->is_object() && tc->contains("chat_template") && (*tc)["chat_template"].is_string())
    if (const auto t = template_from_jinja((*tc)["chat_template"].get<std::string>()))
      return {*t, "tokenizer_config.json"};
  {
    std::ifstream in(fs::path(model_dir) / "chat_template.jinja");
    if (in) {
      std::stringstream ss;
      ss << in.rdbuf();
      if (const auto t = template_from_jinja(ss.str())) return {*t, "chat_template.jinja"};
    }
  }
  return {ChatTemplate::mistral, "default"};
}

std::vector<int32_t> model_eos_ids(const std::string& model_dir, const ModelConfig& cfg, const Tokenizer* tok) {
  std::vector<int32_t> ids;
  auto add = [&](long id) {
    if (id >= 0 && id < cfg.vocab_size && std::find(ids.begin(), ids.end(), (int32_t)id) == ids.end())
      ids.push_back((int32_t)id);
  };
  const auto gc = read_json_if_exists(fs::path(model_dir) / "generation_config.json");
  if (gc && gc->is_object() && gc->contains("eos_token_id")) {
    const auto& e = (*gc)["eos_token_id"];
    if (e.is_number_integer()) add(e.get<long>());
    if (e.is_array())
      for (const auto& x : e)
        if (x.is_number_integer()) add(x.get<long>());
  }
  if (ids.empty())
    for (int id : cfg.eos_token_ids) add(id);
  if (ids.empty()) add(cfg.eos_token_id);
  if (tok) add(tok->eos_id());
  return ids;
}

void add_chat_stop_ids(std::vector<int32_t>& eos_ids, const TemplateChoice& tc, const Tokenizer& tok,
                       const ModelConfig& cfg) {
  std::vector<int32_t> ids;
  if (!tc.jinja) {
    ids = chat_stop_ids(tc.tmpl, tok);
  } else {
    for (const char* marker : {"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|return|>", "<|call|>", "<end_of_turn>",
                               "<|end_of_text|>"})
      if (tc.jinja->source().find(marker) != std::string::npos)
        if (const int32_t id = tok.piece_to_id(marker); id >= 0) ids.push_back(id);
  }
  for (const int32_t id : ids)
    if (id < cfg.vocab_size && std::find(eos_ids.begin(), eos_ids.end(), id) == eos_ids.end()) eos_ids.push_back(id);
}

std::unique_ptr<Tokenizer> load_model_tokenizer(const std::string& model_dir, const std::string& explicit_path,
                                                const ModelConfig& cfg, bool required) {
  // Only MODEL/tokenizer.model, MODEL/tokenizer.json or --tokenizer: a path read from a file in the
  // model directory could name anything on this machine (moetron checkpoints carry their tokenizer).
  // tokenizer.model first: a Llama/Mistral directory that ships both is read as it always was.
  std::string path = explicit_path;
  for (const char* name : {"tokenizer.model", "tokenizer.json"}) {
    if (!path.empty()) break;
    const fs::path own = fs::path(model_dir) / name;
    std::error_code ec;
    if (fs::is_regular_file(own, ec)) path = own.string();
  }
  if (path.empty()) {
    if (!required) return nullptr;
    fail("{}: no tokenizer.model or tokenizer.json; pass --tokenizer PATH", model_dir);
  }
  auto tok = std::make_unique<Tokenizer>(Tokenizer::load(path));
  if (tok->vocab_size() > cfg.vocab_size)
    fail("{}: the tokenizer has {} pieces but the model's vocab_size is {}", path, tok->vocab_size(), cfg.vocab_size);
  return tok;
}

}  // namespace moetron
