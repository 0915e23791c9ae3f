// moetron serve, in process: the OpenAI exchanges (plain and streaming chat / completions, models,
// health) with fixed expectations -- the replies transformers' generate gives on the committed tiny
// model (tests/golden/generate/expected.json) -- the error objects, and the bounded queue.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "infer/model_runner.h"
#include "infer/generate.h"
#include "infer/model.h"
#include "infer/chat_format.h"
#include "server/engine.h"
#include "server/openai_api.h"
#include "server/server.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace moetron;

namespace {

const fs::path kModel = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden" / "generate" / "mixtral_gqa";

json expected_text() {
  std::ifstream in(fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden" / "generate" / "expected.json");
  return json::parse(in)["cases"][0]["text"];
}

// The data: lines of an SSE body, parsed (the final "[DONE]" as a string).
std::vector<json> sse_events(const std::string& body) {
  std::vector<json> out;
  size_t pos = 0;
  while (pos < body.size()) {
    size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) end = body.size();
    const std::string ev = body.substr(pos, end - pos);
    pos = end + 2;
    if (ev.empty()) continue;
    EXPECT_EQ(ev.rfind("data: ", 0), 0u) << ev;
    const std::string data = ev.substr(6);
    out.push_back(data == "[DONE]" ? json("[DONE]") : json::parse(data));
  }
  return out;
}

class ServeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    signal(SIGPIPE, SIG_IGN);
    model_ = load_inference_model(kModel.string()).release();
    tok_ = load_model_tokenizer(kModel.string(), "", model_->cfg, true).release();
  }
  static void TearDownTestSuite() {
    delete tok_;
    delete model_;
  }
  void start(server::ServerOptions o = {}) {
    o.port = 0;
    o.model_name = "tiny-mixtral";
    o.read_timeout_ms = 2000;
    o.write_timeout_ms = 2000;
    decoder_ = std::make_unique<ModelRunner>(*model_);
    srv_ = std::make_unique<server::Server>(*decoder_, *tok_, ChatTemplate::mistral,
                                            model_eos_ids(kModel.string(), model_->cfg, tok_), o);
    port_ = srv_->bind();
    thread_ = std::thread([this] { srv_->run(); });
  }
  void TearDown() override {
    if (srv_) srv_->stop();
    if (thread_.joinable()) thread_.join();
  }
  httplib::Result post(const std::string& path, const json& body) {
    httplib::Client cli("127.0.0.1", port_);
    cli.set_read_timeout(10, 0);
    return cli.Post(path.c_str(), body.dump(), "application/json");
  }
  httplib::Result post_raw(const std::string& path, const std::string& body) {
    httplib::Client cli("127.0.0.1", port_);
    return cli.Post(path.c_str(), body, "application/json");
  }
  // Status and error object of a request expected to fail.
  void expect_error(const std::string& path, const std::string& body, int status, const std::string& param,
                    const std::string& code = "") {
    SCOPED_TRACE(body.substr(0, 200));
    auto r = post_raw(path, body);
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    EXPECT_EQ(r->status, status);
    const json j = json::parse(r->body);
    ASSERT_TRUE(j.contains("error"));
    const json& e = j["error"];
    EXPECT_TRUE(e["message"].is_string() && !e["message"].get<std::string>().empty());
    EXPECT_TRUE(e["type"].is_string());
    EXPECT_TRUE(e.contains("param") && e.contains("code"));
    if (param.empty())
      EXPECT_TRUE(e["param"].is_null()) << e.dump();
    else
      EXPECT_EQ(e["param"], param) << e.dump();
    if (!code.empty()) {
      EXPECT_EQ(e["code"], code) << e.dump();
    }
  }

  static InferenceModel* model_;
  static Tokenizer* tok_;
  std::unique_ptr<ModelRunner> decoder_;  // destroyed after the server (declared before it)
  std::unique_ptr<server::Server> srv_;
  std::thread thread_;
  int port_ = 0;
};

InferenceModel* ServeTest::model_ = nullptr;
Tokenizer* ServeTest::tok_ = nullptr;

json chat_body(const json& t, bool stream) {
  return {{"model", "tiny-mixtral"},
          {"messages", {{{"role", "user"}, {"content", t["chat"]["user"]}}}},
          {"max_tokens", t["max_tokens"]},
          {"temperature", 0},
          {"stream", stream}};
}

json completion_body(const json& t, bool stream) {
  return {{"model", "tiny-mixtral"},
          {"prompt", t["completion"]["prompt"]},
          {"max_tokens", t["max_tokens"]},
          {"temperature", 0},
          {"stream", stream}};
}

}  // namespace

TEST_F(ServeTest, HealthAndModels) {
  start();
  httplib::Client cli("127.0.0.1", port_);
  auto h = cli.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  EXPECT_EQ(json::parse(h->body)["status"], "ok");
  auto m = cli.Get("/v1/models");
  ASSERT_TRUE(m);
  const json j = json::parse(m->body);
  EXPECT_EQ(j["object"], "list");
  ASSERT_EQ(j["data"].size(), 1u);
  EXPECT_EQ(j["data"][0]["id"], "tiny-mixtral");
  EXPECT_EQ(j["data"][0]["object"], "model");
  auto one = cli.Get("/v1/models/tiny-mixtral");
  ASSERT_TRUE(one);
  EXPECT_EQ(one->status, 200);
  auto missing = cli.Get("/v1/models/gpt-4");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  EXPECT_EQ(json::parse(missing->body)["error"]["code"], "model_not_found");
}

