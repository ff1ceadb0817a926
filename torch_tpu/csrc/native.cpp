// The native shim of torch_tpu: the few things PyTorch only accepts from C++.
//
// It owns: the PrivateUse1 device guard (true device count, per-thread current
// device, a default stream per device), the hooks (per-device Philox-style
// generators holding (seed, offset)), and the storage allocator.  The allocator
// hands out unique fake addresses (never dereferenced) with real byte sizes,
// keeps live/peak byte counts per device, raises torch.OutOfMemoryError past the
// device limit, and queues freed addresses so Python can drop the device buffers.
// It also runs cache hits: the boxed kernel registered for every lowered op
// launches a program the Python executor already built, without Python objects
// for the arguments. Every decision (lowering, execution, caching) stays in Python.
#include <torch/extension.h>

#include <ATen/EmptyTensor.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/SDPBackend.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/native/TensorFactories.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/COW.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/library.h>
#include <c10/util/SmallVector.h>

#include <structmember.h>

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

using c10::Device;
using c10::DeviceIndex;
using c10::Stream;
constexpr c10::DeviceType kTpu = c10::DeviceType::PrivateUse1;
constexpr int kMaxDevices = 64;

// ---------------------------------------------------------------- devices
std::atomic<int> g_device_count{-1};  // -1: runtime not initialised yet
py::object* g_init_callback = nullptr;  // Python: initialise runtime, return count
py::object* g_resize_callback = nullptr;  // Python: move a storage's buffer on resize_
py::object* g_copy_callback = nullptr;  // Python: a copy-on-write storage copied (its buffer shared)
std::string g_init_error;               // why the last initialisation failed
thread_local DeviceIndex t_current_device = 0;

DeviceIndex device_count() noexcept {
  int count = g_device_count.load();
  if (count >= 0 || g_init_callback == nullptr) return std::max(count, 0);
  try {
    py::gil_scoped_acquire gil;
    count = (*g_init_callback)().cast<int>();
    g_device_count.store(count);
    g_init_error.clear();
  } catch (const std::exception& e) {
    g_init_error = e.what();  // noexcept interface: check_index reports it
    return 0;
  }
  return count;
}

void check_index(DeviceIndex index) {
  DeviceIndex count = device_count();
  TORCH_CHECK(count > 0 || g_init_error.empty(), "tpu runtime failed to initialise: ", g_init_error);
  TORCH_CHECK(index >= 0 && index < count, "Invalid device 'tpu:", static_cast<int>(index),
              "': torch.tpu.device_count() is ", static_cast<int>(count));
}

// Python's answers for what the runtime knows (torch_tpu/streams.py): device synchronization,
// events, memory info. Called with the GIL taken, from any thread.
py::object* g_runtime = nullptr;

// The result is converted (and the Python objects released) while the GIL is held.
template <typename R = void, typename... Args>
R call_runtime(const char* name, Args&&... args) {
  py::gil_scoped_acquire gil;
  TORCH_CHECK(g_runtime != nullptr, "tpu runtime callbacks are not registered");
  py::object result = g_runtime->attr(name)(std::forward<Args>(args)...);
  if constexpr (!std::is_void_v<R>) return result.cast<R>();
}

// Streams are ids (0: the default stream); the current one is per thread and device. XLA runs a
// device's programs in launch order, so every stream of a device shares that one order.
thread_local c10::StreamId t_current_stream[kMaxDevices] = {};
std::atomic<c10::StreamId> g_next_stream{1};
std::atomic<uint64_t> g_next_event{1};

struct TpuGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kTpu; }
  Device exchangeDevice(Device d) const override {
    Device old(kTpu, t_current_device);
    setDevice(d);
    return old;
  }
  Device getDevice() const override { return Device(kTpu, t_current_device); }
  void setDevice(Device d) const override {
    if (d.index() < 0) return;
    check_index(d.index());
    t_current_device = d.index();
  }
  void uncheckedSetDevice(Device d) const noexcept override {
    if (d.index() >= 0) t_current_device = d.index();
  }
  static DeviceIndex index_of(Device d) { return d.index() < 0 ? t_current_device : d.index(); }
  Stream getStream(Device d) const override {
    DeviceIndex i = index_of(d);
    return Stream(Stream::UNSAFE, Device(kTpu, i), t_current_stream[i]);
  }
  Stream getDefaultStream(Device d) const override { return Stream(Stream::DEFAULT, Device(kTpu, index_of(d))); }
  Stream getNewStream(Device d, int) const override {
    DeviceIndex i = index_of(d);
    check_index(i);
    return Stream(Stream::UNSAFE, Device(kTpu, i), g_next_stream++);
  }
  Stream getStreamFromGlobalPool(Device d, bool) const override { return getNewStream(d, 0); }
  Stream exchangeStream(Stream s) const override {
    DeviceIndex i = s.device_index();
    Stream old(Stream::UNSAFE, Device(kTpu, i), t_current_stream[i]);
    t_current_stream[i] = s.id();
    return old;
  }
  DeviceIndex deviceCount() const noexcept override { return device_count(); }
  // torch.accelerator.get_device_capability: the dtypes the platform holds (streams.supported_dtypes).
  c10::DeviceCapability getDeviceCapability(Device d) const override {
    auto types = call_runtime<std::vector<at::ScalarType>>("supported_dtypes", index_of(d));
    c10::DeviceCapability cap;
    cap.capability_data.capability_bits = 0;
    for (auto st : types) {
#define TPU_CAPABILITY(_, name) \
  if (st == at::ScalarType::name) cap.capability_data.capability_bits |= 1ULL << c10::kIndex_##name;
      AT_FORALL_SCALAR_TYPES_WITH_COMPLEX_AND_QINTS(TPU_CAPABILITY)
#undef TPU_CAPABILITY
    }
    return cap;
  }
  // A stream is done when its device is: all streams share the device's order.
  bool queryStream(const Stream& s) const override { return call_runtime<bool>("query_device", s.device_index()); }
  void synchronizeStream(const Stream& s) const override { call_runtime("synchronize", s.device_index()); }
  void synchronizeDevice(const DeviceIndex index) const override {
    call_runtime("synchronize", index < 0 ? t_current_device : index);
  }
  // An event is an id; Python keeps what it marks (the device's work launched before record()).
  void record(void** event, const Stream& s, const DeviceIndex, const c10::EventFlag flag) const override {
    if (*event == nullptr) *event = reinterpret_cast<void*>(g_next_event++);
    call_runtime("event_record", reinterpret_cast<uint64_t>(*event), s.device_index(),
                 flag == c10::EventFlag::BACKEND_DEFAULT);
  }
  // Waiting needs nothing: the waiting stream's later work is launched after the recorded work,
  // on the same in-order device (or reads its results through a transfer that waits for them).
  void block(void*, const Stream&) const override {}
  bool queryEvent(void* event) const override {
    return event == nullptr || call_runtime<bool>("event_query", reinterpret_cast<uint64_t>(event));
  }
  void synchronizeEvent(void* event) const override {
    if (event != nullptr) call_runtime("event_synchronize", reinterpret_cast<uint64_t>(event));
  }
  double elapsedTime(void* start, void* end, const DeviceIndex) const override {
    TORCH_CHECK(start != nullptr && end != nullptr, "Both events must be recorded before calculating elapsed time.");
    return call_runtime<double>("event_elapsed", reinterpret_cast<uint64_t>(start), reinterpret_cast<uint64_t>(end));
  }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override {
    if (event == nullptr || g_runtime == nullptr || !Py_IsInitialized()) return;
    try {
      call_runtime("event_destroy", reinterpret_cast<uint64_t>(event));
    } catch (...) {
    }
  }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, TpuGuard);

// ---------------------------------------------------------------- memory
struct DeviceMemory {
  std::atomic<int64_t> allocated{0}, peak{0}, num_allocs{0}, num_frees{0}, live_storages{0};
  std::atomic<int64_t> limit{INT64_MAX};
  c10::CachingDeviceAllocator::DeviceStats stats;  // CUDA-style counters, under g_freed_mutex
};

// CUDA's pools: blocks up to 1 MiB are "small". One storage is one XLA buffer, so an allocation is
// also a segment and an active block.
void count_stats(DeviceMemory& m, int64_t bytes, bool add) {
  using c10::CachingAllocator::StatType;
  for (auto type : {StatType::AGGREGATE, bytes <= (1 << 20) ? StatType::SMALL_POOL : StatType::LARGE_POOL}) {
    size_t t = static_cast<size_t>(type);
    for (auto* stat : {&m.stats.allocated_bytes[t], &m.stats.reserved_bytes[t], &m.stats.active_bytes[t],
                       &m.stats.requested_bytes[t]}) {
      add ? stat->increase(bytes) : stat->decrease(bytes);
    }
    for (auto* stat : {&m.stats.allocation[t], &m.stats.segment[t], &m.stats.active[t]}) {
      add ? stat->increase(1) : stat->decrease(1);
    }
  }
  add ? ++m.stats.num_device_alloc : ++m.stats.num_device_free;
}
DeviceMemory g_memory[kMaxDevices];

// A counter written only under g_freed_mutex: its new value.
inline int64_t bump(std::atomic<int64_t>& counter, int64_t by) {
  int64_t now = counter.load(std::memory_order_relaxed) + by;
  counter.store(now, std::memory_order_relaxed);
  return now;
}

std::mutex g_freed_mutex;
std::vector<uint64_t> g_freed;  // addresses whose storages PyTorch released
std::unordered_map<uint64_t, std::pair<int64_t, int>> g_live;  // address -> (bytes, device)

void release(void* ctx) {
  uint64_t addr = reinterpret_cast<uint64_t>(ctx);
  int64_t bytes = -1, now = 0;
  int index = 0;
  {
    std::lock_guard<std::mutex> lock(g_freed_mutex);
    auto it = g_live.find(addr);
    if (it != g_live.end()) {
      bytes = it->second.first;
      index = it->second.second;
      DeviceMemory& m = g_memory[index];
      // Written only under g_freed_mutex: plain loads and stores (no locked instructions); readers
      // elsewhere load them atomically.
      now = bump(m.allocated, -bytes);
      bump(m.num_frees, 1);
      bump(m.live_storages, -1);
      count_stats(m, bytes, false);
      g_live.erase(it);
    }
    g_freed.push_back(addr);
  }
  // torch.profiler(profile_memory=True): a thread-local check when no profiler is on.
  if (bytes >= 0) c10::reportMemoryUsageToProfiler(ctx, -bytes, now, now, Device(kTpu, static_cast<DeviceIndex>(index)));
}

