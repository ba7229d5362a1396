#include "http_front.h"

#include <httplib.h>

#include <atomic>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <thread>

#include "codepoint_text.h"

namespace moelink::scheduler::sim {

using nlohmann::json;

struct HttpFront::Impl {
  SimEngine& engine;
  HttpOptions o;
  httplib::Server server;
  std::thread thread;
  std::atomic<uint64_t> next_id{0};

  Impl(SimEngine& e, const HttpOptions& opts) : engine(e), o(opts) {}

  static void reply_json(httplib::Response& res, const json& j, int status = 200) {
    res.status = status;
    res.set_content(j.dump(), "application/json");
  }

  static json meta(const std::string& id, size_t prompt, const LocalStream& s, bool done) {
    json m = {{"id", id},
              {"prompt_tokens", prompt},
              {"completion_tokens", s.output.size()},
              {"cached_tokens", s.cached_tokens}};
    m["finish_reason"] = done ? json{{"type", "length"}, {"length", s.output.size()}} : json(nullptr);
    if (done) m["e2e_latency"] = s.e2e_us / 1e6;
    return m;
  }

  void generate(const httplib::Request& req, httplib::Response& res) {
    json body;
    std::vector<uint32_t> prompt;
    uint32_t max_new = 128;
    bool stream = false;
    try {
      body = json::parse(req.body);
      if (body.contains("input_ids") && !body["input_ids"].is_null()) {
        prompt = body["input_ids"].get<std::vector<uint32_t>>();
      } else if (body.contains("text") && body["text"].is_string()) {
        prompt = text_to_tokens(body["text"].get<std::string>());
      } else {
        throw std::invalid_argument("the body needs 'text' (a string) or 'input_ids'");
      }
      if (prompt.empty()) throw std::invalid_argument("the prompt is empty");
      if (body.contains("sampling_params") && body["sampling_params"].contains("max_new_tokens"))
        max_new = body["sampling_params"]["max_new_tokens"].get<uint32_t>();
      if (max_new == 0) throw std::invalid_argument("sampling_params.max_new_tokens must be >= 1");
      stream = body.value("stream", false);
    } catch (const std::exception& e) {
      reply_json(res, {{"error", {{"message", e.what()}}}}, 400);
      return;
    }
    std::string id = body.contains("rid") && body["rid"].is_string()
                         ? body["rid"].get<std::string>()
                         : "http-" + std::to_string(next_id++);
    const size_t prompt_size = prompt.size();
    auto s = std::make_shared<LocalStream>();
    engine.submit_local(id, std::move(prompt), max_new, s);
    if (!stream) {
      std::unique_lock<std::mutex> lock(s->mu);
      s->cv.wait(lock, [&] { return s->done; });
      reply_json(res, {{"text", tokens_to_text(s->output)},
                       {"output_ids", s->output},
                       {"meta_info", meta(id, prompt_size, *s, true)}});
      return;
    }
    // Server-sent events: a chunk with the first token at once, then every
    // stream_interval tokens, then the rest with the finish reason, then [DONE].
    auto sent = std::make_shared<size_t>(0);
    auto finished = std::make_shared<bool>(false);
    const uint32_t interval = std::max<uint32_t>(1, o.stream_interval);
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream", [s, sent, finished, interval, id, prompt_size](size_t, httplib::DataSink& sink) {
          if (*finished) {
            const std::string end = "data: [DONE]\n\n";
            sink.write(end.data(), end.size());
            sink.done();
            return true;
          }
          json chunk;
          {
            std::unique_lock<std::mutex> lock(s->mu);
            s->cv.wait(lock, [&] {
              return s->done || (*sent == 0 && !s->output.empty()) ||
                     s->output.size() >= *sent + interval;
            });
            std::vector<uint32_t> fresh(s->output.begin() + static_cast<std::ptrdiff_t>(*sent), s->output.end());
            chunk = {{"text", tokens_to_text(fresh)},
                     {"output_ids", fresh},
                     {"meta_info", meta(id, prompt_size, *s, s->done)}};
            *sent = s->output.size();
            *finished = s->done;
          }
          const std::string line = "data: " + chunk.dump() + "\n\n";
          return sink.write(line.data(), line.size());
        });
  }

  void routes() {
    const json info = {{"model_path", "moelink-engine-sim"},
                       {"tokenizer_path", nullptr},
                       {"is_generation", true},
                       {"served_model_name", "moelink-engine-sim"}};
    auto ok = [](const httplib::Request&, httplib::Response& res) { res.status = 200; };
    server.Get("/health", ok);
    server.Get("/health_generate", ok);
    for (const char* path : {"/server_info", "/get_server_info", "/model_info", "/get_model_info"})
      server.Get(path, [info](const httplib::Request&, httplib::Response& res) { reply_json(res, info); });
    server.Get("/v1/models", [](const httplib::Request&, httplib::Response& res) {
      reply_json(res, {{"object", "list"},
                       {"data", json::array({{{"id", "moelink-engine-sim"}, {"object", "model"}}})}});
    });
    server.Post("/generate",
                [this](const httplib::Request& req, httplib::Response& res) { generate(req, res); });
  }
};

HttpFront::HttpFront(SimEngine& engine, const HttpOptions& o) : impl_(std::make_unique<Impl>(engine, o)) {}

HttpFront::~HttpFront() { stop(); }

void HttpFront::start() {
  Impl& m = *impl_;
  m.routes();
  const int threads = m.o.threads;
  m.server.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  m.server.set_keep_alive_max_count(1000000);
  m.server.set_keep_alive_timeout(2);  // stop() waits for idle keep-alive connections
  if (!m.server.bind_to_port(m.o.host.c_str(), m.o.port))
    throw std::runtime_error("cannot listen on http://" + m.o.host + ":" + std::to_string(m.o.port));
  m.thread = std::thread([&m] { m.server.listen_after_bind(); });
}

void HttpFront::stop() {
  if (!impl_->thread.joinable()) return;
  impl_->server.stop();
  impl_->thread.join();
}

}  // namespace moelink::scheduler::sim
