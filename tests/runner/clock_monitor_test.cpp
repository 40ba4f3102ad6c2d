// tests/runner/clock_monitor_test.cpp — ClockMonitor on a GPU machine: NVML knows the CUDA device by
// its PCI bus id and reports a plausible SM clock and power while sampling.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "fp4moe/bench.hpp"
#include "fp4moe/runner.hpp"
#include "runner/clock_monitor.hpp"

namespace fp4moe {
namespace {

TEST(ClockMonitorGpu, SamplesTheCudaDevice) {
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  int dev = 0;
  char bus[32] = {};
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetPCIBusId(bus, sizeof(bus), dev), cudaSuccess);
  ClockMonitor m(bus, 1000);
  ASSERT_TRUE(m.available()) << m.reason();
  EXPECT_TRUE(m.reason().empty());
  m.start();
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  const ClockStats s = m.stop();
  EXPECT_GE(s.samples, 5);   // ~30 at 1 ms; a loaded host may sleep longer
  EXPECT_LE(s.samples, 40);
  EXPECT_GT(s.min_sm_mhz, 0.0);
  EXPECT_LE(s.min_sm_mhz, s.mean_sm_mhz);
  EXPECT_LE(s.mean_sm_mhz, s.max_sm_mhz);
  EXPECT_LT(s.max_sm_mhz, 5000.0);
  EXPECT_GT(s.mean_power_w, 0.0);
  EXPECT_LT(s.max_power_w, 2000.0);
  m.start();  // a second window starts empty
  EXPECT_GE(m.stop().samples, 0);
}

}  // namespace
}  // namespace fp4moe
