// torch.profiler's device rows for tpu: a Kineto activity profiler (PyTorch's PrivateUse1 profiler
// registry) whose sessions report what torch_tpu/profiler.py records while a trace runs: each
// executed program and each host<->device copy, with the time from its launch until its results
// were ready. Python decides what to record; this file only carries records into Kineto's trace.
#include <torch/extension.h>

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

// setup.py defines TORCH_TPU_KINETO when the installed torch was built with Kineto.
#if defined(TORCH_TPU_KINETO) && !defined(USE_KINETO)
#define USE_KINETO
#endif
#ifdef USE_KINETO
#include <libkineto.h>
#include <output_base.h>
#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>
#endif

namespace {

struct Record {
  std::string name;
  int64_t start_ns, end_ns;
  int device, kind;  // kind: 0 program, 1 copy, 2 compile or compile-cache hit
  uint64_t correlation;  // the host op running when it was recorded (0: none)
};

// Kineto pushes the correlation id of each profiled host op on the thread that runs it; a record
// made inside that op (on the same thread) links to it: device time per op in key_averages, and
// flow arrows in the trace.
thread_local std::vector<uint64_t> t_correlation;

std::mutex g_mutex;
std::vector<Record> g_records;
py::object* g_on_session = nullptr;  // Python: called with True when a session starts, False when it stops

void notify(bool active) {
  if (g_on_session == nullptr || !Py_IsInitialized()) return;
  py::gil_scoped_acquire gil;
  try {
    (*g_on_session)(active);
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable("torch_tpu profiler session callback");
  }
}

#ifdef USE_KINETO
class TpuSession final : public libkineto::IActivityProfilerSession {
 public:
  void start() override {
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      g_records.clear();
    }
    notify(true);
    status_ = libkineto::TraceStatus::RECORDING;
  }
  void stop() override {
    notify(false);
    status_ = libkineto::TraceStatus::PROCESSING;
  }
  std::vector<std::string> errors() override { return {}; }
  void pushCorrelationId(uint64_t id) override { t_correlation.push_back(id); }
  void popCorrelationId() override {
    if (!t_correlation.empty()) t_correlation.pop_back();
  }
  void processTrace(libkineto::ActivityLogger& logger, libkineto::getLinkedActivityCallback linked, int64_t,
                    int64_t) override {
    linked_ = std::move(linked);
    processTrace(logger);
  }
  void processTrace(libkineto::ActivityLogger& logger) override {
    std::vector<Record> records;
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      records.swap(g_records);
    }
    buffer_ = std::make_unique<libkineto::CpuTraceBuffer>();
    int64_t first = records.empty() ? 0 : records.front().start_ns, last = first;
    for (const Record& r : records) {
      first = std::min(first, r.start_ns);
      last = std::max(last, r.end_ns);
    }
    buffer_->span = libkineto::TraceSpan(first, last, "tpu");
    int32_t id = 0;
    for (const Record& r : records) {
      auto type = r.kind == 1   ? libkineto::ActivityType::GPU_MEMCPY
                  : r.kind == 2 ? libkineto::ActivityType::PRIVATEUSE1_RUNTIME  // compile / cache lookup
                                : libkineto::ActivityType::CONCURRENT_KERNEL;
      buffer_->emplace_activity(buffer_->span, type, r.name);
      auto& act = libkineto::CpuTraceBuffer::toRef(buffer_->activities.back());
      act.startTime = r.start_ns;
      act.endTime = r.end_ns;
      act.device = r.device;
      act.resource = 0;  // the device's one in-order queue
      act.id = r.correlation ? static_cast<int32_t>(r.correlation) : ++id;
      if (r.correlation && linked_) {
        act.linked = linked_(static_cast<int32_t>(r.correlation));
        act.flow.id = static_cast<uint32_t>(r.correlation);
        act.flow.type = libkineto::kLinkAsyncCpuGpu;
        act.flow.start = 0;
      }
      act.addMetadataQuoted("device", "tpu:" + std::to_string(r.device));
      logger.handleActivity(act);
    }
  }
  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override { return nullptr; }
  std::vector<libkineto::ResourceInfo> getResourceInfos() override { return {}; }
  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override { return std::move(buffer_); }

 private:
  std::unique_ptr<libkineto::CpuTraceBuffer> buffer_;
  libkineto::getLinkedActivityCallback linked_;
};

class TpuProfiler final : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override { return name_; }
  const std::set<libkineto::ActivityType>& availableActivities() const override { return activities_; }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(const std::set<libkineto::ActivityType>& types,
                                                                 const libkineto::Config&) override {
    // Only when device activity was asked for (ProfilerActivity.PrivateUse1 adds kernels; CPU-only
    // traces ask for PRIVATEUSE1_RUNTIME too): CPU-only traces keep the executor's fast path.
    if (types.count(libkineto::ActivityType::CONCURRENT_KERNEL)) return std::make_unique<TpuSession>();
    return nullptr;
  }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(int64_t, int64_t,
                                                                 const std::set<libkineto::ActivityType>& types,
                                                                 const libkineto::Config& config) override {
    return configure(types, config);
  }

 private:
  std::string name_{"torch_tpu"};
  std::set<libkineto::ActivityType> activities_{libkineto::ActivityType::CONCURRENT_KERNEL,
                                                libkineto::ActivityType::GPU_MEMCPY,
                                                libkineto::ActivityType::PRIVATEUSE1_RUNTIME};
};

REGISTER_PRIVATEUSE1_PROFILER(TpuProfiler);
#endif

}  // namespace

void init_profiler(py::module& m) {
  m.def("profiler_plugin_built", []() {
#ifdef USE_KINETO
    return true;
#else
    return false;
#endif
  });
  m.def("set_profiler_session_callback", [](py::object callback) {
    delete g_on_session;
    g_on_session = new py::object(std::move(callback));
  });
  m.def("profiler_record", [](std::string name, int64_t start_ns, int64_t end_ns, int device, int kind) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_records.push_back({std::move(name), start_ns, end_ns, device, kind,
                         t_correlation.empty() ? 0 : t_correlation.back()});
  });
}