std::string format_bytes(int64_t n) {
  char buf[64];
  snprintf(buf, sizeof(buf), "%.2f GiB", static_cast<double>(n) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

// A DeviceAllocator, so torch.accelerator's memory API (c10::getDeviceAllocator) reads these counts.
struct TpuAllocator final : c10::DeviceAllocator {
  // Fake addresses start high and only grow, so no two storages ever share
  // one; ranges never overlap, which tied-weight detection relies on.
  std::atomic<uint64_t> next{1ull << 44};

  c10::DataPtr allocate(size_t nbytes) override {
    DeviceIndex index = t_current_device;
    DeviceMemory& m = g_memory[index];
    int64_t n = static_cast<int64_t>(nbytes);
    int64_t now = m.allocated.load();
    if (now + n > m.limit.load()) {
      std::lock_guard<std::mutex> lock(g_freed_mutex);
      m.stats.num_ooms += 1;
    }
    TORCH_CHECK_WITH(OutOfMemoryError, now + n <= m.limit.load(),
                     "TPU out of memory. Tried to allocate ", format_bytes(n), " (tpu:",
                     static_cast<int>(index), "; ", format_bytes(m.limit.load()), " total capacity; ",
                     format_bytes(now), " already allocated).");
    uint64_t span = nbytes == 0 ? 64 : ((nbytes + 63) / 64) * 64;
    uint64_t addr = next.fetch_add(span);
    {
      std::lock_guard<std::mutex> lock(g_freed_mutex);
      g_live.emplace(addr, std::make_pair(n, static_cast<int>(index)));
      count_stats(m, n, true);
      now = bump(m.allocated, n);
      if (now > m.peak.load(std::memory_order_relaxed)) m.peak.store(now, std::memory_order_relaxed);
      bump(m.num_allocs, 1);
      bump(m.live_storages, 1);
    }
    void* p = reinterpret_cast<void*>(addr);
    c10::reportMemoryUsageToProfiler(p, n, now, now, Device(kTpu, index));
    return {p, p, &release, Device(kTpu, index)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  // Called by c10's copy-on-write materialization (a lazy clone written to, or its source): the new
  // allocation gets the source's device buffer (buffers are immutable values: sharing one is a copy).
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    TORCH_CHECK(g_copy_callback != nullptr, "tpu storages are not host-addressable; copy through torch_tpu");
    py::gil_scoped_acquire gil;
    (*g_copy_callback)(reinterpret_cast<uint64_t>(dest), reinterpret_cast<uint64_t>(src), count);
  }
  bool initialized() override { return g_device_count.load() > 0; }
  // Drops the device buffers of freed storages now (Python owns the buffer map).
  void emptyCache(c10::MempoolId_t) override { call_runtime("empty_cache"); }
  // PJRT keeps a buffer alive until the programs using it finish: no stream bookkeeping needed.
  void recordStream(const c10::DataPtr&, c10::Stream) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(DeviceIndex index) override {
    check_index(index);
    std::lock_guard<std::mutex> lock(g_freed_mutex);
    return g_memory[index].stats;
  }
  void resetAccumulatedStats(DeviceIndex index) override {
    check_index(index);
    std::lock_guard<std::mutex> lock(g_freed_mutex);
    auto& st = g_memory[index].stats;
    for (auto* a : {&st.allocation, &st.segment, &st.active, &st.allocated_bytes, &st.reserved_bytes,
                    &st.active_bytes, &st.requested_bytes}) {
      for (auto& stat : *a) stat.reset_accumulated();
    }
    st.num_alloc_retries = st.num_ooms = st.num_device_alloc = st.num_device_free = 0;
  }
  void resetPeakStats(DeviceIndex index) override {
    check_index(index);
    std::lock_guard<std::mutex> lock(g_freed_mutex);
    DeviceMemory& m = g_memory[index];
    m.peak.store(m.allocated.load());
    for (auto* a : {&m.stats.allocation, &m.stats.segment, &m.stats.active, &m.stats.allocated_bytes,
                    &m.stats.reserved_bytes, &m.stats.active_bytes, &m.stats.requested_bytes}) {
      for (auto& stat : *a) stat.reset_peak();
    }
  }
  // (free, total) bytes: PJRT's numbers where the platform reports them (streams.memory_info).
  std::pair<size_t, size_t> getMemoryInfo(DeviceIndex index) override {
    check_index(index);
    return call_runtime<std::pair<size_t, size_t>>("memory_info", index);
  }
};
TpuAllocator g_allocator;
REGISTER_ALLOCATOR(kTpu, &g_allocator);

// ---------------------------------------------------------------- random
// Counter-based generator state, like CUDA's Philox: programs take (seed,
// offset) as runtime inputs, so compiled random ops are reused every step.
struct TpuGenerator final : c10::GeneratorImpl {
  uint64_t seed_ = c10::default_rng_seed_val;
  uint64_t offset_ = 0;
  explicit TpuGenerator(DeviceIndex index)
      : c10::GeneratorImpl(Device(kTpu, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)) {}
  void set_current_seed(uint64_t seed) override { seed_ = seed; offset_ = 0; }
  void set_offset(uint64_t offset) override { offset_ = offset; }
  uint64_t get_offset() const override { return offset_; }
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override {
    uint64_t s = c10::detail::getNonDeterministicRandom();
    set_current_seed(s);
    return s;
  }
  void set_state(const c10::TensorImpl& state) override {
    TORCH_CHECK(state.numel() == 16 && state.dtype() == at::kByte,
                "tpu RNG state must be a ByteTensor of 16 bytes (seed, offset)");
    const uint64_t* p = static_cast<const uint64_t*>(state.data());
    seed_ = p[0];
    offset_ = p[1];
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    at::Tensor t = at::empty({16}, at::kByte);
    uint64_t* p = static_cast<uint64_t*>(t.data_ptr());
    p[0] = seed_;
    p[1] = offset_;
    return t.getIntrusivePtr();
  }
  TpuGenerator* clone_impl() const override {
    auto* g = new TpuGenerator(device().index());
    g->seed_ = seed_;
    g->offset_ = offset_;
    return g;
  }
};

std::mutex g_generators_mutex;
std::vector<at::Generator> g_default_generators;

// ---------------------------------------------------------------- pinned host memory
// `pin_memory()`, DataLoader(pin_memory=True) and `t.to("cpu", non_blocking=True)` ask the
// device's hooks for a pinned host allocator. XLA copies host buffers itself (page-locking buys
// nothing through PJRT's host transfers), so pinned tensors are ordinary CPU allocations that
// remember they were pinned, for `is_pinned()`.
// It is also PyTorch's host allocator for tpu (torch.accelerator.empty_host_cache, host memory stats).
std::mutex g_pinned_mutex;
std::unordered_map<const void*, size_t> g_pinned;  // pointer -> bytes
at::HostStats g_pinned_stats;                      // under g_pinned_mutex

void delete_pinned(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    auto it = g_pinned.find(ptr);
    if (it != g_pinned.end()) {
      for (auto* stat : {&g_pinned_stats.active_bytes, &g_pinned_stats.allocated_bytes}) stat->decrease(it->second);
      for (auto* stat : {&g_pinned_stats.active_requests, &g_pinned_stats.allocations}) stat->decrease(1);
      g_pinned_stats.num_host_free += 1;
      g_pinned.erase(it);
    }
  }
  c10::free_cpu(ptr);
}

struct PinnedAllocator final : at::HostAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    if (ptr) {
      std::lock_guard<std::mutex> lock(g_pinned_mutex);
      g_pinned.emplace(ptr, nbytes);
      for (auto* stat : {&g_pinned_stats.active_bytes, &g_pinned_stats.allocated_bytes}) stat->increase(nbytes);
      for (auto* stat : {&g_pinned_stats.active_requests, &g_pinned_stats.allocations}) stat->increase(1);
      g_pinned_stats.num_host_alloc += 1;
    }
    return {ptr, ptr, &delete_pinned, Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  // Nothing is cached (a freed block goes straight back to the system) and nothing needs a
  // stream's work to finish before reuse (XLA copied the bytes when the transfer was issued).
  bool record_event(void*, void*, c10::Stream) override { return true; }
  void empty_cache() override {}
  at::HostStats get_stats() override {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    return g_pinned_stats;
  }
  void reset_accumulated_stats() override {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    for (auto* stat : {&g_pinned_stats.active_requests, &g_pinned_stats.active_bytes, &g_pinned_stats.allocations,
                       &g_pinned_stats.allocated_bytes}) {
      stat->reset_accumulated();
    }
    g_pinned_stats.num_host_alloc = g_pinned_stats.num_host_free = 0;
  }
  void reset_peak_stats() override {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    for (auto* stat : {&g_pinned_stats.active_requests, &g_pinned_stats.active_bytes, &g_pinned_stats.allocations,
                       &g_pinned_stats.allocated_bytes}) {
      stat->reset_peak();
    }
  }
};
PinnedAllocator g_pinned_allocator;
REGISTER_HOST_ALLOCATOR(kTpu, &g_pinned_allocator);

struct TpuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return device_count() > 0; }
  const at::Generator& getDefaultGenerator(DeviceIndex index) const override {
    if (index < 0) index = t_current_device;
    check_index(index);
    std::lock_guard<std::mutex> lock(g_generators_mutex);
    while (static_cast<int>(g_default_generators.size()) <= index) {
      g_default_generators.push_back(
          at::make_generator<TpuGenerator>(static_cast<DeviceIndex>(g_default_generators.size())));
    }
    return g_default_generators[index];
  }
  at::Generator getNewGenerator(DeviceIndex index) const override {
    return at::make_generator<TpuGenerator>(index < 0 ? t_current_device : index);
  }
  Device getDeviceFromPtr(void*) const override { return Device(kTpu, t_current_device); }
  bool hasPrimaryContext(DeviceIndex index) const override { return g_device_count.load() > 0; }
  bool isPinnedPtr(const void* ptr) const override {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    return g_pinned.count(ptr) > 0;
  }
  at::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_allocator; }
  // untyped_storage().resize_(n) (FSDP2 frees and re-allocates unsharded parameters this way):
  // a fresh allocation of the new size; Python moves the device buffer to the new address.
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
    c10::DeviceGuard guard(impl->device());
    uint64_t old_address = reinterpret_cast<uint64_t>(impl->data());
    size_t old_size = impl->nbytes();
    c10::DataPtr fresh = g_allocator.allocate(newsize);
    uint64_t new_address = reinterpret_cast<uint64_t>(fresh.get());
    if (g_resize_callback != nullptr) {
      py::gil_scoped_acquire gil;
      (*g_resize_callback)(old_address, new_address, old_size, newsize);
    }
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};

// ---------------------------------------------------------------- factories
// torch.use_deterministic_algorithms(True) with fill_uninitialized_memory (the default): an empty
// tensor holds NaN (integers: their max), as on CPU and CUDA; resize_ grows through empty too.
at::Tensor deterministic_fill(at::Tensor t) {
  if (C10_UNLIKELY(at::globalContext().deterministicAlgorithms() &&
                   at::globalContext().deterministicFillUninitializedMemory())) {
    at::native::fill_empty_deterministic_(t);
  }
  return t;
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>, std::optional<Device> device,
                               std::optional<bool>, std::optional<c10::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(device.value_or(Device(kTpu, -1)));
  return deterministic_fill(at::detail::empty_generic(size, &g_allocator,
                                                      c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                      dtype.value_or(at::get_default_dtype_as_scalartype()),
                                                      memory_format));
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout>, std::optional<Device> device, std::optional<bool>) {
  c10::DeviceGuard guard(device.value_or(Device(kTpu, -1)));
  return deterministic_fill(at::detail::empty_strided_generic(size, stride, &g_allocator,
                                                              c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                              dtype.value_or(at::get_default_dtype_as_scalartype())));
}

// One call instead of six attribute reads: the executor's cache key and
// storage lookup per tensor argument.
py::tuple int_tuple(c10::IntArrayRef values) {
  py::tuple out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = py::int_(values[i]);
  return out;
}

// A storage's address, the key of its device buffer. A copy-on-write storage (Tensor._lazy_clone) shares
// its address with its clones until written: it is copied here first (c10 calls copy_data), as a CPU or
// CUDA kernel's mutable_data_ptr() does, so no caller reads or writes a buffer another storage shares.
uint64_t storage_address(const c10::Storage& s) {
  if (C10_UNLIKELY(c10::impl::cow::is_cow_data_ptr(s.data_ptr()))) {
    return reinterpret_cast<uint64_t>(s.mutable_data());
  }
  return reinterpret_cast<uint64_t>(s.data());
}

py::tuple tensor_signature(const at::Tensor& t) {
  const c10::Storage& s = t.storage();
  return py::make_tuple(t.scalar_type(), int_tuple(t.sizes()), int_tuple(t.strides()), t.storage_offset(),
                        s.nbytes(), t.device().index(), storage_address(s));
}

// The executor's output allocation: skips the dispatcher, returns the address too.
py::tuple new_tensor(c10::IntArrayRef sizes, c10::IntArrayRef strides, at::ScalarType dtype, int index) {
  c10::DeviceGuard guard(Device(kTpu, static_cast<DeviceIndex>(index)));
  at::Tensor t = at::detail::empty_strided_generic(sizes, strides, &g_allocator,
                                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), dtype);
  uint64_t address = reinterpret_cast<uint64_t>(t.storage().data());
  return py::make_tuple(std::move(t), address);
}

// ---------------------------------------------------------------- signatures
// The executor's hot path (see eager/program.py for the key layout). Handles
// the common case: tpu tensors on one device, Python scalars, static values.
// Anything else (CPU tensors, mixed devices, odd types) returns None and the
// Python slow path handles it, raising PyTorch-style errors where needed.
enum ArgKind { kTensor = 0, kOptTensor, kTensorList, kOptTensorList, kScalar, kOptScalar, kScalarList, kGenerator,
               kStatic };

// The storages a call touches (its slots), in first-use order, all on one tpu device.
struct SlotTable {
  std::vector<uint64_t> addresses;
  std::vector<int64_t> nbytes;
  int device = -1;

  // The tensor's slot, or -1 when it is not on the call's tpu device or reads through a lazy
  // conjugate/negative bit (PyTorch passes those to a few ops: their Python path resolves them).
  int64_t slot_of(const at::Tensor& t) {
    if (!t.defined() || t.device().type() != kTpu || t.is_conj() || t.is_neg()) return -1;
    int index = t.device().index();
    if (device != index) {
      if (device >= 0) return -1;
      device = index;
    }
    const c10::Storage& s = t.storage();
    uint64_t address = storage_address(s);
    size_t slot = 0;
    while (slot < addresses.size() && addresses[slot] != address) ++slot;
    if (slot == addresses.size()) {
      addresses.push_back(address);
      nbytes.push_back(static_cast<int64_t>(s.nbytes()));
    }
    return static_cast<int64_t>(slot);
  }
};

