"""Print what NVML says about each GPU (nvidia-ml-py, imported as pynvml), for the GPU fact."""

import sys


def main() -> int:
    try:
        import pynvml
    except ImportError:
        print("pynvml: not importable")
        return 0
    pynvml.nvmlInit()
    drv = pynvml.nvmlSystemGetDriverVersion()
    cuda = pynvml.nvmlSystemGetCudaDriverVersion()
    n = pynvml.nvmlDeviceGetCount()
    print(f"driver={drv!r} cuda_driver={cuda} count={n}")
    for i in range(n):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        name = pynvml.nvmlDeviceGetName(h)
        cc = pynvml.nvmlDeviceGetCudaComputeCapability(h)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        print(f"{i} name={name!r} cc={cc} total={mem.total} free={mem.free} used={mem.used}")
    print(f"pynvml module file: {pynvml.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
