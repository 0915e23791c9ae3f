// `moetron report` (src/train/report.h): the page holds one SVG per chart with one point per logged
// step, one heatmap cell per (layer, expert, time bin) coloured by share, nothing external, escaped
// text; bad input fails with FILE:LINE; an empty log fails with "nothing to report".
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "train/report.h"

namespace fs = std::filesystem;
using namespace moetron;
using nlohmann::json;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("moetron_report_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

void write_file(const fs::path& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary);
  f << text;
}

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

size_t count(const std::string& s, const std::string& needle) {
  size_t n = 0;
  for (size_t i = s.find(needle); i != std::string::npos; i = s.find(needle, i + needle.size())) n++;
  return n;
}

// Layer 0 is skewed (expert 0 takes 55%, expert 3 5%), layer 1 balanced.
std::vector<double> shares_of(int layer) {
  return layer == 0 ? std::vector<double>{0.55, 0.25, 0.15, 0.05} : std::vector<double>{0.25, 0.25, 0.25, 0.25};
}

json train_line(long step, bool with_shares = true) {
  json moe = json::array();
  for (int l = 0; l < 2; l++) {
    json e = {{"layer", l}, {"max_share", 0.55}, {"min_share", 0.05}, {"cv", l == 0 ? 0.8 : 0.0}, {"dropped_fraction", 0.0}};
    if (with_shares) e["shares"] = shares_of(l);
    moe.push_back(e);
  }
  return {{"step", step},
          {"loss", 4.0 * std::exp(-0.1 * step) + 1.0},
          {"ce_loss", 4.0 * std::exp(-0.1 * step) + 0.98},
          {"aux_loss", 1.0 + 0.01 / step},
          {"z_loss", 0.0},
          {"lr", 1e-3 * std::min(1.0, step / 5.0)},
          {"grad_norm", 2.0 / std::sqrt((double)step)},
          {"tokens_per_s", 1000.0 + step},
          {"param_norm", 30.0},
          {"mfu", 0.01},
          {"loss_tokens", 512},
          {"step_time_s", 0.5},
          {"skipped", false},
          {"moe", moe}};
}

// A run of `steps` training lines with an eval line every `eval_every` steps.
void write_run(const fs::path& dir, int steps, int eval_every = 5, bool with_shares = true) {
  std::ofstream f(dir / "metrics.jsonl");
  for (int s = 1; s <= steps; s++) {
    f << train_line(s, with_shares).dump() << '\n';
    if (eval_every > 0 && s % eval_every == 0)
      f << json{{"step", s}, {"val_loss", 3.0 - 0.05 * s}, {"val_ppl", std::exp(3.0 - 0.05 * s)}}.dump() << '\n';
  }
  write_file(dir / "config.yaml",
             "run_dir: runs/x\nmodel:\n  init: random\nnote: <script>alert('x')</script> & \"q\"\n");
}

// The <svg ...>...</svg> element whose id is `id` ("" when absent).
std::string svg_by_id(const std::string& html, const std::string& id) {
  const size_t at = html.find("id=\"" + id + "\"");
  if (at == std::string::npos) return "";
  const size_t begin = html.rfind("<svg", at);
  const size_t end = html.find("</svg>", at);
  return html.substr(begin, end + 6 - begin);
}

// The (x, y) points of every polyline in `svg`.
std::vector<std::pair<double, double>> polyline_points(const std::string& svg) {
  std::vector<std::pair<double, double>> pts;
  // A plain scan rather than std::regex: libstdc++'s regex recurses once per character, and a
  // capture of thousands of points overflows the stack under AddressSanitizer.
  for (size_t at = svg.find("<polyline"); at != std::string::npos; at = svg.find("<polyline", at + 1)) {
    const size_t tag_end = svg.find('>', at);
    const size_t attr = svg.find(" points=\"", at);
    if (attr == std::string::npos || attr > tag_end) continue;
    const size_t begin = attr + 9, end = svg.find('"', begin);
    std::istringstream in(svg.substr(begin, end - begin));
    std::string pair;
    while (in >> pair) {
      const size_t comma = pair.find(',');
      pts.emplace_back(std::stod(pair.substr(0, comma)), std::stod(pair.substr(comma + 1)));
    }
  }
  return pts;
}

// Fill colour of the heatmap cell whose tooltip is `title`.
std::string cell_fill(const std::string& html, const std::string& title) {
  const size_t t = html.find("<title>" + title + "</title>");
  if (t == std::string::npos) return "";
  const size_t rect = html.rfind("<rect", t);
  const size_t f = html.find("fill=\"#", rect);
  return f < t ? html.substr(f + 6, 7) : "";
}

