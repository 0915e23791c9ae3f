// The training loop (trainer.h): setup, one optimizer step, the loop with logging, evaluation and
// checkpoints.  The pieces it orchestrates live in their own files: the layout (layout.h), the 1F1B
// schedule and stage links (pipeline.h), the checkpoint gather (checkpoint_gather.h), metrics
// (metrics.h), the log (run_log.h); the model and its backend (model/model.h, backend/).
#include "train/trainer.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <unistd.h>

#include "backend/select.h"
#include "cuda/runtime.h"
#include "core/error.h"
#include "core/interrupt.h"
#include "data/loader.h"
#include "dist/comm.h"
#include "dist/grid.h"
#include "dist/nccl_comm.h"
#include "dist/staged_comm.h"
#include "io/hf_config.h"
#include "io/model_files.h"
#include "model/flops.h"
#include "model/model.h"
#include "model/params.h"
#include "model/weights.h"
#include "ops/matmul.h"
#include "optim/adamw.h"
#include "optim/lr_schedule.h"
#include "optim/zero.h"
#include "core/json_limits.h"
#include "core/sha256.h"
#include "train/checkpoint.h"
#include "train/checkpoint_gather.h"
#include "train/evaluate.h"
#include "train/layout.h"
#include "train/metrics.h"
#include "train/pipeline.h"
#include "train/plan.h"
#include "train/run_log.h"

namespace fs = std::filesystem;

namespace moetron {

namespace {

// The tokenizer `data prepare` used (dataset.json's tokenizer.path) when it is still there and
// unchanged (sha256); "" otherwise, with `why` saying so.  Checkpoints carry a copy as
// tokenizer.model (tokenizer.json for a byte-level one), so a model trained from random init needs no --tokenizer afterwards.
std::string prepared_data_tokenizer(const std::string& data_dir, std::string& why) {
  std::ifstream in(fs::path(data_dir) / "dataset.json");
  if (!in) return "";
  std::stringstream ss;
  ss << in.rdbuf();
  const nlohmann::json d = parse_json_or_discarded(ss.str());
  const auto t = d.is_object() ? d.find("tokenizer") : d.end();
  if (!d.is_object() || t == d.end() || !t->is_object() || !t->contains("path") || !(*t)["path"].is_string())
    return "";
  const std::string path = (*t)["path"].get<std::string>();
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    why = fmt::format("the data's tokenizer {} is gone", path);
    return "";
  }
  if (t->contains("sha256") && (*t)["sha256"].is_string() && sha256_file(path) != (*t)["sha256"].get<std::string>()) {
    why = fmt::format("the data's tokenizer {} has changed since `data prepare`", path);
    return "";
  }
  return path;
}

// The one piece of process-wide state: a signal handler can only talk to the loop through a
// volatile sig_atomic_t.  Set by SIGTERM/SIGINT while run_training is active, read once per step.
volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

// Installs the handler for the duration of a run (core/interrupt.h restores the previous ones).
class StopSignals {
 public:
  StopSignals() : handlers_((g_stop_signal = 0, on_stop_signal)) {}
  int received() const { return g_stop_signal; }

 private:
  SignalHandlerScope handlers_;
};

using Clock = std::chrono::steady_clock;

// The dense bf16 peak of an H100/H200 SXM, which device: cuda's MFU is measured against.
constexpr double kCudaPeakGflops = 989e3;

// The groups of the process grid over the backend's memory: the grid's own (host) groups on a
// host-memory backend; on a device, NCCL communicators (parallel.device_comm nccl, or auto when
// built with NCCL and every rank has a GPU of its own), else the host groups staged through host
// memory (dist/staged_comm.h), which also lets ranks share a GPU.
class DeviceGroups {
 public:
  DeviceGroups(const dist::ProcessGrid& grid, Backend& be, const std::string& mode) {
    dist::MemorySpace* mem = be.memory_space();
    dist::Comm* host[5] = {&grid.tp(), &grid.dp(), &grid.pp(), &grid.ep(), &grid.edp()};
    if (mem == nullptr) {
      for (int i = 0; i < 5; i++) g_[i] = host[i];
      return;
    }
    nccl_ = use_nccl(grid.world(), mode);
    for (int i = 0; i < 5; i++) {
      own_[i] = nccl_ ? dist::make_nccl_comm(*host[i], be.device_stream()) : dist::make_staged_comm(*host[i], *mem);
      g_[i] = own_[i].get();
    }
  }
  dist::Comm& tp() const { return *g_[0]; }
  dist::Comm& dp() const { return *g_[1]; }
  dist::Comm& pp() const { return *g_[2]; }
  dist::Comm& ep() const { return *g_[3]; }
  dist::Comm& edp() const { return *g_[4]; }
  const char* transport() const { return nccl_ ? "nccl" : own_[0] ? "staged through host memory" : "host"; }
  // Bytes sent by device transports of their own (staged groups count in their host groups).
  uint64_t own_bytes() const {
    uint64_t b = 0;
    if (nccl_)
      for (const auto& c : own_) b += c->stats().bytes_sent;
    return b;
  }

 private:
  // Whether every rank has a GPU of its own (host name, device): NCCL cannot put two ranks of a
  // communicator on one GPU.
  static bool use_nccl(dist::Comm& world, const std::string& mode) {
    if (mode == "staged") return false;
    char name[256] = {0};
    gethostname(name, sizeof name - 1);
    const int64_t mine[2] = {(int64_t)std::hash<std::string>{}(name), (int64_t)gpu::default_device()};
    std::vector<int64_t> all(2 * (size_t)world.size());
    world.all_gather(all.data(), mine, std::vector<size_t>(world.size(), 2), dist::CommDType::i64);
    std::set<std::pair<int64_t, int64_t>> seen;
    for (int r = 0; r < world.size(); r++) seen.insert({all[2 * r], all[2 * r + 1]});
    const bool distinct = (int)seen.size() == world.size();
    if (mode == "nccl") {
      if (!dist::have_nccl()) fail("parallel.device_comm: nccl, but this build has no NCCL");
      if (!distinct)
        fail("parallel.device_comm: nccl needs one GPU per rank, and {} ranks share {} GPUs; use staged (or auto)",
             world.size(), seen.size());
      return true;
    }
    return dist::have_nccl() && distinct && world.size() > 1;
  }
  std::unique_ptr<dist::Comm> own_[5];
  dist::Comm* g_[5] = {};
  bool nccl_ = false;
};

struct StepResult {
  double loss = 0, ce_loss = 0, aux_loss = 0, z_loss = 0;
  long loss_tokens = 0, tokens = 0;
};

class Training {
 public:
  Training(const TrainConfig& cfg, const TrainOptions& options) : cfg_(cfg), options_(options) {
    if (options.world == nullptr) own_world_ = std::make_unique<dist::SelfComm>("world");
    world_ = options.world ? options.world : own_world_.get();
    root_ = world_->rank() == 0;
  }
  TrainSummary run();