TEST_F(ServeTest, ChatCompletionPlain) {
  start();
  const json t = expected_text();
  auto r = post("/v1/chat/completions", chat_body(t, false));
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(r->get_header_value("Content-Type"), "application/json");
  const json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["model"], "tiny-mixtral");
  EXPECT_EQ(j["id"].get<std::string>().rfind("chatcmpl-", 0), 0u);
  ASSERT_EQ(j["choices"].size(), 1u);
  EXPECT_EQ(j["choices"][0]["index"], 0);
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"], t["chat"]["content"]);
  EXPECT_EQ(j["choices"][0]["finish_reason"], t["chat"]["finish_reason"]);
  EXPECT_EQ(j["usage"]["prompt_tokens"], t["chat"]["prompt_ids"].size());
  EXPECT_EQ(j["usage"]["completion_tokens"], t["chat"]["completion_ids"].size());
  EXPECT_EQ(j["usage"]["total_tokens"], t["chat"]["prompt_ids"].size() + t["chat"]["completion_ids"].size());
}

TEST_F(ServeTest, ChatCompletionStreaming) {
  start();
  const json t = expected_text();
  json body = chat_body(t, true);
  body["stream_options"] = {{"include_usage", true}};
  auto r = post("/v1/chat/completions", body);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(r->get_header_value("Content-Type"), "text/event-stream");
  const std::vector<json> ev = sse_events(r->body);
  ASSERT_GE(ev.size(), 4u);
  EXPECT_EQ(ev.back(), "[DONE]");
  // first: the role; then content deltas; then the finish reason; then usage; then [DONE]
  EXPECT_EQ(ev[0]["choices"][0]["delta"]["role"], "assistant");
  std::string content;
  const std::string id = ev[0]["id"];
  for (size_t i = 0; i + 3 < ev.size(); i++) {
    EXPECT_EQ(ev[i]["id"], id);
    EXPECT_EQ(ev[i]["object"], "chat.completion.chunk");
    EXPECT_TRUE(ev[i]["choices"][0]["finish_reason"].is_null());
    if (ev[i]["choices"][0]["delta"].contains("content")) content += ev[i]["choices"][0]["delta"]["content"];
  }
  EXPECT_EQ(content, t["chat"]["content"]);
  const json& fin = ev[ev.size() - 3];
  EXPECT_EQ(fin["choices"][0]["finish_reason"], t["chat"]["finish_reason"]);
  const json& usage = ev[ev.size() - 2];
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], t["chat"]["completion_ids"].size());
  EXPECT_EQ(usage["usage"]["prompt_tokens"], t["chat"]["prompt_ids"].size());
}

TEST_F(ServeTest, CompletionPlainAndStreaming) {
  start();
  const json t = expected_text();
  auto r = post("/v1/completions", completion_body(t, false));
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["id"].get<std::string>().rfind("cmpl-", 0), 0u);
  EXPECT_EQ(j["choices"][0]["text"], t["completion"]["text"]);
  EXPECT_EQ(j["choices"][0]["finish_reason"], t["completion"]["finish_reason"]);
  EXPECT_EQ(j["usage"]["prompt_tokens"], t["completion"]["prompt_ids"].size());

  auto s = post("/v1/completions", completion_body(t, true));
  ASSERT_TRUE(s);
  ASSERT_EQ(s->status, 200);
  const std::vector<json> ev = sse_events(s->body);
  ASSERT_GE(ev.size(), 3u);
  EXPECT_EQ(ev.back(), "[DONE]");
  std::string text;
  for (size_t i = 0; i + 2 < ev.size(); i++) {
    EXPECT_EQ(ev[i]["object"], "text_completion");
    text += ev[i]["choices"][0]["text"];
  }
  EXPECT_EQ(text, t["completion"]["text"]);
  EXPECT_EQ(ev[ev.size() - 2]["choices"][0]["finish_reason"], t["completion"]["finish_reason"]);
  // An array holding one prompt is the same request.
  json arr = completion_body(t, false);
  arr["prompt"] = json::array({t["completion"]["prompt"]});
  auto a = post("/v1/completions", arr);
  ASSERT_TRUE(a);
  EXPECT_EQ(json::parse(a->body)["choices"][0]["text"], t["completion"]["text"]);
}

