#include "engine_binding.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/optional.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>

#include "engine/engine.h"
#include "model_binding.h"
#include "moelink/errors.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace moelink::python {
namespace {

// An Engine with the KV-cache manager it owns; the Model (a Python object)
// is kept alive by the wrapper in moelink/_engine.py.
class PyEngine {
 public:
  PyEngine(nb::handle model, int64_t num_pages, int page_size, int64_t token_budget,
           int max_running, int max_pages_per_request, bool speculative, bool prefix_caching)
      : kv_(num_pages, page_size, prefix_caching) {
    engine::EngineOptions o;
    o.speculative = speculative;
    o.token_budget = token_budget;
    o.max_running = max_running;
    o.max_pages_per_request = max_pages_per_request;
    try {
      engine_ = std::make_unique<engine::Engine>(unwrap_model(model), kv_, o);
    } catch (const std::invalid_argument& e) {
      throw InvalidArgument(e.what());
    }
  }

  static engine::GenerateParams params(const std::vector<uint32_t>& prompt, int max_tokens, float temperature,
                                       int top_k, float top_p, int64_t seed,
                                       const std::vector<uint32_t>& stop_tokens, bool hand_off) {
    engine::GenerateParams p;
    p.prompt = prompt;
    p.max_tokens = max_tokens;
    p.temperature = temperature;
    p.top_k = top_k;
    p.top_p = top_p;
    p.seed = seed;
    p.stop_tokens = stop_tokens;
    p.hand_off = hand_off;
    return p;
  }

  uint64_t add(const std::vector<uint32_t>& prompt, int max_tokens, float temperature, int top_k,
               float top_p, int64_t seed, const std::vector<uint32_t>& stop_tokens, bool hand_off) {
    try {
      return engine_->add(params(prompt, max_tokens, temperature, top_k, top_p, seed, stop_tokens, hand_off));
    } catch (const std::invalid_argument& e) {
      throw InvalidArgument(e.what());
    }
  }

  // (id, cached prompt tokens, pages) or None when the pages do not suffice now.
  nb::object receive(const std::vector<uint32_t>& prompt, int max_tokens, float temperature, int top_k,
                     float top_p, int64_t seed, const std::vector<uint32_t>& stop_tokens) {
    std::optional<engine::Engine::Received> r;
    try {
      r = engine_->receive(params(prompt, max_tokens, temperature, top_k, top_p, seed, stop_tokens, false));
    } catch (const std::invalid_argument& e) {
      throw InvalidArgument(e.what());
    }
    if (!r) return nb::none();
    return nb::make_tuple(r->id, r->cached_tokens, r->pages);
  }

  void resume(uint64_t id, uint32_t first_token) {
    try {
      engine_->resume(id, first_token);
    } catch (const std::invalid_argument& e) {
      throw InvalidArgument(e.what());
    }
  }

  // [(id, new tokens, finish reason or "", cached tokens, error)]
  std::vector<std::tuple<uint64_t, std::vector<uint32_t>, std::string, int64_t, std::string>> step() {
    std::vector<engine::StepResult> r;
    using Clock = std::chrono::steady_clock;
    const Clock::time_point start = Clock::now();
    Clock::time_point done;
    {
      nb::gil_scoped_release release;
      r = engine_->step();
      done = Clock::now();
    }
    // The step without the GIL, then the wait to take it back (other
    // Python threads hold it meanwhile: a server's handler threads).
    step_seconds_ += std::chrono::duration<double>(done - start).count();
    gil_wait_seconds_ += std::chrono::duration<double>(Clock::now() - done).count();
    std::vector<std::tuple<uint64_t, std::vector<uint32_t>, std::string, int64_t, std::string>> out;
    for (const engine::StepResult& s : r)
      out.emplace_back(s.id, s.tokens, engine::finish_reason_name(s.finished), s.cached_tokens, s.error);
    return out;
  }

