// runner/clock_monitor.cpp — NVML through dlopen (no link against the driver's library, so the CPU
// build and machines without a driver still build and run; see runner/clock_monitor.hpp).
//
//   1. constructor: dlopen libnvidia-ml.so.1, resolve the six entry points, nvmlInit_v2, look the
//      device up by its PCI bus id; any failure leaves the monitor unavailable with the reason
//   2. start(): a host thread samples SM clock, power and throttle reasons every period_us
//   3. stop(): joins the thread and summarizes the window
#include "runner/clock_monitor.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <type_traits>

namespace fp4moe {

namespace {

// The NVML declarations used here (nvml.h, stable C ABI): return codes are an int enum, NVML_SUCCESS
// = 0; devices are opaque handles.
using NvmlReturn = int;
using NvmlDevice = void*;
constexpr NvmlReturn kNvmlSuccess = 0;
constexpr int kNvmlClockSm = 1;                                  // NVML_CLOCK_SM
constexpr unsigned long long kThrottleSwPowerCap = 0x4ull;       // nvmlClocksThrottleReasonSwPowerCap

}  // namespace

struct ClockMonitor::Nvml {
  void* lib = nullptr;
  NvmlReturn (*init)() = nullptr;
  NvmlReturn (*shutdown)() = nullptr;
  NvmlReturn (*handle_by_pci)(const char*, NvmlDevice*) = nullptr;
  NvmlReturn (*clock_info)(NvmlDevice, int, unsigned*) = nullptr;
  NvmlReturn (*power_usage)(NvmlDevice, unsigned*) = nullptr;        // milliwatts
  NvmlReturn (*throttle_reasons)(NvmlDevice, unsigned long long*) = nullptr;
  NvmlDevice device = nullptr;
  bool initialized = false;

  ~Nvml() {
    if (initialized) shutdown();
    if (lib != nullptr) dlclose(lib);
  }
  bool sample(ClockSample& s) const {
    unsigned mhz = 0, mw = 0;
    unsigned long long reasons = 0;
    if (clock_info(device, kNvmlClockSm, &mhz) != kNvmlSuccess) return false;
    s.sm_mhz = mhz;
    s.power_w = power_usage(device, &mw) == kNvmlSuccess ? mw * 1e-3 : 0.0;
    s.power_capped = throttle_reasons(device, &reasons) == kNvmlSuccess && (reasons & kThrottleSwPowerCap) != 0;
    return true;
  }
};

ClockStats summarize_clock_samples(const std::vector<ClockSample>& samples) {
  ClockStats st;
  if (samples.empty()) return st;
  st.samples = static_cast<int>(samples.size());
  st.min_sm_mhz = st.max_sm_mhz = samples[0].sm_mhz;
  double mhz = 0, w = 0;
  int capped = 0;
  for (const ClockSample& s : samples) {
    mhz += s.sm_mhz;
    w += s.power_w;
    st.min_sm_mhz = std::min(st.min_sm_mhz, s.sm_mhz);
    st.max_sm_mhz = std::max(st.max_sm_mhz, s.sm_mhz);
    st.max_power_w = std::max(st.max_power_w, s.power_w);
    capped += s.power_capped ? 1 : 0;
  }
  st.mean_sm_mhz = mhz / st.samples;
  st.mean_power_w = w / st.samples;
  st.power_capped_fraction = static_cast<double>(capped) / st.samples;
  return st;
}

ClockMonitor::ClockMonitor(const std::string& pci_bus_id, int period_us)
    : period_us_(std::max(period_us, 100)) {
  auto nvml = std::make_unique<Nvml>();
  nvml->lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (nvml->lib == nullptr) {
    reason_ = "NVML (libnvidia-ml.so.1) not found";
    return;
  }
  const auto sym = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(nvml->lib, name));
    if (fn == nullptr && reason_.empty()) reason_ = std::string("NVML has no ") + name;
  };
  sym(nvml->init, "nvmlInit_v2");
  sym(nvml->shutdown, "nvmlShutdown");
  sym(nvml->handle_by_pci, "nvmlDeviceGetHandleByPciBusId_v2");
  sym(nvml->clock_info, "nvmlDeviceGetClockInfo");
  sym(nvml->power_usage, "nvmlDeviceGetPowerUsage");
  sym(nvml->throttle_reasons, "nvmlDeviceGetCurrentClocksThrottleReasons");
  if (!reason_.empty()) return;
  if (NvmlReturn r = nvml->init(); r != kNvmlSuccess) {
    reason_ = "nvmlInit_v2 failed (NVML error " + std::to_string(r) + ")";
    return;
  }
  nvml->initialized = true;
  if (NvmlReturn r = nvml->handle_by_pci(pci_bus_id.c_str(), &nvml->device); r != kNvmlSuccess) {
    reason_ = "NVML does not know the device at PCI bus id '" + pci_bus_id + "' (NVML error " + std::to_string(r) + ")";
    return;
  }
  ClockSample probe;
  if (!nvml->sample(probe)) {
    reason_ = "NVML reports no SM clock for the device at '" + pci_bus_id + "'";
    return;
  }
  nvml_ = std::move(nvml);
}

ClockMonitor::~ClockMonitor() { (void)stop(); }

bool ClockMonitor::available() const { return nvml_ != nullptr; }
const std::string& ClockMonitor::reason() const { return reason_; }

void ClockMonitor::start() {
  (void)stop();
  samples_.clear();
  if (!available()) return;
  samples_.reserve(4096);
  running_.store(true);
  thread_ = std::thread([this] {
    const auto period = std::chrono::microseconds(period_us_);
    auto next = std::chrono::steady_clock::now();
    while (running_.load(std::memory_order_relaxed)) {
      ClockSample s;
      if (nvml_->sample(s)) samples_.push_back(s);
      next += period;
      std::this_thread::sleep_until(next);
    }
  });
}

ClockStats ClockMonitor::stop() {
  if (!thread_.joinable()) return summarize_clock_samples({});
  running_.store(false);
  thread_.join();
  return summarize_clock_samples(samples_);
}

}  // namespace fp4moe
