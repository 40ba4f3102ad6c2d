// python/jax_ffi_unavailable.cpp — the extension's JAX entry point in a build that did not find the XLA
// FFI headers (jaxlib's include folder): it says so instead of registering handlers. A build with them
// compiles python/jax_ffi.cpp instead (CMakeLists.txt picks one of the two).
#include <nanobind/nanobind.h>

#include "fp4moe/error.hpp"

namespace nb = nanobind;

namespace fp4moe::python {

void bind_jax_ffi(nb::module_& m) {
  m.def(
      "_jax_ffi_handlers",
      []() -> nb::dict {
        throw Error(
            "fp4moe was built without JAX support: jaxlib's XLA FFI headers were not found at build time. Install "
            "jax into the build environment and rebuild (pip install --no-build-isolation ., or configure CMake with "
            "-DFP4MOE_XLA_FFI_INCLUDE_DIR=<jax.ffi.include_dir()>)");
      },
      "The XLA FFI handlers of the layer: {platform: {target name: PyCapsule}} (python/fp4moe/jax_ops.py).");
}

}  // namespace fp4moe::python
