#include "train/trainer.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>

#include "core/error.h"
#include "data/loader.h"
#include "dist/comm.h"
#include "dist/grid.h"
#include "io/hf_config.h"
#include "io/model_files.h"
#include "model/flops.h"
#include "model/mixtral.h"
#include "model/params.h"
#include "model/weights.h"
#include "ops/matmul.h"
#include "optim/adamw.h"
#include "optim/lr_schedule.h"
#include "optim/zero.h"
#include "train/checkpoint.h"
#include "train/evaluate.h"
#include "train/plan.h"
#include "train/tensorboard.h"

namespace fs = std::filesystem;

namespace moetron {

namespace {

// The one piece of process-wide state: a signal handler can only talk to the loop through a
// volatile sig_atomic_t.  Set by SIGTERM/SIGINT while run_training is active, read once per step.
volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

// Installs the handlers for the duration of a run and restores the previous ones.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, &old_term_);
    sigaction(SIGINT, &sa, &old_int_);
  }
  ~StopSignals() {
    sigaction(SIGTERM, &old_term_, nullptr);
    sigaction(SIGINT, &old_int_, nullptr);
  }
  int received() const { return g_stop_signal; }

 private:
  struct sigaction old_term_ {
  }, old_int_{};
};

using Clock = std::chrono::steady_clock;

// RUN/log.txt and the terminal: a live progress line on a TTY, plain lines otherwise.
// Only the root rank of a distributed run writes; the others' RunLog is inactive (default-built).
class RunLog {
 public:
  RunLog() = default;
  explicit RunLog(const fs::path& path) : file_(path, std::ios::app), tty_(isatty(fileno(stdout))), active_(true) {
    if (!file_) fail("{}: cannot open for writing", path.string());
  }
  void line(const std::string& text) {
    if (!active_) return;
    end_progress();
    std::printf("%s\n", text.c_str());
    std::fflush(stdout);
    file_ << text << '\n';
    file_.flush();
  }
  void progress(const std::string& text) {
    if (!active_) return;
    file_ << text << '\n';
    file_.flush();
    if (tty_) {
      std::printf("\r\033[K%s", text.c_str());
      progress_open_ = true;
    } else {
      std::printf("%s\n", text.c_str());
    }
    std::fflush(stdout);
  }
  void end_progress() {
    if (progress_open_) std::printf("\n");
    progress_open_ = false;
  }

 private:
  std::ofstream file_;
  bool tty_ = false;
  bool active_ = false;
  bool progress_open_ = false;
};

