// tests/runner/graph_test.cpp — a forward captured in a CUDA graph (global capture mode) replays to the
// same bits as the eager forward, for fresh inputs written into the same buffers between replays; the
// bench's marked forward captures its stage marks as timed event nodes.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fp4moe/bench.hpp"
#include "fp4moe/case_file.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/runner.hpp"
#include "runner/layer_buffers.hpp"

namespace fp4moe {
namespace {

#define CK(call) ASSERT_EQ((call), cudaSuccess) << #call

// The output that the buffers hold now (written by a graph replay) against a plain forward's on the
// same inputs: the output is read, poisoned, written again by runner.forward and compared bit for bit.
void expect_output_equals_eager_forward(MoeRunner& runner, cudaStream_t s, const test::LayerBuffers& buf,
                                        const std::string& what) {
  cudaError_t copied;
  const std::vector<uint16_t> replayed = buf.output(&copied);
  CK(copied);
  CK(buf.poison_output());
  ASSERT_TRUE(runner.forward(s, buf.args).ok()) << what;
  CK(cudaStreamSynchronize(s));
  const std::vector<uint16_t> eager = buf.output(&copied);
  CK(copied);
  EXPECT_EQ(replayed, eager) << what;
}

TEST(LayerGraph, SmallReplayMatchesEagerForward) {
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  for (ActQuant mode : {ActQuant::W4A16, ActQuant::W4A4Scalar}) {
    const MoeProblem p = preset("tiny", mode);
    const int64_t T = 77;
    io::MoeCase c = io::make_random_packed_case(p, T, 11);
    auto runner = MoeRunner::create(p, T);
    ASSERT_TRUE(runner->prepare_weights(c.weights()).ok());
    const test::LayerBuffers buf(p, T, *runner);
    const ForwardArgs& a = buf.args;
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    const Status cs = runner->forward(s, a);
    const cudaError_t end = cudaStreamEndCapture(s, &graph);
    ASSERT_TRUE(cs.ok()) << cs.message;
    ASSERT_EQ(end, cudaSuccess) << cudaGetErrorString(end);
    CK(cudaGraphInstantiate(&exec, graph, 0));
    for (uint64_t seed : {21, 22, 23}) {  // new inputs in the same buffers, then replay vs eager
      io::MoeCase in = io::make_random_packed_case(p, T, seed);
      CK(buf.upload(in));
      CK(buf.poison_output());
      CK(cudaGraphLaunch(exec, s));
      CK(cudaStreamSynchronize(s));
      expect_output_equals_eager_forward(*runner, s, buf, "seed " + std::to_string(seed));
      if (HasFatalFailure()) return;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
  }
}

// The bench's stage times: forward_marked captured in a graph records its marks as event record nodes,
// which replay in order with non-negative gaps, and the marked forward's output is the plain one's.
TEST(LayerGraph, MarkedForwardCapturesTimedStageEvents) {
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  const MoeProblem p = preset("tiny", ActQuant::W4A16);
  const int64_t T = 33;
  io::MoeCase c = io::make_random_packed_case(p, T, 5);
  auto runner = MoeRunner::create(p, T);
  ASSERT_TRUE(runner->prepare_weights(c.weights()).ok());
  const test::LayerBuffers buf(p, T, *runner);
  CK(buf.upload(c));
  const ForwardArgs& a = buf.args;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::vector<cudaEvent_t> marks(kForwardStages + 1);
  for (auto& e : marks) CK(cudaEventCreate(&e));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  const Status cs = forward_marked(*runner, s, a, false, marks.data());
  const cudaError_t end = cudaStreamEndCapture(s, &graph);
  ASSERT_TRUE(cs.ok()) << cs.message;
  ASSERT_EQ(end, cudaSuccess) << cudaGetErrorString(end);
  size_t nodes = 0;
  CK(cudaGraphGetNodes(graph, nullptr, &nodes));
  std::vector<cudaGraphNode_t> all(nodes);
  CK(cudaGraphGetNodes(graph, all.data(), &nodes));
  int event_nodes = 0;
  for (cudaGraphNode_t n : all) {
    cudaGraphNodeType type;
    CK(cudaGraphNodeGetType(n, &type));
    event_nodes += type == cudaGraphNodeTypeEventRecord;
  }
  EXPECT_EQ(event_nodes, kForwardStages + 1);  // every mark, including the stages without a launch
  CK(cudaGraphInstantiate(&exec, graph, 0));
  CK(buf.poison_output());
  CK(cudaGraphLaunch(exec, s));
  CK(cudaStreamSynchronize(s));
  float total = 0;
  for (int j = 0; j < kForwardStages; ++j) {
    float ms = -1;
    CK(cudaEventElapsedTime(&ms, marks[j], marks[j + 1]));
    EXPECT_GE(ms, 0.0f) << "stage " << j;
    total += ms;
  }
  EXPECT_GT(total, 0.0f);
  expect_output_equals_eager_forward(*runner, s, buf, "the marked forward's output");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  for (auto e : marks) cudaEventDestroy(e);
  cudaStreamDestroy(s);
}

}  // namespace
}  // namespace fp4moe