struct SignatureBuilder : SlotTable {
  py::list* scalars = nullptr;  // runtime scalars, in argument order
  bool ok = true;

  py::object tensor_entry(PyObject* obj) {
    const at::Tensor& t = THPVariable_Unpack(obj);
    int64_t slot = slot_of(t);
    if (slot < 0) { ok = false; return py::none(); }
    py::object dtype = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type())));
    // A nonzero storage offset is a runtime scalar (-1 marks it): x[i] for every i shares one program.
    int64_t offset = t.storage_offset();
    if (offset != 0) scalars->append(py::int_(offset));
    return py::make_tuple("T", dtype, int_tuple(t.sizes()), int_tuple(t.strides()), offset == 0 ? 0 : -1, slot);
  }
};

bool is_number(PyObject* v) { return PyFloat_CheckExact(v) || PyLong_CheckExact(v) || PyBool_Check(v); }

void drain_into(py::dict& buffers) {
  // Drop the buffers of storages PyTorch freed since the last op. The list trades places with a
  // spare one that keeps its capacity (no allocation per op); a nested call (a callback run by a
  // dict deletion) finds no spare and allocates.
  thread_local std::vector<uint64_t> spare;
  std::vector<uint64_t> freed = std::move(spare);
  freed.clear();
  {
    std::lock_guard<std::mutex> lock(g_freed_mutex);
    freed.swap(g_freed);
  }
  for (uint64_t address : freed) {
    py::int_ key(address);
    if (PyDict_DelItem(buffers.ptr(), key.ptr()) != 0) PyErr_Clear();
  }
  freed.clear();
  spare = std::move(freed);
}

// A signature: the key (see eager/program.py) plus what launching needs.
struct Signature {
  py::tuple key;
  py::list addresses, entries, scalars;
  py::object generator = py::none();
  int device = -1;
};

// Fills `sig`; false when the call needs the Python slow path.
bool build_signature(py::handle op, py::tuple kinds, py::list full, py::dict& buffers, bool static_scalars,
                     Signature& sig) {
  size_t n = kinds.size();
  SignatureBuilder b;
  b.scalars = &sig.scalars;
  py::tuple key(n + 3);
  key[0] = op;
  for (size_t i = 0; i < n; ++i) {
    PyObject* v = PyList_GET_ITEM(full.ptr(), i);
    int kind = PyLong_AsLong(PyTuple_GET_ITEM(kinds.ptr(), i));
    py::object entry;
    if (v == Py_None) {
      entry = py::none();
    } else if (kind == kTensor || kind == kOptTensor) {
      if (THPVariable_Check(v)) {
        entry = b.tensor_entry(v);
      } else if (is_number(v)) {
        entry = py::make_tuple("S", py::handle(reinterpret_cast<PyObject*>(Py_TYPE(v))));
        sig.scalars.append(v);
      } else {
        return false;
      }
    } else if (kind == kTensorList || kind == kOptTensorList) {
      if (!PyList_Check(v) && !PyTuple_Check(v)) return false;
      py::sequence seq = py::reinterpret_borrow<py::sequence>(v);
      py::tuple items(seq.size());
      for (size_t j = 0; j < seq.size(); ++j) {
        py::object item = seq[j];
        if (item.is_none()) {
          items[j] = py::none();
        } else if (THPVariable_Check(item.ptr())) {
          items[j] = b.tensor_entry(item.ptr());
        } else {
          return false;
        }
      }
      entry = items;
    } else if (kind == kScalar || kind == kOptScalar) {
      if (!is_number(v)) return false;
      if (static_scalars) {
        entry = py::make_tuple("V", py::handle(v));
      } else {
        entry = py::make_tuple("S", py::handle(reinterpret_cast<PyObject*>(Py_TYPE(v))));
        sig.scalars.append(v);
      }
    } else if (kind == kScalarList) {
      if (!PyList_Check(v) && !PyTuple_Check(v)) return false;
      py::sequence seq = py::reinterpret_borrow<py::sequence>(v);
      py::tuple types(seq.size());
      for (size_t j = 0; j < seq.size(); ++j) {
        py::object item = seq[j];
        if (!is_number(item.ptr())) return false;
        types[j] = py::handle(reinterpret_cast<PyObject*>(Py_TYPE(item.ptr())));
        sig.scalars.append(item);
      }
      entry = py::make_tuple("L", types);
    } else if (kind == kGenerator) {
      sig.generator = py::reinterpret_borrow<py::object>(v);
      entry = py::none();
    } else if (PyList_Check(v)) {
      entry = py::reinterpret_steal<py::object>(PyList_AsTuple(v));
    } else {
      entry = py::reinterpret_borrow<py::object>(v);
    }
    if (!b.ok) return false;
    key[i + 2] = entry;
  }
  if (b.device < 0) return false;
  key[1] = py::int_(b.device);
  size_t n_slots = b.addresses.size();
  py::tuple slots(n_slots);
  for (size_t j = 0; j < n_slots; ++j) {
    py::int_ address(b.addresses[j]);
    PyObject* found = PyDict_GetItem(buffers.ptr(), address.ptr());  // borrowed
    py::object buffer_entry = found ? py::reinterpret_borrow<py::object>(found) : py::none();
    py::object buffer_dtype = found ? py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(found, 1)) : py::none();
    slots[j] = py::make_tuple(buffer_dtype, b.nbytes[j]);
    sig.addresses.append(address);
    sig.entries.append(buffer_entry);
  }
  key[n + 2] = slots;
  sig.key = key;
  sig.device = b.device;
  return true;
}

py::object fast_signature(py::handle op, py::tuple kinds, py::list full, py::dict buffers, bool static_scalars) {
  drain_into(buffers);
  Signature sig;
  if (!build_signature(op, kinds, full, buffers, static_scalars, sig)) return py::none();
  return py::make_tuple(sig.key, sig.addresses, sig.entries, sig.scalars, sig.device, sig.generator);
}

// Fresh program outputs as tpu tensors: allocate each and record its buffer.
// `layouts`: per output (sizes, strides, dtype), or None for an undefined result.
py::list new_outputs(py::sequence layouts, py::sequence arrays, int index, py::dict buffers);

// The key of a runtime scalar's device array in executor._scalar_cache, as executor.scalar_key
// builds it: (type, value, device), with negative zero apart (-0.0 == 0.0 as a dict key).
py::tuple scalar_cache_key(const py::object& value, const py::int_& device) {
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(value.ptr()));
  if (PyFloat_CheckExact(value.ptr())) {
    double d = PyFloat_AS_DOUBLE(value.ptr());
    if (d == 0.0 && std::signbit(d)) return py::make_tuple(py::handle(type), py::str("-0.0"), device);
  }
  return py::make_tuple(py::handle(type), value, device);
}

// ---------------------------------------------------------------- torch.compile graph keys
// GraphFunction._key's common case in one call (compile/graph.py): the arguments of a compiled
// graph are plain tpu tensors (parameters too), CPU tensors and Python numbers. Returns
// (entries, slot addresses, slot buffers, device) with the entries Python builds, or None when an
// argument needs the Python key (another tensor type or device, mixed tpu devices, anything else).
PyTypeObject* g_parameter_type = nullptr;  // torch.nn.Parameter, set on the first call

py::object graph_key(py::handle args, py::dict buffers, py::handle tensor_tag) {
  if (!PyList_CheckExact(args.ptr())) return py::none();
  if (g_parameter_type == nullptr)
    g_parameter_type = reinterpret_cast<PyTypeObject*>(py::object(py::module::import("torch.nn").attr("Parameter")).release().ptr());
  const Py_ssize_t n = PyList_GET_SIZE(args.ptr());
  py::tuple entries(n);
  py::list addresses, arrays;
  std::unordered_map<uint64_t, int64_t> slot_of;
  int device = -1;
  static PyObject* const host_tag = PyUnicode_InternFromString("H");
  static PyObject* const number_tag = PyUnicode_InternFromString("P");
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = PyList_GET_ITEM(args.ptr(), i);
    if (a == Py_None || PyLong_Check(a) || PyFloat_Check(a)) {  // bool is an int
      entries[i] = py::make_tuple(py::handle(number_tag), py::handle(a));
      continue;
    }
    PyTypeObject* type = Py_TYPE(a);
    if (type != reinterpret_cast<PyTypeObject*>(THPVariableClass) && type != g_parameter_type) return py::none();
    const at::Tensor& t = THPVariable_Unpack(a);
    py::handle dtype(reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type())));
    const c10::DeviceType kind = t.device().type();
    if (kind == c10::DeviceType::CPU) {
      entries[i] = py::make_tuple(py::handle(host_tag), dtype, int_tuple(t.sizes()), int_tuple(t.strides()));
      continue;
    }
    if (kind != kTpu) return py::none();
    const int index = t.device().index();
    if (device != -1 && index != device) return py::none();
    device = index;
    const c10::Storage& st = t.storage();
    const uint64_t address = storage_address(st);
    py::int_ key(address);
    PyObject* entry = PyDict_GetItemWithError(buffers.ptr(), key.ptr());  // borrowed: (array, dtype)
    if (entry == nullptr && PyErr_Occurred()) throw python_error();
    if (entry != nullptr && (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2)) return py::none();
    auto [it, fresh] = slot_of.emplace(address, static_cast<int64_t>(slot_of.size()));
    if (fresh) {
      addresses.append(key);
      arrays.append(entry == nullptr ? py::none() : py::handle(PyTuple_GET_ITEM(entry, 0)));
    }
    py::handle slot_dtype = entry == nullptr ? dtype : py::handle(PyTuple_GET_ITEM(entry, 1));
    entries[i] = py::make_tuple(tensor_tag, dtype, int_tuple(t.sizes()), int_tuple(t.strides()), t.storage_offset(),
                                it->second, slot_dtype, st.nbytes(), py::bool_(entry != nullptr));
  }
  return py::make_tuple(std::move(entries), std::move(addresses), std::move(arrays), device);
}

// ---------------------------------------------------------------- cache-hit fast path
// Counters the Python metrics add to their own (the fast path never touches Python objects for them).
std::atomic<int64_t> g_fast_ops{0};

// Defined with the boxed kernels' launch routine, which it shares.
py::object run_cached(py::handle op, py::tuple kinds, py::list full, py::dict buffers, bool static_scalars,
                      py::dict programs, py::dict scalar_cache, py::tuple extra, py::handle miss);

// A registered tpu kernel for one lowered op. Cache hits run entirely here
// (normalize arguments, then run_cached); everything else calls `slow`, the
// Python executor. Fast paths are globally off in Debug and DeferAndFuse.
std::atomic<bool> g_fast_enabled{true};

struct OpKernel {
  py::object op, slow, programs, buffers, scalar_cache, miss, precision_key, translate, runtime_error;
  py::tuple kinds, names, defaults;
  py::object required;  // sentinel marking arguments with no default
  bool static_scalars = false, use_fast = true, precision = false;

  py::object call(py::args args, py::kwargs kwargs) {
    if (!use_fast || !g_fast_enabled.load(std::memory_order_relaxed)) return slow(*args, **kwargs);
    size_t n = kinds.size(), given = args.size();
    if (given > n) return slow(*args, **kwargs);
    py::list full(n);
    for (size_t i = 0; i < n; ++i) full[i] = i < given ? args[i] : defaults[i];
    for (auto item : kwargs) {
      size_t i = 0;
      while (i < n && !py::reinterpret_borrow<py::object>(names[i]).equal(item.first)) ++i;
      if (i == n) return slow(*args, **kwargs);
      full[i] = item.second;
    }
    for (size_t i = 0; i < n; ++i)
      if (py::object(full[i]).is(required)) return slow(*args, **kwargs);
    py::tuple extra = precision ? py::make_tuple(precision_key()) : py::tuple();
    py::object out;
    try {
      out = run_cached(op, kinds, full, buffers, static_scalars, programs, scalar_cache, extra, miss);
    } catch (py::error_already_set& e) {
      if (!e.matches(runtime_error)) throw;
      py::object translated = translate(e.value(), py::str(op));
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(translated.ptr())), translated.ptr());
      throw py::error_already_set();
    }
    if (out.is(miss)) return slow(*args, **kwargs);
    return out;
  }
};