// Keeps metrics.jsonl lines up to `step` (after a resume, lines of steps that were redone go).
void truncate_metrics(const fs::path& path, long step) {
  if (!fs::exists(path)) return;
  std::ifstream in(path);
  std::vector<std::string> keep;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("step") && j["step"].is_number() && j["step"].get<long>() <= step)
      keep.push_back(line);
  }
  in.close();
  std::ofstream out(path, std::ios::trunc);
  for (const auto& l : keep) out << l << '\n';
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const long t = (long)s;
  if (t >= 3600) return fmt::format("{}h{:02d}m", t / 3600, (t % 3600) / 60);
  if (t >= 60) return fmt::format("{}m{:02d}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

// Per MoE layer telemetry over one step: each expert's share of the routed assignments, and the
// fraction of them a capacity limit dropped.
nlohmann::json moe_telemetry(const std::vector<std::vector<double>>& assigned, const std::vector<double>& dropped) {
  nlohmann::json layers = nlohmann::json::array();
  for (size_t l = 0; l < assigned.size(); l++) {
    const std::vector<double>& a = assigned[l];
    double total = 0;
    for (double x : a) total += x;
    if (total <= 0) continue;
    double mx = 0, mn = 1, mean = 1.0 / a.size(), var = 0;
    for (double x : a) {
      const double share = x / total;
      mx = std::max(mx, share);
      mn = std::min(mn, share);
      var += (share - mean) * (share - mean);
    }
    std::vector<double> shares(a.size());
    for (size_t e = 0; e < a.size(); e++) shares[e] = a[e] / total;
    layers.push_back({{"layer", l},
                      {"shares", shares},
                      {"max_share", mx},
                      {"min_share", mn},
                      {"cv", std::sqrt(var / a.size()) / mean},
                      {"dropped_fraction", dropped[l] / total}});
  }
  return layers;
}

// The point-to-point traffic of one pipeline stage with its neighbours in the pp group: hidden
// states [N,C] and the router statistics pooled so far ([E] assigned, [E] prob sums, tokens) go
// forward; the gradient of the hidden states [N,C] and the pooled aux loss's gradient per expert [E]
// go back.  Every transfer is a sendrecv, so in the 1F1B steady state, where neighbours exchange in
// opposite directions at once, neither waits for the other.  On a stage without that neighbour (or
// without pipeline parallelism) a call does nothing.
class PipelineLink {
 public:
  PipelineLink(dist::Comm& pp, int experts)
      : pp_(pp), stage_(pp.rank()), stages_(pp.size()), E_(experts), stats_in_(2 * experts + 1), aux_in_(experts) {}

  // Receives the previous stage's output (the next forward's input).
  void recv_forward(size_t n) {
    if (!first()) transfer(-1, nullptr, nullptr, 0, prev(), hidden_in_, stats_in_, n);
  }
  void send_forward(const MixtralModel& m, size_t n) {
    if (!last()) transfer(next(), m.stage_output(), pack(m).data(), stats_in_.size(), -1, grad_in_, aux_in_, n);
  }
  // The forward's output to the next stage while its gradient for the oldest pending micro-batch
  // comes back.
  void send_forward_recv_backward(const MixtralModel& m, size_t n) {
    if (!last()) transfer(next(), m.stage_output(), pack(m).data(), stats_in_.size(), next(), grad_in_, aux_in_, n);
  }
  // The backward's input gradient to the previous stage while the next forward's input arrives.
  void send_backward_recv_forward(const MixtralModel& m, size_t n) {
    if (!first())
      transfer(prev(), m.input_grad(), m.input_aux_grad().data(), aux_in_.size(), prev(), hidden_in_, stats_in_, n);
  }
  void recv_backward(size_t n) {
    if (!last()) transfer(-1, nullptr, nullptr, 0, next(), grad_in_, aux_in_, n);
  }
  void send_backward(const MixtralModel& m, size_t n) {
    if (!first())
      transfer(prev(), m.input_grad(), m.input_aux_grad().data(), aux_in_.size(), -1, hidden_in_, stats_in_, n);
  }

  StageInput input() {
    StageInput in;
    if (first()) return in;
    in.hidden = hidden_in_.data();
    if (E_ > 0) {
      pooled_in_.assigned.assign(stats_in_.begin(), stats_in_.begin() + E_);
      pooled_in_.prob_sum.assign(stats_in_.begin() + E_, stats_in_.begin() + 2 * E_);
      pooled_in_.tokens = stats_in_[2 * E_];
      in.pooled = &pooled_in_;
    }
    return in;
  }
  StageGrad grad() const {
    StageGrad g;
    if (last()) return g;
    g.hidden = grad_in_.data();
    if (E_ > 0) g.aux_grad = aux_in_.data();
    return g;
  }

 private:
  bool first() const { return stage_ == 0; }
  bool last() const { return stage_ == stages_ - 1; }
  int prev() const { return stage_ - 1; }
  int next() const { return stage_ + 1; }
  const std::vector<double>& pack(const MixtralModel& m) {
    stats_out_.assign(stats_in_.size(), 0.0);
    if (E_ > 0) {
      const ops::RouterLayerStats& st = m.pooled_stats();
      std::copy(st.assigned.begin(), st.assigned.end(), stats_out_.begin());
      std::copy(st.prob_sum.begin(), st.prob_sum.end(), stats_out_.begin() + E_);
      stats_out_[2 * E_] = st.tokens;
    }
    return stats_out_;
  }
  // Hidden states (n floats) and the statistics that go with them, each one sendrecv.
  void transfer(int to, const float* hidden, const double* stats, size_t stats_n, int from,
                std::vector<float>& hidden_in, std::vector<double>& stats_in, size_t n) {
    constexpr int kHidden = 40, kStats = 41;
    if (from != -1) hidden_in.resize(n);
    pp_.sendrecv(hidden, to != -1 ? n : 0, to, hidden_in.data(), from != -1 ? n : 0, from, dist::CommDType::f32,
                 kHidden);
    if (E_ > 0)
      pp_.sendrecv(stats, to != -1 ? stats_n : 0, to, stats_in.data(), from != -1 ? stats_in.size() : 0, from,
                   dist::CommDType::f64, kStats);
  }

  dist::Comm& pp_;
  int stage_, stages_, E_;
  std::vector<float> hidden_in_, grad_in_;
  std::vector<double> stats_in_, stats_out_, aux_in_;
  ops::RouterLayerStats pooled_in_;
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
  void load_resume(const std::string& dir);
  StepResult train_step(long step);
  // Forward and backward of this step's micro-batches (micro_) in the 1F1B pipeline schedule;
  // `account` sees each forward's losses.  Without pipeline parallelism: forward, backward, ...
  void run_schedule(const std::function<void(const Losses&)>& account);
  // One forward (no backward) on this stage: the previous stage's output is received first, this
  // stage's is sent on after.
  Losses stage_forward(const Batch& b, const LossWeights& w);
  double evaluate();
  std::string save(long step, bool final_save);
  void gather_whole(const ParamTable& whole, std::vector<float>& params, std::vector<float>& m, std::vector<float>& v);
  nlohmann::json trainer_state(long step) const;
  uint64_t comm_bytes() const;
  // Over the optimizers (one, or dense + experts under ep): the global L2 norm of a flat array laid
  // out by the table, every parameter counted once; gradient reduction; the AdamW step.
  double global_norm(const float* values) const;
  void reduce_gradients();
  void optimizer_step(double lr, float grad_scale);

  const TrainConfig& cfg_;
  const TrainOptions& options_;
  std::unique_ptr<dist::Comm> own_world_;  // a SelfComm when the caller gave no world
  dist::Comm* world_ = nullptr;
  bool root_ = true;  // world rank 0: writes the run directory, metrics, TensorBoard, checkpoints
  std::optional<dist::ProcessGrid> grid_;
  fs::path run_dir_;
  RunLog log_;
  ModelConfig mcfg_;
  std::optional<MixtralModel> model_;
  std::optional<PipelineLink> link_;
  std::vector<int> stage_starts_;        // the first layer of each pipeline stage, then L
  std::optional<ShardedAdamW> opt_;      // every tensor, or (ep > 1) all but the experts, over dp
  std::optional<ShardedAdamW> opt_exp_;  // ep > 1: the expert tensors, over edp
  std::optional<DataLoader> train_data_, valid_data_;
  std::optional<LoaderState> valid_start_;
  LrSchedule schedule_;
  LossWeights weights_;
  double aux_coef_ = 0;   // the load-balancing coefficient (config, or the model's router_aux_loss_coef)
  std::string init_dir_;  // source of tokenizer files, when initialised from an HF directory
  long total_steps_ = 0;
  long start_step_ = 0;  // last step done before this invocation
  long micro_per_step_ = 0;
  long consumed_samples_ = 0, consumed_tokens_ = 0;
  FlopCount flops_;
  std::vector<Batch> micro_;  // the current step's micro-batches
  nlohmann::json last_moe_;   // MoE telemetry of the last step
  std::optional<TensorBoardWriter> tb_;
  double sgemm_peak_ = 0;             // GFLOP/s, for MFU
  uint64_t opt_state_bytes_max_ = 0;  // the largest optimizer state of any rank
};

void Training::setup() {
  if (cfg_.device != "cpu")
    fail("device: '{}' is not available in this build yet (only 'cpu'); set device: cpu", cfg_.device);
  {
    const int tp = cfg_.parallel.tp, pp = cfg_.parallel.pp, ep = cfg_.parallel.ep, world = world_->size();
    if (tp >= 1 && pp >= 1 && world % (tp * pp) == 0 && ep >= 1 && (world / (tp * pp)) % ep != 0)
      fail("parallel.ep: ep {} does not divide the data-parallel size {} (= world {} / (tp {} x pp {}))", ep,
           world / (tp * pp), world, tp, pp);
  }
  grid_.emplace(*world_, cfg_.parallel.tp, cfg_.parallel.pp, cfg_.parallel.ep);
  const dist::GridShape& gs = grid_->shape();
  if (cfg_.model.dtype != "fp32") fail("model.dtype: '{}' is not supported on CPU; use fp32", cfg_.model.dtype);

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
  if (cfg_.parallel.ep > 1 && !mcfg_.is_moe())
    fail("parallel.ep: ep {} needs an MoE model; {} is dense (num_local_experts 0)", cfg_.parallel.ep,
         mcfg_.architecture);
  if (cfg_.parallel.ep > 1 && mcfg_.num_local_experts % cfg_.parallel.ep != 0)
    fail("parallel.ep: ep {} does not divide num_local_experts {}", cfg_.parallel.ep, mcfg_.num_local_experts);
  // The layout against the model (heads, FFN width, vocabulary, batch divisible): plan's rules.
  if (world_->size() > 1) make_plan(cfg_, mcfg_, world_->size());
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
  total_steps_ = cfg_.train.max_steps > 0 ? cfg_.train.max_steps
                                          : (long)std::ceil(cfg_.train.epochs * (double)td.steps_per_epoch(0));
  if (total_steps_ <= 0)
    fail("train: the run has no steps (max_steps={}, epochs={})", cfg_.train.max_steps, cfg_.train.epochs);
  micro_per_step_ = cfg_.train.global_batch_size / (cfg_.train.micro_batch_size * gs.dp);

  schedule_.lr = cfg_.train.lr;
  schedule_.min_lr = cfg_.train.min_lr;
  schedule_.warmup_steps = cfg_.train.warmup_steps;
  schedule_.decay_steps = total_steps_;
  schedule_.decay = lr_decay_from_string(cfg_.train.schedule);

  aux_coef_ = cfg_.moe.aux_loss_coef ? *cfg_.moe.aux_loss_coef : mcfg_.router_aux_loss_coef;
  weights_.aux_kind = cfg_.moe.aux_loss == "per_layer" ? AuxLossKind::per_layer : AuxLossKind::hf_pooled;
  flops_ = count_flops(mcfg_, cfg_.data.seq_length);

  // The run directory and the resolved config (the root rank's; the directory must be shared by
  // every node of a multi-node run).
  run_dir_ = cfg_.run_dir;
  if (root_) {
    fs::create_directories(run_dir_);
    {
      const fs::path tmp = run_dir_ / "config.yaml.tmp";
      std::ofstream(tmp) << train_config_to_yaml(cfg_);
      fs::rename(tmp, run_dir_ / "config.yaml");
    }
    log_ = RunLog(run_dir_ / "log.txt");
    if (cfg_.log.tensorboard) tb_.emplace((run_dir_ / "tb").string());
    sgemm_peak_ = ops::measure_sgemm_gflops(1024, 3);
  }

  // Pipeline stage s holds layers [starts[s], starts[s+1]) (an even split or layers_per_stage).
  stage_starts_ = stage_layer_starts(cfg_, mcfg_);
  const LayerRange layers = {stage_starts_[grid_->coord().pp], stage_starts_[grid_->coord().pp + 1]};
  model_.emplace(mcfg_, &grid_->tp(), &grid_->ep(), layers);
  link_.emplace(grid_->pp(), mcfg_.is_moe() ? mcfg_.num_local_experts : 0);
  if (!options_.router_bias.empty()) model_->set_router_bias(options_.router_bias);
  if (cfg_.moe.capacity_factor) model_->set_capacity_factor(*cfg_.moe.capacity_factor);
  AdamWConfig ac;
  ac.lr = cfg_.train.lr;
  ac.beta1 = cfg_.train.adam_beta1;
  ac.beta2 = cfg_.train.adam_beta2;
  ac.eps = cfg_.train.adam_eps;
  ac.weight_decay = cfg_.train.weight_decay;
  const bool ep_on = gs.ep > 1;
  opt_.emplace(model_->table(), ac, grid_->dp(), *world_, cfg_.parallel.zero1, ep_on ? ParamSet::dense : ParamSet::all);
  if (ep_on) opt_exp_.emplace(model_->table(), ac, grid_->edp(), *world_, cfg_.parallel.zero1, ParamSet::experts);
  const size_t state_bytes = opt_->state_bytes() + (opt_exp_ ? opt_exp_->state_bytes() : 0);
  opt_state_bytes_max_ = (uint64_t)world_->all_reduce_value((int64_t)state_bytes, dist::ReduceOp::max);

  // Resume, or initialise.  The root decides which checkpoint (the others follow).
  std::string resume_dir;
  if (root_) {
    if (cfg_.checkpoint.resume == "auto")
      resume_dir = find_latest_checkpoint(run_dir_.string());
    else if (cfg_.checkpoint.resume != "none")
      resume_dir = cfg_.checkpoint.resume;
  }
  world_->broadcast_string(resume_dir, 0);
  const ParamTable& table = model_->table();
  if (!resume_dir.empty()) {
    load_resume(resume_dir);
    if (root_) truncate_metrics(run_dir_ / "metrics.jsonl", start_step_);
    log_.line(fmt::format("resumed from {} at step {}", resume_dir, start_step_));
  } else if (cfg_.model.init == "random") {
    // Keyed by (seed, HF name, index in the whole tensor): any shard initialises to its part.
    init_parameters(table, mcfg_, cfg_.seed, model_->params().data());
    if (root_) truncate_metrics(run_dir_ / "metrics.jsonl", 0);
  } else {
    const ModelTensors files = ModelTensors::open(init_dir_);
    if (table.is_whole()) {
      load_hf_weights(files, table, model_->params().data(), init_dir_);
    } else {
      // Only this rank's slices are read (weights.h): its tensor-parallel part of its experts.  Each
      // rank also checks that the directory holds nothing the whole model lacks.
      const ParamTable whole(mcfg_);
      std::set<std::string> used;
      for (const HfTensorRef& ref : table.hf_tensors()) {
        HfTensorSlice slice;
        slice.ref = whole.find_hf(ref.name);
        MOETRON_ASSERT(slice.ref != nullptr);
        slice.dim = ref.slice_dim;
        slice.begin = ref.slice_begin;
        slice.end = ref.slice_end;
        used.insert(read_hf_slice(files, whole, slice, model_->params().data() + ref.offset, init_dir_));
      }
      for (const std::string& name : files.names())
        if (!used.count(name) && whole.find_hf(name) == nullptr &&
            name.find("rotary_emb.inv_freq") == std::string::npos)
          fail("{}: tensor '{}' is not a parameter of the model config.json describes", init_dir_, name);
    }
    if (root_) truncate_metrics(run_dir_ / "metrics.jsonl", 0);
  }
  const LoaderStats& ls = td.stats();
  log_.line(fmt::format(
      "model {}: {} layers, hidden {}, {} experts top-{}, {:.1f}M parameters; data {}: {} documents, {} blocks of {} "
      "tokens per epoch ({} split, {} dropped); {} steps of {} sequences ({} micro-batches of {})",
      mcfg_.architecture, mcfg_.num_hidden_layers, mcfg_.hidden_size, mcfg_.num_local_experts,
      mcfg_.num_experts_per_tok, (double)model_->table().total() / 1e6, cfg_.data.path, ls.documents, ls.blocks,
      cfg_.data.seq_length, ls.split_documents, ls.dropped_documents, total_steps_, cfg_.train.global_batch_size,
      micro_per_step_, cfg_.train.micro_batch_size));
  if (world_->size() > 1)
    log_.line(fmt::format(
        "distributed: {} ranks over {} ({}): pp {} x dp {} x tp {} (ep {}); ZeRO-1 {}; optimizer state {} per rank "
        "(largest)",
        world_->size(), world_->transport(), grid_->describe(), gs.pp, gs.dp, gs.tp, gs.ep,
        cfg_.parallel.zero1 ? "on" : "off", format_bytes((double)opt_state_bytes_max_)));
}

namespace {

// The part of a whole tensor `view` (of the whole model's shape) that `ref` of a sharded table holds.
void read_slice(const TensorView& view, const HfTensorRef& ref, float* out, const std::string& source) {
  if (view.shape != ref.full_shape)
    fail("{}: tensor '{}' has shape {}, but the model config implies {}", source, view.name,
         nlohmann::json(view.shape).dump(), nlohmann::json(ref.full_shape).dump());
  if (ref.slice_dim < 0)
    read_f32(view, out, ref.numel);
  else
    read_f32_slice(view, ref.slice_dim, ref.slice_begin, ref.slice_end, out);
}

}  // namespace

void Training::load_resume(const std::string& dir) {
  const ParamTable& table = model_->table();
  const bool direct = table.is_whole() && !opt_exp_ && opt_->state_ranges().size() == 1 &&
                      opt_->state_ranges()[0] == ShardedAdamW::Range{0, table.total()};
  LoadedCheckpoint ck;
  if (direct) {
    ck = load_checkpoint(dir, mcfg_, table, model_->params().data(), opt_->exp_avg().data(), opt_->exp_avg_sq().data());
  } else {
    // The root loads the whole checkpoint the single-process way (every file's checksum, the
    // architecture, no unknown tensor) -- it holds whole tensors for saving anyway; the other ranks
    // wait for that, then read only their slices (tensor-parallel parts of their experts).
    std::vector<float> lm(table.total(), 0.0f), lv(table.total(), 0.0f);
    if (root_) {
      std::optional<ParamTable> whole_own;
      if (!table.is_whole()) whole_own.emplace(mcfg_);
      const ParamTable& whole = table.is_whole() ? table : *whole_own;
      std::vector<float> wp(whole.total(), 0.0f), wm(whole.total(), 0.0f), wv(whole.total(), 0.0f);
      ck = load_checkpoint(dir, mcfg_, whole, wp.data(), wm.data(), wv.data());
      copy_from_whole(whole, wp.data(), table, model_->params().data());
      copy_from_whole(whole, wm.data(), table, lm.data());
      copy_from_whole(whole, wv.data(), table, lv.data());
    }
    world_->barrier();
    if (!root_) {
      const std::string opt_dir = (fs::path(dir) / "optimizer").string();
      const ShardedSafetensors opt = ShardedSafetensors::open(opt_dir, "optimizer");
      for (const HfTensorRef& ref : table.hf_tensors()) {
        const std::pair<const char*, float*> parts[] = {
            {".master", model_->params().data()}, {".exp_avg", lm.data()}, {".exp_avg_sq", lv.data()}};
        for (const auto& [suffix, dst] : parts) {
          const TensorView* t = opt.find(ref.name + suffix);
          if (t == nullptr) fail("{}: tensor '{}' is missing", opt_dir, ref.name + suffix);
          read_slice(*t, ref, dst + ref.offset, opt_dir);
        }
      }
      nlohmann::json state = read_trainer_state(dir);
      ck.optimizer_steps = state.at("optimizer_steps").get<long>();
      ck.trainer_state = std::move(state);
    }
    opt_->state_from_flat(lm.data(), lv.data());
    if (opt_exp_) opt_exp_->state_from_flat(lm.data(), lv.data());
  }
  opt_->set_steps_taken(ck.optimizer_steps);
  if (opt_exp_) opt_exp_->set_steps_taken(ck.optimizer_steps);
  const nlohmann::json& st = ck.trainer_state;
  start_step_ = st.at("step").get<long>();
  consumed_samples_ = st.value("consumed_samples", 0L);
  consumed_tokens_ = st.value("consumed_tokens", 0L);
  train_data_->restore(st.at("loader_state").get<LoaderState>());
}

uint64_t Training::comm_bytes() const {
  uint64_t b = world_->stats().bytes_sent + model_->comm_bytes();
  for (dist::Comm* c : {&grid_->tp(), &grid_->dp(), &grid_->pp(), &grid_->ep(), &grid_->edp()})
    b += c->stats().bytes_sent;
  return b;
}

double Training::global_norm(const float* values) const {
  double s = opt_->local_sum_squares(values);
  if (opt_exp_) s += opt_exp_->local_sum_squares(values);
  return std::sqrt(world_->all_reduce_value(s));
}

void Training::reduce_gradients() {
  opt_->reduce_gradients(model_->grads().data());
  if (opt_exp_) opt_exp_->reduce_gradients(model_->grads().data());
}

void Training::optimizer_step(double lr, float grad_scale) {
  opt_->step(model_->params().data(), model_->grads().data(), lr, grad_scale);
  if (opt_exp_) opt_exp_->step(model_->params().data(), model_->grads().data(), lr, grad_scale);
}

StepResult Training::train_step(long step) {
  (void)step;
  StepResult r;
  micro_.resize(micro_per_step_);
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
  run_schedule([&](const Losses& l) {
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
  // Gradients: replicated kv heads over their tp ranks, then everything over dp (experts over edp).
  model_->reduce_replicated_grads();
  reduce_gradients();
  return r;
}

// Megatron's 1F1B ("PipeDream-flush") schedule for stage s of pp over m micro-batches: warm-up
// forwards min(pp - s - 1, m), then one forward and one backward at a time, then the remaining
// backwards.  Stage s keeps at most min(pp - s, m) micro-batches' activations, whatever m.
void Training::run_schedule(const std::function<void(const Losses&)>& account) {
  const int P = grid_->shape().pp, st = grid_->coord().pp, m = (int)micro_.size();
  const size_t n = micro_.empty() ? 0 : (size_t)micro_[0].B * micro_[0].T * mcfg_.hidden_size;
  for (const Batch& b : micro_)
    if ((size_t)b.B * b.T * mcfg_.hidden_size != n)
      fail("pipeline: micro-batches of one step differ in shape ({}x{} and {}x{})", micro_[0].B, micro_[0].T, b.B, b.T);
  PipelineLink& link = *link_;
  model_->discard_pending();  // an evaluation's forward may have left one
  int f = 0;
  auto forward = [&] { account(model_->forward_queued(micro_[f++], weights_, link.input())); };
  auto backward = [&] { model_->backward(link.grad()); };
  const int warmup = std::min(P - st - 1, m), steady = m - warmup;
  for (int i = 0; i < warmup; i++) {
    link.recv_forward(n);
    forward();
    link.send_forward(*model_, n);
  }
  if (steady > 0) link.recv_forward(n);
  for (int i = 0; i < steady; i++) {
    forward();
    link.send_forward_recv_backward(*model_, n);
    backward();
    if (i + 1 == steady)
      link.send_backward(*model_, n);
    else
      link.send_backward_recv_forward(*model_, n);
  }
  for (int i = 0; i < warmup; i++) {
    link.recv_backward(n);
    backward();
    link.send_backward(*model_, n);
  }
}

Losses Training::stage_forward(const Batch& b, const LossWeights& w) {
  const size_t n = (size_t)b.B * b.T * mcfg_.hidden_size;
  link_->recv_forward(n);
  const Losses l = model_->forward(b, w, link_->input());
  link_->send_forward(*model_, n);
  return l;
}

double Training::evaluate() {
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
    if (k * dp + d < cfg_.eval.batches) {
      valid_data_->next(b);
      const Losses l = stage_forward(b, w);
      ce_sum += l.ce_sum;
      tokens += l.loss_tokens;
    } else if (grid_->shape().ep > 1) {
      Batch pad;
      pad.B = 1;
      pad.T = cfg_.data.seq_length;
      pad.input_ids.assign(pad.T, 0);
      stage_forward(pad, w);
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

// World rank 0 receives every rank's part and assembles whole tensors (the checkpoint is layout
// independent); the other ranks send: parameters from the ranks with edp rank 0 (dp rank 0 without
// expert parallelism) of each (pipeline stage, tensor-parallel rank), moments from every rank
// holding a ZeRO-1 shard of a parameter set (or from the first rank of the set's group without
// ZeRO-1).
void Training::gather_whole(const ParamTable& whole, std::vector<float>& params, std::vector<float>& m,
                            std::vector<float>& v) {
  const dist::GridShape& gs = grid_->shape();
  const dist::GridCoord& me = grid_->coord();
  dist::Comm& w = *world_;
  constexpr int kParams = 11, kExpAvg = 12, kExpAvgSq = 13;
  const bool zero1 = cfg_.parallel.zero1, ep_on = gs.ep > 1;
  // The flat ranges of table `t` whose moments the rank at dp rank d sends, in the order of its
  // optimizers' packed moments.
  auto state_ranges = [&](const ParamTable& t, int d) {
    struct Set {
      ParamSet set;
      int size, rank;
    };
    std::vector<Set> sets;
    if (!ep_on)
      sets.push_back({ParamSet::all, gs.dp, d});
    else
      sets = {{ParamSet::dense, gs.dp, d}, {ParamSet::experts, gs.dp / gs.ep, d / gs.ep}};
    std::vector<ShardedAdamW::Range> out;
    for (const Set& s : sets) {
      if (!zero1 && s.rank != 0) continue;
      const auto r = ShardedAdamW::state_ranges_of(t, s.set, s.size, s.rank, zero1);
      out.insert(out.end(), r.begin(), r.end());
    }
    std::sort(out.begin(), out.end());
    return out;
  };
  auto total_of = [](const std::vector<ShardedAdamW::Range>& rs) {
    size_t n = 0;
    for (const auto& [b, e] : rs) n += e - b;
    return n;
  };
  // Flat moments of this rank (zeros outside its state ranges).
  auto own_state = [&](std::vector<float>& lm, std::vector<float>& lv) {
    lm.assign(model_->table().total(), 0.0f);
    lv.assign(model_->table().total(), 0.0f);
    if (zero1 || me.dp == 0) opt_->state_to_flat(lm.data(), lv.data());
    if (opt_exp_ && (zero1 || me.edp == 0)) opt_exp_->state_to_flat(lm.data(), lv.data());
  };
  if (!root_) {
    const size_t total = model_->table().total();
    if (me.edp == 0) w.send(model_->params().data(), total, dist::CommDType::f32, 0, kParams);
    const auto ranges = state_ranges(model_->table(), me.dp);
    const size_t n = total_of(ranges);
    if (n > 0) {
      std::vector<float> lm, lv, pm(n), pv(n);
      own_state(lm, lv);
      size_t p = 0;
      for (const auto& [b, e] : ranges) {
        std::copy(lm.begin() + b, lm.begin() + e, pm.begin() + p);
        std::copy(lv.begin() + b, lv.begin() + e, pv.begin() + p);
        p += e - b;
      }
      w.send(pm.data(), n, dist::CommDType::f32, 0, kExpAvg);
      w.send(pv.data(), n, dist::CommDType::f32, 0, kExpAvgSq);
    }
    return;
  }
  params.assign(whole.total(), 0.0f);
  m.assign(whole.total(), 0.0f);
  v.assign(whole.total(), 0.0f);
  for (int stage = 0; stage < gs.pp; stage++)
    for (int t = 0; t < gs.tp; t++) {
      for (int d = 0; d < gs.dp; d++) {
        dist::GridCoord c;
        c.tp = t;
        c.dp = d;
        c.pp = stage;
        const int src = dist::grid_rank(gs, c);
        ParamShard shard;
        shard.tp_rank = t;
        shard.tp_size = gs.tp;
        shard.layer_begin = stage_starts_[stage];
        shard.layer_end = stage_starts_[stage + 1];
        if (ep_on) {
          const int El = mcfg_.num_local_experts / gs.ep, r = d % gs.ep;
          shard.expert_begin = r * El;
          shard.expert_end = (r + 1) * El;
        }
        const ParamTable lt(mcfg_, shard);
        const auto ranges = state_ranges(lt, d);
        const size_t n = total_of(ranges);
        const bool sends_params = d < gs.ep;  // edp rank 0
        std::vector<float> lp, lm, lv;
        if (src == 0) {
          lp = model_->params();
          own_state(lm, lv);
        } else {
          lp.assign(lt.total(), 0.0f);
          lm.assign(lt.total(), 0.0f);
          lv.assign(lt.total(), 0.0f);
          if (sends_params) w.recv(lp.data(), lt.total(), dist::CommDType::f32, src, kParams);
          if (n > 0) {
            std::vector<float> pm(n), pv(n);
            w.recv(pm.data(), n, dist::CommDType::f32, src, kExpAvg);
            w.recv(pv.data(), n, dist::CommDType::f32, src, kExpAvgSq);
            size_t p = 0;
            for (const auto& [b, e] : ranges) {
              std::copy(pm.begin() + p, pm.begin() + p + (e - b), lm.begin() + b);
              std::copy(pv.begin() + p, pv.begin() + p + (e - b), lv.begin() + b);
              p += e - b;
            }
          }
        }
        if (sends_params) copy_to_whole(lt, lp.data(), whole, params.data());
        copy_to_whole(lt, lm.data(), whole, m.data(), ranges);
        copy_to_whole(lt, lv.data(), whole, v.data(), ranges);
      }
    }
}

std::string Training::save(long step, bool final_save) {
  // Never write a checkpoint that could not be resumed usefully.
  const double param_norm = global_norm(model_->params().data());
  if (!std::isfinite(param_norm)) {
    log_.line(fmt::format("step {}: parameters are not finite; checkpoint NOT saved", step));
    return "";
  }
  const auto t0 = Clock::now();
  const ParamTable& table = model_->table();
  const bool direct = world_->size() == 1 && table.is_whole() && !opt_exp_;
  std::optional<ParamTable> whole_own;
  if (!table.is_whole()) whole_own.emplace(mcfg_);
  const ParamTable& whole = table.is_whole() ? table : *whole_own;
  std::vector<float> wp, wm, wv;
  if (!direct) gather_whole(whole, wp, wm, wv);
  std::string dir;
  if (root_) {
    CheckpointContents c;
    c.model_config = &mcfg_;
    c.table = &whole;
    c.params = direct ? model_->params().data() : wp.data();
    c.exp_avg = direct ? opt_->exp_avg().data() : wm.data();
    c.exp_avg_sq = direct ? opt_->exp_avg_sq().data() : wv.data();
    c.optimizer_steps = opt_->steps_taken();
    c.trainer_state = trainer_state(step);
    SaveOptions o;
    o.keep_last = cfg_.checkpoint.keep_last;
    o.tokenizer_source_dir = init_dir_;
    dir = save_checkpoint(run_dir_.string(), step, c, o);
    log_.line(fmt::format("{} checkpoint {} ({:.2f} s)", final_save ? "saved final" : "saved", dir,
                          std::chrono::duration<double>(Clock::now() - t0).count()));
  }
  world_->broadcast_string(dir, 0);
  return dir;
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
  std::ofstream metrics;
  if (root_) {
    metrics.open(run_dir_ / "metrics.jsonl", std::ios::app);
    if (!metrics) fail("{}: cannot open for writing", (run_dir_ / "metrics.jsonl").string());
  }
  const auto run_t0 = Clock::now();
  int nan_in_row = 0;
  for (long step = start_step_ + 1; step <= total_steps_; step++) {
    const auto t0 = Clock::now();
    const uint64_t bytes0 = comm_bytes();
    if (options_.fail_rank == world_->rank() && options_.fail_step == step)
      fail("--debug-fail: failure injected on rank {} at step {}", options_.fail_rank, step);
    const StepResult r = train_step(step);
    if (std::find(options_.inject_nan_steps.begin(), options_.inject_nan_steps.end(), step) !=
        options_.inject_nan_steps.end())
      if (!opt_->state_ranges().empty())
        model_->grads()[opt_->state_ranges()[0].first] = std::nanf("");  // an element this rank owns
    const double grad_norm = global_norm(model_->grads().data());
    const double lr = schedule_.at(step);
    const bool finite = std::isfinite(r.loss) && std::isfinite(grad_norm);
    if (finite) {
      nan_in_row = 0;
      optimizer_step(lr, (float)clip_coefficient(grad_norm, cfg_.train.grad_clip));
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
    const uint64_t step_bytes = comm_bytes() - bytes0;
    consumed_samples_ += cfg_.train.global_batch_size;
    consumed_tokens_ += r.tokens;
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    const double tps = (double)cfg_.train.global_batch_size * cfg_.data.seq_length / dt;
    summary.last_step = step;
    summary.last_loss = r.loss;

    const bool log_now = cfg_.log.every_steps > 0 && (step % cfg_.log.every_steps == 0 || step == total_steps_);
    // Collective: every rank takes part in the norm.
    const double param_norm = log_now ? global_norm(model_->params().data()) : 0.0;
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
      nlohmann::json m = {{"step", step},           {"loss", r.loss},      {"ce_loss", r.ce_loss},
                          {"aux_loss", r.aux_loss}, {"z_loss", r.z_loss},  {"lr", lr},
                          {"grad_norm", grad_norm}, {"tokens_per_s", tps}, {"loss_tokens", r.loss_tokens},
                          {"step_time_s", dt},      {"skipped", !finite}};
      const double mfu = tps * flops_.train_per_token() / 1e9 / sgemm_peak_;
      m["param_norm"] = param_norm;
      m["mfu"] = mfu;
      if (world_->size() > 1) {
        m["comm_bytes"] = step_bytes;  // sent by this (the root) rank during the step
        m["comm_bytes_max"] = all_bytes[1];
        m["comm_bytes_all_ranks"] = all_bytes[0];
      }
      m["optimizer_state_bytes"] = opt_state_bytes_max_;
      if (P > 1) {
        std::vector<int64_t> in_flight, bytes, per_micro;
        for (int st = 0; st < P; st++) {
          in_flight.push_back(stage_memory[3 * st]);
          bytes.push_back(stage_memory[3 * st + 1]);
          per_micro.push_back(stage_memory[3 * st + 2]);
        }
        m["pipeline"] = {{"stages", P},
                         {"micro_batches", micro_per_step_},
                         {"peak_micro_batches_in_flight", in_flight},
                         {"peak_activation_bytes", bytes},
                         {"activation_bytes_per_micro_batch", per_micro}};
      }
      if (!last_moe_.empty()) m["moe"] = last_moe_;
      metrics << m.dump() << '\n';
      metrics.flush();
      if (tb_) {
        for (const char* k :
             {"loss", "ce_loss", "aux_loss", "z_loss", "lr", "grad_norm", "param_norm", "tokens_per_s", "mfu"})
          tb_->scalar(k, step, m[k].get<double>());
        for (const auto& layer : last_moe_)
          for (const char* k : {"max_share", "min_share", "cv", "dropped_fraction"})
            tb_->scalar(fmt::format("moe/layer_{}/{}", layer["layer"].get<int>(), k), step, layer[k].get<double>());
        tb_->flush();
      }
      const double elapsed = std::chrono::duration<double>(Clock::now() - run_t0).count();
      const double eta = elapsed / (double)(step - start_step_) * (double)(total_steps_ - step);
      log_.progress(
          fmt::format("step {}/{}  loss {:.4f}  ce {:.4f}  aux {:.4f}  lr {:.3g}  grad norm {:.3f}  "
                      "{:.0f} tok/s  {:.1f} GFLOP/s  ETA {}",
                      step, total_steps_, r.loss, r.ce_loss, r.aux_loss, lr, grad_norm, tps,
                      tps * flops_.train_per_token() / 1e9, format_duration(eta)));
    }
    if (valid_data_ && cfg_.eval.every_steps > 0 && (step % cfg_.eval.every_steps == 0 || step == total_steps_)) {
      const double val = evaluate();
      if (root_) {
        metrics << nlohmann::json{{"step", step}, {"val_loss", val}, {"val_ppl", std::exp(val)}}.dump() << '\n';
        metrics.flush();
      }
      if (tb_) {
        tb_->scalar("val_loss", step, val);
        tb_->flush();
      }
      log_.line(fmt::format("step {}: val_loss {:.4f}  perplexity {:.2f}", step, val, std::exp(val)));
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
