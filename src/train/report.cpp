// `moetron report` (see report.h): metrics.jsonl -> one self-contained HTML page of inline SVG charts.
#include "train/report.h"
#include "core/json_limits.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/stats.h"

namespace moetron {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Points = std::vector<std::pair<double, double>>;  // (step, value), in step order

// ---------------------------------------------------------------------------------------------
// Reading metrics.jsonl

struct LayerTelemetry {
  Points cv, max_share, min_share, dropped;
  Points bias_max, bias_min;  // aux-loss-free balancing: the range of the layer's selection bias
  std::vector<std::pair<long, std::vector<double>>> shares;  // (step, share of each expert)
  int experts = 0;                                           // length of "shares" (0: never seen)
};

struct RunMetrics {
  std::map<std::string, Points> scalars;  // training and eval scalars by key
  std::set<std::string> keys_seen;        // keys present on some line (null values included)
  std::map<int, LayerTelemetry> layers;   // MoE telemetry by layer index
  long train_lines = 0, eval_lines = 0, skipped_steps = 0;
  long first_step = 0, last_step = 0;
  std::optional<long> last_train_step;
};

// Keys of training lines drawn or summarised (other keys are accepted and ignored).
constexpr const char* kTrainKeys[] = {"loss",         "ce_loss",     "aux_loss", "z_loss",      "lr",  "grad_norm",
                                      "tokens_per_s", "param_norm",  "mfu",      "step_time_s", "loss_tokens"};
constexpr const char* kEvalKeys[] = {"val_loss", "val_ppl"};

// A number, or nullopt when absent or null; anything else is an error at `where`.
std::optional<double> number_field(const json& j, const char* key, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_number()) fail("{}: \"{}\" must be a number or null, got {}", where, key, it->dump());
  return it->get<double>();
}

void read_moe(RunMetrics& m, const json& moe, long step, const std::string& where) {
  if (!moe.is_array()) fail("{}: \"moe\" must be an array of per-layer objects, got {}", where, moe.type_name());
  for (size_t i = 0; i < moe.size(); i++) {
    const json& e = moe[i];
    const std::string at = fmt::format("{} (moe[{}])", where, i);
    if (!e.is_object()) fail("{}: expected an object, got {}", at, e.type_name());
    const auto layer_it = e.find("layer");
    if (layer_it == e.end() || !layer_it->is_number_integer() || layer_it->get<long>() < 0)
      fail("{}: \"layer\" must be a non-negative integer", at);
    LayerTelemetry& t = m.layers[layer_it->get<int>()];
    if (auto v = number_field(e, "cv", at)) t.cv.emplace_back(step, *v);
    if (auto v = number_field(e, "max_share", at)) t.max_share.emplace_back(step, *v);
    if (auto v = number_field(e, "min_share", at)) t.min_share.emplace_back(step, *v);
    if (auto v = number_field(e, "dropped_fraction", at)) t.dropped.emplace_back(step, *v);
    if (auto v = number_field(e, "bias_max", at)) t.bias_max.emplace_back(step, *v);
    if (auto v = number_field(e, "bias_min", at)) t.bias_min.emplace_back(step, *v);
    const auto sh = e.find("shares");
    if (sh == e.end() || sh->is_null()) continue;
    if (!sh->is_array() || sh->empty()) fail("{}: \"shares\" must be a non-empty array of numbers", at);
    std::vector<double> shares;
    for (const json& x : *sh) {
      if (!x.is_number() || x.get<double>() < 0)
        fail("{}: \"shares\" must hold non-negative numbers, got {}", at, json_preview(x));
      shares.push_back(x.get<double>());
    }
    if (t.experts != 0 && (int)shares.size() != t.experts)
      fail("{}: \"shares\" of layer {} has {} entries, earlier lines had {}", at, layer_it->get<int>(),
           shares.size(), t.experts);
    t.experts = (int)shares.size();
    t.shares.emplace_back(step, std::move(shares));
  }
}