py::list new_outputs(py::sequence layouts, py::sequence arrays, int index, py::dict buffers) {
  c10::DeviceGuard guard(Device(kTpu, static_cast<DeviceIndex>(index)));
  size_t n = layouts.size();
  py::list out(n);
  size_t next_array = 0;
  for (size_t i = 0; i < n; ++i) {
    py::object layout = layouts[i];
    if (layout.is_none()) {  // an undefined result: no buffer
      out[i] = py::none();
      continue;
    }
    py::tuple l = layout.cast<py::tuple>();
    auto sizes = l[0].cast<std::vector<int64_t>>();
    auto strides = l[1].cast<std::vector<int64_t>>();
    py::object dtype = l[2];
    at::ScalarType scalar_type = reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
    at::Tensor t = at::detail::empty_strided_generic(sizes, strides, &g_allocator,
                                                     c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), scalar_type);
    py::int_ address(reinterpret_cast<uint64_t>(t.storage().data()));
    buffers[address] = py::make_tuple(arrays[next_array++], dtype);
    out[i] = py::cast(std::move(t));
  }
  return out;
}

// ---------------------------------------------------------------- boxed kernels
// Lowered ops are registered with the dispatcher as boxed C++ kernels (not Python callables): a
// cache hit reads the dispatcher's stack of IValues directly and pushes its results back, with no
// Python objects for the arguments, no argument normalization and no tuple key. Its key is a flat
// byte string holding everything the executor's tuple key holds (eager/program.py), per kernel;
// an entry is made from the Python program cache (`programs`) the first time a key is seen after
// its program exists, so both always agree. Anything unusual takes the Python path (`slow`).

// How an argument reaches Python: PyTorch's Python kernels get dtypes, layouts and memory formats
// as their Python objects, everything else as torch::jit::toPyObject makes it.
enum Convert : uint8_t { kAsIs = 0, kDtype, kLayout, kMemoryFormat };

Convert convert_of(c10::TypePtr type) {
  if (auto optional = type->cast<c10::OptionalType>()) type = optional->getElementType();
  switch (type->kind()) {
    case c10::TypeKind::ScalarTypeType: return kDtype;
    case c10::TypeKind::LayoutType: return kLayout;
    case c10::TypeKind::MemoryFormatType: return kMemoryFormat;
    default: return kAsIs;
  }
}

py::object to_python(const c10::IValue& v, Convert how) {
  if (v.isNone()) return py::none();
  switch (how) {
    case kDtype:
      return py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<at::ScalarType>(v.toInt()))));
    case kLayout:
      return py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<at::Layout>(v.toInt()))));
    case kMemoryFormat:
      return py::reinterpret_borrow<py::object>(
          torch::utils::getTHPMemoryFormat(static_cast<at::MemoryFormat>(v.toInt())));
    default:
      return torch::jit::toPyObject(v);
  }
}

// A runtime scalar: its Python type (0 float, 1 int, 2 bool) and value.
struct RuntimeScalar {
  uint8_t type;
  double d;
  int64_t i;
  py::object to_python() const {
    if (type == 0) return py::float_(d);
    if (type == 1) return py::int_(i);
    return py::bool_(i != 0);
  }
};

// Device arrays of runtime scalars, by (type, value bits, device); fed from the executor's
// `_scalar_cache` (which creates them), so both hold the same arrays.
struct ScalarKey {
  uint8_t type;
  int64_t bits;
  int device;
  bool operator==(const ScalarKey& o) const { return type == o.type && bits == o.bits && device == o.device; }
};
struct ScalarKeyHash {
  size_t operator()(const ScalarKey& k) const {
    return std::hash<int64_t>()(k.bits) * 31 + k.type * 7 + static_cast<size_t>(k.device);
  }
};
// Never destroyed: its Python objects must not be released after the interpreter is gone.
auto& g_scalar_arrays = *new std::unordered_map<ScalarKey, py::object, ScalarKeyHash>();
constexpr size_t kScalarArraysLimit = 4096;

// Bumped whenever the Python program cache forgets programs: every kernel then drops its entries.
std::atomic<uint64_t> g_generation{0};

struct OutputLayout {
  bool defined = false;
  std::vector<int64_t> sizes, strides;
  at::ScalarType type = at::kFloat;
  py::object dtype;
};

// What launching or recording a program needs from its Python plan (`OpProgram.fast` and
// `OpProgram.record_plan()` begin alike: input slots, updated slots, slot dtypes, output layouts,
// returns), converted once per byte key.
struct ProgramPlan {
  std::vector<size_t> input_slots, updated_slots;
  std::vector<py::object> slot_dtypes;
  std::vector<OutputLayout> outputs;
  size_t n_fresh = 0;  // defined outputs
  std::vector<std::array<int64_t, 3>> returns;  // (kind, a, b) as in run_cached
};

void read_plan(const py::tuple& f, ProgramPlan& plan) {
  for (auto slot : f[0].cast<py::tuple>()) plan.input_slots.push_back(slot.cast<size_t>());
  for (auto slot : f[1].cast<py::tuple>()) plan.updated_slots.push_back(slot.cast<size_t>());
  for (auto dtype : f[2]) plan.slot_dtypes.push_back(py::reinterpret_borrow<py::object>(dtype));
  for (auto layout : f[3]) {
    OutputLayout out;
    if (!layout.is_none()) {
      py::tuple l = layout.cast<py::tuple>();
      out.defined = true;
      out.sizes = l[0].cast<std::vector<int64_t>>();
      out.strides = l[1].cast<std::vector<int64_t>>();
      out.dtype = l[2];
      out.type = reinterpret_cast<THPDtype*>(out.dtype.ptr())->scalar_type;
      plan.n_fresh += 1;
    }
    plan.outputs.push_back(std::move(out));
  }
  for (auto item : f[4]) {
    py::tuple r = item.cast<py::tuple>();
    plan.returns.push_back({r[0].cast<int64_t>(), r[1].cast<int64_t>(), r[2].cast<int64_t>()});
  }
}

// Fresh tpu tensors in a plan's output layouts (undefined where an output is None).
// Per-call vectors on the stack (no heap allocation on the hot paths for the usual few slots/outputs).
using Outputs = c10::SmallVector<at::Tensor, 4>;
using Args = c10::ArrayRef<c10::IValue>;
using SlotObjects = c10::SmallVector<py::object, 6>;
Outputs allocate_outputs(const std::vector<OutputLayout>& layouts, int device);

// A program's PJRT executable launched without JAX's dispatch: `execute_sharded` on one flat list
// of arrays, the results made into arrays by JAX's own result handlers (one per output, made once
// from the first launch's results: cache/executable.py, `direct_launch`). The same work JAX's
// C++ dispatch does for a `Compiled`, less its pytree and argument checks (the byte key already
// fixed every shape, dtype and device), and for executables loaded from the compile cache too.
struct DirectLaunch {
  py::object execute;   // the runtime executable's execute_sharded
  py::object consume;   // its results' consume_with_handlers (unbound)
  py::list handlers;    // per flat output
  size_t n_fresh = 0;   // the first n_fresh outputs are the fresh ones, the rest the updated slots

  DirectLaunch(py::object execute, py::object consume, py::list handlers, size_t n_fresh)
      : execute(std::move(execute)), consume(std::move(consume)), handlers(std::move(handlers)), n_fresh(n_fresh) {}

  py::list launch(const py::list& flat) const {
    py::object results = execute(flat);
    return consume(results, handlers);
  }

  // The executors' calling convention: (arrays, scalars) -> (fresh, updated).
  py::tuple call(const py::list& arrays, const py::list& scalars) const {
    py::list flat = arrays;
    if (scalars.size() > 0) flat = py::reinterpret_steal<py::list>(PySequence_Concat(arrays.ptr(), scalars.ptr()));
    if (!flat) throw python_error();
    return split(launch(flat));
  }

  py::tuple split(const py::list& results) const {
    Py_ssize_t n = PyList_GET_SIZE(results.ptr()), k = static_cast<Py_ssize_t>(n_fresh);
    return py::make_tuple(py::reinterpret_steal<py::object>(PyList_GetSlice(results.ptr(), 0, k)),
                          py::reinterpret_steal<py::object>(PyList_GetSlice(results.ptr(), k, n)));
  }
};

// `obj` as a list or tuple whose items are read in place (PySequence_Fast).
py::object fast_sequence(const py::handle& obj) {
  PyObject* seq = PySequence_Fast(obj.ptr(), "expected a sequence of results");
  if (seq == nullptr) throw python_error();
  return py::reinterpret_steal<py::object>(seq);
}

// What a cache hit needs, converted once from `OpProgram.fast` (see program.py).
struct FastEntry : ProgramPlan {
  py::object executable;
  const DirectLaunch* direct = nullptr;  // set when `executable` is a DirectLaunch (held by it)
  py::object checked_op;  // a value-checked op's name (its flag follows the updated slots), else None
};

std::shared_ptr<FastEntry> fast_entry(const py::tuple& fast) {
  auto entry = std::make_shared<FastEntry>();
  read_plan(fast, *entry);
  entry->executable = fast[5];
  if (py::isinstance<DirectLaunch>(entry->executable)) entry->direct = entry->executable.cast<const DirectLaunch*>();
  entry->checked_op = fast[6];
  return entry;
}

// valuecheck.launched(flag, op, results): where a value-checked hit's error flag goes (set by executor.py).
// Never destroyed, like g_scalar_arrays.
py::object& g_value_check_hook = *new py::object();

// ---------------------------------------------------------------- one cache hit's launch, shared
// By the boxed kernels (arguments from the dispatcher's stack) and run_cached (from Python).

// A hit's arguments: one flat list (arrays, then scalars) for a direct launch, two lists otherwise.
struct HitArguments {
  bool direct;
  size_t n_in;
  py::list arrays, scalars;
  HitArguments(const FastEntry& e, size_t n_scalars)
      : direct(e.direct != nullptr),
        n_in(e.input_slots.size()),
        arrays(direct ? n_in + n_scalars : n_in),
        scalars(direct ? 0 : n_scalars) {}
  void set_scalar(size_t i, py::handle value) {
    if (direct)
      arrays[n_in + i] = value;
    else
      scalars[i] = value;
  }
};

// Launches the hit (raising what the executable raises) and stores its results: the updated
// slots' new buffers (`slot_key(slot)`: the slot's key in `buffers`), then the fresh outputs,
// allocated here. Returns the outputs (undefined where the op returns no tensor).
template <typename SlotKey>
Outputs launch_hit(const FastEntry& e, const HitArguments& in, int device, py::dict& buffers, SlotKey slot_key) {
  py::list flat;     // a direct launch's results: fresh, then updated
  py::tuple result;  // any other callable's (fresh, updated)
  if (e.direct)
    flat = e.direct->launch(in.arrays);
  else
    result = e.executable(in.arrays, in.scalars).template cast<py::tuple>();
  // The results as borrowed items, read in place.
  py::object fresh_seq = e.direct ? py::object(flat) : fast_sequence(result[0]);
  py::object updated_seq = e.direct ? py::object(flat) : fast_sequence(result[1]);
  const Py_ssize_t skip = e.direct ? static_cast<Py_ssize_t>(e.direct->n_fresh) : 0;
  const Py_ssize_t n_fresh = e.direct ? skip : PySequence_Fast_GET_SIZE(fresh_seq.ptr());
  const bool checked = !e.checked_op.is_none();
  if (PySequence_Fast_GET_SIZE(updated_seq.ptr()) - skip !=
          static_cast<Py_ssize_t>(e.updated_slots.size() + (checked ? 1 : 0)) ||
      n_fresh != static_cast<Py_ssize_t>(e.n_fresh))
    throw std::runtime_error("a cached program returned a different number of results than it was planned with");
  PyObject** fresh = PySequence_Fast_ITEMS(fresh_seq.ptr());
  PyObject** updated = PySequence_Fast_ITEMS(updated_seq.ptr()) + skip;
  for (size_t i = 0; i < e.updated_slots.size(); ++i) {
    size_t slot = e.updated_slots[i];
    buffers[slot_key(slot)] = py::make_tuple(py::handle(updated[i]), e.slot_dtypes[slot]);
  }
  Outputs outs = allocate_outputs(e.outputs, device);
  size_t next = 0;
  for (size_t i = 0; i < outs.size(); ++i) {
    if (!outs[i].defined()) continue;
    buffers[py::int_(reinterpret_cast<uint64_t>(outs[i].storage().data()))] =
        py::make_tuple(py::handle(fresh[next++]), e.outputs[i].dtype);
  }
  if (checked) {  // the flag waits for the next materialization point (written tensors were kept on failure)
    if (!g_value_check_hook) throw std::runtime_error("a value-checked program ran before the executor set its hook");
    py::list results(n_fresh);
    for (Py_ssize_t i = 0; i < n_fresh; ++i) results[i] = py::handle(fresh[i]);
    g_value_check_hook(py::handle(updated[e.updated_slots.size()]), e.checked_op, results);
  }
  g_fast_ops += 1;
  return outs;
}