TEST_F(ServeTest, StopSequencesSeedsAndContentParts) {
  start();
  const json t = expected_text();
  const std::string full = t["completion"]["text"];
  const std::string stop = full.substr(full.size() / 2, 3);
  json b = completion_body(t, false);
  b["stop"] = {stop, "zzzz"};
  auto r = post("/v1/completions", b);
  ASSERT_TRUE(r);
  const json j = json::parse(r->body);
  EXPECT_EQ(j["choices"][0]["text"], full.substr(0, full.find(stop)));
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  b["stream"] = true;
  auto s = post("/v1/completions", b);
  ASSERT_TRUE(s);
  std::string text;
  for (const json& e : sse_events(s->body))
    if (e.is_object()) text += e["choices"][0]["text"];
  EXPECT_EQ(text, full.substr(0, full.find(stop)));

  // Sampling with a seed is reproducible.
  json c = completion_body(t, false);
  c["temperature"] = 1.2;
  c["top_p"] = 0.9;
  c["seed"] = 1234;
  auto s1 = post("/v1/completions", c), s2 = post("/v1/completions", c);
  ASSERT_TRUE(s1 && s2);
  EXPECT_EQ(json::parse(s1->body)["choices"][0]["text"], json::parse(s2->body)["choices"][0]["text"]);

  // Content given as text parts, and a "developer" message, are accepted.
  json parts = chat_body(t, false);
  parts["messages"] = {{{"role", "user"}, {"content", {{{"type", "text"}, {"text", t["chat"]["user"]}}}}}};
  auto p = post("/v1/chat/completions", parts);
  ASSERT_TRUE(p);
  EXPECT_EQ(json::parse(p->body)["choices"][0]["message"]["content"], t["chat"]["content"]);
}

TEST_F(ServeTest, ErrorsAreOpenAiErrorObjects) {
  server::ServerOptions o;
  o.max_body_bytes = 4096;
  o.max_tokens_limit = 100;
  start(o);
  const std::string chat = "/v1/chat/completions", comp = "/v1/completions";
  expect_error(chat, "{not json", 400, "", "invalid_json");
  expect_error(chat, "", 400, "", "invalid_json");
  expect_error(chat, "[1,2]", 400, "", "invalid_type");
  expect_error(chat, "\"hello\"", 400, "", "invalid_type");
  expect_error(chat, "{\"messages\": \"\xff\xfe\"}", 400, "", "invalid_json");  // invalid UTF-8
  expect_error(chat, R"({"model":"m"})", 400, "messages", "missing_required_parameter");
  expect_error(chat, R"({"messages":[]})", 400, "messages", "invalid_value");
  expect_error(chat, R"({"messages":{}})", 400, "messages", "invalid_type");
  expect_error(chat, R"({"messages":[1]})", 400, "messages[0]", "invalid_type");
  expect_error(chat, R"({"messages":[{"content":"x"}]})", 400, "messages[0].role", "missing_required_parameter");
  expect_error(chat, R"({"messages":[{"role":"user"}]})", 400, "messages[0].content", "missing_required_parameter");
  expect_error(chat, R"({"messages":[{"role":"robot","content":"x"}]})", 400, "messages[0].role", "invalid_value");
  expect_error(chat, R"({"messages":[{"role":"user","content":7}]})", 400, "messages[0].content", "invalid_type");
  expect_error(chat, R"({"messages":[{"role":"user","content":[{"type":"image_url"}]}]})", 400,
               "messages[0].content[0].type", "invalid_value");
  expect_error(chat, R"({"messages":[{"role":"assistant","content":"x"}]})", 400, "messages", "invalid_value");
  const std::string ok_msgs = R"("messages":[{"role":"user","content":"hi"}])";
  expect_error(chat, "{" + ok_msgs + R"(,"max_tokens":-1})", 400, "max_tokens", "invalid_value");
  expect_error(chat, "{" + ok_msgs + R"(,"max_tokens":0})", 400, "max_tokens", "invalid_value");
  expect_error(chat, "{" + ok_msgs + R"(,"max_tokens":"10"})", 400, "max_tokens", "invalid_type");
  expect_error(chat, "{" + ok_msgs + R"(,"max_tokens":2.5})", 400, "max_tokens", "invalid_type");
  expect_error(chat, "{" + ok_msgs + R"(,"max_tokens":101})", 400, "max_tokens", "invalid_value");
  expect_error(chat, "{" + ok_msgs + R"(,"max_tokens":99999999999999999999})", 400, "max_tokens", "invalid_type");
  expect_error(chat, "{" + ok_msgs + R"(,"max_completion_tokens":-5})", 400, "max_completion_tokens", "invalid_value");
  expect_error(chat, "{" + ok_msgs + R"(,"temperature":-1})", 400, "temperature", "invalid_value");
  expect_error(chat, "{" + ok_msgs + R"(,"temperature":"hot"})", 400, "temperature", "invalid_type");
  expect_error(chat, "{" + ok_msgs + R"(,"top_p":1.5})", 400, "top_p", "invalid_value");
  expect_error(chat, "{" + ok_msgs + R"(,"n":2})", 400, "n", "unsupported_parameter");
  expect_error(chat, "{" + ok_msgs + R"(,"stream":"yes"})", 400, "stream", "invalid_type");
  expect_error(chat, "{" + ok_msgs + R"(,"stop":5})", 400, "stop", "invalid_type");
  expect_error(chat, "{" + ok_msgs + R"(,"stop":["a","b","c","d","e"]})", 400, "stop", "invalid_value");
  expect_error(chat, "{" + ok_msgs + R"(,"seed":1.5})", 400, "seed", "invalid_type");
  expect_error(chat, "{" + ok_msgs + R"(,"top_k":-1})", 400, "top_k", "invalid_value");
  expect_error(chat, "{" + ok_msgs + R"(,"repetition_penalty":0})", 400, "repetition_penalty", "invalid_value");
  expect_error(chat, "{" + ok_msgs + R"(,"presence_penalty":5})", 400, "presence_penalty", "invalid_value");
  expect_error(chat, "{" + ok_msgs + R"(,"logprobs":true})", 400, "logprobs", "unsupported_parameter");
  expect_error(chat, "{" + ok_msgs + R"(,"tools":[{"type":"function"}]})", 400, "tools", "unsupported_parameter");
  expect_error(chat, "{" + ok_msgs + R"(,"model":5})", 400, "model", "invalid_type");
  expect_error(comp, R"({"model":"m"})", 400, "prompt", "missing_required_parameter");
  expect_error(comp, R"({"prompt":5})", 400, "prompt", "invalid_type");
  expect_error(comp, R"({"prompt":["a","b"]})", 400, "prompt", "invalid_value");
  expect_error(comp, R"({"prompt":[1,2,3]})", 400, "prompt", "invalid_value");
  expect_error(comp, R"({"prompt":"x","echo":true})", 400, "echo", "unsupported_parameter");
  // Too long: a prompt beyond the model's 512 positions (under the body limit), and prompt +
  // max_tokens beyond them.
  std::string words;
  for (int i = 0; i < 450; i++) words += "cat ";  // 450 tokens
  expect_error(comp, json{{"prompt", words + words}}.dump(), 400, "prompt", "context_length_exceeded");
  expect_error(comp, json{{"prompt", words}, {"max_tokens", 100}}.dump(), 400, "max_tokens", "context_length_exceeded");
  // Too large: over --max-body-bytes (413, no param).
  expect_error(comp, json{{"prompt", std::string(5000, 'a')}}.dump(), 413, "");
  // Unknown routes and methods.
  httplib::Client cli("127.0.0.1", port_);
  auto nf = cli.Get("/v1/engines");
  ASSERT_TRUE(nf);
  EXPECT_EQ(nf->status, 404);
  EXPECT_TRUE(json::parse(nf->body).contains("error"));
  auto get = cli.Get("/v1/chat/completions");
  ASSERT_TRUE(get);
  EXPECT_EQ(get->status, 405);
  // And the server still answers.
  const json t = expected_text();
  auto ok = post(chat, chat_body(t, false));
  ASSERT_TRUE(ok);
  EXPECT_EQ(json::parse(ok->body)["choices"][0]["message"]["content"], t["chat"]["content"]);
}