RunMetrics read_metrics(const fs::path& path) {
  std::ifstream in(path);
  if (!in) {
    if (!fs::exists(path))
      fail("{}: not found; RUN_DIR must be a run directory written by `moetron train`", path.string());
    fail("{}: cannot open for reading", path.string());
  }
  RunMetrics m;
  long line_no = 0;
  bool any = false;
  for (std::string line; std::getline(in, line);) {
    line_no++;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", path.string(), line_no);
    const json j = parse_json(line, where);
    if (!j.is_object()) fail("{}: expected a JSON object, got {}", where, j.type_name());
    const auto step_it = j.find("step");
    if (step_it == j.end() || !step_it->is_number_integer())
      fail("{}: \"step\" must be present and an integer", where);
    const long step = step_it->get<long>();
    m.first_step = any ? std::min(m.first_step, step) : step;
    m.last_step = any ? std::max(m.last_step, step) : step;
    any = true;
    if (j.contains("val_loss")) {
      m.eval_lines++;
      for (const char* k : kEvalKeys) {
        if (j.contains(k)) m.keys_seen.insert(k);
        if (auto v = number_field(j, k, where)) m.scalars[k].emplace_back(step, *v);
      }
      continue;
    }
    m.train_lines++;
    m.last_train_step = m.last_train_step ? std::max(*m.last_train_step, step) : step;
    for (const char* k : kTrainKeys) {
      if (j.contains(k)) m.keys_seen.insert(k);
      if (auto v = number_field(j, k, where)) m.scalars[k].emplace_back(step, *v);
    }
    if (const auto sk = j.find("skipped"); sk != j.end() && !sk->is_null()) {
      if (!sk->is_boolean()) fail("{}: \"skipped\" must be true or false, got {}", where, sk->dump());
      if (sk->get<bool>()) m.skipped_steps++;
    }
    if (const auto moe = j.find("moe"); moe != j.end() && !moe->is_null()) read_moe(m, *moe, step, where);
  }
  if (!any)
    fail("{}: nothing to report: the file has no training or eval lines (has the run logged a step yet?)",
         path.string());
  // Lines are appended in step order; sort anyway (stable) so a hand-edited file still plots.
  auto by_step = [](const auto& a, const auto& b) { return a.first < b.first; };
  for (auto& [k, p] : m.scalars) std::stable_sort(p.begin(), p.end(), by_step);
  for (auto& [l, t] : m.layers) {
    for (Points* p : {&t.cv, &t.max_share, &t.min_share, &t.dropped, &t.bias_max, &t.bias_min})
      std::stable_sort(p->begin(), p->end(), by_step);
    std::stable_sort(t.shares.begin(), t.shares.end(), by_step);
  }
  return m;
}

// ---------------------------------------------------------------------------------------------
// Formatting

std::string escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// "1e-05" -> "1e-5", "2.5e+06" -> "2.5e6".
std::string tidy_exponent(std::string s) {
  const size_t e = s.find('e');
  if (e == std::string::npos) return s;
  std::string mant = s.substr(0, e), exp = s.substr(e + 1);
  const bool neg = !exp.empty() && exp[0] == '-';
  if (!exp.empty() && (exp[0] == '-' || exp[0] == '+')) exp.erase(0, 1);
  exp.erase(0, std::min(exp.find_first_not_of('0'), exp.size() - 1));
  return mant + "e" + (neg ? "-" : "") + exp;
}

// A value for a table or a tooltip: 4 significant digits, scientific for very small/large.
std::string fmt_value(double v) {
  if (!std::isfinite(v)) return "–";
  if (v == 0) return "0";
  const double a = std::fabs(v);
  if (a >= 1e6 || a < 1e-3) return tidy_exponent(fmt::format("{:.3g}", v));
  if (a >= 1000) return fmt::format("{:.0f}", v);
  return fmt::format("{:.4g}", v);
}

// A tick label of a linear axis whose ticks are `step` apart.
std::string fmt_tick(double v, double step) {
  if (std::fabs(v) < step * 1e-6) v = 0;
  const double a = std::max(std::fabs(v), step);
  if (v != 0 && (a >= 1e6 || step < 1e-3)) return tidy_exponent(fmt::format("{:.2g}", v));
  const int decimals = std::max(0, (int)-std::floor(std::log10(step) + 1e-9));
  return fmt::format("{:.{}f}", v, decimals);
}

// 1, 2 or 5 times a power of ten, near `raw`.
double nice_step(double raw) {
  if (!(raw > 0) || !std::isfinite(raw)) return 1;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / p;
  return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * p;
}

// ---------------------------------------------------------------------------------------------
// Line charts

struct Series {
  std::string name;
  std::string colour;
  Points points;
};

constexpr const char* kPalette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                    "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};

// Charts with more points than this are drawn from each bucket's min and max (by value), in order.
constexpr size_t kMaxDrawnPoints = 2000;

Points decimate(const Points& p) {
  if (p.size() <= kMaxDrawnPoints) return p;
  const size_t buckets = kMaxDrawnPoints / 2;
  Points out;
  for (size_t b = 0; b < buckets; b++) {
    const size_t lo = p.size() * b / buckets, hi = p.size() * (b + 1) / buckets;
    if (lo >= hi) continue;
    size_t imin = lo, imax = lo;
    for (size_t i = lo; i < hi; i++) {
      if (p[i].second < p[imin].second) imin = i;
      if (p[i].second > p[imax].second) imax = i;
    }
    out.push_back(p[std::min(imin, imax)]);
    if (imin != imax) out.push_back(p[std::max(imin, imax)]);
  }
  return out;
}

struct ChartSpec {
  std::string id;     // svg id: "chart-<id>"
  std::string title;
  bool log_y = false;
  double x_min = 0, x_max = 1;  // shared by all charts so they line up
};