// run_cached's plans by the program's `fast` tuple (held: its address is not reused), dropped
// when the Python program cache forgets programs. Never destroyed, like g_scalar_arrays.
auto& g_fast_plans = *new std::unordered_map<PyObject*, std::pair<py::object, std::shared_ptr<FastEntry>>>();
uint64_t g_fast_plans_generation = 0;
constexpr size_t kFastPlansLimit = 1 << 16;

const FastEntry& fast_entry_of(const py::object& fast) {
  uint64_t now = g_generation.load(std::memory_order_relaxed);
  if (g_fast_plans_generation != now || g_fast_plans.size() >= kFastPlansLimit) {
    g_fast_plans.clear();
    g_fast_plans_generation = now;
  }
  auto it = g_fast_plans.find(fast.ptr());
  if (it == g_fast_plans.end())
    it = g_fast_plans.emplace(fast.ptr(), std::make_pair(fast, fast_entry(fast.cast<py::tuple>()))).first;
  return *it->second.second;
}

// The native keys hold no default dtype: they describe calls made under float32, PyTorch's default.
// Under another default (float results of integer tensors or Python numbers, scalar_tensor...) the
// Python path keys the call with it (executor.state_key).
inline bool default_dtype_is_float() { return at::get_default_dtype_as_scalartype() == at::kFloat; }

// The whole executor for a call whose program is cached and ready: signature,
// lookup, device scalars, launch, buffer updates, output tensors, return
// value. Returns `miss` (untouched state) when the Python path must run.
// `prog.fast` is (input_slots, updated_slots, slot_dtypes, outputs, returns, executable, checked op), see program.py.
py::object run_cached(py::handle op, py::tuple kinds, py::list full, py::dict buffers, bool static_scalars,
                      py::dict programs, py::dict scalar_cache, py::tuple extra, py::handle miss) {
  if (!default_dtype_is_float()) return py::reinterpret_borrow<py::object>(miss);
  drain_into(buffers);
  Signature sig;
  if (!build_signature(op, kinds, full, buffers, static_scalars, sig)) return py::reinterpret_borrow<py::object>(miss);
  py::object key = sig.key;
  if (extra.size() > 0) key = py::reinterpret_steal<py::object>(PySequence_Concat(sig.key.ptr(), extra.ptr()));
  PyObject* prog = PyDict_GetItem(programs.ptr(), key.ptr());  // borrowed
  if (prog == nullptr) return py::reinterpret_borrow<py::object>(miss);
  py::object fast = py::reinterpret_borrow<py::object>(prog).attr("fast");
  if (fast.is_none()) return py::reinterpret_borrow<py::object>(miss);
  const FastEntry& e = fast_entry_of(fast);

  HitArguments in(e, sig.scalars.size());
  for (size_t i = 0; i < in.n_in; ++i) {
    py::object entry = sig.entries[e.input_slots[i]];
    if (entry.is_none()) return py::reinterpret_borrow<py::object>(miss);
    in.arrays[i] = entry.cast<py::tuple>()[0];
  }
  py::int_ device(sig.device);
  for (size_t i = 0; i < sig.scalars.size(); ++i) {
    py::tuple cache_key = scalar_cache_key(sig.scalars[i], device);
    PyObject* array = PyDict_GetItem(scalar_cache.ptr(), cache_key.ptr());  // borrowed
    if (array == nullptr) return py::reinterpret_borrow<py::object>(miss);
    in.set_scalar(i, array);
  }
  // Raises on runtime errors (the executor translates them).
  Outputs outs = launch_hit(e, in, sig.device, buffers, [&](size_t slot) { return py::object(sig.addresses[slot]); });
  // returns: (kind, a, b): kind 0 -> argument a; 1 -> output a; 2 -> outputs [a, a + b).
  auto one = [&](const std::array<int64_t, 3>& r) -> py::object {
    if (r[0] == 0) return full[r[1]];
    if (r[0] == 1) return py::cast(outs[r[1]]);
    py::list sub(r[2]);
    for (int64_t j = 0; j < r[2]; ++j) sub[j] = py::cast(outs[r[1] + j]);
    return std::move(sub);
  };
  if (e.returns.empty()) return py::none();
  if (e.returns.size() == 1) return one(e.returns[0]);
  py::tuple out(e.returns.size());
  for (size_t r = 0; r < e.returns.size(); ++r) out[r] = one(e.returns[r]);
  return std::move(out);
}

// The byte key of one call, built from the dispatcher's stack.
struct KeyBuilder : SlotTable {
  std::string key;
  std::vector<RuntimeScalar> scalars;

  void put(int64_t x) { key.append(reinterpret_cast<const char*>(&x), sizeof(x)); }
  void tag(char c) { key.push_back(c); }

  bool tensor(const at::Tensor& t) {
    int64_t slot = slot_of(t);
    if (slot < 0) return false;
    tag('T');
    tag(static_cast<char>(t.scalar_type()));
    put(t.dim());
    for (int64_t size : t.sizes()) put(size);
    for (int64_t stride : t.strides()) put(stride);
    int64_t offset = t.storage_offset();
    tag(offset != 0);
    if (offset != 0) scalars.push_back({1, 0.0, offset});
    put(slot);
    return true;
  }

  // A Python number (or a wrapped one): its type in the key, its value a runtime scalar or, for
  // lowerings with static scalars, in the key.
  bool number(const c10::IValue& v, bool in_key) {
    RuntimeScalar s{};
    if (v.isDouble()) {
      s = {0, v.toDouble(), 0};
    } else if (v.isBool()) {
      s = {2, 0.0, v.toBool()};
    } else if (v.isInt()) {
      s = {1, 0.0, v.toInt()};
    } else {
      return false;
    }
    tag(in_key ? 'V' : 'S');
    tag(static_cast<char>(s.type));
    if (in_key) {
      int64_t bits = s.i;
      if (s.type == 0) std::memcpy(&bits, &s.d, sizeof(bits));
      put(bits);
    } else {
      scalars.push_back(s);
    }
    return true;
  }

  // A wrapped number is a 0-dim CPU tensor made from a Python scalar: read in place (item() would
  // dispatch an op).
  bool wrapped_number(const at::Tensor& t) {
    if (t.device().type() != c10::DeviceType::CPU || t.numel() != 1) return false;
    switch (t.scalar_type()) {
      case at::kDouble: return number(c10::IValue(*t.const_data_ptr<double>()), false);
      case at::kLong: return number(c10::IValue(*t.const_data_ptr<int64_t>()), false);
      case at::kBool: return number(c10::IValue(*t.const_data_ptr<bool>()), false);
      default: return false;
    }
  }

  bool static_value(const c10::IValue& v) {
    if (v.isNone()) {
      tag('n');
    } else if (v.isBool()) {
      tag('b');
      tag(v.toBool());
    } else if (v.isInt()) {
      tag('i');
      put(v.toInt());
    } else if (v.isDouble()) {
      tag('d');
      double d = v.toDouble();
      key.append(reinterpret_cast<const char*>(&d), sizeof(d));
    } else if (v.isString()) {
      const std::string& s = v.toStringRef();
      tag('s');
      put(static_cast<int64_t>(s.size()));
      key.append(s);
    } else if (v.isDevice()) {
      tag('D');
      tag(static_cast<char>(v.toDevice().type()));
      tag(static_cast<char>(v.toDevice().index()));
    } else if (v.isList()) {
      c10::ArrayRef<c10::IValue> items = v.toListRef();
      tag('L');
      put(static_cast<int64_t>(items.size()));
      for (const c10::IValue& item : items)
        if (!static_value(item)) return false;
    } else {
      return false;  // a SymInt, a tuple, ...: the Python path
    }
    return true;
  }

  bool argument(int kind, const c10::IValue& v, bool static_scalars) {
    // An undefined tensor is None to Python (autograd passes saved optional tensors, e.g.
    // nll_loss_backward's weight, as undefined tensors rather than None).
    if (v.isNone() || (v.isTensor() && !v.toTensor().defined())) {
      tag('n');
      return true;
    }
    switch (kind) {
      case kTensor:
      case kOptTensor: {
        if (!v.isTensor()) return false;
        const at::Tensor& t = v.toTensor();
        if (t.unsafeGetTensorImpl()->is_wrapped_number()) return wrapped_number(t);
        return tensor(t);
      }
      case kTensorList:
      case kOptTensorList: {
        if (!v.isList() && !v.isTensorList()) return false;
        c10::ArrayRef<c10::IValue> items = v.toListRef();
        tag('l');
        put(static_cast<int64_t>(items.size()));
        for (const c10::IValue& item : items) {
          if (item.isNone() || (item.isTensor() && !item.toTensor().defined())) {
            tag('n');
          } else if (!item.isTensor() || !tensor(item.toTensor())) {
            return false;
          }
        }
        return true;
      }
      case kScalar:
      case kOptScalar:
        return number(v, static_scalars);
      case kScalarList: {
        if (!v.isList()) return false;
        c10::ArrayRef<c10::IValue> items = v.toListRef();
        tag('q');
        put(static_cast<int64_t>(items.size()));
        for (const c10::IValue& item : items)
          if (!number(item, false)) return false;
        return true;
      }
      case kGenerator:
        return false;  // random ops take the Python path (they advance the generator)
      default:
        return static_value(v);
    }
  }
};

KeyBuilder& key_builder() {
  thread_local KeyBuilder b;
  return b;
}


// ---------------------------------------------------------------- DeferAndFuse recording
// A recorded op whose program exists is appended to eager/defer.py's current graph from here,
// exactly as defer.record would append it (the same Node, Pending and buffer entries, the same
// bytes of the graph's structural fingerprint), so flushing and planning stay in Python. Anything
// unusual (a new signature, the size cap, a lost value, the lock held by another thread) takes
// the Python recorder.
std::atomic<bool> g_defer_enabled{false};
std::atomic<int64_t> g_native_recorded{0};
std::atomic<bool> g_any_lost{false};  // valuecheck.any_lost, kept in step by valuecheck.py
// Why calls went to the Python recorder (diagnostics: `_native.defer_fallbacks()`).
enum DeferFallback { kArguments = 0, kLocked, kModeChanged, kLostValues, kNewSignature, kPythonProgram, kSizeCap,
                     kUnreadyInput, kFallbackKinds };
const char* const kFallbackNames[] = {"arguments", "locked", "mode changed", "lost values", "new signature",
                                      "python program", "size cap", "unready input"};
std::atomic<int64_t> g_defer_fallbacks[kFallbackKinds] = {};
std::string g_last_unkeyed;  // the last call the byte key could not describe (under the GIL)
inline bool fallback(DeferFallback why) {
  g_defer_fallbacks[why] += 1;
  return false;
}

// defer.lock: a reentrant lock the native recorder takes without calling Python (two Python
// method calls per recorded op cost ~0.1 us). Python uses it like threading.RLock (acquire,
// release, `with`); a blocking acquire waits with the GIL released, as RLock's does.
struct RecorderLock;
// Every RecorderLock (for a fork child); never destroyed, so a lock freed at exit still finds them.
std::mutex& g_recorder_locks_mutex = *new std::mutex();
std::unordered_set<RecorderLock*>& g_recorder_locks = *new std::unordered_set<RecorderLock*>();
void reinit_recorder_locks_in_child();

struct RecorderLock {
  std::mutex m;
  std::condition_variable freed;
  unsigned long owner = 0;  // the holder's PyThread ident; count 0: free
  int64_t count = 0;

  RecorderLock() {
    static const bool registered = pthread_atfork(nullptr, nullptr, reinit_recorder_locks_in_child) == 0;
    (void)registered;
    std::lock_guard<std::mutex> g(g_recorder_locks_mutex);
    g_recorder_locks.insert(this);
  }
  ~RecorderLock() {
    std::lock_guard<std::mutex> g(g_recorder_locks_mutex);
    g_recorder_locks.erase(this);
  }