  // (cleared_all, [(kind "stored" / "removed", hashes, parent or None)]):
  // what the prefix cache changed since the last call, for the scheduler.
  nb::tuple take_kv_events() {
    bool cleared = false;
    const std::vector<engine::KvEvent> events = kv_.take_events(&cleared);
    nb::list out;
    for (const engine::KvEvent& e : events)
      out.append(nb::make_tuple(e.kind == engine::KvEvent::kStored ? "stored" : "removed", e.hashes,
                                e.parent ? nb::cast(*e.parent) : nb::none()));
    return nb::make_tuple(cleared, out);
  }

  engine::Engine& engine() { return *engine_; }
  double step_seconds() const { return step_seconds_; }
  double gil_wait_seconds() const { return gil_wait_seconds_; }
  engine::KvCacheManager& kv() { return kv_; }

 private:
  engine::KvCacheManager kv_;
  std::unique_ptr<engine::Engine> engine_;
  double step_seconds_ = 0.0, gil_wait_seconds_ = 0.0;  // step(): its C++ part, the GIL wait after it
};

}  // namespace

void bind_engine(nb::module_& m) {
  nb::class_<PyEngine>(m, "Engine", "The serving engine's step loop (moelink.Engine wraps this).")
      .def(nb::init<nb::handle, int64_t, int, int64_t, int, int, bool, bool>(), "model"_a, "num_pages"_a,
           "page_size"_a, "token_budget"_a, "max_running"_a, "max_pages_per_request"_a, "speculative"_a,
           "prefix_caching"_a = true)
      .def("add", &PyEngine::add, "prompt"_a, "max_tokens"_a, "temperature"_a, "top_k"_a,
           "top_p"_a, "seed"_a, "stop_tokens"_a, "hand_off"_a)
      .def("receive", &PyEngine::receive, "prompt"_a, "max_tokens"_a, "temperature"_a, "top_k"_a,
           "top_p"_a, "seed"_a, "stop_tokens"_a)
      .def("resume", &PyEngine::resume, "id"_a, "first_token"_a)
      .def("release", [](PyEngine& e, uint64_t id) { e.engine().release(id); }, "id"_a)
      .def("pages", [](PyEngine& e, uint64_t id) { return e.kv().pages(id); }, "id"_a)
      .def("cancel", [](PyEngine& e, uint64_t id) { e.engine().cancel(id); }, "id"_a)
      .def("step", &PyEngine::step)
      .def("take_kv_events", &PyEngine::take_kv_events)
      .def_prop_ro("idle", [](PyEngine& e) { return e.engine().idle(); })
      .def_prop_ro("failure", [](PyEngine& e) { return e.engine().failure(); })
      .def_prop_ro("waiting", [](PyEngine& e) { return e.engine().waiting(); })
      .def_prop_ro("running", [](PyEngine& e) { return e.engine().running(); })
      .def_prop_ro("preemptions", [](PyEngine& e) { return e.engine().preemptions(); })
      .def_prop_ro("drafts_proposed", [](PyEngine& e) { return e.engine().drafts_proposed(); })
      .def_prop_ro("drafts_accepted", [](PyEngine& e) { return e.engine().drafts_accepted(); })
      .def_prop_ro("available_pages", [](PyEngine& e) { return e.kv().available_pages(); })
      .def_prop_ro("cached_pages", [](PyEngine& e) { return e.kv().cached_pages(); })
      .def_prop_ro("step_times", [](PyEngine& e) {
        const engine::Engine::StepTimes& t = e.engine().step_times();
        nb::dict d;
        d["steps"] = t.steps;
        d["seconds"] = t.seconds;
        d["decode_steps"] = t.decode_steps;
        d["decode_seconds"] = t.decode_seconds;
        d["decode_requests"] = t.decode_requests;
        d["step_seconds"] = e.step_seconds();
        d["gil_wait_seconds"] = e.gil_wait_seconds();
        return d;
      });
}

}  // namespace moelink::python