// Every OpenAI parameter is honoured or refused with a 400 naming it (the review saw logit_bias,
// response_format json_object and tool_choice "required" answered 200 as if absent).  logit_bias is
// honoured as OpenAI's client sends it ({"<token id>": bias}): +100 on one id makes the greedy reply
// that id throughout, -100 on the greedy reply's first token changes that token.
TEST_F(ServeTest, EveryParameterIsHonouredOrRefused) {
  start();
  const std::string chat = "/v1/chat/completions", comp = "/v1/completions";
  const std::string msgs = R"("messages":[{"role":"user","content":"hi"}])";
  expect_error(chat, "{" + msgs + R"(,"frobnicate":1})", 400, "frobnicate", "unrecognized_parameter");
  expect_error(comp, R"({"prompt":"x","messages":[]})", 400, "messages", "unrecognized_parameter");
  expect_error(comp, R"({"prompt":"x","response_format":{"type":"text"}})", 400, "response_format",
               "unrecognized_parameter");
  expect_error(chat, "{" + msgs + R"(,"response_format":{"type":"json_object"}})", 400, "response_format",
               "unsupported_parameter");
  expect_error(chat, "{" + msgs + R"(,"response_format":{"type":"json_schema","json_schema":{"name":"x"}}})", 400,
               "response_format", "unsupported_parameter");
  expect_error(chat, "{" + msgs + R"(,"tool_choice":"required"})", 400, "tool_choice", "unsupported_parameter");
  expect_error(chat, "{" + msgs + R"(,"tool_choice":{"type":"function","function":{"name":"f"}}})", 400,
               "tool_choice", "unsupported_parameter");
  expect_error(chat, "{" + msgs + R"(,"store":true})", 400, "store", "unsupported_parameter");
  expect_error(chat, "{" + msgs + R"(,"metadata":{"k":"v"}})", 400, "metadata", "unsupported_parameter");
  expect_error(chat, "{" + msgs + R"(,"service_tier":"flex"})", 400, "service_tier", "unsupported_parameter");
  expect_error(chat, "{" + msgs + R"(,"modalities":["text","audio"]})", 400, "modalities", "unsupported_parameter");
  expect_error(chat, "{" + msgs + R"(,"parallel_tool_calls":"no"})", 400, "parallel_tool_calls", "invalid_type");
  expect_error(chat, "{" + msgs + R"(,"logit_bias":[1]})", 400, "logit_bias", "invalid_type");
  expect_error(chat, "{" + msgs + R"(,"logit_bias":{"abc":1}})", 400, "logit_bias", "invalid_value");
  expect_error(chat, "{" + msgs + R"(,"logit_bias":{"-3":1}})", 400, "logit_bias", "invalid_value");
  expect_error(chat, "{" + msgs + R"(,"logit_bias":{"5":101}})", 400, "logit_bias", "invalid_value");
  expect_error(chat, "{" + msgs + R"(,"logit_bias":{"5":"up"}})", 400, "logit_bias", "invalid_type");
  expect_error(chat, "{" + msgs + R"(,"logit_bias":{"999999":1}})", 400, "logit_bias", "invalid_value");

  // Harmless values of the parameters that change nothing here are accepted, with the plain reply.
  const json t = expected_text();
  json body = chat_body(t, false);
  body["response_format"] = {{"type", "text"}};
  body["tool_choice"] = "none";
  body["parallel_tool_calls"] = false;
  body["store"] = false;
  body["service_tier"] = "auto";
  body["modalities"] = {"text"};
  auto ok = post(chat, body);
  ASSERT_TRUE(ok);
  ASSERT_EQ(ok->status, 200) << ok->body;
  EXPECT_EQ(json::parse(ok->body)["choices"][0]["message"]["content"], t["chat"]["content"]);

  // logit_bias, honoured.
  auto complete = [&](const json& bias) {
    json b = {{"prompt", t["completion"]["prompt"]}, {"max_tokens", 6}, {"temperature", 0}};
    if (!bias.is_null()) b["logit_bias"] = bias;
    auto r = post(comp, b);
    EXPECT_TRUE(r && r->status == 200) << (r ? r->body : httplib::to_string(r.error()));
    return r ? json::parse(r->body) : json();
  };
  const int32_t forced = 100;
  const json all = complete({{std::to_string(forced), 100}});
  EXPECT_EQ(all["usage"]["completion_tokens"], 6);
  const std::vector<int32_t> six(6, forced);
  EXPECT_EQ(all["choices"][0]["text"], tok_->decode(six));
  const json plain = complete(nullptr);
  const std::vector<int32_t> first = tok_->encode_literal(plain["choices"][0]["text"].get<std::string>());
  ASSERT_FALSE(first.empty());
  const json banned = complete({{std::to_string(first[0]), -100}});
  EXPECT_NE(banned["choices"][0]["text"], plain["choices"][0]["text"]);
}

