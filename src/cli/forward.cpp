// moetron forward: one forward (and backward) pass of an HF model directory on one batch.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "backend/select.h"
#include "io/hf_config.h"
#include "io/model_files.h"
#include "io/output_guard.h"
#include "io/safetensors.h"
#include "model/batch_io.h"
#include "model/lora.h"
#include "model/model.h"
#include "model/weights.h"

namespace moetron::cli {

int run_forward(int argc, char** argv) {
  CLI::App app{"One forward (and backward) pass of a Hugging Face Mixtral/Mistral/Llama model directory.\n"
               "Writes logits and, when the input has labels, ce_loss, aux_loss, z_loss and loss.",
               "moetron forward"};
  std::string model_dir, input, output, grads_path, aux_kind = "hf_pooled";
  double z_coef = 0.0;
  app.add_option("--model", model_dir, "HF model directory (config.json + safetensors)")->required();
  app.add_option("--input", input, "input safetensors: input_ids [B,T], optional labels, attention_mask, "
                                   "position_ids, segment_ids")->required();
  app.add_option("--output", output, "output safetensors")->required();
  app.add_option("--grads", grads_path, "also write d loss / d param for every parameter (F32, HF names; with "
                                        "--lora: of every adapter tensor, PEFT's names)");
  std::string lora_dir;
  app.add_option("--lora", lora_dir, "a PEFT LoRA adapter directory for the model, applied unmerged (the base frozen)");
  app.add_option("--aux-loss", aux_kind, "load-balancing formula: hf_pooled | per_layer | sequence")
      ->check(CLI::IsMember({"hf_pooled", "per_layer", "sequence"}));
  app.add_option("--z-loss-coef", z_coef, "router z-loss coefficient (default 0)");
  bool force = false;
  app.add_flag("--force", force, "replace an existing --output / --grads file (never replaced otherwise)");
  std::string device = "cpu";
  app.add_option("--device", device, "cpu (fp32), or cuda (bf16 with fp32 master weights, one NVIDIA GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  for (const std::string* f : {&output, &grads_path})
    if (!force && !f->empty() && std::filesystem::is_regular_file(*f)) {
      std::fprintf(stderr, "moetron forward: %s already exists; it is kept (pass --force to replace it)\n", f->c_str());
      return 2;
    }

  const ModelConfig cfg = load_model_config((std::filesystem::path(model_dir) / "config.json").string());
  const Batch batch = read_batch_safetensors(input);
  if (!grads_path.empty() && batch.labels.empty())
    fail("--grads needs labels: '{}' has no 'labels' tensor", input);

  LossWeights w;
  const long loss_tokens = count_loss_tokens(batch);
  w.ce_scale = loss_tokens > 0 ? 1.0 / (double)loss_tokens : 0.0;
  w.aux_coef = cfg.router_aux_loss_coef;
  w.z_coef = z_coef;
  w.aux_kind = aux_kind == "per_layer" ? AuxLossKind::per_layer
               : aux_kind == "sequence"  ? AuxLossKind::sequence
                                         : AuxLossKind::hf_pooled;
  const ModelTensors files = ModelTensors::open(model_dir);
  {  // --force replaces an earlier output, never an input (the model's files, --input, the adapter)
    InputPaths inputs;
    inputs.add_tree(model_dir);
    for (size_t i = 0; i < files.num_files(); i++) inputs.files.emplace_back(files.file(i).path());
    inputs.files.emplace_back(input);
    if (!lora_dir.empty()) inputs.dirs.emplace_back(lora_dir);
    refuse_output_over_inputs(output, inputs, "--output");
    if (!grads_path.empty()) refuse_output_over_inputs(grads_path, inputs, "--grads");
    if (!grads_path.empty() && std::filesystem::weakly_canonical(grads_path) == std::filesystem::weakly_canonical(output))
      throw InputError(fmt::format("--grads {}: is the --output file too; give each its own path", grads_path));
  }

  // The same model on either backend; the parameters are read on the host and uploaded.
  check_weights_size(files, ParamTable(cfg), model_dir);  // before allocating from config.json
  const std::unique_ptr<Backend> backend = make_backend(device);
  std::optional<PeftAdapter> adapter;
  if (!lora_dir.empty()) adapter = read_peft_adapter(lora_dir, cfg);
  Model model(*backend, cfg, nullptr, nullptr, LayerRange{}, adapter ? adapter->spec : LoraSpec{});
  {
    std::vector<float> params(model.table().total(), 0.0f);
    load_hf_weights(files, model.table(), params.data(), model_dir);
    model.set_params(params.data());
  }
  if (adapter) model.set_train_params(adapter->values.data());
  const Losses losses = model.forward(batch, w);
  std::vector<float> logits((size_t)batch.B * batch.T * cfg.vocab_size);
  model.download_logits(logits.data());  // before backward: backward overwrites the logits in place

  SafetensorsWriter out;
  out.add_f32("logits", {batch.B, batch.T, cfg.vocab_size}, logits.data());
  const float scalars[4] = {(float)losses.ce_loss, (float)losses.aux_loss, (float)losses.z_loss, (float)losses.loss};
  if (!batch.labels.empty()) {
    out.add_copy("ce_loss", DType::F32, {}, &scalars[0]);
    out.add_copy("aux_loss", DType::F32, {}, &scalars[1]);
    out.add_copy("z_loss", DType::F32, {}, &scalars[2]);
    out.add_copy("loss", DType::F32, {}, &scalars[3]);
    out.set_metadata("loss_tokens", std::to_string(loss_tokens));
  }
  out.write(output);
  if (!batch.labels.empty())
    std::printf("loss %.6f  ce_loss %.6f  aux_loss %.6f  z_loss %.6f  (%ld loss tokens%s)\n", losses.loss,
                losses.ce_loss, losses.aux_loss, losses.z_loss, loss_tokens, device == "cuda" ? ", cuda bf16" : "");

  if (!grads_path.empty()) {
    model.zero_grads();
    model.backward();
    if (adapter) {  // the adapters' gradients, in PEFT's layout (written by the adapter writer)
      std::vector<float> grads(model.train_table().total());
      backend->download(grads.data(), model.train_grad_tensor());
      const std::string tmp = grads_path + ".lora-tmp";
      write_peft_adapter(tmp, cfg, adapter->spec, model.train_table(), grads.data(), "");
      std::filesystem::rename(std::filesystem::path(tmp) / "adapter_model.safetensors", grads_path);
      std::filesystem::remove_all(tmp);
    } else {
      std::vector<float> grads(model.table().total());
      model.get_grads(grads.data());
      SafetensorsWriter g;
      add_hf_tensors(g, model.table(), grads.data(), DType::F32);
      g.write(grads_path);
    }
  }
  return 0;
}

}  // namespace moetron::cli
