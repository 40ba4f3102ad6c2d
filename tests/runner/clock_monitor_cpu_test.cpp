// tests/runner/clock_monitor_cpu_test.cpp — ClockMonitor without a GPU: the summary of given samples,
// and an unavailable monitor (no NVML, or a device NVML does not know) that measures nothing.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>
#include <vector>

#include "runner/clock_monitor.hpp"

namespace fp4moe {
namespace {

TEST(ClockMonitor, SummaryOfNoSamplesIsEmpty) {
  const ClockStats s = summarize_clock_samples({});
  EXPECT_EQ(s.samples, 0);
  EXPECT_EQ(s.mean_sm_mhz, 0.0);
  EXPECT_EQ(s.max_power_w, 0.0);
  EXPECT_EQ(s.power_capped_fraction, 0.0);
}

TEST(ClockMonitor, SummaryOfSamples) {
  // values exact in binary: the means are exact too
  const std::vector<ClockSample> v = {{1500, 200, true}, {1980, 400, false}, {1800, 300, true}, {1980, 300, false}};
  const ClockStats s = summarize_clock_samples(v);
  EXPECT_EQ(s.samples, 4);
  EXPECT_EQ(s.mean_sm_mhz, 1815.0);
  EXPECT_EQ(s.min_sm_mhz, 1500.0);
  EXPECT_EQ(s.max_sm_mhz, 1980.0);
  EXPECT_EQ(s.mean_power_w, 300.0);
  EXPECT_EQ(s.max_power_w, 400.0);
  EXPECT_EQ(s.power_capped_fraction, 0.5);
}

TEST(ClockMonitor, UnknownDeviceIsUnavailableAndMeasuresNothing) {
  // No such PCI address: unavailable whether or not this machine has NVML, and it says why.
  ClockMonitor m("0000:FF:1F.7");
  EXPECT_FALSE(m.available());
  EXPECT_FALSE(m.reason().empty());
  EXPECT_EQ(m.stop().samples, 0);  // before any start
  m.start();
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(m.stop().samples, 0);
  EXPECT_EQ(m.stop().samples, 0);  // a second stop is harmless
}

}  // namespace
}  // namespace fp4moe