// Concurrent clients: with room in the queue every request is served, each with the right reply.
TEST_F(ServeTest, ConcurrentRequestsAreQueued) {
  server::ServerOptions o;
  o.queue_size = 8;
  start(o);
  const json t = expected_text();
  std::vector<std::thread> th;
  std::atomic<int> ok{0};
  for (int i = 0; i < 8; i++)
    th.emplace_back([&, i] {
      auto r = post(i % 2 ? "/v1/completions" : "/v1/chat/completions", i % 2 ? completion_body(t, i % 4 == 1)
                                                                                : chat_body(t, i % 4 == 2));
      if (!r || r->status != 200) return;
      std::string text;
      if (r->get_header_value("Content-Type") == "text/event-stream") {
        for (const json& e : sse_events(r->body))
          if (e.is_object() && !e["choices"].empty())
            text += i % 2 ? e["choices"][0]["text"].get<std::string>()
                          : e["choices"][0]["delta"].value("content", std::string());
      } else {
        const json j = json::parse(r->body);
        text = i % 2 ? j["choices"][0]["text"] : j["choices"][0]["message"]["content"];
      }
      if (text == (i % 2 ? t["completion"]["text"] : t["chat"]["content"])) ok++;
    });
  for (auto& x : th) x.join();
  EXPECT_EQ(ok.load(), 8);
}

// The engine's queue is bounded: with room for one waiting job, a burst of long jobs is mostly
// refused, and every accepted job completes.
// A denormal temperature is greedy, as on the command line: the sampler would divide the logits by
// it and overflow them all to infinity (garbage instead of the greedy reply).
TEST(OpenAiApi, TinyTemperaturesAreGreedy) {
  using server::Endpoint;
  using server::parse_request;
  const std::string msgs = R"("messages":[{"role":"user","content":"hi"}])";
  for (const char* t : {"0", "1e-45", "1e-30", "9e-6"}) {
    SCOPED_TRACE(t);
    const auto r = parse_request(Endpoint::chat, "{" + msgs + ",\"temperature\":" + t + "}");
    EXPECT_TRUE(r.sampling.greedy());
    EXPECT_EQ(r.sampling.temperature, 0.0f);
  }
  const auto r = parse_request(Endpoint::chat, "{" + msgs + R"(,"temperature":1e-5})");
  EXPECT_FALSE(r.sampling.greedy());
}