 private:
  void setup();
  void build_model();
  void initialise();
  // Error unless run_dir_ is free for a fresh start (no metrics.jsonl lines, no checkpoints/).
  void refuse_existing_run() const;
  void load_resume(const std::string& dir);
  StepResult train_step();
  // The validation loss, or nullopt when a stop signal arrived on any rank during it (every rank
  // leaves at the same batch; the step's checkpoint follows).
  std::optional<double> evaluate(const StopSignals& signals);
  std::string save(long step, bool final_save);
  nlohmann::json trainer_state(long step) const;
  nlohmann::json step_line(long step, const StepResult& r, double lr, double grad_norm, double dt, bool finite,
                           double param_norm, const int64_t all_bytes[2], uint64_t step_bytes,
                           const std::vector<int64_t>& stage_memory) const;
  uint64_t comm_bytes() const;
  // Over the optimizers (one, or dense + experts under ep): the global L2 norm of a flat array laid
  // out by the table, every parameter counted once; gradient reduction; the AdamW step.
  double global_norm(Tensor values) const;
  void reduce_gradients();
  void optimizer_step(double lr, float grad_scale);
  // This rank's parameters and moments as host arrays in its table's layout.
  RankState host_state(std::vector<float>& params_store) const;
  // Fills this rank's parameters through a host array (the model's own on a host backend).
  void fill_params(const std::function<void(float*)>& fill);
  // The same for what trains: the adapters of a LoRA run, else the parameters.
  void fill_train_params(const std::function<void(float*)>& fill);
  // The whole table of what trains (the model's, or its LoRA adapter table).
  ParamTable whole_train_table() const { return lora_.on() ? ParamTable(mcfg_, lora_) : ParamTable(mcfg_); }