std::string render_chart(const ChartSpec& spec, const std::vector<Series>& series) {
  constexpr double W = 520, H = 230, ML = 62, MR = 14, MT = 30, MB = 38;
  const double pw = W - ML - MR, ph = H - MT - MB;
  auto yv = [&](double v) { return spec.log_y ? std::log10(v) : v; };
  double lo = INFINITY, hi = -INFINITY;
  for (const Series& s : series)
    for (const auto& [x, y] : s.points) lo = std::min(lo, yv(y)), hi = std::max(hi, yv(y));
  // y domain and ticks
  std::vector<std::pair<double, std::string>> yticks;  // (position in domain units, label)
  if (spec.log_y) {
    if (hi - lo < 1e-9) lo -= 0.05, hi += 0.05;
    const double pad = 0.04 * (hi - lo);
    lo -= pad, hi += pad;
    for (int mult_set = 0; mult_set < 2 && yticks.size() < 3; mult_set++) {
      yticks.clear();
      const std::vector<int> mults = mult_set == 0 ? std::vector<int>{1} : std::vector<int>{1, 2, 5};
      for (int d = (int)std::floor(lo); d <= (int)std::ceil(hi); d++)
        for (int mlt : mults) {
          const double v = mlt * std::pow(10.0, d), lv = std::log10(v);
          if (lv >= lo && lv <= hi) yticks.emplace_back(lv, fmt_value(v));
        }
    }
  } else {
    if (hi - lo < 1e-12 * std::max(1.0, std::fabs(hi))) {
      const double d = hi == 0 ? 1 : std::fabs(hi) * 0.1;
      lo -= d, hi += d;
    }
    const double step = nice_step((hi - lo) / 5);
    lo = std::floor(lo / step + 1e-9) * step;
    hi = std::ceil(hi / step - 1e-9) * step;
    for (long k = std::lround(lo / step); k <= std::lround(hi / step); k++)
      yticks.emplace_back(k * step, fmt_tick(k * step, step));
  }
  const double x0 = spec.x_min, x1 = spec.x_max > spec.x_min ? spec.x_max : spec.x_min + 1;
  auto px = [&](double x) { return ML + (x - x0) / (x1 - x0) * pw; };
  auto py = [&](double v) { return MT + (hi - v) / (hi - lo) * ph; };

  std::string o;
  auto out = std::back_inserter(o);
  fmt::format_to(out, "<svg class=\"chart\" id=\"chart-{}\" viewBox=\"0 0 {} {}\" role=\"img\">\n", spec.id, W, H);
  fmt::format_to(out, "<title>{} over steps</title>\n", escape(spec.title));
  fmt::format_to(out, "<text class=\"ctitle\" x=\"{}\" y=\"18\">{}{}</text>\n", ML, escape(spec.title),
                 spec.log_y ? " <tspan class=\"muted\">(log scale)</tspan>" : "");
  // grid and y ticks
  for (const auto& [v, label] : yticks) {
    const double y = py(v);
    fmt::format_to(out, "<line class=\"grid\" x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\"/>", ML, y, ML + pw, y);
    fmt::format_to(out, "<text class=\"ytick\" x=\"{:.1f}\" y=\"{:.1f}\">{}</text>\n", ML - 5, y + 3.5, label);
  }
  // x ticks (steps are integers)
  const double xstep = std::max(1.0, nice_step((x1 - x0) / 6));
  for (double t = std::ceil(x0 / xstep) * xstep; t <= x1 + 1e-9; t += xstep) {
    const double x = px(t);
    fmt::format_to(out, "<line class=\"grid\" x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\"/>", x, MT, x, MT + ph);
    fmt::format_to(out, "<text class=\"xtick\" x=\"{:.1f}\" y=\"{:.1f}\">{}</text>\n", x, MT + ph + 14,
                   fmt_tick(t, xstep));
  }
  fmt::format_to(out, "<rect class=\"frame\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\"/>\n", ML, MT, pw, ph);
  fmt::format_to(out, "<text class=\"xlabel\" x=\"{:.1f}\" y=\"{:.1f}\">step</text>\n", ML + pw / 2, H - 4);
  // series
  for (const Series& s : series) {
    const Points pts = decimate(s.points);
    fmt::format_to(out, "<polyline class=\"series\" data-series=\"{}\" stroke=\"{}\" points=\"", escape(s.name), s.colour);
    for (size_t i = 0; i < pts.size(); i++)
      fmt::format_to(out, "{}{:.1f},{:.1f}", i ? " " : "", px(pts[i].first), py(yv(pts[i].second)));
    o += "\"/>\n";
    if (pts.size() <= 60)
      for (const auto& [x, y] : pts)
        fmt::format_to(out, "<circle class=\"marker\" cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2.4\" fill=\"{}\"><title>step {}: {}</title></circle>",
                       px(x), py(yv(y)), s.colour, (long)x, fmt_value(y));
  }
  // legend (several series) or the last value (one series)
  if (series.size() > 1 && series.size() <= 12) {
    double lx = ML + pw;
    for (size_t i = series.size(); i-- > 0;) {
      lx -= 8.0 + 6.5 * series[i].name.size() + 14;
      fmt::format_to(out, "<rect x=\"{:.1f}\" y=\"10\" width=\"10\" height=\"3\" fill=\"{}\"/>", lx, series[i].colour);
      fmt::format_to(out, "<text class=\"legend\" x=\"{:.1f}\" y=\"15\">{}</text>", lx + 13, escape(series[i].name));
    }
    o += "\n";
  } else if (series.size() > 12) {
    fmt::format_to(out, "<text class=\"legend end\" x=\"{:.1f}\" y=\"15\">one line per layer ({}), colours cycle</text>\n",
                   ML + pw, series.size());
  } else if (series.size() == 1 && !series[0].points.empty()) {
    const auto& [x, y] = series[0].points.back();
    fmt::format_to(out, "<text class=\"legend end\" x=\"{:.1f}\" y=\"15\">last: {} at step {}</text>\n", ML + pw,
                   fmt_value(y), (long)x);
  }
  o += "</svg>\n";
  return o;
}