TEST(Engine, BoundedQueueRefusesWhenFull) {
  const auto model = load_inference_model(kModel.string());
  const auto tok = load_model_tokenizer(kModel.string(), "", model->cfg, true);
  ModelRunner dec(*model);
  server::Engine engine(dec, *tok, 1);
  GenerateOptions o;
  o.max_new_tokens = 400;
  std::vector<std::shared_ptr<server::Job>> accepted;
  accepted.push_back(std::make_shared<server::Job>(std::vector<int32_t>{1, 5, 6, 7}, o, false));
  ASSERT_TRUE(engine.submit(accepted[0]));
  while (engine.waiting() > 0) std::this_thread::yield();  // the worker has taken it
  int refused = 0;
  for (int i = 0; i < 20; i++) {
    auto job = std::make_shared<server::Job>(std::vector<int32_t>{1, 5, 6, 7}, o, false);
    if (engine.submit(job))
      accepted.push_back(job);
    else
      refused++;
  }
  EXPECT_GE(refused, 15);
  EXPECT_GE(accepted.size(), 2u);
  for (auto& j : accepted) {
    j->wait_done();
    EXPECT_TRUE(j->error().empty());
    EXPECT_EQ(j->result().tokens.size(), 400u);
  }
  // A cancelled job stops early.
  auto job = std::make_shared<server::Job>(std::vector<int32_t>{1, 5, 6, 7}, o, true);
  job->cancel();
  ASSERT_TRUE(engine.submit(job));
  job->wait_done();
  EXPECT_EQ(job->result().finish, FinishReason::cancelled);
  EXPECT_LT(job->result().tokens.size(), 400u);
}

// Continuous batching: jobs of different lengths, prompts and sampling settings (greedy, temperature
// with seeds, a repetition penalty), running 4 at a time with more joining as others finish (their
// prompts prefilled in the pass that steps the running ones), each get exactly the tokens and text they
// get alone; a job cancelled mid-batch stops without disturbing the others.
TEST(Engine, BatchedJobsGetWhatEachGetsAlone) {
  const auto model = load_inference_model(kModel.string());
  const auto tok = load_model_tokenizer(kModel.string(), "", model->cfg, true);
  const int V = model->cfg.vocab_size;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<GenerateOptions> opts;
  for (int i = 0; i < 9; i++) {
    std::vector<int32_t> p = {1};
    for (int t = 0; t < 3 + 2 * i; t++) p.push_back((int32_t)(3 + (i * 131 + t * 17) % (V - 3)));
    prompts.push_back(p);
    GenerateOptions o;
    o.max_new_tokens = 6 + 5 * (i % 4);
    o.eos_ids = {2};
    if (i % 3 == 1) {
      o.sampling.temperature = 0.8f;
      o.sampling.seed = 1000 + i;
    }
    if (i == 5) o.sampling.repetition_penalty = 1.3f;
    opts.push_back(o);
  }
  std::vector<GenerateResult> alone;  // each job on an engine of its own
  for (int i = 0; i < 9; i++) {
    ModelRunner solo_dec(*model);
    server::Engine solo(solo_dec, *tok, 1, 1);
    auto job = std::make_shared<server::Job>(prompts[i], opts[i], false);
    ASSERT_TRUE(solo.submit(job));
    job->wait_done();
    ASSERT_TRUE(job->error().empty()) << job->error();
    alone.push_back(job->result());
    // ... which is what generate() gives (the same model; prefill arithmetic aside).
    ModelRunner d(*model);
    KvCache c = d.new_cache();
    EXPECT_EQ(generate(d, c, prompts[i], opts[i], tok.get()).tokens, alone[i].tokens) << i;
  }
  ModelRunner dec(*model);
  server::Engine engine(dec, *tok, 16, /*max_batch=*/4);
  std::vector<std::shared_ptr<server::Job>> jobs;
  for (int i = 0; i < 9; i++) {
    jobs.push_back(std::make_shared<server::Job>(prompts[i], opts[i], /*stream=*/i % 2 == 0));
    ASSERT_TRUE(engine.submit(jobs.back()));
  }
  // One more, long, cancelled once it has streamed something.
  GenerateOptions long_opts;
  long_opts.max_new_tokens = 400;
  auto cancelled = std::make_shared<server::Job>(std::vector<int32_t>{1, 9, 8, 7}, long_opts, true);
  ASSERT_TRUE(engine.submit(cancelled));
  std::vector<std::string> pieces;
  while (pieces.empty() && !cancelled->wait(pieces, 1000)) {
  }
  cancelled->cancel();
  cancelled->wait_done();
  EXPECT_EQ(cancelled->result().finish, FinishReason::cancelled);
  EXPECT_LT(cancelled->result().tokens.size(), 400u);
  for (int i = 0; i < 9; i++) {
    SCOPED_TRACE(i);
    jobs[i]->wait_done();
    ASSERT_TRUE(jobs[i]->error().empty()) << jobs[i]->error();
    EXPECT_EQ(jobs[i]->result().tokens, alone[i].tokens);
    EXPECT_EQ(jobs[i]->result().text, alone[i].text);
    EXPECT_EQ(jobs[i]->result().finish, alone[i].finish);
  }
  EXPECT_EQ(engine.peak_batch(), 4) << "the jobs were not decoded together";
  EXPECT_GT(engine.shared_passes(), 0) << "no job joined in the running requests' pass";
}

