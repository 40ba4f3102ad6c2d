// runner/clock_monitor.hpp — the SM clock and board power of one GPU, sampled from NVML on a host
// thread while a benchmark replays its graphs.
//
// NOTE: at prefill sizes the H200 runs into its power limit and lowers the SM clock (measured
// 1.56-1.98 GHz within one bench run), so a layer's time moves with the clock as well
// as with the kernel. bench reports the clock of every row next to its time.
//
// NVML comes with the driver (libnvidia-ml.so.1) and is opened at run time (dlopen): a machine without
// it, or a device NVML does not know, gives an unavailable monitor (reason() says why) whose
// measurements are empty. The monitor never throws after construction and never stops a benchmark.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fp4moe/bench.hpp"  // ClockStats

namespace fp4moe {

struct ClockSample {
  double sm_mhz = 0;
  double power_w = 0;         // NVML's board power (averaged by the driver over its own window)
  bool power_capped = false;  // the clock was held down by the software power cap at this sample
};

// Mean, min and max over the samples; all zero for none.
ClockStats summarize_clock_samples(const std::vector<ClockSample>& samples);

class ClockMonitor {
 public:
  // pci_bus_id: the device's PCI bus id as cudaDeviceGetPCIBusId writes it ("0000:1B:00.0").
  // period_us: time between samples (>= 100).
  explicit ClockMonitor(const std::string& pci_bus_id, int period_us = 1000);
  ~ClockMonitor();
  ClockMonitor(const ClockMonitor&) = delete;
  ClockMonitor& operator=(const ClockMonitor&) = delete;

  bool available() const;
  const std::string& reason() const;  // why the monitor is unavailable ("" when available)

  // Starts sampling on a host thread (one sample at once); a running window is restarted.
  void start();
  // Stops sampling and summarizes the window since start(); no samples when unavailable or not started.
  ClockStats stop();

 private:
  struct Nvml;
  std::unique_ptr<Nvml> nvml_;
  std::string reason_;
  int period_us_;
  std::atomic<bool> running_{false};
  std::thread thread_;
  std::vector<ClockSample> samples_;  // written by the sampling thread only while running_
};

}  // namespace fp4moe