bool use_log(LossScale s, const Points& p) {
  if (s == LossScale::linear || p.empty()) return false;
  double lo = INFINITY, hi = 0;
  for (const auto& [x, y] : p) lo = std::min(lo, y), hi = std::max(hi, y);
  if (!(lo > 0)) return false;  // log impossible; the linear chart is drawn
  return s == LossScale::log || hi >= 10 * lo;
}

// ---------------------------------------------------------------------------------------------
// Heatmaps of expert shares

// Diverging colour: blue (below the uniform share u) - light grey (u) - red (at or above vmax).
std::string share_colour(double v, double u, double vmax) {
  struct Rgb {
    double r, g, b;
  };
  static constexpr Rgb stops[] = {{33, 102, 172}, {146, 197, 222}, {247, 247, 247}, {244, 165, 130}, {178, 24, 43}};
  double t = v <= u ? 0.5 * std::clamp(v / u, 0.0, 1.0) : 0.5 + 0.5 * std::clamp((v - u) / (vmax - u), 0.0, 1.0);
  const double f = t * 4;
  const int i = std::min(3, (int)f);
  const double w = f - i;
  const Rgb& a = stops[i];
  const Rgb& b = stops[i + 1];
  return fmt::format("#{:02x}{:02x}{:02x}", (int)std::lround(a.r + w * (b.r - a.r)),
                     (int)std::lround(a.g + w * (b.g - a.g)), (int)std::lround(a.b + w * (b.b - a.b)));
}

struct Bin {
  long first_step = 0, last_step = 0;
  int samples = 0;
  std::vector<double> mean;  // per expert
};

// One bin per logged step when there are at most max_bins of them, else max_bins equal step ranges.
std::vector<Bin> bin_shares(const LayerTelemetry& t, int max_bins) {
  // One sample per step (a repeated step keeps its last line).
  std::vector<std::pair<long, std::vector<double>>> s;
  for (const auto& p : t.shares) {
    if (!s.empty() && s.back().first == p.first) s.back() = p;
    else s.push_back(p);
  }
  const int E = t.experts;
  std::vector<Bin> bins;
  if ((int)s.size() <= max_bins) {
    for (const auto& [step, sh] : s) bins.push_back({step, step, 1, sh});
    return bins;
  }
  const long lo = s.front().first, hi = s.back().first;
  const double width = (double)(hi - lo + 1) / max_bins;
  bins.resize(max_bins);
  for (int b = 0; b < max_bins; b++) {
    bins[b].first_step = lo + (long)std::ceil(b * width - 1e-9);
    bins[b].last_step = lo + (long)std::ceil((b + 1) * width - 1e-9) - 1;
    bins[b].mean.assign(E, 0.0);
  }
  for (const auto& [step, sh] : s) {
    const int b = std::min(max_bins - 1, (int)((double)(step - lo) / width));
    bins[b].samples++;
    for (int e = 0; e < E; e++) bins[b].mean[e] += sh[e];
  }
  for (Bin& b : bins)
    for (double& v : b.mean) v = b.samples ? v / b.samples : std::nan("");
  return bins;
}

// Largest share of any expert in any bin of any layer: the top of every colour scale, so colours
// compare across layers.
double max_binned_share(const RunMetrics& m, int max_bins) {
  double mx = 0;
  for (const auto& [l, t] : m.layers)
    if (!t.shares.empty())
      for (const Bin& b : bin_shares(t, max_bins))
        for (double v : b.mean)
          if (std::isfinite(v)) mx = std::max(mx, v);
  return mx;
}

