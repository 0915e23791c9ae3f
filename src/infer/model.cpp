#include "infer/model.h"
#include "core/json_limits.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/model_files.h"
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

std::unique_ptr<InferenceModel> load_inference_model(const std::string& dir, const std::string& lora_dir) {
  const ModelConfig cfg = load_model_config((fs::path(dir) / "config.json").string());
  const ModelTensors files = ModelTensors::open(dir);
  check_weights_size(files, ParamTable(cfg), dir);  // before allocating what config.json asks for
  // The adapter is read (and checked against the base) before the base's memory is allocated.
  std::optional<PeftAdapter> adapter;
  if (!lora_dir.empty()) adapter = read_peft_adapter(lora_dir, cfg);
  auto m = std::make_unique<InferenceModel>(cfg);
  load_hf_weights(files, m->table, m->params.data(), dir);
  if (adapter) {
    ParamTable t(cfg, adapter->spec);
    m->lora.reset(new InferenceModel::Adapter{adapter->spec, std::move(t), std::move(adapter->values)});
  }
  m->keep_bf16_copy();
  return m;
}

bool InferenceModel::keep_bf16_copy() {
  params_bf16.clear();
  for (float v : params) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    if ((bits & 0xFFFFu) != 0) return false;
  }
  params_bf16.resize(params.size());
  for (size_t i = 0; i < params.size(); i++) {
    uint32_t bits;
    std::memcpy(&bits, &params[i], sizeof bits);
    params_bf16[i] = (uint16_t)(bits >> 16);
  }
  return true;
}

TemplateChoice choose_chat_template(const std::string& model_dir, const std::string& explicit_name) {
  if (!explicit_name.empty() && explicit_name != "auto") return {parse_chat_template(explicit_name), "--template"};
  if (const auto ds = training_dataset(model_dir); ds && ds->contains("template") && (*ds)["template"].is_string())
    return {parse_chat_template((*ds)["template"].get<std::string>()), "the training dataset's dataset.json"};
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

void add_chat_stop_ids(std::vector<int32_t>& eos_ids, ChatTemplate tmpl, const Tokenizer& tok, const ModelConfig& cfg) {
  for (const int32_t id : chat_stop_ids(tmpl, tok))
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