// A Qwen-style model directory (tests/golden/generate/qwen3_moe: a tiny Qwen3-MoE with a byte-level
// tokenizer.json and a ChatML chat template in tokenizer_config.json) answers a ChatML chat as
// transformers' apply_chat_template + generate does, plain and streamed: the template is chosen from
// the directory, <|im_end|> (its EOS) ends replies.
TEST(ServeChatml, QwenStyleModelAnswersAChatmlChat) {
  signal(SIGPIPE, SIG_IGN);
  const fs::path dir = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden" / "generate" / "qwen3_moe";
  std::ifstream in(fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden" / "generate" / "expected.json");
  const json cases = json::parse(in)["cases"];
  ASSERT_EQ(cases[2]["model"], "qwen3_moe");
  const json t = cases[2]["text"];
  ASSERT_EQ(t["template"], "chatml");
  const auto model = load_inference_model(dir.string());
  const auto tok = load_model_tokenizer(dir.string(), "", model->cfg, true);
  ASSERT_TRUE(tok->byte_level());
  // The directory's own template (a ChatML Jinja template), rendered as transformers does; the
  // built-in chatml format gives the same tokens.
  const TemplateChoice tc = choose_chat_template(dir.string(), "auto", tok->byte_level());
  ASSERT_TRUE(tc.jinja) << tc.source;
  std::vector<int32_t> eos = model_eos_ids(dir.string(), model->cfg, tok.get());
  add_chat_stop_ids(eos, tc, *tok, model->cfg);
  EXPECT_NE(std::find(eos.begin(), eos.end(), tok->piece_to_id("<|im_end|>")), eos.end());
  // The prompt tokens are transformers' apply_chat_template(add_generation_prompt=True).
  const std::vector<ChatMessage> chat = {{Role::user, t["chat"]["user"].get<std::string>()}};
  EXPECT_EQ(chat_prompt_tokens(tc, *tok, chat), t["chat"]["prompt_ids"].get<std::vector<int32_t>>());
  EXPECT_EQ(chat_prompt_tokens(ChatTemplate::chatml, *tok, chat), t["chat"]["prompt_ids"].get<std::vector<int32_t>>());

  server::ServerOptions o;
  o.port = 0;
  o.model_name = "tiny-qwen3-moe";
  ModelRunner dec(*model);
  server::Server srv(dec, *tok, tc, eos, o);
  const int port = srv.bind();
  std::thread th([&] { srv.run(); });
  for (bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streaming" : "plain");
    const json body = {{"model", "tiny-qwen3-moe"},
                       {"messages", {{{"role", "user"}, {"content", t["chat"]["user"]}}}},
                       {"max_tokens", t["max_tokens"]},
                       {"temperature", 0},
                       {"stream", stream}};
    httplib::Client cli("127.0.0.1", port);
    cli.set_read_timeout(10, 0);
    auto r = cli.Post("/v1/chat/completions", body.dump(), "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    std::string content, finish;
    if (!stream) {
      const json j = json::parse(r->body);
      content = j["choices"][0]["message"]["content"];
      finish = j["choices"][0]["finish_reason"];
      EXPECT_EQ(j["usage"]["prompt_tokens"], t["chat"]["prompt_ids"].size());
      EXPECT_EQ(j["usage"]["completion_tokens"], t["chat"]["completion_ids"].size());
    } else {
      for (const json& ev : sse_events(r->body)) {
        if (ev == "[DONE]" || ev["choices"].empty()) continue;
        const json& c = ev["choices"][0];
        if (c["delta"].contains("content")) content += c["delta"]["content"].get<std::string>();
        if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
      }
    }
    EXPECT_EQ(content, t["chat"]["content"].get<std::string>());
    EXPECT_EQ(finish, t["chat"]["finish_reason"].get<std::string>());
  }
  // "" (or [""]) has no tokens with this tokenizer, which adds no BOS: a 400 naming 'prompt' (it was a
  // 500 "server_error"; streamed, a 200 and then an error event).
  for (const json& prompt : {json(""), json::array({""})})
    for (bool stream : {false, true}) {
      SCOPED_TRACE(prompt.dump() + (stream ? " streaming" : ""));
      httplib::Client cli("127.0.0.1", port);
      auto r = cli.Post("/v1/completions", json{{"prompt", prompt}, {"stream", stream}}.dump(), "application/json");
      ASSERT_TRUE(r);
      EXPECT_EQ(r->status, 400) << r->body;
      const json e = json::parse(r->body)["error"];
      EXPECT_EQ(e["param"], "prompt") << e.dump();
      EXPECT_EQ(e["type"], "invalid_request_error") << e.dump();
    }
  srv.stop();
  th.join();
}

// A Qwen3-style and a GPT-OSS-style model directory (the tiny Qwen3-MoE with Qwen3's and gpt-oss's
// real chat templates in tokenizer_config.json): the server renders every committed conversation
// -- tools, assistant tool calls (arguments as objects and as JSON strings, content null), tool
// results, reasoning, content parts, chat_template_kwargs -- with the model's template, its prompt
// is transformers' apply_chat_template(add_generation_prompt=True) token for token
// (tests/data/chat_templates/ids/prompts.jsonl, tools/chat_template_ids_refs.py), and a
// conversation the template refuses is a 400 naming 'messages'.
TEST(ServeModelTemplate, QwenAndGptOssStyleDirectoriesRenderToolsAsTransformers) {
  signal(SIGPIPE, SIG_IGN);
  const fs::path shared = fs::path(MOETRON_SOURCE_DIR) / ".." / "shared" / "data" / "templates";
  if (!fs::exists(shared)) GTEST_SKIP() << "../shared/data/templates is absent";
  const fs::path golden = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden" / "generate" / "qwen3_moe";
  const fs::path data = fs::path(MOETRON_SOURCE_DIR) / "tests" / "data" / "chat_templates";
  std::vector<nlohmann::ordered_json> convs, prompts;
  {
    std::ifstream in(data / "conversations.jsonl");
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) convs.push_back(nlohmann::ordered_json::parse(line));
    std::ifstream p(data / "ids" / "prompts.jsonl");
    for (std::string line; std::getline(p, line);)
      if (!line.empty()) prompts.push_back(nlohmann::ordered_json::parse(line));
  }
  const std::map<std::string, std::pair<std::string, json>> cases = {
      {"qwen3", {"Qwen-Qwen3-0.6B.jinja", {{"eos_token", "<|im_end|>"}, {"pad_token", "<|endoftext|>"}}}},
      {"gptoss", {"openai-gpt-oss-120b.jinja", {{"eos_token", "<|endoftext|>"}, {"pad_token", "<|endoftext|>"}}}},
  };
  for (const auto& [name, c] : cases) {
    SCOPED_TRACE(name);
    const fs::path dir = fs::temp_directory_path() / ("moetron_serve_template_" + name + "_" + std::to_string(getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    for (const char* f : {"generation_config.json", "model.safetensors", "tokenizer.json"}) fs::copy_file(golden / f, dir / f);
    {  // 4096 positions instead of 512, so the tool conversations (long system prompts) fit
      std::ifstream in(golden / "config.json");
      json mc = json::parse(in);
      mc["max_position_embeddings"] = 4096;
      std::ofstream(dir / "config.json") << mc.dump();
    }
    {
      std::ifstream t(shared / c.first);
      std::stringstream ss;
      ss << t.rdbuf();
      json cfg = c.second;
      cfg["chat_template"] = ss.str();
      std::ofstream(dir / "tokenizer_config.json") << cfg.dump();
    }
    const auto model = load_inference_model(dir.string());
    const auto tok = load_model_tokenizer(dir.string(), "", model->cfg, true);
    TemplateChoice tc = choose_chat_template(dir.string(), "auto", tok->byte_level());
    ASSERT_TRUE(tc.jinja) << tc.source;
    // The date the references froze (tools/chat_template_ids_refs.py): GPT-OSS's template prints it.
    std::tm day{};
    day.tm_year = 2026 - 1900;
    day.tm_mon = 11;
    day.tm_mday = 7;
    day.tm_hour = 12;
    std::mktime(&day);  // fills the weekday and day of the year
    tc.now = day;
    std::vector<int32_t> eos = model_eos_ids(dir.string(), model->cfg, tok.get());
    add_chat_stop_ids(eos, tc, *tok, model->cfg);
    server::ServerOptions o;
    o.port = 0;
    o.model_name = "tiny";
    ModelRunner dec(*model);
    server::Server srv(dec, *tok, tc, eos, o);
    const int port = srv.bind();
    std::thread th([&] { srv.run(); });
    size_t checked = 0, refused = 0;
    for (const auto& want : prompts) {
      if (want["case"] != name) continue;
      const auto conv = std::find_if(convs.begin(), convs.end(), [&](const auto& x) { return x["name"] == want["conversation"]; });
      ASSERT_NE(conv, convs.end());
      SCOPED_TRACE(want["conversation"].get<std::string>());
      nlohmann::ordered_json msgs = (*conv)["messages"];
      if (!msgs.empty() && msgs.back()["role"] == "assistant") msgs.erase(msgs.size() - 1);
      nlohmann::ordered_json body = {{"model", "tiny"}, {"messages", msgs}, {"max_tokens", 2}, {"temperature", 0}};
      if (conv->contains("tools")) body["tools"] = (*conv)["tools"];
      if (conv->contains("chat_template_kwargs")) body["chat_template_kwargs"] = (*conv)["chat_template_kwargs"];
      // The library path the server takes gives HF's ids.
      ChatRequest req;
      req.messages = msgs;
      if (conv->contains("tools")) req.tools = (*conv)["tools"];
      if (conv->contains("chat_template_kwargs")) req.kwargs = (*conv)["chat_template_kwargs"];
      httplib::Client cli("127.0.0.1", port);
      cli.set_read_timeout(20, 0);
      auto r = cli.Post("/v1/chat/completions", body.dump(), "application/json");
      ASSERT_TRUE(r);
      if (want.contains("error")) {
        EXPECT_THROW(chat_prompt_tokens(tc, *tok, req), jinja::TemplateError);
        EXPECT_EQ(r->status, 400) << r->body;
        EXPECT_EQ(json::parse(r->body)["error"]["param"], "messages") << r->body;
        ++refused;
        continue;
      }
      EXPECT_EQ(nlohmann::ordered_json(chat_prompt_tokens(tc, *tok, req)), want["ids"]);
      ASSERT_EQ(r->status, 200) << r->body;
      EXPECT_EQ(json::parse(r->body)["usage"]["prompt_tokens"], want["ids"].size());
      ++checked;
    }
    EXPECT_GE(checked, 12u);
    srv.stop();
    th.join();
    fs::remove_all(dir);
  }
}