std::string render_heatmap(int layer, const LayerTelemetry& t, int max_bins, double max_share) {
  const int E = t.experts;
  const std::vector<Bin> bins = bin_shares(t, max_bins);
  const int nb = (int)bins.size();
  bool binned = false;
  for (const Bin& b : bins) binned |= b.first_step != b.last_step;
  const double u = 1.0 / E;
  const double vmax = std::max(2 * u, max_share);
  constexpr double W = 1060, ML = 70, MR = 16, MT = 26;
  const double ch = std::clamp(220.0 / E, 5.0, 18.0), pw = W - ML - MR, ph = ch * E, cw = pw / nb;
  const double legend_y = MT + ph + 44, H = legend_y + 30;

  std::string o;
  auto out = std::back_inserter(o);
  fmt::format_to(out, "<svg class=\"heatmap\" id=\"heatmap-layer-{}\" viewBox=\"0 0 {} {:.0f}\" role=\"img\">\n", layer, W, H);
  fmt::format_to(out, "<title>layer {}: share of routed tokens per expert over steps</title>\n", layer);
  fmt::format_to(out, "<text class=\"ctitle\" x=\"{}\" y=\"17\">layer {} <tspan class=\"muted\">· share of routed tokens per expert · {} {}</tspan></text>\n",
                 ML, layer, nb, binned ? "time bins (mean of the logged steps in each)" : "logged steps");
  o += "<g shape-rendering=\"crispEdges\">\n";
  for (int b = 0; b < nb; b++) {
    const Bin& bin = bins[b];
    const std::string steps = bin.first_step == bin.last_step ? fmt::format("step {}", bin.first_step)
                                                              : fmt::format("steps {}–{}", bin.first_step, bin.last_step);
    for (int e = 0; e < E; e++) {
      const double v = bin.mean[e];
      const bool ok = std::isfinite(v);
      fmt::format_to(out,
                     "<rect class=\"cell{}\" x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" height=\"{:.2f}\" fill=\"{}\">"
                     "<title>layer {} · expert {} · {}: {}</title></rect>",
                     ok ? "" : " nodata", ML + b * cw, MT + e * ch, cw + 0.3, ch + 0.3,
                     ok ? share_colour(v, u, vmax) : std::string("#d9d9d9"), layer, e, steps,
                     ok ? fmt::format("share {:.4f}", v) : std::string("no data"));
    }
    o += "\n";
  }
  o += "</g>\n";
  fmt::format_to(out, "<rect class=\"frame\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{:.2f}\"/>\n", ML, MT, pw, ph);
  // y labels: experts
  const int every = E <= 24 ? 1 : (E + 15) / 16;
  for (int e = 0; e < E; e += every)
    fmt::format_to(out, "<text class=\"ytick\" x=\"{}\" y=\"{:.1f}\">expert {}</text>", ML - 5, MT + (e + 0.5) * ch + 3.5, e);
  o += "\n";
  // x ticks: round steps, placed in the bin that holds them (a step between two logged steps is skipped)
  const long s0 = bins.front().first_step, s1 = bins.back().last_step;
  const long xstep = std::max(1L, (long)nice_step((double)(s1 - s0 + 1) / 8));
  for (long s = (s0 + xstep - 1) / xstep * xstep; s <= s1; s += xstep) {
    const auto it = std::upper_bound(bins.begin(), bins.end(), s, [](long v, const Bin& b) { return v < b.first_step; });
    if (it == bins.begin()) continue;
    const Bin& b = *(it - 1);
    if (s > b.last_step) continue;
    const double x = ML + ((it - 1 - bins.begin()) + (s - b.first_step + 0.5) / (b.last_step - b.first_step + 1)) * cw;
    fmt::format_to(out, "<line class=\"tick\" x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\"/>", x, MT + ph, x,
                   MT + ph + 4);
    fmt::format_to(out, "<text class=\"xtick\" x=\"{:.1f}\" y=\"{:.1f}\">{}</text>", x, MT + ph + 15, s);
  }
  fmt::format_to(out, "<text class=\"xlabel\" x=\"{:.1f}\" y=\"{:.1f}\">step</text>\n", ML + pw / 2, MT + ph + 29);
  // colour legend: a bar from 0 to vmax; "balanced" above the bar at 1/E, the ends below it
  constexpr double LW = 360, LH = 10;
  const double lx = ML + pw - LW;
  fmt::format_to(out, "<text class=\"legend end\" x=\"{:.1f}\" y=\"{:.1f}\">share of routed tokens</text>", lx - 10,
                 legend_y + 9);
  constexpr int kLegendSteps = 72;
  for (int i = 0; i < kLegendSteps; i++) {
    const double v = vmax * (i + 0.5) / kLegendSteps;
    fmt::format_to(out, "<rect class=\"legend-cell\" x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{}\" fill=\"{}\"/>",
                   lx + LW * i / kLegendSteps, legend_y, LW / kLegendSteps + 0.3, LH, share_colour(v, u, vmax));
  }
  const double ux = lx + LW * u / vmax;
  fmt::format_to(out, "<line class=\"tick\" x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\"/>", ux, legend_y - 3,
                 ux, legend_y + LH);
  fmt::format_to(out, "<text class=\"legend\" x=\"{:.1f}\" y=\"{:.1f}\">1/{} = {} (balanced)</text>", ux - 4,
                 legend_y - 5, E, fmt_value(u));
  fmt::format_to(out, "<text class=\"legend\" x=\"{:.1f}\" y=\"{:.1f}\">0</text>", lx, legend_y + LH + 13);
  fmt::format_to(out, "<text class=\"legend end\" x=\"{:.1f}\" y=\"{:.1f}\">{}{}</text>", lx + LW, legend_y + LH + 13,
                 fmt_value(vmax), vmax > max_share ? " (2/E)" : " (max)");
  o += "\n</svg>\n";
  return o;
}