  bool try_acquire(unsigned long me) {
    std::lock_guard<std::mutex> g(m);
    if (count == 0 || owner == me) {
      owner = me;
      ++count;
      return true;
    }
    return false;
  }
  bool acquire(bool blocking, double timeout) {
    unsigned long me = PyThread_get_thread_ident();
    if (try_acquire(me)) return true;
    if (!blocking) return false;
    py::gil_scoped_release nogil;
    std::unique_lock<std::mutex> l(m);
    auto is_free = [&] { return count == 0; };
    if (timeout < 0) {
      freed.wait(l, is_free);
    } else if (!freed.wait_for(l, std::chrono::duration<double>(timeout), is_free)) {
      return false;
    }
    owner = me;
    count = 1;
    return true;
  }
  void release() {
    unsigned long me = PyThread_get_thread_ident();
    std::lock_guard<std::mutex> g(m);
    if (count == 0 || owner != me) throw std::runtime_error("cannot release un-acquired lock");
    if (--count == 0) {
      owner = 0;
      freed.notify_one();
    }
  }
};

struct DeferHooks {
  py::object module, lock, config, config_dict, valuecheck, is_library, user_code, on_first;
  RecorderLock* native_lock = nullptr;  // lock's C++ object
  PyObject* module_dict = nullptr;  // defer's globals (borrowed: the module lives as long as the process)
  PyTypeObject* graph_type = nullptr;
  Py_ssize_t graph_nodes = 0, graph_descs = 0, graph_ext = 0, graph_ext_ids = 0;
  PyTypeObject *node_type = nullptr, *pending_type = nullptr, *lost_type = nullptr;
  Py_ssize_t node_prog = 0, node_refs = 0, node_scalars = 0, node_device = 0, node_where = 0, pending_ref = 0;
  py::object s_graph, s_defer_and_fuse, s_max_ops;
};
DeferHooks* g_defer = nullptr;  // never destroyed (its Python objects outlive no interpreter)

// The byte offset of a __slots__ member of a Python class: its instances are filled without Python code.
Py_ssize_t slot_offset(PyTypeObject* type, const char* name) {
  PyObject* d = PyDict_GetItemString(type->tp_dict, name);  // borrowed
  TORCH_CHECK(d != nullptr && Py_TYPE(d) == &PyMemberDescr_Type, "expected a __slots__ member ", name);
  PyMemberDef* member = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
  TORCH_CHECK(member->type == T_OBJECT_EX, "unexpected member type of ", name);
  return member->offset;
}

inline void put_slot(PyObject* obj, Py_ssize_t offset, PyObject* value /* stolen */) {
  PyObject** p = reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset);
  Py_XSETREF(*p, value);
}

inline PyObject* get_slot(PyObject* obj, Py_ssize_t offset) {  // borrowed, may be null
  return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset);
}

void set_defer_hooks(py::object module, py::object lock, py::object config, py::object valuecheck,
                     py::dict is_library, py::object user_code, py::object on_first, py::object node,
                     py::object pending, py::object lost) {
  auto* d = new DeferHooks();
  d->module = module;
  d->lock = lock;
  d->native_lock = lock.cast<RecorderLock*>();
  d->module_dict = PyModule_GetDict(module.ptr());
  d->graph_type = reinterpret_cast<PyTypeObject*>(py::object(module.attr("Graph")).release().ptr());
  d->graph_nodes = slot_offset(d->graph_type, "nodes");
  d->graph_descs = slot_offset(d->graph_type, "descs");
  d->graph_ext = slot_offset(d->graph_type, "ext");
  d->graph_ext_ids = slot_offset(d->graph_type, "ext_ids");
  d->config = config;
  d->config_dict = py::reinterpret_borrow<py::object>(PyObject_GenericGetDict(config.ptr(), nullptr));
  Py_DECREF(d->config_dict.ptr());  // GenericGetDict returned a new reference
  d->valuecheck = valuecheck;
  d->is_library = is_library;
  d->user_code = user_code;
  d->on_first = on_first;
  d->node_type = reinterpret_cast<PyTypeObject*>(node.release().ptr());
  d->pending_type = reinterpret_cast<PyTypeObject*>(pending.release().ptr());
  d->lost_type = reinterpret_cast<PyTypeObject*>(lost.release().ptr());
  d->node_prog = slot_offset(d->node_type, "prog");
  d->node_refs = slot_offset(d->node_type, "refs");
  d->node_scalars = slot_offset(d->node_type, "scalars");
  d->node_device = slot_offset(d->node_type, "device");
  d->node_where = slot_offset(d->node_type, "where");
  d->pending_ref = slot_offset(d->pending_type, "ref");
  auto intern = [](const char* name) { return py::reinterpret_steal<py::object>(PyUnicode_InternFromString(name)); };
  d->s_graph = intern("_graph");
  d->s_defer_and_fuse = intern("defer_and_fuse");
  d->s_max_ops = intern("defer_max_ops");
  delete g_defer;
  g_defer = d;
}

py::object attr(const py::object& obj, const py::object& name) {
  PyObject* v = PyObject_GetAttr(obj.ptr(), name.ptr());
  if (v == nullptr) throw python_error();
  return py::reinterpret_steal<py::object>(v);
}

// (code, instruction offset) -> the (code, line) tuple of recorded nodes: a training loop records
// from the same lines again and again, so each site's line is looked up once. Holds the code
// objects, so their addresses are not reused while cached (never freed, like the code's own
// classification in recompiles._is_library).
auto& g_sites = *new std::unordered_map<std::pair<PyObject*, int>, PyObject*, c10::hash<std::pair<PyObject*, int>>>();
// recompiles._is_library by code address (a code is classified once, by Python).
auto& g_code_library = *new std::unordered_map<PyObject*, bool>();

// A field of torch_tpu.config (borrowed), read from the instance's dict: no attribute lookup.
PyObject* config_value(const DeferHooks& d, const py::object& name) {
  PyObject* v = PyDict_GetItemWithError(d.config_dict.ptr(), name.ptr());
  if (v == nullptr) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_AttributeError, "torch_tpu.config has no field %S", name.ptr());
    throw python_error();
  }
  return v;
}

// A fork child (a DataLoader worker) has only the forking thread: a waiter of another thread may
// have held `m` for an instant without the GIL, so the child gets fresh ones. The owner and count
// stay: held by the forking thread, it is still held by the child's only thread (as RLock).
void reinit_recorder_locks_in_child() {
  new (&g_recorder_locks_mutex) std::mutex();
  for (RecorderLock* lock : g_recorder_locks) {
    new (&lock->m) std::mutex();
    new (&lock->freed) std::condition_variable();
  }
}

// Holds defer.lock for one native recording, if no other thread holds it.
struct DeferLock {
  RecorderLock* lock;
  bool held;
  DeferLock() : lock(g_defer->native_lock), held(lock->try_acquire(PyThread_get_thread_ident())) {}
  ~DeferLock() {
    if (held) lock->release();
  }
};

// defer._user_frame without Python: (code, line) of the innermost frame outside torch, torch_tpu
// and the standard library, from recompiles' per-code classification; a code not classified yet
// is left to recompiles.user_code.
py::object user_where() {
  PyFrameObject* f = PyEval_GetFrame();  // borrowed
  Py_XINCREF(f);
  while (f != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(f);
    PyObject* library;
    auto known = g_code_library.find(reinterpret_cast<PyObject*>(code));
    if (known != g_code_library.end()) {
      library = known->second ? Py_True : Py_False;
    } else {
      // Hashing a code object hashes its contents: looked up once per code, then by address.
      library = PyDict_GetItem(g_defer->is_library.ptr(), reinterpret_cast<PyObject*>(code));  // borrowed
      if (library != nullptr) {
        Py_INCREF(code);  // held by the cache: its address is not reused
        g_code_library.emplace(reinterpret_cast<PyObject*>(code), library == Py_True);
      }
    }
    if (library == nullptr) {
      Py_DECREF(code);
      py::object frame = py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(f));
      return g_defer->user_code(frame);
    }
    if (library == Py_False) {
      auto key = std::make_pair(reinterpret_cast<PyObject*>(code), PyFrame_GetLasti(f));
      auto it = g_sites.find(key);
      if (it != g_sites.end()) {
        Py_DECREF(code);
        Py_DECREF(f);
        return py::reinterpret_borrow<py::object>(it->second);
      }
      int line = PyFrame_GetLineNumber(f);
      Py_DECREF(f);
      PyObject* where = Py_BuildValue("(Oi)", reinterpret_cast<PyObject*>(code), line);
      if (where == nullptr) {
        Py_DECREF(code);
        throw python_error();
      }
      PyObject_GC_UnTrack(where);  // a code object and an int: never part of a cycle
      g_sites.emplace(key, where);  // keeps the code (reference from PyFrame_GetCode) and the tuple
      return py::reinterpret_borrow<py::object>(where);
    }
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(f);
    Py_DECREF(f);
    f = back;
  }
  return py::none();
}

// What recording one signature needs, from `OpProgram.record_plan()`; `prog` is None when the
// program must always be recorded by Python (out= resizes, non-tensor returns).
struct DeferEntry : ProgramPlan {
  py::object prog;
};

struct BoxedKernel final : c10::OperatorKernel {
  py::object holder;  // the OpKernel (Python object): keeps it alive
  OpKernel* k;
  std::vector<Convert> converts;
  std::vector<c10::TypePtr> return_types;
  // Never destroyed with the kernel: PyTorch's dispatcher frees kernels at process exit, after the
  // interpreter is gone, when their Python objects must not be released any more.
  std::unordered_map<std::string, std::shared_ptr<FastEntry>>& entries =
      *new std::unordered_map<std::string, std::shared_ptr<FastEntry>>();
  uint64_t generation = 0;
  std::unordered_map<std::string, std::shared_ptr<DeferEntry>>& defer_entries =
      *new std::unordered_map<std::string, std::shared_ptr<DeferEntry>>();
  uint64_t defer_generation = 0;

  ~BoxedKernel() override { holder.release(); }

  BoxedKernel(py::object kernel, const c10::FunctionSchema& schema)
      : holder(std::move(kernel)), k(holder.cast<OpKernel*>()) {
    for (const c10::Argument& a : schema.arguments()) converts.push_back(convert_of(a.real_type()));
    for (const c10::Argument& r : schema.returns()) return_types.push_back(r.real_type());
  }

  void operator()(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack* stack) {
    py::gil_scoped_acquire gil;
    size_t n = converts.size();
    // The arguments, moved off the stack into a stack-allocated vector (no heap allocation).
    c10::SmallVector<c10::IValue, 8> popped(std::make_move_iterator(stack->end() - n), std::make_move_iterator(stack->end()));
    torch::jit::drop(*stack, n);
    Args args(popped);
    if (k->use_fast && g_fast_enabled.load(std::memory_order_relaxed) && fast(args, stack)) return;
    if (k->use_fast && g_defer != nullptr && g_defer_enabled.load(std::memory_order_relaxed) && record(args, stack))
      return;
    slow(args, stack);
  }