  const TrainConfig& cfg_;
  const TrainOptions& options_;
  std::unique_ptr<dist::Comm> own_world_;  // a SelfComm when the caller gave no world
  dist::Comm* world_ = nullptr;
  bool root_ = true;  // world rank 0: writes the run directory, metrics, TensorBoard, checkpoints
  Layout layout_;
  std::optional<dist::ProcessGrid> grid_;
  std::unique_ptr<Backend> backend_;
  std::optional<DeviceGroups> groups_;
  fs::path run_dir_;
  RunLog log_;
  ModelConfig mcfg_;
  std::optional<Model> model_;
  LoraSpec lora_;  // rank 0: the whole model trains
  std::optional<PipelineLink> link_;
  std::optional<ShardedAdamW> opt_;      // every tensor, or (ep > 1) all but the experts, over dp
  std::optional<ShardedAdamW> opt_exp_;  // ep > 1: the expert tensors, over edp
  std::optional<DataLoader> train_data_, valid_data_;
  std::optional<LoaderState> valid_start_;
  LrSchedule schedule_;
  LossWeights weights_;
  double aux_coef_ = 0;   // the load-balancing coefficient (config, or the model's router_aux_loss_coef)
  std::string init_dir_;  // source of tokenizer files, when initialised from an HF directory
  std::string data_tokenizer_;  // the prepared data's tokenizer file (copied into checkpoints), or ""
  std::string resume_dir_;  // the root's choice: the checkpoint to resume, or "" (a fresh start)
  long total_steps_ = 0;
  long start_step_ = 0;  // last step done before this invocation
  long consumed_samples_ = 0, consumed_tokens_ = 0;
  FlopCount flops_;
  std::vector<Batch> micro_;  // the current step's micro-batches
  nlohmann::json last_moe_;   // MoE telemetry of the last step
  // The last step's tokens per expert of every layer, summed over every rank (aux-loss-free balancing).
  std::vector<std::vector<double>> last_assigned_;
  std::string mtp_note_;  // the init directory's skipped multi-token-prediction tensors (logged)
  // Moves this stage's selection biases after an optimizer step (moe.bias_update_rate) and adds
  // each layer's bias range to the telemetry.
  void update_selection_biases();
  std::optional<MetricsWriter> metrics_;
  double peak_gflops_ = 0;            // for MFU: the in-process sgemm peak (cpu), or kCudaPeakGflops
  uint64_t opt_state_bytes_max_ = 0;  // the largest optimizer state of any rank
};

void Training::setup() {
  // Model config: from the init directory or from model.config.
  if (cfg_.model.init == "random") {
    mcfg_ = model_config_from_json(cfg_.model.config, "model.config");
  } else {
    init_dir_ = cfg_.model.init;
    mcfg_ = load_model_config((fs::path(init_dir_) / "config.json").string());
    if (!cfg_.model.config.empty())
      fail(
          "model.config must be empty when model.init is a directory ('{}'): the directory's config.json "
          "defines the model",
          init_dir_);
  }
  // An HF directory's weights must be the size its config.json says, before that size is allocated.
  if (!init_dir_.empty()) {
    const ParamTable whole(mcfg_);
    mtp_note_ = mtp_note(check_weights_size(ModelTensors::open(init_dir_), whole, init_dir_), whole, init_dir_);
  }
  // The layout against the world and the model: the rules `moetron plan` applies.
  layout_ = resolve_layout(cfg_, mcfg_, world_->size());
  // The device: without a usable GPU, device: cuda stops here, before any work.
  const std::string why = device_unavailable_reason(cfg_.device);
  if (!why.empty()) fail("device: {}: {}", cfg_.device, why);
  grid_.emplace(*world_, layout_.tp, layout_.pp, layout_.ep);
  const dist::GridShape& gs = grid_->shape();
  // Data: checked before any allocation-heavy work.
  const fs::path data = cfg_.data.path;
  if (!fs::exists(data / "train.idx"))
    fail("data.path: '{}' has no train.idx/train.bin; create it with `moetron data prepare`", data.string());
  LoaderConfig lc = training_loader_config(cfg_);
  lc.dp_rank = grid_->coord().dp;
  lc.dp_size = gs.dp;
  train_data_.emplace((data / "train").string(), split_mask_prefix(data.string(), "train"), lc);
  if (fs::exists(data / "valid.idx") && cfg_.eval.every_steps > 0 && cfg_.eval.batches > 0) {
    LoaderConfig vc = validation_loader_config(cfg_);
    vc.dp_rank = lc.dp_rank;
    vc.dp_size = lc.dp_size;
    valid_data_.emplace((data / "valid").string(), split_mask_prefix(data.string(), "valid"), vc);
    valid_start_ = valid_data_->state();
  }
  const DataLoader& td = *train_data_;
  if (cfg_.train.max_steps > 0) {
    total_steps_ = cfg_.train.max_steps;
  } else {
    // In double, checked before the cast (the review's epochs: 1e300 wrapped to "no steps").
    const double steps = std::ceil(cfg_.train.epochs * (double)td.steps_per_epoch(0));
    if (!(steps <= (double)kMaxStateCount))
      fail("train.epochs: {} epochs of {} steps are {:.3g} steps, more than the {} a run may have", cfg_.train.epochs,
           td.steps_per_epoch(0), steps, kMaxStateCount);
    total_steps_ = (long)steps;
  }
  if (total_steps_ <= 0)
    fail("train: the run has no steps (max_steps={}, epochs={})", cfg_.train.max_steps, cfg_.train.epochs);

  schedule_.lr = cfg_.train.lr;
  schedule_.min_lr = cfg_.train.min_lr;
  schedule_.warmup_steps = cfg_.train.warmup_steps;
  schedule_.decay_steps = total_steps_;
  schedule_.decay = lr_decay_from_string(cfg_.train.schedule);

  aux_coef_ = cfg_.moe.aux_loss_coef ? *cfg_.moe.aux_loss_coef : mcfg_.router_aux_loss_coef;
  weights_.aux_kind = cfg_.moe.aux_loss == "per_layer" ? AuxLossKind::per_layer
                      : cfg_.moe.aux_loss == "sequence" ? AuxLossKind::sequence
                                                        : AuxLossKind::hf_pooled;
  flops_ = count_flops(mcfg_, cfg_.data.seq_length);

  // The run directory and the resolved config (the root rank's; the directory must be shared by
  // every node of a multi-node run).  The root decides what to resume first: a fresh start never
  // writes over another run's metrics or checkpoints.
  run_dir_ = cfg_.run_dir;
  if (root_) {
    if (cfg_.checkpoint.resume == "auto")
      resume_dir_ = find_latest_checkpoint(run_dir_.string());
    else if (cfg_.checkpoint.resume != "none")
      resume_dir_ = cfg_.checkpoint.resume;
    if (resume_dir_.empty()) refuse_existing_run();
    fs::create_directories(run_dir_);
    {
      const fs::path tmp = run_dir_ / "config.yaml.tmp";
      std::ofstream(tmp) << train_config_to_yaml(cfg_);
      fs::rename(tmp, run_dir_ / "config.yaml");
    }
    log_ = RunLog(run_dir_ / "log.txt");
    std::string why;
    data_tokenizer_ = prepared_data_tokenizer(cfg_.data.path, why);
    if (!why.empty()) log_.line(fmt::format("note: {}; checkpoints hold no copy of it", why));
    if (!mtp_note_.empty()) log_.line("note: " + mtp_note_);
  }
  build_model();
  initialise();
  if (root_) metrics_.emplace(run_dir_, cfg_.log.tensorboard);  // after a resume truncated metrics.jsonl

  const LoaderStats& ls = td.stats();
  log_.line(fmt::format(
      "model {}: {} layers, hidden {}, {} experts top-{}, {:.1f}M parameters; data {}: {} documents, {} blocks of {} "
      "tokens per epoch ({} split, {} dropped); {} steps of {} sequences ({} micro-batches of {}); device {}",
      mcfg_.architecture, mcfg_.num_hidden_layers, mcfg_.hidden_size, mcfg_.num_local_experts,
      mcfg_.num_experts_per_tok, (double)model_->table().total() / 1e6, cfg_.data.path, ls.documents, ls.blocks,
      cfg_.data.seq_length, ls.split_documents, ls.dropped_documents, total_steps_, cfg_.train.global_batch_size,
      layout_.micro_batches, cfg_.train.micro_batch_size, backend_->name()));
  if (lora_.on()) {
    std::vector<std::string> names;
    for (LoraTarget t : lora_.targets) names.push_back(lora_target_name(t));
    log_.line(fmt::format("LoRA rank {} alpha {} (scale {:.4g}) on {}: {:.3f}M trainable parameters (this rank), "
                          "the base frozen",
                          lora_.rank, lora_.alpha, lora_.scale(), fmt::join(names, ", "),
                          (double)model_->train_table().total() / 1e6));
  }
  if (model_->recompute() != Recompute::none)
    log_.line(fmt::format("activation recompute: {} (train.recompute)", recompute_name(model_->recompute())));
  if (world_->size() > 1)
    log_.line(fmt::format(
        "distributed: {} ranks over {} ({}): pp {} x dp {} x tp {} (ep {}); ZeRO-1 {}; optimizer state {} per rank "
        "(largest); device buffers: {}",
        world_->size(), world_->transport(), grid_->describe(), gs.pp, gs.dp, gs.tp, gs.ep,
        cfg_.parallel.zero1 ? "on" : "off", format_bytes((double)opt_state_bytes_max_), groups_->transport()));
}

// The backend, this rank's stage of the model, its pipeline link and optimizers.
void Training::build_model() {
  backend_ = make_backend(cfg_.device);
  groups_.emplace(*grid_, *backend_, cfg_.parallel.device_comm);
  if (root_) peak_gflops_ = backend_->host_memory() ? ops::measure_sgemm_gflops(1024, 3) : kCudaPeakGflops;
  const dist::GridShape& gs = grid_->shape();
  if (cfg_.moe.bias_update_rate > 0 && !mcfg_.has_selection_bias())
    fail("moe.bias_update_rate: {} routes by softmax and has no selection bias to move (aux-loss-free balancing "
         "needs DeepSeek-V3's or GLM-4.5's sigmoid router; use moe.aux_loss_coef)",
         mcfg_.architecture);
  if (cfg_.moe.bias_update_rate > 0 && cfg_.lora.rank > 0)
    fail("moe.bias_update_rate: the selection bias belongs to the frozen base of a LoRA run (lora.rank {}); "
         "set it to 0",
         cfg_.lora.rank);
  if (cfg_.lora.rank > 0) {
    lora_.rank = cfg_.lora.rank;
    lora_.alpha = cfg_.lora.alpha;
    lora_.rslora = cfg_.lora.rslora;
    lora_.targets = parse_lora_targets(cfg_.lora.targets, mcfg_, "lora.targets");
    lora_.base_bf16 = cfg_.model.dtype == "bf16";  // the frozen base in model.dtype
  }
  model_.emplace(*backend_, mcfg_, &groups_->tp(), &groups_->ep(), layout_.stage_layers(grid_->coord().pp), lora_);
  link_.emplace(*backend_, groups_->pp(), mcfg_.is_moe() ? mcfg_.num_local_experts : 0);
  if (!options_.router_bias.empty()) model_->set_router_bias(options_.router_bias);
  if (cfg_.moe.capacity_factor) model_->set_capacity_factor(*cfg_.moe.capacity_factor);
  model_->set_recompute(parse_recompute(cfg_.train.recompute, "train.recompute"));
  AdamWConfig ac;
  ac.lr = cfg_.train.lr;
  ac.beta1 = cfg_.train.adam_beta1;
  ac.beta2 = cfg_.train.adam_beta2;
  ac.eps = cfg_.train.adam_eps;
  ac.weight_decay = cfg_.train.weight_decay;
  const bool ep_on = gs.ep > 1;
  // Over what trains: the whole model, or its LoRA adapters (model_->train_table()).
  const ParamTable& tt = model_->train_table();
  opt_.emplace(*backend_, tt, ac, groups_->dp(), *world_, cfg_.parallel.zero1, ep_on ? ParamSet::dense : ParamSet::all);
  if (ep_on) opt_exp_.emplace(*backend_, tt, ac, groups_->edp(), *world_, cfg_.parallel.zero1, ParamSet::experts);
  const size_t state_bytes = opt_->state_bytes() + (opt_exp_ ? opt_exp_->state_bytes() : 0);
  opt_state_bytes_max_ = (uint64_t)world_->all_reduce_value((int64_t)state_bytes, dist::ReduceOp::max);
}

void Training::fill_params(const std::function<void(float*)>& fill) {
  if (backend_->host_memory() && !model_->base_in_bf16()) return fill(model_->params().data());
  std::vector<float> host(model_->table().total(), 0.0f);
  fill(host.data());
  model_->set_params(host.data());
}

void Training::fill_train_params(const std::function<void(float*)>& fill) {
  if (!lora_.on()) return fill_params(fill);
  std::vector<float> host(model_->train_table().total(), 0.0f);
  fill(host.data());
  model_->set_train_params(host.data());
}

// Resume, or initialise.  The root decides which checkpoint (the others follow).
void Training::refuse_existing_run() const {
  std::error_code ec;
  const fs::path metrics = run_dir_ / "metrics.jsonl", ckpts = run_dir_ / "checkpoints";
  const bool has_metrics = fs::is_regular_file(metrics, ec) && fs::file_size(metrics, ec) > 0;
  bool has_ckpts = false;
  if (fs::is_directory(ckpts, ec))
    for (const auto& e : fs::directory_iterator(ckpts, ec)) {
      const std::string name = e.path().filename().string();  // a crashed save's leftovers are ours
      if (name.rfind(".tmp-", 0) == 0 || name.rfind(".trash-", 0) == 0) continue;
      has_ckpts = true;
      break;
    }
  if (!has_metrics && !has_ckpts) return;
  fail(
      "run_dir: '{}' already holds a run ({}) and this one would start afresh (checkpoint.resume={}{}); nothing was "
      "changed -- resume it with checkpoint.resume=auto, or train into another run_dir",
      run_dir_.string(), has_ckpts ? "checkpoints/" : "metrics.jsonl", cfg_.checkpoint.resume,
      cfg_.checkpoint.resume == "auto" ? ", and no complete checkpoint was found" : "");
}

void Training::initialise() {
  std::string resume_dir = resume_dir_;
  world_->broadcast_string(resume_dir, 0);
  const ParamTable& table = model_->table();
  if (!resume_dir.empty() && !lora_.on()) {
    load_resume(resume_dir);
    if (root_) truncate_metrics(run_dir_ / "metrics.jsonl", start_step_);
    log_.line(fmt::format("resumed from {} at step {}", resume_dir, start_step_));
    return;
  }
  // A fresh start; a LoRA run's frozen base also on resume (its checkpoints hold the adapters).
  if (cfg_.model.init == "random") {
    // Keyed by (seed, HF name, index in the whole tensor): any shard initialises to its part.
    model_->init_parameters(cfg_.seed);
  } else {
    const ModelTensors files = ModelTensors::open(init_dir_);
    if (model_->base_in_bf16()) {
      // Tensor by tensor into the bf16 store: never a whole fp32 copy of the base (setup checked that
      // the directory holds exactly the model's tensors).
      std::optional<ParamTable> whole;
      if (!table.is_whole()) whole.emplace(mcfg_);
      std::vector<float> tmp;
      for (const HfTensorRef& ref : table.hf_tensors()) {
        HfTensorSlice slice;
        slice.ref = table.is_whole() ? &ref : whole->find_hf(ref.name);
        slice.dim = ref.slice_dim;
        slice.begin = ref.slice_begin;
        slice.end = ref.slice_end;
        tmp.resize(ref.numel);
        read_hf_slice(files, table.is_whole() ? table : *whole, slice, tmp.data(), init_dir_);
        model_->set_param_tensor(ref, tmp.data());
      }
    } else {
      fill_params([&](float* p) {
        if (table.is_whole())
          load_hf_weights(files, table, p, init_dir_);
        else
          read_rank_hf_weights(files, init_dir_, mcfg_, table, p);
      });
    }
  }
  if (!resume_dir.empty()) {  // LoRA: the adapters and their optimizer state
    load_resume(resume_dir);
    if (root_) truncate_metrics(run_dir_ / "metrics.jsonl", start_step_);
    log_.line(fmt::format("resumed from {} at step {}", resume_dir, start_step_));
    return;
  }
  if (lora_.on()) model_->init_lora(cfg_.lora.init_seed);
  if (root_) truncate_metrics(run_dir_ / "metrics.jsonl", 0);
}

void Training::load_resume(const std::string& dir) {
  // The trainer's keys first (a resealed trainer_state.json verifies its own checksum): a negative
  // step, a missing loader_state, ... are refused naming the field before anything is read.
  validate_trainer_state(read_trainer_state(dir), (fs::path(dir) / "trainer_state.json").string(),
                         TrainerStateUse::resume);
  const ParamTable& table = model_->train_table();
  const size_t total = table.total();
  std::vector<float> lm(total, 0.0f), lv(total, 0.0f);
  LoadedCheckpoint ck;
  if (table.is_whole() && world_->size() == 1) {
    fill_train_params([&](float* p) { ck = load_checkpoint(dir, mcfg_, table, p, lm.data(), lv.data()); });
  } else {
    // The root loads the whole checkpoint the single-process way (every file's checksum, the
    // architecture, no unknown tensor) -- it holds whole tensors for saving anyway; the other ranks
    // wait for that, then read only their slices (tensor-parallel parts of their experts).
    if (root_) {
      std::optional<ParamTable> whole_own;
      if (!table.is_whole()) whole_own.emplace(whole_train_table());
      const ParamTable& whole = table.is_whole() ? table : *whole_own;
      std::vector<float> wp(whole.total(), 0.0f), wm(whole.total(), 0.0f), wv(whole.total(), 0.0f);
      ck = load_checkpoint(dir, mcfg_, whole, wp.data(), wm.data(), wv.data());
      fill_train_params([&](float* p) { copy_from_whole(whole, wp.data(), table, p); });
      copy_from_whole(whole, wm.data(), table, lm.data());
      copy_from_whole(whole, wv.data(), table, lv.data());
    }
    world_->barrier();
    if (!root_) {
      fill_train_params([&](float* p) { read_rank_optimizer_state(dir, table, p, lm.data(), lv.data()); });
      nlohmann::json state = read_trainer_state(dir);
      ck.optimizer_steps = state.at("optimizer_steps").get<long>();
      ck.trainer_state = std::move(state);
    }
  }
  opt_->state_from_flat(lm.data(), lv.data());
  if (opt_exp_) opt_exp_->state_from_flat(lm.data(), lv.data());
  opt_->set_steps_taken(ck.optimizer_steps);
  if (opt_exp_) opt_exp_->set_steps_taken(ck.optimizer_steps);
  const nlohmann::json& st = ck.trainer_state;
  start_step_ = st.at("step").get<long>();
  consumed_samples_ = st.value("consumed_samples", 0L);
  consumed_tokens_ = st.value("consumed_tokens", 0L);
  train_data_->restore(st.at("loader_state").get<LoaderState>());
}

uint64_t Training::comm_bytes() const {
  // The host groups count what their staged device views send too.
  uint64_t b = world_->stats().bytes_sent + model_->comm_bytes() + groups_->own_bytes();
  for (dist::Comm* c : {&grid_->tp(), &grid_->dp(), &grid_->pp(), &grid_->ep(), &grid_->edp()})
    b += c->stats().bytes_sent;
  return b;
}

double Training::global_norm(Tensor values) const {
  double s = opt_->local_sum_squares(values);
  if (opt_exp_) s += opt_exp_->local_sum_squares(values);
  return std::sqrt(world_->all_reduce_value(s));
}

void Training::reduce_gradients() {
  opt_->reduce_gradients(model_->train_grad_tensor());
  if (opt_exp_) opt_exp_->reduce_gradients(model_->train_grad_tensor());
}

void Training::optimizer_step(double lr, float grad_scale) {
  opt_->step(model_->train_param_tensor(), model_->train_grad_tensor(), lr, grad_scale);
  if (opt_exp_) opt_exp_->step(model_->train_param_tensor(), model_->train_grad_tensor(), lr, grad_scale);
}

void Training::update_selection_biases() {
  if (!mcfg_.has_selection_bias()) return;
  const double rate = cfg_.moe.bias_update_rate;
  const int L = mcfg_.num_hidden_layers;
  std::vector<double> range(2 * (size_t)L, 0.0);  // max, min of each layer's bias (this stage's layers)
  for (int l = model_->layer_begin(); l < model_->layer_end(); l++) {
    if (!mcfg_.is_moe_layer(l)) continue;
    if (rate > 0) model_->update_selection_bias(l, last_assigned_[l], rate);
    const std::vector<float> b = model_->selection_bias(l);
    range[2 * l] = *std::max_element(b.begin(), b.end());
    range[2 * l + 1] = *std::min_element(b.begin(), b.end());
  }
  if (grid_->shape().pp > 1) grid_->pp().all_reduce(range.data(), range.size());  // every stage's layers
  for (nlohmann::json& layer : last_moe_) {
    const int l = layer["layer"].get<int>();
    layer["bias_max"] = range[2 * l];
    layer["bias_min"] = range[2 * l + 1];
  }
}

StepResult Training::train_step() {
  StepResult r;
  micro_.resize(layout_.micro_batches);
  // This rank's micro-batches; the counts that scale the loss are the GLOBAL batch's (summed over
  // the data-parallel ranks first), so every layout optimises the same objective.
  int64_t counts[3] = {0, 0, 0};  // loss tokens, real tokens, micro-batches holding real tokens
  for (Batch& b : micro_) {
    train_data_->next(b);
    counts[0] += count_loss_tokens(b);
    for (int32_t m : b.attention_mask) counts[1] += m != 0;
    counts[2] += std::any_of(b.attention_mask.begin(), b.attention_mask.end(), [](int32_t m) { return m != 0; });
  }
  grid_->dp().all_reduce(counts, 3);
  const long loss_tokens = (long)counts[0];
  r.tokens = (long)counts[1];
  r.loss_tokens = loss_tokens;
  weights_.ce_scale = loss_tokens > 0 ? 1.0 / (double)loss_tokens : 0.0;
  // The router losses are averaged over the micro-batches that hold real tokens (the last step of an
  // epoch can carry all-padding rows, whose aux loss is 0 by definition).
  const long active = std::max(1L, (long)counts[2]);
  weights_.aux_coef = aux_coef_ / (double)active;
  weights_.z_coef = cfg_.moe.z_loss_coef / (double)active;
  model_->zero_grads();
  const int L = mcfg_.num_hidden_layers, E = mcfg_.is_moe() ? mcfg_.num_local_experts : 0;
  std::vector<std::vector<double>> assigned(mcfg_.is_moe() ? L : 0, std::vector<double>(E, 0.0));
  std::vector<double> dropped(assigned.size(), 0.0);
  const int lb = model_->layer_begin();
  run_1f1b(*model_, *link_, micro_, weights_, grid_->coord().pp, grid_->shape().pp, [&](const Losses& l) {
    r.loss += l.loss;
    r.ce_loss += l.ce_loss;
    r.aux_loss += l.aux_loss / (double)active;
    r.z_loss += l.z_loss / (double)active;
    for (int i = 0; i < (int)model_->router_stats().size(); i++) {
      for (int e = 0; e < E; e++) assigned[lb + i][e] += model_->router_stats()[i].assigned[e];
      dropped[lb + i] += (double)model_->dropped()[i];
    }
  });
  // Sums over the pipeline stages (each holds its layers' router terms; the cross-entropy and the
  // pooled aux loss are the last stage's), then over the data-parallel ranks (tensor-parallel ranks
  // hold identical values).
  const bool pipelined = grid_->shape().pp > 1;
  double sums[4] = {r.loss, r.ce_loss, r.aux_loss, r.z_loss};
  if (pipelined) grid_->pp().all_reduce(sums, 4);
  grid_->dp().all_reduce(sums, 4);
  r.loss = sums[0];
  r.ce_loss = sums[1];
  r.aux_loss = sums[2];
  r.z_loss = sums[3];
  for (auto& a : assigned) {
    if (pipelined) grid_->pp().all_reduce(a.data(), a.size());
    grid_->dp().all_reduce(a.data(), a.size());
  }
  if (!dropped.empty()) {
    if (pipelined) grid_->pp().all_reduce(dropped.data(), dropped.size());
    grid_->dp().all_reduce(dropped.data(), dropped.size());
  }
  last_moe_ = moe_telemetry(assigned, dropped);
  last_assigned_ = std::move(assigned);
  // Gradients: replicated kv heads over their tp ranks, then everything over dp (experts over edp).
  model_->reduce_replicated_grads();
  reduce_gradients();
  return r;
}

std::optional<double> Training::evaluate(const StopSignals& signals) {
  // The same batches every time: the validation loader restarts from its first row.
  valid_data_->restore(*valid_start_);
  double ce_sum = 0;
  long tokens = 0;
  LossWeights w = weights_;
  w.ce_scale = 1.0;
  Batch b;
  // Micro-batch k of data-parallel rank d is batch k * dp + d of one process: each rank evaluates
  // its share of the first eval.batches batches.
  // Under expert parallelism every forward is collective over the ep group: a rank out of batches
  // runs the rounds the others still run on a padding batch whose result is discarded.  The stages
  // of a pipeline read the same batches; each forward passes through them in turn.
  const int dp = grid_->shape().dp, d = grid_->coord().dp;
  const int rounds = (cfg_.eval.batches + dp - 1) / dp;
  for (int k = 0; k < rounds; k++) {
    // eval.batches has no upper bound: a SIGTERM (Slurm's warning before SIGKILL) must not wait for
    // the end of the evaluation.
    if (world_->all_reduce_value((int32_t)signals.received(), dist::ReduceOp::max) != 0) return std::nullopt;
    if (k * dp + d < cfg_.eval.batches) {
      valid_data_->next(b);
      const Losses l = stage_forward(*model_, *link_, b, w);
      ce_sum += l.ce_sum;
      tokens += l.loss_tokens;
    } else if (grid_->shape().ep > 1) {
      Batch pad;
      pad.B = 1;
      pad.T = cfg_.data.seq_length;
      pad.input_ids.assign(pad.T, 0);
      stage_forward(*model_, *link_, pad, w);
    }
  }
  // The cross-entropy is the last stage's.
  double sums[2] = {ce_sum, (double)tokens};
  if (grid_->shape().pp > 1) grid_->pp().all_reduce(sums, 2);
  grid_->dp().all_reduce(sums, 2);
  ce_sum = sums[0];
  tokens = (long)sums[1];
  return tokens > 0 ? ce_sum / (double)tokens : std::nan("");
}

nlohmann::json Training::trainer_state(long step) const {
  return {{"step", step},
          {"total_steps", total_steps_},
          {"consumed_samples", consumed_samples_},
          {"consumed_tokens", consumed_tokens_},
          {"loader_state", train_data_->state()},
          {"rng", {{"kind", "counter-based"}, {"seed", cfg_.seed}}},
          {"lr_schedule",
           {{"lr", schedule_.lr},
            {"min_lr", schedule_.min_lr},
            {"warmup_steps", schedule_.warmup_steps},
            {"decay_steps", schedule_.decay_steps},
            {"schedule", cfg_.train.schedule},
            {"next_lr", schedule_.at(step + 1)}}},
          {"config", train_config_to_json(cfg_)}};
}

RankState Training::host_state(std::vector<float>& params_store) const {
  RankState s;
  const dist::GridCoord& me = grid_->coord();
  const size_t total = model_->train_table().total();
  if (backend_->host_memory() && !lora_.on()) {
    s.params = model_->params().data();
  } else {
    params_store.resize(total);
    model_->get_train_params(params_store.data());
    s.params = params_store.data();
  }
  s.exp_avg.assign(total, 0.0f);
  s.exp_avg_sq.assign(total, 0.0f);
  if (cfg_.parallel.zero1 || me.dp == 0) opt_->state_to_flat(s.exp_avg.data(), s.exp_avg_sq.data());
  if (opt_exp_ && (cfg_.parallel.zero1 || me.edp == 0)) opt_exp_->state_to_flat(s.exp_avg.data(), s.exp_avg_sq.data());
  return s;
}

std::string Training::save(long step, bool final_save) {
  // Never write a checkpoint that could not be resumed usefully.
  const double param_norm = global_norm(model_->train_param_view());
  if (!std::isfinite(param_norm)) {
    log_.line(fmt::format("step {}: parameters are not finite; checkpoint NOT saved", step));
    return "";
  }
  const auto t0 = Clock::now();
  const ParamTable& table = model_->train_table();
  std::vector<float> params_store;
  const RankState mine = host_state(params_store);
  const bool direct = world_->size() == 1 && table.is_whole() && !opt_exp_;
  std::optional<ParamTable> whole_own;
  if (!table.is_whole()) whole_own.emplace(whole_train_table());
  const ParamTable& whole = table.is_whole() ? table : *whole_own;
  std::vector<float> wp, wm, wv;
  if (!direct)
    gather_whole_state(*world_, layout_, grid_->shape(), grid_->coord(), mcfg_, table, mine, whole, wp, wm, wv,
                       lora_.on() ? &lora_ : nullptr);
  std::string dir;
  if (root_) {
    CheckpointContents c;
    c.model_config = &mcfg_;
    c.table = &whole;
    c.lora = lora_.on() ? &lora_ : nullptr;
    c.base_model = init_dir_.empty() ? std::string() : fs::absolute(init_dir_).string();
    c.params = direct ? mine.params : wp.data();
    c.exp_avg = direct ? mine.exp_avg.data() : wm.data();
    c.exp_avg_sq = direct ? mine.exp_avg_sq.data() : wv.data();
    c.optimizer_steps = opt_->steps_taken();
    c.trainer_state = trainer_state(step);
    SaveOptions o;
    o.keep_last = cfg_.checkpoint.keep_last;
    o.tokenizer_source_dir = init_dir_;
    o.tokenizer_model_file = data_tokenizer_;
    dir = save_checkpoint(run_dir_.string(), step, c, o);
    log_.line(fmt::format("{} checkpoint {} ({:.2f} s)", final_save ? "saved final" : "saved", dir,
                          std::chrono::duration<double>(Clock::now() - t0).count()));
  }
  world_->broadcast_string(dir, 0);
  return dir;
}

nlohmann::json Training::step_line(long step, const StepResult& r, double lr, double grad_norm, double dt,
                                   bool finite, double param_norm, const int64_t all_bytes[2], uint64_t step_bytes,
                                   const std::vector<int64_t>& stage_memory) const {
  const double tps = (double)cfg_.train.global_batch_size * cfg_.data.seq_length / dt;
  nlohmann::json m = {{"step", step},           {"loss", r.loss},      {"ce_loss", r.ce_loss},
                      {"aux_loss", r.aux_loss}, {"z_loss", r.z_loss},  {"lr", lr},
                      {"grad_norm", grad_norm}, {"tokens_per_s", tps}, {"loss_tokens", r.loss_tokens},
                      {"step_time_s", dt},      {"skipped", !finite}};
  m["param_norm"] = param_norm;
  m["mfu"] = tps * flops_.train_per_token() / 1e9 / peak_gflops_;
  if (world_->size() > 1) {
    m["comm_bytes"] = step_bytes;  // sent by this (the root) rank during the step
    m["comm_bytes_max"] = all_bytes[1];
    m["comm_bytes_all_ranks"] = all_bytes[0];
  }
  m["optimizer_state_bytes"] = opt_state_bytes_max_;
  const int P = grid_->shape().pp;
  if (P > 1) {
    std::vector<int64_t> in_flight, bytes, per_micro;
    for (int st = 0; st < P; st++) {
      in_flight.push_back(stage_memory[3 * st]);
      bytes.push_back(stage_memory[3 * st + 1]);
      per_micro.push_back(stage_memory[3 * st + 2]);
    }
    m["pipeline"] = {{"stages", P},
                     {"micro_batches", layout_.micro_batches},
                     {"peak_micro_batches_in_flight", in_flight},
                     {"peak_activation_bytes", bytes},
                     {"activation_bytes_per_micro_batch", per_micro}};
  }
  if (!last_moe_.empty()) m["moe"] = last_moe_;
  return m;
}

TrainSummary Training::run() {
  try {
    setup();
  } catch (const SetupError&) {
    throw;
  } catch (const Error& e) {
    throw SetupError(e.what());
  }
  StopSignals signals;
  TrainSummary summary;
  summary.first_step = start_step_ + 1;
  summary.total_steps = total_steps_;
  summary.last_step = start_step_;
  const auto run_t0 = Clock::now();
  int nan_in_row = 0;
  for (long step = start_step_ + 1; step <= total_steps_; step++) {
    const auto t0 = Clock::now();
    const uint64_t bytes0 = comm_bytes();
    if (options_.fail_rank == world_->rank() && options_.fail_step == step)
      fail("--debug-fail: failure injected on rank {} at step {}", options_.fail_rank, step);
    const StepResult r = train_step();
    if (std::find(options_.inject_nan_steps.begin(), options_.inject_nan_steps.end(), step) !=
        options_.inject_nan_steps.end())
      if (!opt_->state_ranges().empty()) {  // an element this rank owns
        const float nan = std::nanf("");
        backend_->upload(model_->train_grad_tensor().part(opt_->state_ranges()[0].first, 1), &nan);
      }
    const double grad_norm = global_norm(model_->train_grad_tensor());
    const double lr = schedule_.at(step);
    const bool finite = std::isfinite(r.loss) && std::isfinite(grad_norm);
    if (finite) {
      nan_in_row = 0;
      optimizer_step(lr, (float)clip_coefficient(grad_norm, cfg_.train.grad_clip));
      update_selection_biases();
    } else {
      nan_in_row++;
      log_.line(fmt::format("step {}: non-finite {} (loss {}, grad norm {}); update skipped ({} in a row, limit {})",
                            step, std::isfinite(r.loss) ? "gradient" : "loss", r.loss, grad_norm, nan_in_row,
                            cfg_.train.nan_skip_limit));
      if (nan_in_row >= cfg_.train.nan_skip_limit)
        fail(
            "training diverged: {} non-finite steps in a row (train.nan_skip_limit); the last good checkpoint "
            "is {}",
            nan_in_row, summary.last_checkpoint.empty() ? std::string("none") : summary.last_checkpoint);
    }
    backend_->synchronize("train step");
    const uint64_t step_bytes = comm_bytes() - bytes0;
    consumed_samples_ += cfg_.train.global_batch_size;
    consumed_tokens_ += r.tokens;
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    summary.last_step = step;
    summary.last_loss = r.loss;

    const bool log_now = cfg_.log.every_steps > 0 && (step % cfg_.log.every_steps == 0 || step == total_steps_);
    // Collective: every rank takes part in the norm.
    const double param_norm = log_now ? global_norm(model_->train_param_view()) : 0.0;
    int64_t all_bytes[2] = {(int64_t)step_bytes, (int64_t)step_bytes};  // sum and max over the ranks
    if (log_now && world_->size() > 1) {
      all_bytes[0] = world_->all_reduce_value(all_bytes[0]);
      all_bytes[1] = world_->all_reduce_value(all_bytes[1], dist::ReduceOp::max);
    }
    // Per pipeline stage (gathered over the root's pp group): micro-batches whose activations were
    // kept at once at most, the bytes they held, and one micro-batch's.
    const int P = grid_->shape().pp;
    std::vector<int64_t> stage_memory(3 * (size_t)P, 0);
    if (log_now && P > 1) {
      const int64_t mine[3] = {(int64_t)model_->peak_pending(), (int64_t)model_->peak_activation_bytes(),
                               (int64_t)model_->activation_bytes_per_micro_batch()};
      grid_->pp().all_gather(stage_memory.data(), mine, std::vector<size_t>(P, 3), dist::CommDType::i64);
    }
    if (log_now && root_) {
      const nlohmann::json m =
          step_line(step, r, lr, grad_norm, dt, finite, param_norm, all_bytes, step_bytes, stage_memory);
      metrics_->step(m);
      const double elapsed = std::chrono::duration<double>(Clock::now() - run_t0).count();
      const double eta = elapsed / (double)(step - start_step_) * (double)(total_steps_ - step);
      const double tps = m["tokens_per_s"].get<double>();
      log_.progress(
          fmt::format("step {}/{}  loss {:.4f}  ce {:.4f}  aux {:.4f}  lr {:.3g}  grad norm {:.3f}  "
                      "{:.0f} tok/s  {:.1f} GFLOP/s  ETA {}",
                      step, total_steps_, r.loss, r.ce_loss, r.aux_loss, lr, grad_norm, tps,
                      tps * flops_.train_per_token() / 1e9, format_duration(eta)));
    }
    if (valid_data_ && cfg_.eval.every_steps > 0 && (step % cfg_.eval.every_steps == 0 || step == total_steps_)) {
      const std::optional<double> val = evaluate(signals);
      if (!val) {
        log_.line(fmt::format("step {}: evaluation stopped by a signal (no val_loss)", step));
      } else {
        if (root_) metrics_->eval(step, *val);
        log_.line(fmt::format("step {}: val_loss {:.4f}  perplexity {:.2f}", step, *val, std::exp(*val)));
      }
    }
    const bool exit_now = cfg_.train.exit_interval > 0 && step % cfg_.train.exit_interval == 0 && step < total_steps_;
    // Every rank stops at the same step: a signal seen by any rank stops them all.
    const int signal = world_->all_reduce_value((int32_t)signals.received(), dist::ReduceOp::max);
    const bool stop = signal != 0 || exit_now;
    const bool periodic = cfg_.checkpoint.every_steps > 0 && step % cfg_.checkpoint.every_steps == 0;
    if (periodic || step == total_steps_ || stop) {
      const std::string dir = save(step, step == total_steps_ || stop);
      if (!dir.empty()) summary.last_checkpoint = dir;
    }
    if (stop) {
      if (signal != 0)
        log_.line(fmt::format("received signal {}: stopped after step {} with a checkpoint", signal, step));
      else
        log_.line(fmt::format("train.exit_interval: stopped after step {} with a checkpoint", step));
      summary.interrupted = true;
      break;
    }
  }
  log_.end_progress();
  summary.world_rank = world_->rank();
  summary.world_size = world_->size();
  return summary;
}

}  // namespace

TrainSummary run_training(const TrainConfig& cfg, const TrainOptions& options) { return Training(cfg, options).run(); }

}  // namespace moetron