// ---------------------------------------------------------------------------------------------
// The page

constexpr const char* kCss = R"css(
body { font-family: system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: #222;
       max-width: 1100px; margin: 24px auto; padding: 0 16px; background: #fff; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.sub { color: #666; font-size: 13px; margin-bottom: 16px; word-break: break-all; }
.top { display: grid; grid-template-columns: 1fr 1fr; gap: 20px; align-items: start; }
table { border-collapse: collapse; font-size: 13px; }
td, th { padding: 3px 10px 3px 0; text-align: left; vertical-align: top; }
th { color: #555; font-weight: 600; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.moe td, table.moe th { padding-right: 16px; }
pre { background: #f6f6f6; border: 1px solid #e4e4e4; padding: 8px 10px; font-size: 12px; max-height: 360px;
      overflow: auto; margin: 0; }
.charts { display: grid; grid-template-columns: 1fr 1fr; gap: 14px 18px; }
svg { width: 100%; height: auto; display: block; }
svg text { font-size: 11px; fill: #333; }
svg .ctitle { font-size: 13px; font-weight: 600; } svg .muted { fill: #888; font-weight: 400; }
svg .ytick { text-anchor: end; } svg .xtick, svg .xlabel { text-anchor: middle; } svg .xlabel { fill: #666; }
svg .legend { font-size: 11px; } svg .end { text-anchor: end; }
svg .grid { stroke: #ececec; stroke-width: 1; } svg .tick { stroke: #555; stroke-width: 1; }
svg .frame { fill: none; stroke: #999; stroke-width: 1; }
svg .series { fill: none; stroke-width: 1.6; stroke-linejoin: round; }
.note { color: #777; font-style: italic; font-size: 13px; margin: 6px 0; }
.heatmaps svg { margin-bottom: 10px; }
)css";

void chart_or_note(std::string& o, const RunMetrics& m, const ChartSpec& spec, const std::string& key,
                   const std::string& colour, const std::string& missing_note) {
  const auto it = m.scalars.find(key);
  if (it == m.scalars.end() || it->second.empty()) {
    const bool present = m.keys_seen.count(key) > 0;
    o += fmt::format("<div><p class=\"note\">{}: {}</p></div>\n", escape(spec.title),
                     escape(present ? "every value is null (non-finite)" : missing_note));
    return;
  }
  o += "<div>" + render_chart(spec, {Series{key, colour, it->second}}) + "</div>\n";
}

std::string read_config_excerpt(const fs::path& path, std::string& note) {
  std::ifstream in(path);
  if (!in) {
    note = fmt::format("{} not found", path.filename().string());
    return "";
  }
  constexpr int kMaxLines = 300;
  std::string text, line;
  int n = 0, more = 0;
  while (std::getline(in, line)) {
    if (n < kMaxLines) text += line + "\n", n++;
    else more++;
  }
  if (more) text += fmt::format("… {} more lines\n", more);
  return text;
}

}  // namespace

std::string render_report_html(const std::string& run_dir, const ReportOptions& options) {
  const fs::path dir(run_dir);
  if (!fs::is_directory(dir)) fail("{}: not a directory (expected a run directory written by `moetron train`)", run_dir);
  const RunMetrics m = read_metrics(dir / "metrics.jsonl");
  std::string cfg_note;
  const std::string cfg_text = read_config_excerpt(dir / "config.yaml", cfg_note);

  std::string o;
  o.reserve(1 << 16);
  auto out = std::back_inserter(o);
  std::string name = fs::absolute(dir).lexically_normal().filename().string();
  if (name.empty()) name = fs::absolute(dir).lexically_normal().parent_path().filename().string();
  fmt::format_to(out, "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>moetron report · {}</title>\n<style>{}</style>\n</head>\n<body>\n",
                 escape(name), kCss);
  fmt::format_to(out, "<h1>moetron run report · {}</h1>\n<div class=\"sub\">{}</div>\n", escape(name),
                 escape(fs::absolute(dir).lexically_normal().string()));

  // Summary
  auto last_of = [&](const char* k) -> std::optional<std::pair<double, double>> {
    const auto it = m.scalars.find(k);
    if (it == m.scalars.end() || it->second.empty()) return std::nullopt;
    return it->second.back();
  };
  std::vector<std::pair<std::string, std::string>> rows;
  rows.emplace_back("logged steps", m.train_lines ? fmt::format("{} training lines, steps {}–{}", m.train_lines,
                                                                m.first_step, *m.last_train_step)
                                                  : std::string("no training lines"));
  rows.emplace_back("eval lines", fmt::format("{}", m.eval_lines));
  if (auto l = last_of("loss")) {
    std::string s = fmt::format("{} at step {}", fmt_value(l->second), (long)l->first);
    if (auto c = last_of("ce_loss")) s += fmt::format(" (ce {}", fmt_value(c->second));
    if (auto a = last_of("aux_loss")) s += fmt::format(", aux {}", fmt_value(a->second));
    if (last_of("ce_loss")) s += ")";
    rows.emplace_back("final loss", s);
  }
  if (const auto it = m.scalars.find("val_loss"); it != m.scalars.end() && !it->second.empty()) {
    const auto best = *std::min_element(it->second.begin(), it->second.end(),
                                        [](const auto& a, const auto& b) { return a.second < b.second; });
    rows.emplace_back("best val_loss", fmt::format("{} at step {} (perplexity {})", fmt_value(best.second),
                                                   (long)best.first, fmt_value(std::exp(best.second))));
    rows.emplace_back("final val_loss", fmt::format("{} at step {}", fmt_value(it->second.back().second),
                                                    (long)it->second.back().first));
  }
  if (const auto it = m.scalars.find("tokens_per_s"); it != m.scalars.end() && !it->second.empty()) {
    std::vector<double> v;
    for (const auto& p : it->second) v.push_back(p.second);
    rows.emplace_back("tokens/s (median)", fmt_value(median(v)));
  }
  if (const auto it = m.scalars.find("mfu"); it != m.scalars.end() && !it->second.empty()) {
    std::vector<double> v;
    for (const auto& p : it->second) v.push_back(p.second);
    rows.emplace_back("MFU (median)", fmt_value(median(v)));
  }
  if (const auto it = m.scalars.find("step_time_s"); it != m.scalars.end() && !it->second.empty()) {
    double total = 0;
    for (const auto& p : it->second) total += p.second;
    rows.emplace_back("time in logged steps", fmt::format("{} s", fmt_value(total)));
  }
  if (auto l = last_of("lr")) rows.emplace_back("final lr", fmt_value(l->second));
  rows.emplace_back("skipped steps (non-finite)", fmt::format("{}", m.skipped_steps));
  if (!m.layers.empty()) {
    int experts = 0;
    for (const auto& [l, t] : m.layers) experts = std::max(experts, t.experts);
    rows.emplace_back("MoE layers with telemetry",
                      experts ? fmt::format("{} ({} experts)", m.layers.size(), experts) : fmt::format("{}", m.layers.size()));
  }
  o += "<div class=\"top\">\n<div>\n<h2>Summary</h2>\n<table class=\"summary\">\n";
  for (const auto& [k, v] : rows) fmt::format_to(out, "<tr><th>{}</th><td>{}</td></tr>\n", escape(k), escape(v));
  o += "</table>\n</div>\n<div>\n<h2>Config <span class=\"muted\">(config.yaml)</span></h2>\n";
  if (cfg_text.empty()) fmt::format_to(out, "<p class=\"note\">{}</p>\n", escape(cfg_note.empty() ? "config.yaml is empty" : cfg_note));
  else fmt::format_to(out, "<pre class=\"config\">{}</pre>\n", escape(cfg_text));
  o += "</div>\n</div>\n";

  // Curves
  const double x_min = (double)m.first_step, x_max = (double)m.last_step;
  auto spec = [&](const std::string& id, const std::string& title, bool log_y = false) {
    return ChartSpec{id, title, log_y, x_min, x_max};
  };
  auto pts = [&](const char* k) -> const Points& {
    static const Points empty;
    const auto it = m.scalars.find(k);
    return it == m.scalars.end() ? empty : it->second;
  };
  const std::string no_train = "not in metrics.jsonl";
  o += "<h2>Curves</h2>\n<div class=\"charts\">\n";
  chart_or_note(o, m, spec("loss", "loss", use_log(options.loss_scale, pts("loss"))), "loss", kPalette[0], no_train);
  chart_or_note(o, m, spec("val_loss", "val_loss", use_log(options.loss_scale, pts("val_loss"))), "val_loss", kPalette[1],
                "no eval lines (eval.every_steps = 0, or no validation split)");
  chart_or_note(o, m, spec("ce_loss", "ce_loss", use_log(options.loss_scale, pts("ce_loss"))), "ce_loss", kPalette[0], no_train);
  chart_or_note(o, m, spec("aux_loss", "aux_loss"), "aux_loss", kPalette[3], no_train);
  chart_or_note(o, m, spec("lr", "lr"), "lr", kPalette[2], no_train);
  chart_or_note(o, m, spec("grad_norm", "grad_norm"), "grad_norm", kPalette[4], no_train);
  chart_or_note(o, m, spec("tokens_per_s", "tokens_per_s"), "tokens_per_s", kPalette[5], no_train);
  bool z_nonzero = false;
  for (const auto& p : pts("z_loss")) z_nonzero |= p.second != 0;
  if (z_nonzero) chart_or_note(o, m, spec("z_loss", "z_loss"), "z_loss", kPalette[6], no_train);
  // Router load imbalance: one line per layer.
  std::vector<Series> cv;
  for (const auto& [l, t] : m.layers)
    if (!t.cv.empty()) cv.push_back({fmt::format("L{}", l), kPalette[cv.size() % std::size(kPalette)], t.cv});
  if (!cv.empty()) o += "<div>" + render_chart(spec("moe_cv", "router load CV"), cv) + "</div>\n";
  // The selection biases of aux-loss-free balancing (sigmoid routers): each layer's largest and
  // smallest, drawn only when some bias moved.
  std::vector<Series> bias;
  bool bias_moved = false;
  for (const auto& [l, t] : m.layers) {
    for (const Points* p : {&t.bias_max, &t.bias_min})
      for (const auto& pt : *p) bias_moved |= pt.second != 0;
    const char* colour = kPalette[bias.size() / 2 % std::size(kPalette)];
    if (!t.bias_max.empty()) bias.push_back({fmt::format("L{} max", l), colour, t.bias_max});
    if (!t.bias_min.empty()) bias.push_back({fmt::format("L{} min", l), colour, t.bias_min});
  }
  if (bias_moved) o += "<div>" + render_chart(spec("moe_bias", "selection bias (max, min)"), bias) + "</div>\n";
  o += "</div>\n";
  if (bias_moved)
    o += "<p class=\"note\">selection bias: the largest and smallest e_score_correction_bias of each MoE layer, "
         "moved by aux-loss-free balancing (moe.bias_update_rate).</p>\n";
  if (!cv.empty())
    o += "<p class=\"note\">router load CV: standard deviation / mean of the experts' shares of routed tokens, "
         "per MoE layer; 0 when perfectly balanced.</p>\n";
  if (!z_nonzero && m.keys_seen.count("z_loss"))
    o += "<p class=\"note\">z_loss is 0 at every logged step (moe.z_loss_coef = 0); not drawn.</p>\n";

  // Expert load
  o += "<h2>Expert load</h2>\n";
  if (m.layers.empty()) {
    o += "<p class=\"note\">No MoE telemetry in metrics.jsonl (a dense model, or a trainer that does not log \"moe\").</p>\n";
  } else {
    o += "<div class=\"heatmaps\">\n";
    bool any = false;
    const int max_bins = std::max(1, options.max_heatmap_bins);
    const double max_share = max_binned_share(m, max_bins);
    for (const auto& [l, t] : m.layers)
      if (!t.shares.empty()) o += render_heatmap(l, t, max_bins, max_share), any = true;
    o += "</div>\n";
    if (!any)
      o += "<p class=\"note\">No per-expert shares (\"moe\"[].\"shares\") in metrics.jsonl; the heatmaps need them. "
           "The table and the CV chart use the summary statistics.</p>\n";
    o += "<table class=\"moe\">\n<tr><th>layer</th><th>step</th><th>max share</th><th>min share</th><th>CV</th><th>dropped</th></tr>\n";
    for (const auto& [l, t] : m.layers) {
      auto last = [](const Points& p) { return p.empty() ? std::string("–") : fmt_value(p.back().second); };
      const Points& any_p = !t.cv.empty() ? t.cv : !t.max_share.empty() ? t.max_share : t.dropped;
      fmt::format_to(out, "<tr><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td></tr>\n",
                     l, any_p.empty() ? std::string("–") : fmt::format("{}", (long)any_p.back().first),
                     last(t.max_share), last(t.min_share), last(t.cv), last(t.dropped));
    }
    o += "</table>\n<p class=\"note\">Last logged step of each layer. Share: the fraction of the step's routed "
         "(token, expert) assignments that went to an expert; 1/E when balanced.</p>\n";
  }
  o += "</body>\n</html>\n";
  return o;
}

void write_report(const std::string& run_dir, const std::string& output, const ReportOptions& options) {
  const fs::path target = output.empty() ? fs::path(run_dir) / "report.html" : fs::path(output);
  const std::string html = render_report_html(run_dir, options);
  const fs::path tmp = target.parent_path() / fmt::format(".{}.tmp-{}", target.filename().string(), ::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) fail("{}: cannot open for writing", tmp.string());
    f.write(html.data(), (std::streamsize)html.size());
    f.flush();
    if (!f) {
      std::error_code ec;
      fs::remove(tmp, ec);
      fail("{}: write failed", tmp.string());
    }
  }
  std::error_code ec;
  fs::rename(tmp, target, ec);
  if (ec) {
    const std::string why = ec.message();
    fs::remove(tmp, ec);
    fail("{}: cannot rename {} to it: {}", target.string(), tmp.string(), why);
  }
}

}  // namespace moetron