  // DeferAndFuse: append this call to the current graph; false (nothing done) when Python must.
  bool record(Args args, torch::jit::Stack* stack) {
    DeferHooks& d = *g_defer;
    // The lock first: the buffers read for the key must not change before the node is appended
    // (the key's precision level is read through Python, where another thread could run a flush).
    DeferLock lock;
    if (!lock.held) return fallback(kLocked);  // another thread records or flushes: wait for it in Python
    if (!PyObject_IsTrue(config_value(d, d.s_defer_and_fuse))) return fallback(kModeChanged);
    py::dict buffers = py::reinterpret_borrow<py::dict>(k->buffers);
    drain_into(buffers);  // first: dropping the last lost storage's buffer clears any_lost (valuecheck.py)
    if (g_any_lost.load(std::memory_order_relaxed)) return fallback(kLostValues);  // Python raises
    KeyBuilder& b = key_builder();
    SlotObjects slot_keys, slot_arrays;
    if (!build_key(args, buffers, slot_keys, slot_arrays)) return fallback(kArguments);

    uint64_t now = g_generation.load(std::memory_order_relaxed);
    if (defer_generation != now) {
      defer_entries.clear();
      defer_generation = now;
    }
    std::shared_ptr<DeferEntry> entry;
    auto it = defer_entries.find(b.key);
    if (it != defer_entries.end()) {
      entry = it->second;
    } else {
      entry = defer_entry(args, buffers);
      if (!entry) return fallback(kNewSignature);
      defer_entries.emplace(b.key, entry);
    }
    if (entry->prog.is_none()) return fallback(kPythonProgram);
    const DeferEntry& e = *entry;

    // defer._graph and its slots, read without attribute lookups.
    PyObject* graph_ptr = PyDict_GetItemWithError(d.module_dict, d.s_graph.ptr());  // borrowed
    if (graph_ptr == nullptr && PyErr_Occurred()) throw python_error();
    if (graph_ptr == nullptr || Py_TYPE(graph_ptr) != d.graph_type) return fallback(kArguments);
    py::object graph = py::reinterpret_borrow<py::object>(graph_ptr);
    PyObject *nodes_ptr = get_slot(graph_ptr, d.graph_nodes), *descs_ptr = get_slot(graph_ptr, d.graph_descs);
    if (nodes_ptr == nullptr || !PyList_CheckExact(nodes_ptr) || descs_ptr == nullptr || !PyByteArray_CheckExact(descs_ptr))
      return fallback(kArguments);
    py::object nodes = py::reinterpret_borrow<py::object>(nodes_ptr), descs = py::reinterpret_borrow<py::object>(descs_ptr);
    Py_ssize_t index = PyList_GET_SIZE(nodes.ptr());
    int64_t max_ops = PyLong_AsLongLong(config_value(d, d.s_max_ops));
    if (max_ops == -1 && PyErr_Occurred()) throw python_error();
    if (index + 1 >= max_ops) return fallback(kSizeCap);  // Python flushes at the size cap

    // Inputs: pending refs, or concrete arrays (looked up only after every check passed).
    size_t n_in = e.input_slots.size();
    c10::SmallVector<int64_t, 8> refs(n_in);
    for (size_t i = 0; i < n_in; ++i) {
      PyObject* value = slot_arrays[e.input_slots[i]].ptr();
      if (value == nullptr || Py_TYPE(value) == d.lost_type) return fallback(kUnreadyInput);
      if (Py_TYPE(value) == d.pending_type) refs[i] = PyLong_AsLongLong(get_slot(value, d.pending_ref));
    }
    py::object where = user_where();
    // Fresh outputs first: an allocation failure (out of memory) leaves the graph as it was.
    const int device = b.device;
    Outputs outs = allocate_outputs(e.outputs, device);
    py::object ext, ext_ids;
    for (size_t i = 0; i < n_in; ++i) {
      PyObject* value = slot_arrays[e.input_slots[i]].ptr();
      if (Py_TYPE(value) == d.pending_type) continue;
      if (!ext) {
        ext = py::reinterpret_borrow<py::object>(get_slot(graph_ptr, d.graph_ext));
        ext_ids = py::reinterpret_borrow<py::object>(get_slot(graph_ptr, d.graph_ext_ids));
        if (!ext.ptr() || !PyList_CheckExact(ext.ptr()) || !ext_ids.ptr() || !PyDict_CheckExact(ext_ids.ptr()))
          throw std::runtime_error("defer.Graph's ext/ext_ids are not a list and a dict");
      }
      py::object id = py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(value));
      PyObject* j = PyDict_GetItem(ext_ids.ptr(), id.ptr());  // borrowed
      int64_t position;
      if (j == nullptr) {
        position = PyList_GET_SIZE(ext.ptr());
        py::int_ p(position);
        if (PyDict_SetItem(ext_ids.ptr(), id.ptr(), p.ptr()) != 0 || PyList_Append(ext.ptr(), value) != 0)
          throw python_error();
      } else {
        position = PyLong_AsLongLong(j);
      }
      refs[i] = -1 - position;
    }
    constexpr int64_t kOut = 1 << 20;  // defer._OUT
    const int64_t base = index * kOut;
    // The objects made here cannot be part of a reference cycle (they hold numbers, dtypes, code
    // objects, the program and each other, never a container that holds them), so they are kept
    // out of the cyclic garbage collector: a graph of thousands of nodes lives until the flush,
    // and tracked it made Python's full collections (which walk every tracked object) run often.
    auto entry_tuple = [](py::object value, const py::object& dtype) {
      py::tuple t = py::make_tuple(std::move(value), dtype);
      PyObject_GC_UnTrack(t.ptr());
      return t;
    };
    auto pending = [&](int64_t ref) {
      PyObject* p = d.pending_type->tp_alloc(d.pending_type, 0);
      if (p == nullptr) throw python_error();
      put_slot(p, d.pending_ref, PyLong_FromLongLong(ref));
      PyObject_GC_UnTrack(p);
      return py::reinterpret_steal<py::object>(p);
    };
    for (size_t j = 0; j < e.updated_slots.size(); ++j) {
      size_t slot = e.updated_slots[j];
      buffers[slot_keys[slot]] =
          entry_tuple(pending(base + static_cast<int64_t>(e.n_fresh + j)), e.slot_dtypes[slot]);
    }
    py::tuple ref_tuple(n_in);
    for (size_t i = 0; i < n_in; ++i) ref_tuple[i] = py::int_(refs[i]);
    PyObject_GC_UnTrack(ref_tuple.ptr());
    py::tuple scalars(b.scalars.size());  // the empty tuple is a singleton: nothing made for most ops
    for (size_t i = 0; i < b.scalars.size(); ++i) scalars[i] = b.scalars[i].to_python();
    if (!b.scalars.empty()) PyObject_GC_UnTrack(scalars.ptr());
    if (!where.is_none()) PyObject_GC_UnTrack(where.ptr());
    PyObject* node = d.node_type->tp_alloc(d.node_type, 0);
    if (node == nullptr) throw python_error();
    PyObject_GC_UnTrack(node);
    py::object node_obj = py::reinterpret_steal<py::object>(node);
    put_slot(node, d.node_prog, e.prog.inc_ref().ptr());
    put_slot(node, d.node_refs, ref_tuple.release().ptr());
    put_slot(node, d.node_scalars, scalars.release().ptr());
    put_slot(node, d.node_device, PyLong_FromLong(device));
    put_slot(node, d.node_where, where.release().ptr());
    if (PyList_Append(nodes.ptr(), node) != 0) throw python_error();
    // The structural fingerprint's bytes (defer._desc): program id, number of inputs, their refs.
    c10::SmallVector<int64_t, 10> desc;
    desc.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(e.prog.ptr())));
    desc.push_back(static_cast<int64_t>(n_in));
    desc.insert(desc.end(), refs.begin(), refs.end());
    Py_ssize_t old_size = PyByteArray_GET_SIZE(descs.ptr());
    Py_ssize_t add = static_cast<Py_ssize_t>(desc.size() * sizeof(int64_t));
    if (PyByteArray_Resize(descs.ptr(), old_size + add) != 0) throw python_error();
    std::memcpy(PyByteArray_AS_STRING(descs.ptr()) + old_size, desc.data(), add);
    size_t next = 0;
    for (size_t i = 0; i < outs.size(); ++i) {
      if (!outs[i].defined()) continue;
      buffers[py::int_(reinterpret_cast<uint64_t>(outs[i].storage().data()))] =
          entry_tuple(pending(base + static_cast<int64_t>(next++)), e.outputs[i].dtype);
    }
    g_native_recorded += 1;
    if (index == 0) d.on_first();
    push_returns(e.returns, args, outs, stack);
    return true;
  }

  std::shared_ptr<DeferEntry> defer_entry(Args args, py::dict& buffers) {
    PyObject* prog = program_of(args, buffers);  // borrowed
    if (prog == nullptr) return nullptr;  // a miss: Python builds the program
    auto entry = std::make_shared<DeferEntry>();
    py::object plan = py::reinterpret_borrow<py::object>(prog).attr("record_plan")();
    if (plan.is_none()) {
      entry->prog = py::none();
      return entry;
    }
    entry->prog = py::reinterpret_borrow<py::object>(prog);
    read_plan(plan.cast<py::tuple>(), *entry);
    return entry;
  }

  // The program the Python cache holds for this call, by the executor's own tuple key (borrowed),
  // or null: a miss, or arguments the tuple key cannot describe.
  PyObject* program_of(Args args, py::dict& buffers) {
    Signature sig;
    if (!build_signature(k->op, k->kinds, python_args(args), buffers, k->static_scalars, sig)) return nullptr;
    py::object key = sig.key;
    if (k->precision) {
      py::tuple extra = py::make_tuple(k->precision_key());
      key = py::reinterpret_steal<py::object>(PySequence_Concat(sig.key.ptr(), extra.ptr()));
    }
    return PyDict_GetItem(k->programs.ptr(), key.ptr());
  }

  static void push_returns(const std::vector<std::array<int64_t, 3>>& returns, Args args,
                           const Outputs& outs, torch::jit::Stack* stack) {
    for (const auto& r : returns) {
      if (r[0] == 0) {
        torch::jit::push(stack, args[r[1]]);
      } else if (r[0] == 1) {
        torch::jit::push(stack, outs[r[1]]);
      } else {
        c10::List<at::Tensor> list;
        for (int64_t j = 0; j < r[2]; ++j) list.push_back(outs[r[1] + j]);
        torch::jit::push(stack, std::move(list));
      }
    }
  }

  // The Python path: arguments as Python objects, results back onto the stack.
  void slow(Args args, torch::jit::Stack* stack) {
    py::list full = python_args(args);
    py::object out;
    try {
      out = k->slow(*full);
    } catch (py::error_already_set& e) {
      e.restore();
      throw python_error();
    }
    size_t n_returns = return_types.size();
    if (n_returns == 1) {
      torch::jit::push(stack, torch::jit::toIValue(out, return_types[0]));
    } else if (n_returns > 1) {
      py::sequence outs = out.cast<py::sequence>();
      for (size_t r = 0; r < n_returns; ++r) torch::jit::push(stack, torch::jit::toIValue(outs[r], return_types[r]));
    }
  }

  py::list python_args(Args args) {
    py::list full(args.size());
    for (size_t i = 0; i < args.size(); ++i) full[i] = to_python(args[i], converts[i]);
    return full;
  }

  // A cache hit: run and push the results; false (nothing done) when the Python path must run.
  bool fast(Args args, torch::jit::Stack* stack) {
    py::dict buffers = py::reinterpret_borrow<py::dict>(k->buffers);
    drain_into(buffers);
    KeyBuilder& b = key_builder();
    SlotObjects slot_keys, slot_arrays;
    if (!build_key(args, buffers, slot_keys, slot_arrays)) return false;

    uint64_t now = g_generation.load(std::memory_order_relaxed);
    if (generation != now) {
      entries.clear();
      generation = now;
    }
    std::shared_ptr<FastEntry> entry;
    auto it = entries.find(b.key);
    if (it != entries.end()) {
      entry = it->second;
    } else {
      entry = from_programs(args, buffers);
      if (!entry) return false;
      entries.emplace(b.key, entry);
    }
    return run(*entry, b, args, buffers, slot_keys, slot_arrays, stack);
  }

  // The byte key of this call in key_builder(), with each slot's address key and current buffer
  // (unset for a slot never written); false when the call needs the Python path.
  bool build_key(Args args, py::dict& buffers, SlotObjects& slot_keys,
                 SlotObjects& slot_arrays) {
    if (!default_dtype_is_float()) return false;
    KeyBuilder& b = key_builder();
    b.key.clear();
    b.addresses.clear();
    b.nbytes.clear();
    b.scalars.clear();
    b.device = -1;
    size_t n = args.size();
    for (size_t i = 0; i < n; ++i) {
      int kind = PyLong_AsLong(PyTuple_GET_ITEM(k->kinds.ptr(), i));
      if (!b.argument(kind, args[i], k->static_scalars)) {
        g_last_unkeyed = py::str(k->op).cast<std::string>() + " argument " + std::to_string(i) + " (" +
                         args[i].tagKind() + ")";
        return false;
      }
    }
    if (b.device < 0) return false;
    b.put(b.device);
    // The slots: their current buffers (an entry is (array, dtype)); the buffer dtype is in the key.
    size_t n_slots = b.addresses.size();
    slot_keys.assign(n_slots, py::object());
    slot_arrays.assign(n_slots, py::object());
    for (size_t j = 0; j < n_slots; ++j) {
      slot_keys[j] = py::int_(b.addresses[j]);
      PyObject* found = PyDict_GetItem(buffers.ptr(), slot_keys[j].ptr());  // borrowed
      if (found == nullptr) {
        b.tag('x');
      } else {
        PyObject* dtype = PyTuple_GET_ITEM(found, 1);
        if (!THPDtype_Check(dtype)) return false;
        b.tag(static_cast<char>(reinterpret_cast<THPDtype*>(dtype)->scalar_type));
        slot_arrays[j] = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(found, 0));
      }
      b.put(b.nbytes[j]);
    }
    if (k->precision) b.key.append(py::str(k->precision_key()).cast<std::string>());
    return true;
  }

  // The entry for this call from the Python program cache: the executor's own tuple key.
  std::shared_ptr<FastEntry> from_programs(Args args, py::dict& buffers) {
    PyObject* prog = program_of(args, buffers);  // borrowed
    if (prog == nullptr) return nullptr;
    py::object fast = py::reinterpret_borrow<py::object>(prog).attr("fast");
    if (fast.is_none()) return nullptr;
    return fast_entry(fast.cast<py::tuple>());
  }

  bool run(const FastEntry& e, const KeyBuilder& b, Args args, py::dict& buffers,
           const SlotObjects& slot_keys, const SlotObjects& slot_arrays,
           torch::jit::Stack* stack) {
    const int device = b.device;
    HitArguments in(e, b.scalars.size());
    for (size_t i = 0; i < in.n_in; ++i) {
      const py::object& array = slot_arrays[e.input_slots[i]];
      if (!array) return false;  // a slot never written: the Python path reads it as zeros
      in.arrays[i] = array;
    }
    for (size_t i = 0; i < b.scalars.size(); ++i) {
      const RuntimeScalar& s = b.scalars[i];
      int64_t bits = s.i;
      if (s.type == 0) std::memcpy(&bits, &s.d, sizeof(bits));
      ScalarKey sk{s.type, bits, device};
      auto found = g_scalar_arrays.find(sk);
      if (found == g_scalar_arrays.end()) {
        py::object value = s.to_python();
        py::tuple cache_key = scalar_cache_key(value, py::int_(device));
        PyObject* array = PyDict_GetItem(k->scalar_cache.ptr(), cache_key.ptr());
        if (array == nullptr) return false;  // the Python path makes it
        if (g_scalar_arrays.size() >= kScalarArraysLimit) g_scalar_arrays.clear();
        found = g_scalar_arrays.emplace(sk, py::reinterpret_borrow<py::object>(array)).first;
      }
      in.set_scalar(i, found->second);
    }
    Outputs outs;
    try {
      outs = launch_hit(e, in, device, buffers, [&](size_t slot) -> const py::object& { return slot_keys[slot]; });
    } catch (py::error_already_set& err) {
      if (!err.matches(k->runtime_error)) {
        err.restore();
        throw python_error();
      }
      py::object translated = k->translate(err.value(), py::str(k->op));
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(translated.ptr())), translated.ptr());
      throw python_error();
    }
    push_returns(e.returns, args, outs, stack);
    return true;
  }

};

