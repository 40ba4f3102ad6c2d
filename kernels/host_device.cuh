// kernels/host_device.cuh — FP4MOE_HD: a function that kernels and CPU tests both call (the layout,
// staging and division helpers): __host__ __device__ __forceinline__ under nvcc, inline otherwise.
#pragma once

#if defined(__CUDACC__)
#define FP4MOE_HD __host__ __device__ __forceinline__
#else
#define FP4MOE_HD inline
#endif