int hex(const std::string& c, int i) { return std::stoi(c.substr(1 + 2 * i, 2), nullptr, 16); }

std::string error_of(const fs::path& dir) {
  try {
    render_report_html(dir.string());
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(Report, ChartsHaveOnePointPerLoggedStep) {
  TempDir t;
  write_run(t.path, 20);
  const std::string html = render_report_html(t.path.string());
  const std::vector<std::pair<std::string, size_t>> charts = {{"loss", 20},     {"ce_loss", 20}, {"aux_loss", 20},
                                                              {"val_loss", 4},  {"lr", 20},      {"grad_norm", 20},
                                                              {"tokens_per_s", 20}};
  for (const auto& [id, n] : charts) {
    SCOPED_TRACE(id);
    EXPECT_EQ(count(html, "id=\"chart-" + id + "\""), 1u);
    const std::string svg = svg_by_id(html, "chart-" + id);
    ASSERT_FALSE(svg.empty());
    EXPECT_EQ(count(svg, "<svg"), 1u);
    EXPECT_EQ(count(svg, "<polyline"), 1u);
    const auto pts = polyline_points(svg);
    ASSERT_EQ(pts.size(), n);
    // Axes: tick labels, the "step" label, and points inside the plot frame, left to right.
    EXPECT_GE(count(svg, "class=\"ytick\""), 2u);
    EXPECT_GE(count(svg, "class=\"xtick\""), 2u);
    EXPECT_NE(svg.find(">step</text>"), std::string::npos);
    for (size_t i = 0; i < pts.size(); i++) {
      EXPECT_GE(pts[i].first, 62.0 - 1e-6);
      EXPECT_LE(pts[i].first, 506.0 + 1e-6);
      EXPECT_GE(pts[i].second, 30.0 - 1e-6);
      EXPECT_LE(pts[i].second, 192.0 + 1e-6);
      if (i > 0) {
        EXPECT_GT(pts[i].first, pts[i - 1].first);
      }
    }
  }
  // Falling curves go down the page (SVG y grows downwards), the warmup lr goes up.
  const auto loss = polyline_points(svg_by_id(html, "chart-loss"));
  EXPECT_LT(loss.front().second, loss.back().second);
  const auto lr = polyline_points(svg_by_id(html, "chart-lr"));
  EXPECT_GT(lr.front().second, lr[5].second);
  // z_loss is 0 throughout: no chart, a note instead. The CV chart has one line per layer.
  EXPECT_EQ(html.find("id=\"chart-z_loss\""), std::string::npos);
  EXPECT_NE(html.find("z_loss is 0 at every logged step"), std::string::npos);
  const std::string cv = svg_by_id(html, "chart-moe_cv");
  EXPECT_EQ(count(cv, "<polyline"), 2u);
  EXPECT_EQ(polyline_points(cv).size(), 40u);
  // One <svg> per chart and per heatmap, nothing else.
  EXPECT_EQ(count(html, "<svg"), charts.size() + 1 + 2);
}

// Aux-loss-free balancing's telemetry: each layer's selection-bias range is drawn (two lines per layer,
// one point per step) once some bias moved; runs without it (above) have no such chart.
TEST(Report, SelectionBiasRangeIsDrawnPerLayer) {
  TempDir t;
  {
    std::ofstream f(t.path / "metrics.jsonl");
    for (int s = 1; s <= 6; s++) {
      json line = train_line(s, true);
      for (auto& layer : line["moe"]) {
        layer["bias_max"] = 0.01 * s;
        layer["bias_min"] = -0.01 * s;
      }
      f << line.dump() << '\n';
    }
  }
  write_file(t.path / "config.yaml", "run_dir: runs/x\n");
  const std::string html = render_report_html(t.path.string());
  const std::string svg = svg_by_id(html, "chart-moe_bias");
  ASSERT_FALSE(svg.empty());
  EXPECT_EQ(count(svg, "<polyline"), 4u);  // 2 layers x (max, min)
  EXPECT_EQ(polyline_points(svg).size(), 24u);
  TempDir plain;
  write_run(plain.path, 6);
  EXPECT_EQ(render_report_html(plain.path.string()).find("chart-moe_bias"), std::string::npos);
}

TEST(Report, HeatmapHasOneColouredCellPerLayerExpertStep) {
  TempDir t;
  write_run(t.path, 20);
  const std::string html = render_report_html(t.path.string());
  EXPECT_EQ(count(html, "<rect class=\"cell"), 2u * 4u * 20u);
  EXPECT_EQ(count(html, "class=\"cell nodata\""), 0u);
  for (int l = 0; l < 2; l++) {
    const std::string svg = svg_by_id(html, fmt::format("heatmap-layer-{}", l));
    ASSERT_FALSE(svg.empty());
    EXPECT_EQ(count(svg, "<rect class=\"cell\""), 4u * 20u);
    const std::regex coloured("<rect class=\"cell\"[^>]* fill=\"#[0-9a-f]{6}\"");
    EXPECT_EQ(std::distance(std::sregex_iterator(svg.begin(), svg.end(), coloured), std::sregex_iterator()), 4 * 20);
    EXPECT_NE(svg.find("expert 3</text>"), std::string::npos);
    EXPECT_NE(svg.find("share of routed tokens"), std::string::npos);  // the colour legend
    EXPECT_GE(count(svg, "class=\"legend-cell\""), 16u);
  }
  // Colour follows share: overloaded red, underloaded blue, balanced near-white grey.
  const std::string hot = cell_fill(html, "layer 0 · expert 0 · step 7: share 0.5500");
  const std::string cold = cell_fill(html, "layer 0 · expert 3 · step 7: share 0.0500");
  const std::string even = cell_fill(html, "layer 1 · expert 2 · step 7: share 0.2500");
  ASSERT_EQ(hot.size(), 7u);
  ASSERT_EQ(cold.size(), 7u);
  ASSERT_EQ(even.size(), 7u);
  EXPECT_GT(hex(hot, 0), hex(hot, 2) + 80) << hot;
  EXPECT_GT(hex(cold, 2), hex(cold, 0) + 80) << cold;
  EXPECT_LT(std::abs(hex(even, 0) - hex(even, 2)), 8) << even;
  EXPECT_GT(hex(even, 1), 230) << even;
}

TEST(Report, ManyStepsAreBinnedAndLongCurvesDecimated) {
  TempDir t;
  write_run(t.path, 5000, 0);
  ReportOptions o;
  o.max_heatmap_bins = 100;
  const std::string html = render_report_html(t.path.string(), o);
  EXPECT_EQ(count(html, "<rect class=\"cell\""), 2u * 4u * 100u);
  EXPECT_NE(html.find("time bins"), std::string::npos);
  EXPECT_NE(html.find("steps 1–50: share 0.5500"), std::string::npos);  // bin 0 = steps 1..50, mean of 50
  // 5000 points are drawn as at most 2000 (per-bucket min and max).
  const auto pts = polyline_points(svg_by_id(html, "chart-loss"));
  EXPECT_GE(pts.size(), 1000u);
  EXPECT_LE(pts.size(), 2000u);
}

TEST(Report, SelfContainedAndEscaped) {
  TempDir t;
  write_run(t.path, 20);
  const std::string html = render_report_html(t.path.string());
  // "http" may appear only as an SVG namespace.
  EXPECT_EQ(count(html, "http"), count(html, "xmlns=\"http://www.w3.org/2000/svg\""));
  for (const char* bad : {"<script", " src=", "href=", "url(", "@import", "<link", "<img", "<iframe"})
    EXPECT_EQ(html.find(bad), std::string::npos) << bad;
  EXPECT_NE(html.find("note: &lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &quot;q&quot;"), std::string::npos);
  // Summary table.
  EXPECT_NE(html.find("20 training lines, steps 1–20"), std::string::npos);
  EXPECT_NE(html.find(fmt::format("<th>final loss</th><td>{:.4g} at step 20", 4.0 * std::exp(-2.0) + 1.0)),
            std::string::npos);
  EXPECT_NE(html.find("<th>best val_loss</th><td>2 at step 20"), std::string::npos);
  EXPECT_NE(html.find("<th>tokens/s (median)</th><td>1010</td>"), std::string::npos);  // median of 1001..1020
  EXPECT_NE(html.find("<pre class=\"config\">run_dir: runs/x"), std::string::npos);
}

TEST(Report, LossScaleLogWhenTheLossSpansADecade) {
  TempDir t;
  {
    std::ofstream f(t.path / "metrics.jsonl");
    for (int s = 1; s <= 10; s++) f << json{{"step", s}, {"loss", 20.0 / s / s}}.dump() << '\n';
  }
  EXPECT_NE(svg_by_id(render_report_html(t.path.string()), "chart-loss").find("(log scale)"), std::string::npos);
  ReportOptions lin;
  lin.loss_scale = LossScale::linear;
  EXPECT_EQ(svg_by_id(render_report_html(t.path.string(), lin), "chart-loss").find("(log scale)"), std::string::npos);
  write_run(t.path, 20);  // loss 1.5 .. 4.6: linear
  EXPECT_EQ(svg_by_id(render_report_html(t.path.string()), "chart-loss").find("(log scale)"), std::string::npos);
}

TEST(Report, MissingKeysSkipChartsWithANote) {
  TempDir t;
  {
    std::ofstream f(t.path / "metrics.jsonl");
    for (int s = 1; s <= 6; s++)
      f << json{{"step", s}, {"loss", s == 3 ? json(nullptr) : json(3.0 - 0.1 * s)}, {"lr", 0.001}}.dump() << "\n\n";
  }
  const std::string html = render_report_html(t.path.string());
  EXPECT_EQ(polyline_points(svg_by_id(html, "chart-loss")).size(), 5u);  // the null loss is left out
  for (const char* id : {"ce_loss", "aux_loss", "val_loss", "grad_norm", "moe_cv"})
    EXPECT_EQ(html.find(fmt::format("id=\"chart-{}\"", id)), std::string::npos) << id;
  EXPECT_NE(html.find("ce_loss: not in metrics.jsonl"), std::string::npos);
  EXPECT_NE(html.find("val_loss: no eval lines"), std::string::npos);
  EXPECT_NE(html.find("No MoE telemetry"), std::string::npos);
  EXPECT_NE(html.find("config.yaml not found"), std::string::npos);
  EXPECT_EQ(count(html, "<rect class=\"cell"), 0u);

  // MoE summaries without per-expert shares: the CV chart and table, no heatmap, a note.
  write_run(t.path, 10, 5, /*with_shares=*/false);
  const std::string h2 = render_report_html(t.path.string());
  EXPECT_EQ(count(h2, "<rect class=\"cell"), 0u);
  EXPECT_NE(h2.find("No per-expert shares"), std::string::npos);
  EXPECT_EQ(polyline_points(svg_by_id(h2, "chart-moe_cv")).size(), 20u);
}

TEST(Report, MalformedLinesNameFileAndLine) {
  TempDir t;
  const std::string path = (t.path / "metrics.jsonl").string();
  const std::string good = train_line(1).dump() + "\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {good + "\n{\"step\": 2, \"loss\": 1.0\n", ":3: not valid JSON"},
      {good + "[1, 2]\n", ":2: expected a JSON object"},
      {good + "{\"loss\": 1.0}\n", ":2: \"step\" must be present and an integer"},
      {good + "{\"step\": 2, \"loss\": \"low\"}\n", ":2: \"loss\" must be a number or null"},
      {good + "{\"step\": 2, \"val_loss\": true}\n", ":2: \"val_loss\" must be a number or null"},
      {good + "{\"step\": 2, \"moe\": [{\"layer\": 0, \"shares\": [0.5, 0.5]}]}\n",
       ":2 (moe[0]): \"shares\" of layer 0 has 2 entries, earlier lines had 4"},
      {good + "{\"step\": 2, \"moe\": [{\"cv\": 0.1}]}\n", ":2 (moe[0]): \"layer\" must be a non-negative integer"},
  };
  for (const auto& [text, expected] : cases) {
    write_file(path, text);
    const std::string err = error_of(t.path);
    EXPECT_NE(err.find(path + expected), std::string::npos) << "got: " << err;
  }
}

TEST(Report, NothingToReport) {
  TempDir t;
  EXPECT_NE(error_of(t.path).find("metrics.jsonl: not found"), std::string::npos);
  write_file(t.path / "metrics.jsonl", "");
  EXPECT_NE(error_of(t.path).find("nothing to report"), std::string::npos);
  write_file(t.path / "metrics.jsonl", "\n  \n");
  EXPECT_NE(error_of(t.path).find("nothing to report"), std::string::npos);
  EXPECT_NE(error_of(t.path / "absent").find("not a directory"), std::string::npos);
}

TEST(Report, WriteReportAndCli) {
  TempDir t;
  write_run(t.path, 12);
  write_report(t.path.string(), "");
  const std::string html = read_file(t.path / "report.html");
  EXPECT_EQ(html, render_report_html(t.path.string()));
  for (const auto& e : fs::directory_iterator(t.path))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();

  const fs::path out = t.path / "custom.html";
  const std::string cmd =
      fmt::format("'{}' report '{}' --output '{}' > /dev/null", MOETRON_BINARY, t.path.string(), out.string());
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  EXPECT_EQ(read_file(out), html);
  // An error exits non-zero with the message on stderr.
  const fs::path err = t.path / "err.txt";
  write_file(t.path / "metrics.jsonl", "oops\n");
  const int rc = std::system(fmt::format("'{}' report '{}' 2> '{}'", MOETRON_BINARY, t.path.string(), err.string()).c_str());
  EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 1) << rc;
  EXPECT_NE(read_file(err).find("metrics.jsonl:1: not valid JSON"), std::string::npos) << read_file(err);
}