Outputs allocate_outputs(const std::vector<OutputLayout>& layouts, int device) {
  Outputs outs;
  outs.reserve(layouts.size());
  c10::DeviceGuard guard(Device(kTpu, static_cast<DeviceIndex>(device)));
  for (const OutputLayout& layout : layouts) {
    if (!layout.defined) {
      outs.emplace_back();
      continue;
    }
    outs.push_back(at::detail::empty_strided_generic(layout.sizes, layout.strides, &g_allocator,
                                                     c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), layout.type));
  }
  return outs;
}

// Registers `kernel` (an OpKernel) as the tpu kernel of `ns::name` ("add.Tensor"). The libraries and
// kernels live as long as the process (never destroyed: their Python objects outlive no interpreter).
std::unordered_map<std::string, torch::Library*> g_libraries;

void register_boxed(py::object kernel, const std::string& ns, const std::string& name) {
  auto dot = name.find('.');
  std::string base = ns + "::" + name.substr(0, dot);
  std::string overload = dot == std::string::npos ? "" : name.substr(dot + 1);
  c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(base.c_str(), overload.c_str());
  torch::Library*& lib = g_libraries[ns];
  if (lib == nullptr) lib = new torch::Library(torch::Library::IMPL, ns, c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  auto functor = std::make_unique<BoxedKernel>(std::move(kernel), op.schema());
  lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::move(functor)));
}

py::dict memory_stats(int index) {
  TORCH_CHECK(index >= 0 && index < kMaxDevices, "bad device index");
  DeviceMemory& m = g_memory[index];
  py::dict d;
  d["allocated_bytes.all.current"] = m.allocated.load();
  d["allocated_bytes.all.peak"] = m.peak.load();
  d["allocation.all.allocated"] = m.num_allocs.load();
  d["allocation.all.freed"] = m.num_frees.load();
  d["allocation.all.current"] = m.live_storages.load();
  d["bytes_limit"] = m.limit.load();
  return d;
}

}  // namespace

// ---------------------------------------------------------------- attention
// F.scaled_dot_product_attention asks a per-device stub which backend to use; with none registered
// a PrivateUse1 device always gets the unfused math path. Pick the overrideable fused op (lowered
// in ops/attention.py as one program) for the shapes fused kernels take: 4-d query/key/value with
// the same batch, key and value alike but for their last dim, equal head counts (or enable_gqa with
// a whole number of query heads per key head). Anything else (broadcast batches, mismatched heads
// without enable_gqa, which must raise PyTorch's error) and sdpa_kernel() without OVERRIDEABLE get
// the math path, whose parts are lowered too.
namespace at::native {
namespace {
// torch.func transforms: vmap has batching rules for CUDA's fused attention ops but none for the
// overrideable one (whose SymInt results its fallback cannot batch), so a batched operand, or one wrapped
// by grad/jacrev (a vmap may sit above it), takes the math path, whose ops all batch.
bool functorch_wrapped(const Tensor& t) {
  return t.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::FuncTorchBatched,
                                                  c10::DispatchKey::FuncTorchGradWrapper}));
}

int64_t tpu_fused_sdp_choice(const Tensor& query, const Tensor& key, const Tensor& value, const std::optional<Tensor>&,
                             double, bool, std::optional<double>, bool enable_gqa) {
  // Nested inputs (irregular sizes: size(2) would raise) take the math path, as on CPU.
  bool fused = !query.is_nested() && !key.is_nested() && !value.is_nested() && !functorch_wrapped(query) &&
               !functorch_wrapped(key) && !functorch_wrapped(value) && at::globalContext().userEnabledOverrideableSDP() &&
               query.dim() == 4 && key.dim() == 4 && value.dim() == 4 &&
               query.size(0) == key.size(0) && key.size(0) == value.size(0) &&
               key.size(1) == value.size(1) && key.size(2) == value.size(2) && query.size(3) == key.size(3);
  if (fused && query.size(1) != key.size(1)) {
    fused = enable_gqa && key.size(1) > 0 && query.size(1) % key.size(1) == 0;
  }
  return static_cast<int64_t>(fused ? at::SDPBackend::overrideable : at::SDPBackend::math);
}
}  // namespace
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &tpu_fused_sdp_choice)
}  // namespace at::native

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", &empty_memory_format);
  m.impl("empty_strided", &empty_strided);
}

void init_profiler(py::module& m);  // profiler.cpp
void init_nested(py::module& m);  // nested.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch_tpu native shim: device guard, hooks, allocator";
  m.def("register_hooks", []() { at::RegisterPrivateUse1HooksInterface(new TpuHooks()); });
  m.def("set_resize_callback", [](py::object cb) {
    delete g_resize_callback;
    g_resize_callback = new py::object(std::move(cb));
  });
  m.def("set_copy_callback", [](py::object cb) {
    delete g_copy_callback;
    g_copy_callback = new py::object(std::move(cb));
  });
  m.def("set_init_callback", [](py::object cb) {
    delete g_init_callback;
    g_init_callback = new py::object(std::move(cb));
  });
  m.def("set_device_count", [](int n) {
    TORCH_CHECK(n >= -1 && n <= kMaxDevices, "device count out of range");
    g_device_count.store(n);
  });
  m.def("device_count_if_initialized", []() { return g_device_count.load(); });
  m.def("current_device", []() { return static_cast<int>(t_current_device); });
  m.def("set_device", [](int index) {
    check_index(static_cast<DeviceIndex>(index));
    t_current_device = static_cast<DeviceIndex>(index);
  });
  m.def("default_generator", [](int index) {
    return at::detail::getPrivateUse1Hooks().getDefaultGenerator(static_cast<DeviceIndex>(index));
  });
  m.def("drain_freed", []() {
    std::lock_guard<std::mutex> lock(g_freed_mutex);
    std::vector<uint64_t> out;
    out.swap(g_freed);
    return out;
  });
  m.def("tensor_signature", &tensor_signature);
  m.def("graph_key", &graph_key);
  m.def("new_tensor", &new_tensor);
  m.def("fast_signature", &fast_signature);
  m.def("new_outputs", &new_outputs);
  m.def("run_cached", &run_cached);
  m.def("set_fast_path", [](bool enabled) { g_fast_enabled.store(enabled); });
  m.def("fast_path_enabled", []() { return g_fast_enabled.load(); });
  py::class_<OpKernel>(m, "OpKernel")
      .def(py::init<>())
      .def_readwrite("op", &OpKernel::op)
      .def_readwrite("slow", &OpKernel::slow)
      .def_readwrite("programs", &OpKernel::programs)
      .def_readwrite("buffers", &OpKernel::buffers)
      .def_readwrite("scalar_cache", &OpKernel::scalar_cache)
      .def_readwrite("miss", &OpKernel::miss)
      .def_readwrite("precision_key", &OpKernel::precision_key)
      .def_readwrite("translate", &OpKernel::translate)
      .def_readwrite("runtime_error", &OpKernel::runtime_error)
      .def_readwrite("kinds", &OpKernel::kinds)
      .def_readwrite("names", &OpKernel::names)
      .def_readwrite("defaults", &OpKernel::defaults)
      .def_readwrite("required", &OpKernel::required)
      .def_readwrite("static_scalars", &OpKernel::static_scalars)
      .def_readwrite("use_fast", &OpKernel::use_fast)
      .def_readwrite("precision", &OpKernel::precision)
      .def("__call__", &OpKernel::call);
  m.def("register_boxed", &register_boxed);
  // C++ warnings (TORCH_WARN) raised while fn runs become Python warnings when it returns, under the
  // Python filters active then. Without it, those of ops called through OpOverload inside a kernel wait for
  // the outermost Python binding (the user's call), past any warnings.catch_warnings around them.
  m.def("capture_cpp_warnings", [](py::function fn) -> py::object {
    torch::PyWarningHandler handler;
    try {
      return fn();
    } catch (...) {
      handler.set_in_exception();
      throw;
    }
  });
  m.def("invalidate_fast_entries", []() { g_generation += 1; });
  m.def("set_defer_hooks", &set_defer_hooks);
  py::class_<DirectLaunch>(m, "DirectLaunch")
      .def(py::init<py::object, py::object, py::list, size_t>(), py::arg("execute"), py::arg("consume"),
           py::arg("handlers"), py::arg("n_fresh"))
      .def("__call__", &DirectLaunch::call, py::arg("arrays"), py::arg("scalars"))
      .def_readonly("n_fresh", &DirectLaunch::n_fresh);
  py::class_<RecorderLock>(m, "RecorderLock")
      .def(py::init<>())
      .def("acquire", &RecorderLock::acquire, py::arg("blocking") = true, py::arg("timeout") = -1.0)
      .def("release", &RecorderLock::release)
      .def("__enter__", [](RecorderLock& l) { return l.acquire(true, -1.0); })
      .def("__exit__", [](RecorderLock& l, py::args) { l.release(); return false; });
  m.def("set_defer_path", [](bool enabled) { g_defer_enabled.store(enabled); });
  m.def("defer_path_enabled", []() { return g_defer_enabled.load(); });
  m.def("set_any_lost", [](bool lost) { g_any_lost.store(lost); });
  m.def("set_value_check_hook", [](py::object hook) { g_value_check_hook = std::move(hook); });
  m.def("native_record_count", []() { return g_native_recorded.load(); });
  m.def("reset_native_record_count", []() {
    g_native_recorded.store(0);
    for (auto& n : g_defer_fallbacks) n.store(0);
  });
  m.def("last_unkeyed_call", []() { return g_last_unkeyed; });
  m.def("defer_fallbacks", []() {
    py::dict out;
    for (int i = 0; i < kFallbackKinds; ++i) out[kFallbackNames[i]] = g_defer_fallbacks[i].load();
    return out;
  });
  m.def("fast_op_count", []() { return g_fast_ops.load(); });
  m.def("reset_fast_op_count", []() { g_fast_ops.store(0); });
  m.def("memory_stats", &memory_stats);
  m.def("set_memory_limit", [](int index, int64_t limit) { g_memory[index].limit.store(limit); });
  m.def("reset_peak", [](int index) { g_allocator.resetPeakStats(static_cast<DeviceIndex>(index)); });
  init_profiler(m);
  init_nested(m);
  m.def("set_runtime_callbacks", [](py::object callbacks) {
    delete g_runtime;
    g_runtime = new py::object(std::move(callbacks));
  });
}
