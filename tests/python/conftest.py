"""pytest configuration of the Python module's tests (ctest runs them as Python.Cpu and Python.Gpu)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an sm_90 GPU and torch with CUDA (ctest label gpu)")
